"""The methods the benchmarks compare. Each ``*_step`` returns a callable that runs one
forward+backward on a ``harness.BenchInputs``; the stock path stands in for Megatron's: bf16
logits ``hidden @ weight.T`` materialized, then a float32 softmax (``logits_logprob``).

Our fused methods run the Triton backend (``FUSED_BACKEND``; off CUDA it falls back to the torch
backend with a warning, which is what a CPU dry run of the scripts measures)."""

from __future__ import annotations

import torch

from megatron_fused_lm import fused_linear_logprob, fused_linear_loss, logits_logprob, logits_loss, losses

FUSED_BACKEND = "triton"

# Per-token log-prob + entropy (the RL use); "floor" is the four GEMMs of any exact recompute method;
# "cute" is our CuTe backend (its forward statistics by the CuTe DSL kernel, the rest Triton's);
# "liger_flsce" is liger-kernel's CuTe fused linear scaled cross-entropy (SM90), "liger_native" the
# same op by its native CUTLASS + NVSHMEM kernels (liger-cute-kernels; liger_native.py), the peers.
PEERS = ("liger_flsce", "liger_native")  # each (hidden, weight, targets, temperature) -> (logprob, entropy)
RL_METHODS = ("floor", "stock", "torch", "triton", "cute", *PEERS)
# Log-prob + entropy without gradients (old and reference log-probs); "floor1" is the logits GEMM.
FORWARD_METHODS = ("floor1", "triton", "cute", *PEERS)
# Mean cross-entropy (the SFT use); "floor" is the three GEMMs (logits, grad_hidden, grad_weight).
# "ours" finishes the gradients in the forward (fused_linear_loss: three GEMMs), "recompute" is the
# mean of the per-token op's log-probs (fused_linear_logprob: the logits again in the backward, four).
# "liger_native" is the mean of its per-token NLL (no entropy term).
# "torch_lce" is PyTorch's own torch.nn.functional.linear_cross_entropy with its default chunking
# options (torch_linear_cross_entropy says where it comes from on an older torch).
# "quack" is Dao-AILab's quack chunked linear cross-entropy (its scaled-exponential route where
# quack takes it), "quack_basic" its basic route: a mean or a sum, no per-token losses.
LOSS_PEERS = ("liger", "cce", "torch_lce", "quack", "quack_basic")  # (hidden, weight, targets, reduction=...)
SFT_METHODS = ("floor", "stock", "ours", "ours_main_grad", "recompute", *LOSS_PEERS, "liger_native")
# A policy loss known in the forward (the RL loss); "floor3" is the three GEMMs, as for SFT. The
# peers compute it as "recompute" does: the loss on their log-prob and entropy, then autograd.
RL_LOSS_METHODS = ("floor3", "stock", "recompute", "ours", "ours_main_grad", *PEERS)

# The RL-loss section's per-token loss: DAPO's asymmetric clip with an entropy bonus, token mean.
CLIP_LOW, CLIP_HIGH, ENTROPY_COEF = 0.2, 0.28, 0.01
# The old (and reference) policy's log-probs are this step's float32 log-probs plus Gaussian noise
# of this standard deviation: ratios near 1, a few tokens clipped, as in on-policy training.
OLD_LOGPROB_NOISE = 0.1


