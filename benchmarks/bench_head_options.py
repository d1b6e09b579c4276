"""What ``softcap`` and ``vocab_size`` cost beside the plain head, on one GPU (Triton backend, bf16,
the inputs of ``harness.make_inputs``): the forward (``no_grad``), the recompute op's forward +
backward, the three-GEMM SFT loss (under a cap the forward stores each exponential times the cap's
slope, so the backward still reads its stored block as it is) and the three-GEMM RL loss (clipped
policy loss with an entropy term, the ``dz`` kernel either way), each plain and with the option:
``softcap=30`` (Gemma-2's), or ``vocab_size`` 271 ids short of the head (Qwen2.5's 151665 of 151936:
the ops compute on the weight's first rows). ``--pairs`` alternated (plain, option) measurements in
one process, each the median of ``--repeats`` timed calls after ``--warmup``; the report gives each
pair's ratio. ``--uses`` picks among forward, recompute, sft and rl.

    PYTHONPATH=.:benchmarks python benchmarks/bench_head_options.py --shapes 8192x4096x151936 --json options.json
"""

from __future__ import annotations

import statistics

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

from megatron_fused_lm import fused_linear_loss, losses

PADDED_IDS = 271  # Qwen2.5: a tokenizer of 151665 ids, a head of 151936 rows


def option_values(vocab: int) -> dict:
    return {"softcap": {"softcap": 30.0}, "vocab_size": {"vocab_size": vocab - PADDED_IDS}}


def steps(inputs, options):
    """``op_steps`` and the three-GEMM RL loss, with ``options``."""
    named = op_steps(inputs, **options)
    policy = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)
    weights = torch.full_like(inputs.grad_logprob, 1.0 / inputs.targets.numel())
    loss_inputs = {"weight": weights, "advantages": inputs.grad_logprob}

    def rl():
        fused_linear_loss(
            inputs.hidden, inputs.weight, inputs.targets, policy, loss_inputs=loss_inputs, backend="triton", **options
        ).loss.backward()

    return dict(named, rl=rl)


def main():
    parser = timing_parser(__doc__.splitlines()[0], "4096x2048x151936,8192x4096x151936", warmup=2, repeats=7)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--options", default="softcap,vocab_size")
    parser.add_argument("--uses", default="forward,recompute,sft,rl")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for shape in parse_shapes(args.shapes):
        inputs = make_inputs(*shape, torch.bfloat16, device)
        inputs.targets.remainder_(shape[2] - PADDED_IDS)  # inside the true vocabulary for every variant
        for name in args.options.split(","):
            option = option_values(shape[2])[name]
            for use in args.uses.split(","):
                ratios = []
                for pair in range(args.pairs):
                    times = {}
                    for label, options in (("plain", {}), (name, option)):
                        step = steps(inputs, options)[use]
                        measurement, failure = try_measure(lambda step=step: step, inputs, args.warmup, args.repeats)
                        row = result_row(measurement, failure, shape=shape_name(shape), use=use, head=label, pair=pair)
                        rows.append(row)
                        times[label] = row.get("ms")
                    if None not in times.values():
                        ratios.append(times[name] / times["plain"])
                summary = dict(shape=shape_name(shape), option=name, use=use, ratios=[round(r, 4) for r in ratios])
                if ratios:
                    summary["median_ratio"] = round(statistics.median(ratios), 4)
                rows.append(summary)
                print(summary, flush=True)
        del inputs
    write_rows(args.json, device, rows)


if __name__ == "__main__":
    main()
