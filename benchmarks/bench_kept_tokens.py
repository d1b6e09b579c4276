"""What ``kept_tokens`` costs beside the unmasked op, on one GPU (Triton backend, bf16, the inputs
of ``harness.make_inputs``): the forward (``no_grad``), the recompute op's forward + backward and the
three-GEMM SFT loss, without sets and with ``K`` random ids per row (the target among them), for
each ``K`` of ``--sizes``; the sets' bitmask alone (checks and the Triton builder); and the sparse
alternative's forward, the ``K`` logits of each row by a gathered product
(``several_targets.gathered_logits``), which the dense masked pass is measured against. Median of
``--repeats`` timed calls after ``--warmup``, peak extra memory of one more.

    PYTHONPATH=.:benchmarks python benchmarks/bench_kept_tokens.py --shapes 4096x2048x151936 --json kept.json
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

from megatron_fused_lm.ops.backends.registry import by_name
from megatron_fused_lm.ops.inputs import select_rows
from megatron_fused_lm.ops.kept_tokens import checked_sets
from megatron_fused_lm.ops.several_targets import gathered_logits


def kept_sets(targets, vocab, size, generator):
    """``size`` ids per row, random, the row's target first: ``(offsets, token_ids)``."""
    ids = torch.randint(0, vocab, (targets.shape[0], size), device=targets.device, generator=generator)
    ids[:, 0] = targets
    offsets = torch.arange(targets.shape[0] + 1, device=targets.device) * size
    return offsets, ids.reshape(-1)


def extra_steps(inputs, kept_tokens):
    """The bitmask alone, and the sparse form's forward products."""
    hidden, weight, targets = inputs.hidden, inputs.weight, inputs.targets
    offsets, ids = kept_tokens
    temperature = torch.ones(targets.shape[0], device=targets.device)

    def bitmask():
        selection = select_rows(targets, targets.shape, None, None, weight.shape[0], None)
        sets = checked_sets(kept_tokens, selection, targets, weight.shape[0], None)
        return by_name("triton").kept_mask(sets, weight.shape[0])

    def sparse_forward():
        with torch.no_grad():
            return gathered_logits(hidden, weight, ids.view(targets.shape[0], -1), temperature, None)

    return {"bitmask": bitmask, "sparse_forward": sparse_forward}


def main():
    parser = timing_parser(__doc__.splitlines()[0], "4096x2048x151936,16384x4096x151936", warmup=2, repeats=7)
    parser.add_argument("--sizes", default="16,256,1024")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for shape in parse_shapes(args.shapes):
        inputs = make_inputs(*shape, torch.bfloat16, device)
        generator = torch.Generator(device=device).manual_seed(3)
        cases = [("none", None)] + [
            (size, kept_sets(inputs.targets, shape[2], int(size), generator)) for size in args.sizes.split(",")
        ]
        for label, kept_tokens in cases:
            named = op_steps(inputs, kept_tokens=kept_tokens)
            if kept_tokens is not None:
                named.update(extra_steps(inputs, kept_tokens))
            for use, step in named.items():
                measurement, failure = try_measure(lambda step=step: step, inputs, args.warmup, args.repeats)
                row = result_row(measurement, failure, shape=shape_name(shape), use=use, kept=label)
                rows.append(row)
                print(row, flush=True)
        del inputs
    write_rows(args.json, device, rows)


if __name__ == "__main__":
    main()
