"""Which of a row's results on the Triton backend depend on the other rows of the call, and what
``batch_invariant=True`` costs.

- Invariance (``--shape``): rows of the call placed alone, first or last in smaller calls; for each
  path and setting, how many placements give the forward log-prob, entropy and hidden-gradient row
  bitwise as the whole call does (upstream gradient one per row).
- Cost (``--time-shapes``): forward + backward (hidden and weight gradients) of each path with the
  option off and on, median of ``--repeats`` CUDA-event timings, in one process.

One JSON line per path and setting, then per timed shape and path.

    PYTHONPATH=.:benchmarks python benchmarks/batch_invariance.py --shape 8192x2048x151936
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from harness import make_inputs, parse_shapes

from devkit.measure import elapsed_ms
from megatron_fused_lm import fused_linear_logprob, fused_linear_loss


def recompute(hidden, weight, targets, batch_invariant):
    logprob, entropy = fused_linear_logprob(
        hidden, weight, targets, return_entropy=True, backend="triton", batch_invariant=batch_invariant
    )
    (logprob.sum() + entropy.sum()).backward()
    return logprob, entropy


def three_gemm(entropy_coef):
    def run(hidden, weight, targets, batch_invariant):
        result = fused_linear_loss(
            hidden, weight, targets, lambda logprob, entropy: entropy_coef * entropy - logprob, backend="triton",
            batch_invariant=batch_invariant,
        )  # fmt: skip
        result.loss.backward()
        return result.logprob, result.entropy

    return run


PATHS = {"recompute": recompute, "three_gemm": three_gemm(0.0), "three_gemm_entropy": three_gemm(0.01)}


def invariance(shape, sizes):
    tokens = shape[0]
    inputs = make_inputs(*shape, torch.bfloat16, "cuda")
    base_hidden, weight, targets = inputs.hidden.detach(), inputs.weight.detach(), inputs.targets
    probes = (0, tokens // 4 + 1, tokens - 1)
    others = torch.arange(tokens, device="cuda").flip(0)
    for name, path in PATHS.items():
        for batch_invariant in (False, True):

            def call(order):
                hidden = base_hidden[order].clone().requires_grad_()
                logprob, entropy = path(hidden, weight, targets[order], batch_invariant)
                return logprob.detach(), entropy.detach(), hidden.grad

            whole = call(torch.arange(tokens, device="cuda"))
            same = dict(logprob=0, entropy=0, grad_hidden=0)
            placements = 0
            for probe in probes:
                for size in sizes:
                    for position in sorted({0, size - 1}):
                        fill = others[others != probe][: size - 1]
                        order = torch.cat([fill[:position], torch.tensor([probe], device="cuda"), fill[position:]])
                        part = call(order)
                        placements += 1
                        for key, mine, full in zip(same, part, whole, strict=True):
                            same[key] += bool(torch.equal(mine[position], full[probe]))
            row = dict(path=name, batch_invariant=batch_invariant, shape="x".join(map(str, shape)))
            print(json.dumps(dict(row, placements=placements, bitwise_same=same)), flush=True)


def cost(shape, warmup, repeats):
    inputs = make_inputs(*shape, torch.bfloat16, "cuda")
    hidden, weight, targets = inputs.hidden, inputs.weight, inputs.targets
    for name, path in PATHS.items():
        times = {}
        for batch_invariant in (False, True):

            def step():
                hidden.grad = weight.grad = None
                path(hidden, weight, targets, batch_invariant)

            for _ in range(warmup):
                step()
            times[batch_invariant] = statistics.median(elapsed_ms(step, hidden.device) for _ in range(repeats))
        row = dict(path=name, shape="x".join(map(str, shape)), ms_default=times[False], ms_batch_invariant=times[True])
        print(json.dumps(dict(row, ratio=times[True] / times[False])), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192x2048x151936")
    parser.add_argument("--sizes", default="1,64,1000,4097")
    parser.add_argument("--time-shapes", default="")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.shape:
        invariance(parse_shapes(args.shape)[0], [int(size) for size in args.sizes.split(",")])
    for shape in parse_shapes(args.time_shapes):
        cost(shape, args.warmup, args.repeats)


if __name__ == "__main__":
    main()
