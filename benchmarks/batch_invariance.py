"""Which of a row's results on the Triton backend depend on the other rows of the call: for rows of
an ``--shape`` call placed alone, first or last in smaller calls, whether the forward log-prob and
entropy and the hidden-gradient row come out bitwise the same as in the whole call (recompute and
three-GEMM paths; upstream gradient one per row). Prints one JSON line per path.

    PYTHONPATH=.:benchmarks python benchmarks/batch_invariance.py --shape 8192x2048x151936
"""

from __future__ import annotations

import argparse
import json

import torch
from harness import make_inputs, parse_shapes

from megatron_fused_lm import fused_linear_logprob, fused_linear_loss


def recompute(hidden, weight, targets):
    logprob, entropy = fused_linear_logprob(hidden, weight, targets, return_entropy=True, backend="triton")
    (logprob.sum() + entropy.sum()).backward()
    return logprob, entropy


def three_gemm(hidden, weight, targets):
    result = fused_linear_loss(hidden, weight, targets, lambda logprob, entropy: entropy - logprob, backend="triton")
    result.loss.backward()
    return result.logprob, result.entropy


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192x2048x151936")
    parser.add_argument("--sizes", default="1,64,1000,4097")
    args = parser.parse_args()
    (tokens, hidden_size, vocab), sizes = parse_shapes(args.shape)[0], [int(s) for s in args.sizes.split(",")]
    inputs = make_inputs(tokens, hidden_size, vocab, torch.bfloat16, "cuda")
    base_hidden, weight, targets = inputs.hidden.detach(), inputs.weight.detach(), inputs.targets
    probes = (0, tokens // 4 + 1, tokens - 1)
    others = torch.arange(tokens, device="cuda").flip(0)
    for name, path in (("recompute", recompute), ("three_gemm", three_gemm)):

        def call(order):
            hidden = base_hidden[order].clone().requires_grad_()
            logprob, entropy = path(hidden, weight.clone().requires_grad_(), targets[order])
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
        print(json.dumps(dict(path=name, shape=args.shape, placements=placements, bitwise_same=same)), flush=True)


if __name__ == "__main__":
    main()
