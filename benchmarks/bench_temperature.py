"""What a temperature per token costs beside one temperature for all, on one GPU (Triton backend,
bf16, the inputs of ``harness.make_inputs``): the forward (``no_grad``), the recompute op's forward
+ backward (log-prob and entropy, random upstream gradients) and the three-GEMM SFT loss, each with
``temperature=0.7`` and with a ``[tokens]`` tensor of temperatures from 0.5 to 2. Median of
``--repeats`` timed calls after ``--warmup``, peak extra memory of one more.

    PYTHONPATH=.:benchmarks python benchmarks/bench_temperature.py --shapes 8192x4096x151936 --json temperature.json
"""

from __future__ import annotations

import torch
from harness import (
    make_inputs,
    op_steps,
    parse_shapes,
    result_row,
    shape_name,
    timing_parser,
    try_measure,
    write_rows,
)


def main():
    parser = timing_parser(__doc__.splitlines()[0], "4096x2048x151936,16384x5120x152064", warmup=2, repeats=7)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for shape in parse_shapes(args.shapes):
        inputs = make_inputs(*shape, torch.bfloat16, device)
        gen = torch.Generator(device=device).manual_seed(3)
        per_token = torch.rand(shape[0], device=device, generator=gen) * 1.5 + 0.5
        for label, temperature in (("one", 0.7), ("per_token", per_token)):
            for use, step in op_steps(inputs, temperature=temperature).items():
                measurement, failure = try_measure(lambda step=step: step, inputs, args.warmup, args.repeats)
                row = result_row(measurement, failure, shape=shape_name(shape), use=use, temperature=label)
                rows.append(row)
                print(row)
        del inputs
    write_rows(args.json, device, rows)


if __name__ == "__main__":
    main()
