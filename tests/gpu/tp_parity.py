"""The fused head on a bf16 GPTModel, tensor parallel over every process with sequence
parallelism, against the stock model: tied and untied embeddings, Triton and torch backends, every
fused path. Started by torchrun on two GPUs, or four (TP=4):

    torchrun --nproc-per-node 2 tests/gpu/tp_parity.py [--json tp_parity.json]

For each embedding mode, on one model:

1. stock: the logits shard -> log-probs and entropy from a float64 oracle on the logits gathered
   across the TP group; the backward of a random weighted sum of both gives the reference
   gradients of every parameter; the labels path gives the stock per-token loss and its gradients.
2. for each backend, fused: the model returns hidden states; the head's log-probs and entropy,
   every parameter gradient, and the labels-path loss and its gradients against step 1.

Two oracles, both float64:
- from the stock logits (bf16, as the stock layer rounds them): the fused path does not round its
  logits, so the two may differ by that rounding. Per token, with ``e`` half a bf16 spacing of the
  token's largest |logit / T| (at most ``2^-8 max|z| / T``), first order gives
  ``|d logprob| <= 2e`` and ``|d entropy| <= e * std_p(z / T)``; the tolerance is twice that (for
  the second order) plus the exact tolerance below.
- exact, from the pre-projection hidden and the full weight (all-gathered): the fused path rounds
  nothing but its float32 sums, so it must be within 2e-3 there (measured ~1e-4 on one GPU,
  docs/BENCHMARKS.md) and never less accurate than the stock path.

Gradients (bf16 models: the two paths round the logit gradients differently, by a few per cent
of an entry where the distribution is peaky): the relative L2 difference of each parameter's
gradient against the stock one is at most 0.15. Measured on gloo CPU ranks at hidden 1024 and the
padded vocabulary: 0.02 to 0.04; with the sequence-parallel hidden gradient reduced twice (the
fused head's own all-reduce on top of the gather's reduce-scatter): 1.01.

Every path against float64 (``check_paths``): the same weights in a float64 GPTModel give each
parameter's gradient (sequence-parallel ones summed over the group, as Megatron finalizes them: a
rank whose part of the sequence holds no response would have none) of three losses (the log-prob and entropy sum above; the labels path's
weighted loss; a clipped policy loss with entropy and KL terms on a response), and each bf16 path's
relative L2 error per parameter is compared with stock's (bf16 logits): recompute
(``head.logprobs``, the labels path undeclared), three GEMMs (the labels path with
``declare_loss_weights``, ``head.loss``) and the main_grad route (the same into a DDP copy's
float32 ``main_grad``). Both paths carry the layers' own bf16 rounding, so a fused path's error may
not exceed ``FLOAT64_FACTOR`` times stock's; a wrong reduction, shard or scale errs by O(1).
Measured on gloo CPU ranks at TP=2: the fused paths' largest ratio 1.33; stock's own largest errors
0.04 to 0.11 (log-probs, labels) and 0.26 to 0.69 (the policy loss, whose clipped,
advantage-weighted gradient is small against its terms), so there the check catches an error of
about 1.5 times stock's and no smaller. On one H200 at TP=1 and the GPU size (2026-12-01), stock's
own largest per-parameter error reached 1.4 to 1.5 (log-probs, labels) and 39 to 219 (the policy
loss): at hidden 1024 some parameters' bf16 gradients are unrelated to float64's, so there the
ratios (1.000 to 1.006) say that the fused paths err as stock does, not how far either is from the
exact gradient (the head's own accuracy is ``benchmarks/gradient_audit.py``'s).

Without CUDA it runs on gloo CPU ranks at a tiny size (a dry run of the logic; the CPU suite runs
it on two and four).
"""

from __future__ import annotations

import argparse
import os

import torch

from devkit import distributed, megatron_gpt
from devkit.megatron_gpt import GPTShape
from devkit.oracle import logprob_entropy, max_abs_error
from megatron_fused_lm import losses
from megatron_fused_lm.integration import FusedLMConfig, unwrap_model, wrap_model

