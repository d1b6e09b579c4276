"""The methods the benchmarks compare. Each ``*_step`` returns a callable that runs one
forward+backward on a ``harness.BenchInputs``; the stock path stands in for Megatron's: bf16
logits ``hidden @ weight.T`` materialized, then a float32 softmax (``logits_logprob``)."""

from __future__ import annotations

import torch

from megatron_fused_lm import fused_linear_logprob, logits_logprob

# Per-token log-prob + entropy (the RL use); "floor" is the four GEMMs of any exact recompute method.
RL_METHODS = ("floor", "stock", "torch", "triton")
# Mean cross-entropy (the SFT use); "floor" is the three GEMMs (logits, grad_hidden, grad_weight).
SFT_METHODS = ("floor", "stock", "ours", "liger", "cce")


def import_competitors():
    """``({method: loss function}, {method: why it is missing})`` for liger-kernel's fused linear
    cross-entropy and Apple's cut-cross-entropy; both take ``(hidden, weight, targets,
    reduction=...)``. They are optional benchmark extras, never package dependencies."""
    losses, missing = {}, {}
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        losses["liger"] = liger_fused_linear_cross_entropy
    except ImportError as error:
        missing["liger"] = f"liger-kernel is not installed ({error})"
    try:
        from cut_cross_entropy import linear_cross_entropy

        losses["cce"] = linear_cross_entropy
    except ImportError as error:
        missing["cce"] = f"cut-cross-entropy is not installed ({error})"
    return losses, missing


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


def rl_step(method, inputs, temperature, mask=None):
    """Log-prob + entropy with the random upstream gradients; returns the detached results."""

    def step():
        if method == "stock":
            logprob, entropy = logits_logprob(
                inputs.hidden @ inputs.weight.t(),
                inputs.targets,
                temperature=temperature,
                return_entropy=True,
                mask=mask,
            )
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


def sft_loss(method, competitors, hidden, weight, targets, reduction):
    """Cross-entropy per token (``reduction="none"``) or its mean. Ours is the negated log-prob
    of the Triton backend, as the labels path computes it."""
    if method not in ("stock", "ours"):
        return competitors[method](hidden, weight, targets, reduction=reduction)
    if method == "stock":
        nll = -logits_logprob(hidden @ weight.t(), targets)
    else:
        nll = -fused_linear_logprob(hidden, weight, targets, backend="triton")
    return nll.mean() if reduction == "mean" else nll


def sft_step(method, competitors, inputs):
    def step():
        sft_loss(method, competitors, inputs.hidden, inputs.weight, inputs.targets, "mean").backward()

    return step


def sft_logprob(method, competitors, inputs):
    """Per-token log-prob as the method computes it (forward only, for the error check): the
    timed step returns only the mean."""
    with torch.no_grad():
        return -sft_loss(method, competitors, inputs.hidden.detach(), inputs.weight.detach(), inputs.targets, "none")
