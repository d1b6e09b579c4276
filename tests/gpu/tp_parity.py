"""The fused head on a bf16 GPTModel, TP=2 with sequence parallelism, against the stock model:
tied and untied embeddings, Triton and torch backends. Started by torchrun on two GPUs:

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

Without CUDA it runs on two gloo CPU ranks at a tiny size (a dry run of the logic).
"""

from __future__ import annotations

import argparse

import torch

from devkit import distributed, megatron_gpt
from devkit.megatron_gpt import GPTShape
from devkit.oracle import logprob_entropy, max_abs_error
from megatron_fused_lm.integration import FusedLMConfig, unwrap_model, wrap_model

TENSOR_PARALLEL = 2
GPU_SHAPE = GPTShape(hidden=1024, heads=16, layers=4, vocab=151936, seq=512, micro_batch=2)
CPU_SHAPE = GPTShape(hidden=64, heads=4, layers=2, vocab=1000, seq=16, micro_batch=2)
TEMPERATURE = 0.7
EXACT_ATOL = 2e-3
GRAD_RELATIVE_L2 = 0.15
BACKENDS = ("triton", "torch")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="where rank 0 writes the measured errors")
    args = parser.parse_args()
    device = distributed.init_distributed(TENSOR_PARALLEL)
    shape = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    try:
        records = [check_embedding_mode(shape, device, tied) for tied in (False, True)]
        ranks = distributed.gather_to_rank0({"rank": torch.distributed.get_rank(), "modes": records})
        distributed.write_json(
            args.json,
            {
                "shape": distributed.shape_record(shape),
                "tensor_parallel": TENSOR_PARALLEL,
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