GPU_SHAPE = GPTShape(hidden=1024, heads=16, layers=4, vocab=151936, seq=512, micro_batch=2)
CPU_SHAPE = GPTShape(hidden=64, heads=4, layers=2, vocab=1000, seq=16, micro_batch=2)
TEMPERATURE = 0.7
EXACT_ATOL = 2e-3
GRAD_RELATIVE_L2 = 0.15
BACKENDS = ("triton", "torch")
FLOAT64_FACTOR = 1.5
POLICY = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01, kl_coef=0.05, kl_estimator="k3")
RESPONSE_START = 4  # the policy loss's response: positions from here on


def exact_oracle(hidden: torch.Tensor, weight_shard: torch.Tensor, targets: torch.Tensor):
    """Float64 log-probs and entropy ``[b, s]`` from the pre-projection ``hidden [b, s, h]`` (the
    same on every rank) and the whole weight, gathered from the ranks' shards ``[vocab/TP, h]``."""
    weight_t = megatron_gpt.gather_vocabulary(weight_shard.detach().t())
    return logprob_entropy(hidden.detach().double() @ weight_t.double(), targets, TEMPERATURE)


def stock_rounding_tolerances(stock_logits: torch.Tensor, temperature: float):
    """Per-token tolerances ``[b, s]`` (log-prob, entropy) for the difference between a path that
    rounds its logits to bf16 (stock) and one that does not (fused), from the stock logits."""
    scaled = megatron_gpt.gather_vocabulary(stock_logits.detach()).double() / temperature
    half_spacing = scaled.abs().amax(-1) * 2.0**-8
    probs = torch.softmax(scaled, dim=-1)
    mean = (probs * scaled).sum(-1, keepdim=True)
    spread = (probs * (scaled - mean).square()).sum(-1).sqrt()
    return 2 * (2 * half_spacing) + EXACT_ATOL, 2 * half_spacing * spread + EXACT_ATOL


def relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def grad_errors(grads: dict, reference: dict) -> dict:
    """Relative L2 difference of each parameter's gradient against ``reference``'s."""
    assert grads.keys() == reference.keys(), (sorted(grads), sorted(reference))
    for name, want in reference.items():
        assert want.abs().max() > 0, f"{name} has an all-zero stock gradient: the comparison would prove nothing"
    return {name: relative_l2(grads[name], want) for name, want in reference.items()}


def worst_excess(errors: torch.Tensor, tolerances: torch.Tensor) -> float:
    """Largest ``error / tolerance`` over the tokens (at most 1 passes)."""
    return (errors / tolerances).max().item()