def import_competitors(native_shapes=None, device="cuda"):
    """``({method: function}, {method: why it is missing})`` for liger-kernel's fused linear
    cross-entropy and Apple's cut-cross-entropy, both ``(hidden, weight, targets, reduction=...)``,
    and liger-kernel's fused linear scaled cross-entropy by its CuTe kernel (``liger_flsce``) and by
    its native CUTLASS + NVSHMEM one (``liger_native``), both ``(hidden, weight, targets,
    temperature) -> (logprob, entropy)`` where their SM90 kernels run on this GPU, never a torch
    fallback; PyTorch's own ``linear_cross_entropy`` (``torch_lce``) and quack's chunked one by
    its two routes (``quack``, ``quack_basic``), ``(hidden, weight, targets, reduction=...)``. ``liger_native`` is set up (NVSHMEM initialized, workspace reserved for the
    ``(tokens, hidden, vocab)`` ``native_shapes``) only when ``native_shapes`` is given. They are
    optional benchmark extras, never package dependencies."""
    found, missing = {}, {}
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        found["liger"] = liger_fused_linear_cross_entropy
    except ImportError as error:
        missing["liger"] = f"liger-kernel is not installed ({error})"
    try:
        from cut_cross_entropy import linear_cross_entropy

        found["cce"] = linear_cross_entropy
    except ImportError as error:
        missing["cce"] = f"cut-cross-entropy is not installed ({error})"
    try:
        found["torch_lce"] = torch_linear_cross_entropy()
    except (ImportError, OSError) as error:
        missing["torch_lce"] = f"torch.nn.functional.linear_cross_entropy cannot run here ({error})"
    try:
        found["liger_flsce"] = liger_scaled_cross_entropy()
    except (ImportError, RuntimeError) as error:
        missing["liger_flsce"] = f"liger-kernel's CuTe kernel cannot run here ({error})"
    for method, use_scaled_exp in (("quack", None), ("quack_basic", False)):
        try:
            found[method] = quack_cross_entropy(use_scaled_exp)
        except Exception as error:  # a peer's import failing (its cache key, a library) must not lose the run
            missing[method] = f"quack cannot run here ({type(error).__name__}: {error})"
    if native_shapes is None:
        missing["liger_native"] = "not selected"
    else:
        try:
            from liger_native import NativeScaledCrossEntropy

            found["liger_native"] = NativeScaledCrossEntropy(native_shapes, torch.device(device))
        except Exception as error:  # a peer's setup failing must not lose the run: say why instead
            missing["liger_native"] = f"liger-kernel's native kernel cannot run here ({type(error).__name__}: {error})"
    return found, missing


# Where PyTorch's own op comes from on a torch older than 2.13 (the GPU hosts have 2.11): a folder
# holding a torch 2.13 wheel's torch/nn/functional.py and torch/nn/modules/linear_cross_entropy*.py,
# read at run time and never kept in this repository.
TORCH_LCE_SOURCE = "TORCH_LCE_SOURCE"


