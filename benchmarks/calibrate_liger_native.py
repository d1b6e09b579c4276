"""Calibrate liger-cute-kernels' native fused linear scaled cross-entropy against the rates its
authors publish: its core timed without the Python wrapper, beside the cuBLAS products each of its
passes does, on liger's own inputs, with the TFLOP/s on both conventions.

- Inputs as liger's TP benchmark script makes them: hidden and weight N(0, 0.05^2) in bf16,
  targets ``arange(tokens) % vocab``, temperature 0.8, entropy on.
- ``core_forward``: the core's forward (``tvm_ffi.fused_linear_scaled_cross_entropy_forward``:
  NLL, log-sum-exp and entropy); ``core_backward``: its backward on that forward's saved
  log-sum-exp and entropy (the logits again, then both gradients), with random upstream gradients
  of the NLL and the entropy; ``wrapper``: forward + backward through liger-kernel's autograd
  Function (``liger_native.NativeScaledCrossEntropy``), as bench_logprob.py times it (its
  ``rl_step`` and ``harness.measure``).
- Floors, bench_logprob's bare bf16 cuBLAS products: ``floor1`` the logits (what the forward
  does), ``floor3`` the logits, ``grad_hidden`` and ``grad_weight`` (the backward), ``floor4`` all
  four (the forward + backward).
- Conventions: liger counts 2 N H V for its forward and 6 N H V for its backward
  (``*_tflops_liger``); our pages count 6 N H V for a loss's forward + backward, what a three-product
  method does (``wrapper_tflops_ours``). Each time is also given over the floor of the products it
  does (``*_vs_floor``).

    PYTHONPATH=.:benchmarks python3 benchmarks/calibrate_liger_native.py --json calibration.json

(devkit/gpu-liger-native.sh says what a GPU host needs for the native core.)"""

from __future__ import annotations

import json

import torch
from harness import BenchInputs, measure, parse_shapes, shape_name, timing_parser
from liger_native import IGNORE_INDEX, NativeScaledCrossEntropy
from methods import floor_step, forward_step, rl_step

from devkit.measure import environment, release_memory

# liger's TP benchmark script's inputs: scale of hidden and weight, temperature and seeds.
INPUT_SCALE, TEMPERATURE, SEEDS = 0.05, 0.8, (2027, 3100)
LIGER_SHAPES = "4096x4096x131072,8192x4096x131072"  # its script's default, and the shape of its published rates
OUR_SHAPES = "4096x2048x151936,8192x4096x151936,16384x5120x152064,16384x3072x262144"


def liger_inputs(shape, device):
    """``harness.BenchInputs`` as liger's script makes them, with random upstream gradients."""
    tokens, hidden_size, vocab = shape
    seeded = [torch.Generator(device=device).manual_seed(seed) for seed in (*SEEDS, 0)]
    hidden = torch.randn(tokens, hidden_size, generator=seeded[0], device=device) * INPUT_SCALE
    weight = torch.randn(vocab, hidden_size, generator=seeded[1], device=device) * INPUT_SCALE
    grad_logprob, grad_entropy = torch.randn(2, tokens, generator=seeded[2], device=device)
    return BenchInputs(
        hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_(),
        torch.arange(tokens, device=device) % vocab, grad_logprob, grad_entropy,
    )  # fmt: skip


def calibrate(op, shape, device, warmup, repeats):
    """One shape's record: each step's median ms, TFLOP/s and ratio to its floor."""
    tokens, hidden_size, vocab = shape
    inputs = liger_inputs(shape, device)
    hidden, weight, targets = inputs.hidden.detach(), inputs.weight.detach(), inputs.targets
    lck, team, inverse_temperature = op.lck, op.team, 1.0 / TEMPERATURE
    if not op.fits(shape):
        op.configure(shape)

    def core_forward():
        return lck.fused_linear_scaled_cross_entropy_forward(
            hidden, weight, targets, 0, IGNORE_INDEX, inverse_temperature, team, True
        )

    _, lse, entropy = core_forward()
    grad_nll = -inputs.grad_logprob  # the core's output is the NLL, minus the log-prob

    def core_backward():
        return lck.fused_linear_scaled_cross_entropy_backward(
            grad_nll, inputs.grad_entropy, hidden, weight, targets, lse, entropy, 0, IGNORE_INDEX,
            inverse_temperature, team, 1, True,
        )  # fmt: skip

    steps = dict(
        core_forward=core_forward,
        core_backward=core_backward,
        wrapper=rl_step("liger_native", inputs, TEMPERATURE, competitors={"liger_native": op}),
        floor1=forward_step("floor1", inputs),
        floor3=floor_step(inputs, recompute=False),  # the logits, grad_hidden and grad_weight
        floor4=floor_step(inputs, recompute=True),  # the logits twice, then both gradients
    )
    ms = {name: measure(step, inputs, warmup, repeats).ms for name, step in steps.items()}
    nhv = tokens * hidden_size * vocab
    tflops = lambda flops, milliseconds: flops / (milliseconds * 1e9)  # noqa: E731
    return dict(
        shape=shape_name(shape),
        ms=ms,
        core_forward_tflops_liger=tflops(2 * nhv, ms["core_forward"]),
        core_backward_tflops_liger=tflops(6 * nhv, ms["core_backward"]),
        core_tflops_liger=tflops(8 * nhv, ms["core_forward"] + ms["core_backward"]),
        wrapper_tflops_liger=tflops(8 * nhv, ms["wrapper"]),
        wrapper_tflops_ours=tflops(6 * nhv, ms["wrapper"]),
        floor1_tflops=tflops(2 * nhv, ms["floor1"]),
        floor3_tflops=tflops(6 * nhv, ms["floor3"]),
        core_forward_vs_floor=ms["core_forward"] / ms["floor1"],
        core_backward_vs_floor=ms["core_backward"] / ms["floor3"],
        core_vs_floor=(ms["core_forward"] + ms["core_backward"]) / ms["floor4"],
        wrapper_vs_floor=ms["wrapper"] / ms["floor4"],
        wrapper_over_core=ms["wrapper"] / (ms["core_forward"] + ms["core_backward"]),
    )


def main():
    args = timing_parser(__doc__.splitlines()[0], f"{LIGER_SHAPES},{OUR_SHAPES}", warmup=3, repeats=10).parse_args()
    shapes, device = parse_shapes(args.shapes), torch.device("cuda")
    op = NativeScaledCrossEntropy(shapes, device)
    result = dict(meta=dict(environment(device, torch.bfloat16), temperature=TEMPERATURE), rows=[])
    for shape in shapes:
        result["rows"].append(calibrate(op, shape, device, args.warmup, args.repeats))
        print(json.dumps(result["rows"][-1]), flush=True)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(result, handle, indent=1)
        release_memory()


if __name__ == "__main__":
    main()