def check_embedding_mode(shape: GPTShape, device: torch.device, tied: bool) -> dict:
    """Stock, then each backend fused, on one model; returns the measured errors (asserted here)."""
    label = f"tied={tied}"
    model = megatron_gpt.build_bf16_gpt(shape, device, tied=tied, sequence_parallel=True, seed=1234, peaky=True)
    vocab = model.vocab_size
    batch = megatron_gpt.causal_batch(shape, vocab, seed=7, device=device)
    targets = batch[3]
    # shared_embedding_or_output_weight() is the embedding on a first stage, tied or not.
    weight_shard = model.shared_embedding_or_output_weight() if tied else model.output_layer.weight

    stock_logits = megatron_gpt.forward(model, batch)
    assert stock_logits.dtype == torch.bfloat16 and stock_logits.shape[-1] == weight_shard.shape[0], label
    oracle_logprob, oracle_entropy = megatron_gpt.oracle_logprob_entropy(stock_logits, targets, TEMPERATURE)
    megatron_gpt.head_loss(oracle_logprob, oracle_entropy).backward()
    stock_grads = megatron_gpt.parameter_grads(model)
    stock_loss = megatron_gpt.forward(model, batch, labels=targets)
    megatron_gpt.labels_loss(stock_loss).backward()
    stock_loss_grads = megatron_gpt.parameter_grads(model)
    stock_logits = stock_logits.detach()
    oracle_logprob, oracle_entropy = oracle_logprob.detach(), oracle_entropy.detach()
    logprob_tolerance, entropy_tolerance = stock_rounding_tolerances(stock_logits, TEMPERATURE)
    loss_tolerance = stock_rounding_tolerances(stock_logits, 1.0)[0]
    stock_head = wrap_model(model, FusedLMConfig(enabled=False))
    stock_logprob, stock_entropy = stock_head.logprobs(
        stock_logits, targets, temperature=TEMPERATURE, return_entropy=True
    )
    record = {
        "tied": tied,
        "padded_vocab": vocab,
        "max_abs_logit": megatron_gpt.gather_vocabulary(stock_logits).abs().max().item(),
        "min_entropy": oracle_entropy.min().item(),
        "median_entropy": oracle_entropy.median().item(),
        "backends": {},
    }
    assert record["min_entropy"] < 0.5, f"{label}: the distributions are not peaky enough to test"

    for backend in BACKENDS:
        where = f"{label} backend={backend}"
        head = wrap_model(model, FusedLMConfig(enabled=True, backend=backend))
        assert head.fused and head.fallback_reason is None, where
        hidden = megatron_gpt.forward(model, batch)
        assert hidden.shape == (shape.micro_batch, shape.seq, shape.hidden), f"{where}: {tuple(hidden.shape)}"
        if "stock_vs_exact" not in record:
            exact_logprob, exact_entropy = exact_oracle(hidden, weight_shard, targets)
            record["stock_vs_exact"] = {
                "logprob": max_abs_error(stock_logprob, exact_logprob),
                "entropy": max_abs_error(stock_entropy, exact_entropy),
            }
        logprob, entropy = head.logprobs(hidden, targets, temperature=TEMPERATURE, return_entropy=True)
        megatron_gpt.head_loss(logprob, entropy).backward()
        head_grads = grad_errors(megatron_gpt.parameter_grads(model), stock_grads)
        loss = megatron_gpt.forward(model, batch, labels=targets)
        megatron_gpt.labels_loss(loss).backward()
        loss_grads = grad_errors(megatron_gpt.parameter_grads(model), stock_loss_grads)
        assert logprob.dtype == entropy.dtype == loss.dtype == torch.float32, where
        logprob, entropy, loss = logprob.detach(), entropy.detach(), loss.detach()
        result = {
            "logprob_vs_stock_oracle": max_abs_error(logprob, oracle_logprob),
            "entropy_vs_stock_oracle": max_abs_error(entropy, oracle_entropy),
            "labels_loss_vs_stock": max_abs_error(loss, stock_loss),
            "logprob_vs_stock_oracle_per_tolerance": worst_excess((logprob - oracle_logprob).abs(), logprob_tolerance),
            "entropy_vs_stock_oracle_per_tolerance": worst_excess((entropy - oracle_entropy).abs(), entropy_tolerance),
            "labels_loss_vs_stock_per_tolerance": worst_excess((loss - stock_loss).abs(), loss_tolerance),
            "logprob_vs_exact": max_abs_error(logprob, exact_logprob),
            "entropy_vs_exact": max_abs_error(entropy, exact_entropy),
            "head_grad_relative_l2_max": max(head_grads.values()),
            "worst_head_grad": max(head_grads, key=head_grads.get),
            "labels_grad_relative_l2_max": max(loss_grads.values()),
            "worst_labels_grad": max(loss_grads, key=loss_grads.get),
        }
        record["backends"][backend] = result
        distributed.log(f"{where}: {result}")
        for key in ("logprob_vs_stock_oracle", "entropy_vs_stock_oracle", "labels_loss_vs_stock"):
            excess = result[f"{key}_per_tolerance"]
            assert excess <= 1, f"{where}: {key} {result[key]:.3g} exceeds its rounding tolerance ({excess:.3g}x)"
        for quantity in ("logprob", "entropy"):
            error, stock_error = result[f"{quantity}_vs_exact"], record["stock_vs_exact"][quantity]
            assert error <= EXACT_ATOL, f"{where}: {quantity} off the exact oracle by {error:.3g} > {EXACT_ATOL}"
            assert error <= stock_error, f"{where}: {quantity} error {error:.3g} > stock's {stock_error:.3g}"
        for key in ("head_grad_relative_l2_max", "labels_grad_relative_l2_max"):
            assert result[key] <= GRAD_RELATIVE_L2, f"{where}: {key} {result[key]:.3g} > {GRAD_RELATIVE_L2}"
    unwrap_model(model)
    return record


