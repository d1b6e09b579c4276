"""``fused_linear_topk`` beside the forward it competes with, on one GPU: the logits GEMM alone
(``floor1``), the Triton log-prob + entropy forward under ``no_grad`` (``logprob``), and the top-k
at several ``k`` on each backend of ``--backends`` (Triton: two launches of its forward kernel;
torch: cuBLAS products and a torch selection). Forward only, bf16, the inputs of ``harness.make_inputs``; median of ``--repeats``
timed calls after ``--warmup``, peak extra memory of one more.

    PYTHONPATH=.:benchmarks python benchmarks/bench_topk.py --shapes 8192x4096x151936 --json topk.json
"""

from __future__ import annotations

import json

import torch
from harness import make_inputs, parse_shapes, result_row, shape_name, timing_parser, try_measure

from megatron_fused_lm import fused_linear_logprob, fused_linear_topk


def methods(inputs, ks, backends):
    hidden, weight, targets = inputs.hidden.detach(), inputs.weight.detach(), inputs.targets

    def floor1():
        return hidden @ weight.t()

    def logprob():
        with torch.no_grad():
            return fused_linear_logprob(hidden, weight, targets, return_entropy=True, backend="triton")

    steps = {"floor1": floor1, "logprob": logprob}
    for backend in backends:
        for k in ks:
            steps[f"topk{k}_{backend}"] = lambda k=k, backend=backend: fused_linear_topk(
                hidden, weight, k, backend=backend
            )
    return steps


def main():
    parser = timing_parser(__doc__.splitlines()[0], "8192x4096x151936", warmup=3, repeats=10)
    parser.add_argument("--ks", default="1,64")
    parser.add_argument("--backends", default="triton,torch")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for shape in parse_shapes(args.shapes):
        inputs = make_inputs(*shape, torch.bfloat16, device)
        for method, step in methods(inputs, [int(k) for k in args.ks.split(",")], args.backends.split(",")).items():
            measurement, failure = try_measure(lambda step=step: step, inputs, args.warmup, args.repeats)
            rows.append(result_row(measurement, failure, section="topk", shape=shape_name(shape), method=method))
            print(rows[-1])
        del inputs
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"meta": meta, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
