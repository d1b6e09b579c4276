"""Calibrate liger-cute-kernels' native fused linear scaled cross-entropy against the rates its
authors publish: its core timed without the Python wrapper, beside the cuBLAS products each of its
passes does, on liger's own inputs, with the TFLOP/s on both conventions.

- Inputs as liger's TP benchmark script makes them: hidden and weight N(0, 0.05^2) in bf16,
  targets ``arange(tokens) % vocab``, temperature 0.8, entropy on.
- ``core_forward``: the core's forward (``tvm_ffi.fused_linear_scaled_cross_entropy_forward``:
  NLL, log-sum-exp and entropy); ``core_backward``: its backward on that forward's saved
  log-sum-exp and entropy (the logits again, then both gradients), with random upstream gradients
  of the NLL and the entropy; ``wrapper``: forward + backward through liger-kernel's autograd
  Function (``liger_native.NativeScaledCrossEntropy``), as bench_logprob.py times it.
- Floors, the bare bf16 cuBLAS products into buffers allocated beforehand: ``floor1`` the logits
  (what the forward does), ``floor3`` the logits, ``grad_hidden`` and ``grad_weight`` (the
  backward), ``floor4`` all four (the forward + backward).
- Conventions: liger counts 2 N H V for its forward and 6 N H V for its backward
  (``*_tflops_liger``); our pages count 6 N H V for a loss's forward + backward, what a three-product
  method does (``wrapper_tflops_ours``). Each time is also given over the floor of the products it
  does (``*_vs_floor``).

    PYTHONPATH=.:benchmarks python3 benchmarks/calibrate_liger_native.py --json calibration.json

(devkit/gpu-liger-native.sh says what a GPU host needs for the native core.)"""

from __future__ import annotations

import json

import torch
from harness import parse_shapes, shape_name, timing_parser
from liger_native import IGNORE_INDEX, NativeScaledCrossEntropy

from devkit import measure

# liger's TP benchmark script's inputs: scale of hidden and weight, temperature and seeds.
INPUT_SCALE, TEMPERATURE, SEEDS = 0.05, 0.8, (2027, 3100)
LIGER_SHAPES = "4096x4096x131072,8192x4096x131072"  # its script's default, and the shape of its published rates
OUR_SHAPES = "4096x2048x151936,8192x4096x151936,16384x5120x152064,16384x3072x262144"


def liger_inputs(shape, device):
    tokens, hidden_size, vocab = shape
    hidden = torch.randn(
        tokens, hidden_size, generator=torch.Generator(device=device).manual_seed(SEEDS[0]), device=device
    )
    weight = torch.randn(
        vocab, hidden_size, generator=torch.Generator(device=device).manual_seed(SEEDS[1]), device=device
    )
    targets = torch.arange(tokens, device=device) % vocab
    gradients = torch.randn(2, tokens, generator=torch.Generator(device=device).manual_seed(0), device=device)
    return (hidden * INPUT_SCALE).bfloat16(), (weight * INPUT_SCALE).bfloat16(), targets, gradients


def floor_steps(hidden, weight):
    """The bare cuBLAS products: ``floor1`` (logits), ``floor3`` (logits, grad_hidden,
    grad_weight) and ``floor4`` (the logits twice, then both gradients)."""
    logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.empty_like(weight)

    def floor1():
        torch.mm(hidden, weight.t(), out=logits)

    def floor3():
        torch.mm(hidden, weight.t(), out=logits)
        torch.mm(logits, weight, out=grad_hidden)
        torch.mm(logits.t(), hidden, out=grad_weight)

    def floor4():
        floor1()
        floor3()

    return dict(floor1=floor1, floor3=floor3, floor4=floor4)


def calibrate(op, shape, device, warmup, repeats):
    """One shape's record: each step's median ms, TFLOP/s and ratio to its floor."""
    tokens, hidden_size, vocab = shape
    hidden, weight, targets, (grad_nll, grad_entropy) = liger_inputs(shape, device)
    lck, team, inverse_temperature = op.lck, op.team, 1.0 / TEMPERATURE
    if not op.fits(shape):
        op.configure(shape)

    def core_forward():
        return lck.fused_linear_scaled_cross_entropy_forward(
            hidden, weight, targets, 0, IGNORE_INDEX, inverse_temperature, team, True
        )

    _, lse, entropy = core_forward()

    def core_backward():
        return lck.fused_linear_scaled_cross_entropy_backward(
            grad_nll, grad_entropy, hidden, weight, targets, lse, entropy, 0, IGNORE_INDEX, inverse_temperature,
            team, 1, True,
        )  # fmt: skip

    leaf_hidden, leaf_weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()

    def wrapper():
        leaf_hidden.grad = leaf_weight.grad = None
        logprob, entropy = op(leaf_hidden, leaf_weight, targets, TEMPERATURE)
        torch.autograd.backward([logprob, entropy], [-grad_nll, grad_entropy])

    steps = dict(core_forward=core_forward, core_backward=core_backward, wrapper=wrapper, **floor_steps(hidden, weight))
    ms = {name: measure.median_ms(step, device, warmup, repeats) for name, step in steps.items()}
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
    result = dict(meta=dict(measure.environment(device, torch.bfloat16), temperature=TEMPERATURE), rows=[])
    for shape in shapes:
        result["rows"].append(calibrate(op, shape, device, args.warmup, args.repeats))
        print(json.dumps(result["rows"][-1]), flush=True)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(result, handle, indent=1)
        measure.release_memory()


if __name__ == "__main__":
    main()