def float64_copy(model, shape: GPTShape, device: torch.device, tied: bool):
    """A float64 GPTModel with ``model``'s weights."""
    copy = megatron_gpt.build_gpt(shape, vocab_size=model.vocab_size, dtype=torch.float64, device=device,
                                  sequence_parallel=True, tied=tied)  # fmt: skip
    copy.load_state_dict({name: value.double() if isinstance(value, torch.Tensor) and value.is_floating_point()
                          else value for name, value in model.state_dict().items()})  # fmt: skip
    return copy


def check_paths(shape: GPTShape, device: torch.device, tied: bool, backend: str) -> dict:
    """Every path's per-parameter gradient error against float64 (the module's docstring), for the
    three losses; asserted here, and returned with the largest ratio to stock's per path."""
    where = f"tied={tied} backend={backend}"
    model = megatron_gpt.build_bf16_gpt(shape, device, tied=tied, sequence_parallel=True, seed=1234, peaky=True)
    batch = megatron_gpt.causal_batch(shape, model.vocab_size, seed=7, device=device)
    targets = batch[3]
    response = torch.zeros_like(targets, dtype=torch.bool)
    response[:, RESPONSE_START:] = True
    labels_weights = megatron_gpt.random_weights(*targets.shape, seed=12, device=device)
    reference = float64_copy(model, shape, device, tied)
    exact_logprob, _ = megatron_gpt.oracle_logprob_entropy(
        megatron_gpt.forward(reference, batch).detach(), targets, 1.0
    )
    inputs = {name: value.to(device) for name, value in megatron_gpt.policy_inputs(exact_logprob, response).items()}

    def logits_losses(logits):  # the three losses from a model's stock logits (float64 math)
        logprob, entropy = megatron_gpt.oracle_logprob_entropy(logits, targets, TEMPERATURE)
        plain_logprob, plain_entropy = megatron_gpt.oracle_logprob_entropy(logits, targets, 1.0)
        return {"logprobs": megatron_gpt.head_loss(logprob, entropy),
                "policy": megatron_gpt.masked_loss(POLICY, plain_logprob, plain_entropy, inputs, response)}  # fmt: skip

    def stock_grads(gpt) -> dict:
        grads = {}
        for name, value in logits_losses(megatron_gpt.forward(gpt, batch)).items():
            value.backward(retain_graph=name == "logprobs")
            grads[name] = megatron_gpt.finalized_parameter_grads(gpt)
        (labels_weights * megatron_gpt.forward(gpt, batch, labels=targets)).sum().backward()
        grads["labels"] = megatron_gpt.finalized_parameter_grads(gpt)
        return grads

    exact = stock_grads(reference)
    errors = {f"stock_{name}": grad_errors(grads, exact[name]) for name, grads in stock_grads(model).items()}
    head = wrap_model(model, FusedLMConfig(enabled=True, backend=backend))
    assert head.fused and head.fallback_reason is None, where
    paths = {
        "recompute_logprobs": lambda: megatron_gpt.head_loss(*head.logprobs(
            megatron_gpt.forward(model, batch), targets, temperature=TEMPERATURE, return_entropy=True)),
        "recompute_labels": lambda: (labels_weights * megatron_gpt.forward(model, batch, labels=targets)).sum(),
        "recompute_policy": lambda: megatron_gpt.masked_loss(POLICY, *head.logprobs(
            megatron_gpt.forward(model, batch), targets, return_entropy=True, mask=response), inputs, response),
        "three_gemm_labels": lambda: declared_labels_loss(head, model, batch, labels_weights, None),
        "three_gemm_policy": lambda: head.loss(megatron_gpt.forward(model, batch), targets, POLICY,
                                               loss_inputs=inputs, mask=response).loss,
    }  # fmt: skip
    for name, loss in paths.items():
        loss().backward()
        errors[name] = grad_errors(megatron_gpt.finalized_parameter_grads(model), exact[name.split("_")[-1]])
    head.declare_loss_weights(None)
    unwrap_model(model)
    # The main_grad route: a DDP copy of the same weights, its float32 main_grad written in the forward.
    ddp = megatron_gpt.megatron_ddp(megatron_gpt.build_bf16_gpt(shape, device, tied=tied, sequence_parallel=True,
                                                                seed=1234, peaky=True))  # fmt: skip
    ddp_head = wrap_model(ddp, FusedLMConfig(enabled=True, backend=backend))
    main_grad_paths = {
        "main_grad_labels": lambda: declared_labels_loss(ddp_head, ddp, batch, labels_weights, 1.0),
        "main_grad_policy": lambda: ddp_head.loss(megatron_gpt.forward(ddp, batch), targets, POLICY,
                                                  loss_inputs=inputs, mask=response, main_grad_scale=1.0).loss,
    }  # fmt: skip
    for name, loss in main_grad_paths.items():
        loss().backward()
        main_grads = megatron_gpt.sum_sequence_parallel(megatron_gpt.ddp_main_grads(ddp), ddp.module)
        errors[name] = grad_errors(main_grads, exact[name.split("_")[-1]])
        ddp.zero_grad_buffer()
    assert not ddp_head.main_grad_outstanding(), where
    unwrap_model(ddp)
    record = {}
    for name, per_parameter in errors.items():
        if name.startswith("stock_"):
            continue
        stock = errors["stock_" + name.split("_")[-1]]
        ratio = max(per_parameter[key] / stock[key] for key in stock)
        record[name] = {"largest_error": max(per_parameter.values()), "largest_ratio_to_stock": ratio}
        assert ratio <= FLOAT64_FACTOR, f"{where} {name}: a gradient {ratio:.3g} x stock's error against float64"
    record["stock_largest_error"] = {name: max(values.values()) for name, values in errors.items() if
                                     name.startswith("stock_")}  # fmt: skip
    distributed.log(f"{where} against float64: {record}")
    return record