def torch_linear_cross_entropy():
    """PyTorch's ``linear_cross_entropy`` with ``LinearCrossEntropyOptions()`` (its chunked path) as
    ``(hidden, weight, targets, reduction=...)``: this torch's own where it has one, else the
    release's modules from the folder ``$TORCH_LCE_SOURCE`` names (the two modules registered
    under their own names, the function taken from the release's ``functional.py`` and run with
    this torch's ``torch.nn.functional`` globals). ``ImportError`` where neither is there."""
    import ast
    import importlib.util
    import os
    import sys
    from pathlib import Path

    function = getattr(torch.nn.functional, "linear_cross_entropy", None)
    if function is not None:
        from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions
    else:
        folder = os.environ.get(TORCH_LCE_SOURCE)
        if not folder:
            raise ImportError(f"torch {torch.__version__} has none, and ${TORCH_LCE_SOURCE} names no copy of 2.13's")
        for name in ("linear_cross_entropy_options", "linear_cross_entropy"):
            spec = importlib.util.spec_from_file_location(f"torch.nn.modules.{name}", Path(folder) / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        LinearCrossEntropyOptions = sys.modules[
            "torch.nn.modules.linear_cross_entropy_options"
        ].LinearCrossEntropyOptions
        tree = ast.parse((Path(folder) / "functional.py").read_text())
        definition = next(node for node in tree.body if getattr(node, "name", None) == "linear_cross_entropy")
        namespace = dict(vars(torch.nn.functional))
        exec(compile(ast.Module([definition], type_ignores=[]), str(Path(folder) / "functional.py"), "exec"), namespace)
        function = namespace["linear_cross_entropy"]

    def loss(hidden, weight, targets, reduction="mean"):
        return function(hidden, weight, targets, reduction=reduction, options=LinearCrossEntropyOptions())

    return loss


def quack_cross_entropy(use_scaled_exp):
    """Dao-AILab's quack ``chunked_linear_cross_entropy`` as ``(hidden, weight, targets,
    reduction=...)``, a mean or a sum only: ``use_scaled_exp=None`` lets quack pick its scaled-
    exponential route where it runs (SM90, bf16, a vocabulary in multiples of 128), ``False`` its
    basic one. quack keys its kernels' cache on the DSL's code unless that lies under a
    ``site-packages`` folder: unpacked elsewhere, its import raises a ``TypeError``."""
    from quack.linear_cross_entropy import chunked_linear_cross_entropy

    def loss(hidden, weight, targets, reduction="mean"):
        if reduction == "none":
            raise NotImplementedError("quack's chunked op returns a mean or a sum, no per-token losses")
        return chunked_linear_cross_entropy(hidden, weight, targets, reduction=reduction, use_scaled_exp=use_scaled_exp)

    return loss


def liger_scaled_cross_entropy():
    """liger-kernel's fused linear scaled cross-entropy as ``(logprob, entropy)``; ``RuntimeError``
    where it would take its torch fallback (no CUDA, not SM90, or CuTe-DSL missing)."""
    from liger_kernel.ops import fused_linear_scaled_cross_entropy as flsce

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    implementation = flsce._resolve_implementation(torch.device("cuda"))
    if implementation is flsce._FusedLinearPPOFallbackFunction:
        raise RuntimeError("it resolves to its torch fallback on this device")

    def logprob_entropy(hidden, weight, targets, temperature):
        nll, entropy = flsce.LigerFusedLinearScaledCrossEntropyFunction.apply(
            hidden, weight, targets, temperature, -100, 1, True
        )
        return -nll, entropy

    return logprob_entropy


def floor_step(inputs, recompute):
    """The bf16 cuBLAS products an exact method cannot avoid: logits, the logits again when they
    are recomputed rather than kept (``recompute``), grad_hidden and grad_weight. The buffers are
    allocated here, before the measurement, so the floor's peak extra memory is about zero."""
    hidden, weight = inputs.hidden.detach(), inputs.weight.detach()
    logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.empty_like(weight)

    def step():
        torch.mm(hidden, weight.t(), out=logits)
        if recompute:
            torch.mm(hidden, weight.t(), out=logits)
        torch.mm(logits, weight, out=grad_hidden)
        torch.mm(logits.t(), hidden, out=grad_weight)

    return step


def rl_step(method, inputs, temperature, mask=None, competitors=None):
    """Log-prob + entropy with the random upstream gradients; returns the detached results.
    ``competitors`` (``import_competitors``) holds the ``PEERS``."""

    def step():
        if method == "stock":
            logprob, entropy = logits_logprob(
                inputs.hidden @ inputs.weight.t(),
                inputs.targets,
                temperature=temperature,
                return_entropy=True,
                mask=mask,
            )
        elif method in PEERS:
            logprob, entropy = competitors[method](inputs.hidden, inputs.weight, inputs.targets, temperature)
        else:
            logprob, entropy = fused_linear_logprob(
                inputs.hidden,
                inputs.weight,
                inputs.targets,
                temperature=temperature,
                return_entropy=True,
                backend=method,
                mask=mask,
            )
        torch.autograd.backward([logprob, entropy], [inputs.grad_logprob, inputs.grad_entropy])
        return logprob.detach(), entropy.detach()

    return step


def forward_step(method, inputs, competitors=None):
    """Log-prob + entropy under ``no_grad`` (detached inputs), as a trainer computes the old and
    reference log-probs; ``floor1`` is the logits product alone, into a buffer allocated here."""
    hidden, weight, targets = inputs.hidden.detach(), inputs.weight.detach(), inputs.targets
    if method == "floor1":
        logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
        return lambda: torch.mm(hidden, weight.t(), out=logits)

    @torch.no_grad()
    def step():
        if method in PEERS:
            return competitors[method](hidden, weight, targets, 1.0)
        return fused_linear_logprob(hidden, weight, targets, return_entropy=True, backend=method)

    return step


def main_grad_for(method, inputs):
    """For ``ours_main_grad``: a float32 accumulator of the weight's shape, made before the
    measurement as Megatron's DDP keeps one per parameter (its ``main_grad``); else ``None``."""
    if method != "ours_main_grad":
        return None
    return torch.zeros(inputs.weight.shape, dtype=torch.float32, device=inputs.weight.device)


def main_grad_route(weight, main_grad):
    """``fused_linear_loss``'s weight arguments inside Megatron's DDP, as ``FusedLMHead.loss(...,
    main_grad_scale=1.0)`` passes them: the weight gradient added into ``main_grad`` in the
    forward, and the weight behind the integration's ``MainGradWritten``, which hands autograd the
    dummy gradient Megatron's own layers hand it (weight-sized, allocated in the backward)."""
    from megatron_fused_lm.integration.megatron_compat import MainGradWritten

    return dict(weight=MainGradWritten.apply(weight), weight_grad_into=main_grad, weight_grad_scale=1.0)


def sft_weights(inputs):
    """The per-token weights of the mean cross-entropy over every token (``losses.cross_entropy``)."""
    return losses.token_mean_weights(torch.ones_like(inputs.targets, dtype=torch.float32))


def sft_loss(method, competitors, hidden, weight, targets, reduction, weights=None, token_chunk=None, main_grad=None):
    """Cross-entropy per token (``reduction="none"``) or its mean. ``recompute`` is the negated
    log-prob of the per-token op, as Megatron's labels path computes it; ``ours`` is
    ``fused_linear_loss`` with ``losses.cross_entropy`` and token-mean ``weights`` (made here when
    not given); ``ours_main_grad`` the same through ``main_grad_route`` with ``main_grad``."""
    if method in LOSS_PEERS:
        return competitors[method](hidden, weight, targets, reduction=reduction)
    if method == "liger_native":
        logprob, _ = competitors[method](hidden, weight, targets, 1.0, return_entropy=False)
        return -logprob.mean() if reduction == "mean" else -logprob
    if method in ("ours", "ours_main_grad"):
        if weights is None:
            weights = losses.token_mean_weights(torch.ones_like(targets, dtype=torch.float32))
        route = main_grad_route(weight, main_grad) if method == "ours_main_grad" else {"weight": weight}
        result = fused_linear_loss(
            hidden, targets=targets, loss_fn=losses.cross_entropy, loss_inputs={"weight": weights},
            backend=FUSED_BACKEND, token_chunk=token_chunk, **route,
        )  # fmt: skip
        return result.loss if reduction == "mean" else -result.logprob
    if method == "stock":
        nll = -logits_logprob(hidden @ weight.t(), targets)
    elif method == "recompute":
        nll = -fused_linear_logprob(hidden, weight, targets, backend=FUSED_BACKEND)
    else:
        raise ValueError(f"unknown SFT method {method!r}")
    return nll.mean() if reduction == "mean" else nll


def sft_step(method, competitors, inputs, token_chunk=None):
    """``loss.backward()`` of the mean cross-entropy; returns the hidden states' gradient (for the
    error check; the benchmark drops it after reading the sampled rows)."""
    weights = sft_weights(inputs)  # made before the measurement, as a trainer would have it
    main_grad = main_grad_for(method, inputs)

    def step():
        loss = sft_loss(
            method, competitors, inputs.hidden, inputs.weight, inputs.targets, "mean", weights, token_chunk, main_grad
        )
        loss.backward()
        return inputs.hidden.grad

    return step


def sft_logprob(method, competitors, inputs):
    """Per-token log-prob as the method computes it (forward only, for the error check): the
    timed step returns only the mean."""
    with torch.no_grad():
        return -sft_loss(method, competitors, inputs.hidden.detach(), inputs.weight.detach(), inputs.targets, "none")


def sft_mean_loss(method, competitors, inputs):
    """The mean cross-entropy the method returns (forward only, for the error check)."""
    with torch.no_grad():
        weights = sft_weights(inputs)
        return sft_loss(
            method, competitors, inputs.hidden.detach(), inputs.weight.detach(), inputs.targets, "mean", weights
        )


def policy_loss(kl_coef=0.0, entropy_coef=ENTROPY_COEF):
    """The RL-loss section's ``losses.ClippedPolicyLoss`` (a k3 KL penalty when ``kl_coef``; no
    entropy term when ``entropy_coef`` is 0)."""
    return losses.ClippedPolicyLoss(
        clip_low=CLIP_LOW, clip_high=CLIP_HIGH, entropy_coef=entropy_coef, kl_coef=kl_coef, kl_estimator="k3"
    )


def policy_loss_inputs(inputs, kl_coef=0.0, seed=2):
    """The per-token inputs of ``policy_loss``, made once per shape and shared by every method:
    ``old_logprob`` (this step's float32 log-probs, by the per-token op under no_grad, plus noise),
    standard normal ``advantages``, the token-mean ``weight``, and ``ref_logprob`` when ``kl_coef``."""
    targets = inputs.targets
    gen = torch.Generator(device=targets.device).manual_seed(seed)
    with torch.no_grad():
        logprob = fused_linear_logprob(inputs.hidden, inputs.weight, targets, backend=FUSED_BACKEND)

    def noisy():
        return logprob + OLD_LOGPROB_NOISE * torch.randn(logprob.shape, device=targets.device, generator=gen)

    loss_inputs = {
        "old_logprob": noisy(),
        "advantages": torch.randn(targets.shape, device=targets.device, generator=gen),
        "weight": losses.token_mean_weights(torch.ones_like(targets, dtype=torch.float32)),
    }
    if kl_coef:
        loss_inputs["ref_logprob"] = noisy()
    return loss_inputs


def rl_loss_step(method, inputs, loss_fn, loss_inputs, token_chunk=None, competitors=None):
    """``loss.backward()`` of the summed per-token ``loss_fn``; returns ``(loss, logprob, entropy,
    hidden's gradient)``, detached, for the error check.

    - ``stock``: bf16 logits materialized, then ``logits_loss`` (float32 softmax, autograd);
    - ``recompute``: ``fused_linear_logprob`` with entropy, ``loss_fn`` on its flattened results
      and autograd into the per-token op's backward (four GEMMs);
    - ``ours``: ``fused_linear_loss`` (three GEMMs, the gradients finished in the forward);
    - ``ours_main_grad``: the same through ``main_grad_route``;
    - the ``PEERS`` (from ``competitors``): as ``recompute``, on the peer's log-prob and entropy."""
    main_grad = main_grad_for(method, inputs)

    def step():
        hidden, weight, targets = inputs.hidden, inputs.weight, inputs.targets
        if method == "stock":
            loss, logprob, entropy = logits_loss(hidden @ weight.t(), targets, loss_fn, loss_inputs=loss_inputs)
        elif method in ("recompute", *PEERS):
            if method == "recompute":
                logprob, entropy = fused_linear_logprob(
                    hidden, weight, targets, return_entropy=True, backend=FUSED_BACKEND
                )
            else:
                logprob, entropy = competitors[method](hidden, weight, targets, 1.0)
            flat = {name: value.reshape(-1) for name, value in loss_inputs.items()}
            loss = loss_fn(logprob.reshape(-1), entropy.reshape(-1), **flat).sum()
        elif method in ("ours", "ours_main_grad"):
            route = main_grad_route(weight, main_grad) if method == "ours_main_grad" else {"weight": weight}
            loss, logprob, entropy = fused_linear_loss(
                hidden, targets=targets, loss_fn=loss_fn, loss_inputs=loss_inputs, backend=FUSED_BACKEND,
                token_chunk=token_chunk, **route,
            )  # fmt: skip
        else:
            raise ValueError(f"unknown RL-loss method {method!r}")
        loss.backward()
        return loss.detach(), logprob.detach(), entropy.detach(), inputs.hidden.grad

    return step
