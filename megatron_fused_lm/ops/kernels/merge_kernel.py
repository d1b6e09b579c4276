"""``softmax.merge_statistics`` as one kernel whose order of summation is fixed by the number of
parts alone: a program loads all parts of its rows as one ``[rows, parts]`` tile per statistic and
reduces along the parts, so a row's result does not depend on how many rows share the call (a
torch reduction picks its order from the tensor's size; ``docs/DESIGN.md``, "Batch invariance")."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..softmax import NUM_STATISTICS

ELEMENTS = 4096  # rows x parts of one program's tiles
STATISTICS = tl.constexpr(NUM_STATISTICS)


@triton.jit
def merge_kernel(parts_ptr, out_ptr, num_parts, num_tokens, stride_part, ROWS: tl.constexpr, PARTS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    parts = tl.arange(0, PARTS)
    valid = (rows < num_tokens)[:, None] & (parts < num_parts)[None, :]
    at = parts_ptr + parts[None, :].to(tl.int64) * stride_part + rows[:, None].to(tl.int64) * STATISTICS
    # A part with no columns, and a padding part, has max = -inf and sumexp = 0: it adds nothing.
    block_max = tl.load(at, mask=valid, other=float("-inf"))
    block_sumexp = tl.load(at + 1, mask=valid, other=0.0)
    overall = tl.max(block_max, axis=1)
    empty = block_max == float("-inf")
    offset = tl.where(empty, 0.0, block_max - overall[:, None])
    scale = tl.where(empty, 0.0, tl.exp(offset))
    sumexp = tl.sum(block_sumexp * scale, axis=1)
    sumexp_z = tl.sum(scale * (tl.load(at + 2, mask=valid, other=0.0) + block_sumexp * offset), axis=1)
    target = tl.sum(tl.load(at + 3, mask=valid, other=0.0), axis=1)
    out = out_ptr + rows.to(tl.int64) * STATISTICS
    row_valid = rows < num_tokens
    tl.store(out, overall, mask=row_valid)
    tl.store(out + 1, sumexp, mask=row_valid)
    tl.store(out + 2, sumexp_z, mask=row_valid)
    tl.store(out + 3, target, mask=row_valid)


def merge_parts(parts: torch.Tensor) -> torch.Tensor:
    """``softmax.merge_statistics(parts)``: ``[k, n, 4]`` float32 (each ``[n, 4]`` contiguous) ->
    ``[n, 4]``, with an order of summation that depends on ``k`` only."""
    num_parts, num_tokens = parts.shape[:2]
    out = parts.new_empty(num_tokens, NUM_STATISTICS)
    if num_tokens:
        width = triton.next_power_of_2(num_parts)
        rows = max(1, ELEMENTS // width)
        merge_kernel[(triton.cdiv(num_tokens, rows),)](
            parts, out, num_parts, num_tokens, parts.stride(0), ROWS=rows, PARTS=width, num_warps=4
        )
    return out