def declared_labels_loss(head, model, batch, weights, main_grad_scale):
    """The labels path's ``sum(weights * loss)`` with ``weights`` declared (three GEMMs)."""
    head.declare_loss_weights(weights, main_grad_scale=main_grad_scale)
    return (weights * megatron_gpt.forward(model, batch, labels=batch[3])).sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="where rank 0 writes the measured errors")
    args = parser.parse_args()
    tensor_parallel = int(os.environ["WORLD_SIZE"])  # one tensor-parallel group over every process
    device = distributed.init_distributed(tensor_parallel)
    shape = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    try:
        records = []
        for tied in (False, True):
            record = check_embedding_mode(shape, device, tied)
            # The Triton kernels where they compile; the CPU dry run checks the logic once, by torch.
            backends = BACKENDS if device.type == "cuda" else ("torch",)
            record["float64"] = {backend: check_paths(shape, device, tied, backend) for backend in backends}
            records.append(record)
        ranks = distributed.gather_to_rank0({"rank": torch.distributed.get_rank(), "modes": records})
        distributed.write_json(
            args.json,
            {
                "shape": distributed.shape_record(shape),
                "tensor_parallel": tensor_parallel,
                "sequence_parallel": True,
                "temperature": TEMPERATURE,
                "ranks": ranks,
            },
        )
        distributed.log("tp_parity: PASS")
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
