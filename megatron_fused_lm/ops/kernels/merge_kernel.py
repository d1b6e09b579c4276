"""``softmax.merge_statistics`` as one kernel whose order of summation is fixed by the number of
parts alone: a program loads all parts of its rows as one ``[rows, parts]`` tile per statistic and
reduces along the parts, so a row's result does not depend on how many rows share the call (a
torch reduction picks its order from the tensor's size; ``docs/DESIGN.md``, "Batch invariance").

The same launch does what a chunk needs next, row by row, so that no torch step runs between it and
the next product: with ``stale`` it checks each row's exponentials reference against the merged
maximum (the rule and bounds of ``backends.triton_reference``) and flags the rows to
refresh; with ``summary`` it writes the rows' ``softmax.summarize`` results instead of the
statistics (the parts are then every rank's, or the splits of a call without tensor parallelism).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..softmax import NUM_STATISTICS, OUTSIDE_VOCAB, SoftmaxSummary

ELEMENTS = 4096  # rows x parts of one program's tiles
STATISTICS = tl.constexpr(NUM_STATISTICS)
NO_SHARD = tl.constexpr(OUTSIDE_VOCAB)  # a target outside the vocabulary: its row's largest logit stands in


class StaleCheck(NamedTuple):
    """What ``merge_parts`` checks the rows' exponentials references with
    (``backends.triton_reference`` gives the rule and the bounds)."""

    reference: torch.Tensor  # [n] float32, contiguous: updated in place
    refresh: torch.Tensor  # [n] int8: 1 where the row is to be stored again
    max_above: float  # a maximum further above the reference is stale
    max_below: float  # ... and one further below it
    empty_reference: float  # the reference of a row whose shard keeps none of its columns


@triton.jit
def merge_kernel(
    parts_ptr,
    out_ptr,
    num_parts,
    num_tokens,
    stride_part,
    reference_ptr,
    refresh_ptr,
    target_column_ptr,
    logprob_ptr,
    entropy_ptr,
    lse_ptr,
    mean_logit_ptr,
    mean_minus_target_ptr,
    STALE: tl.constexpr,
    MAX_ABOVE: tl.constexpr,
    MAX_BELOW: tl.constexpr,
    EMPTY_REFERENCE: tl.constexpr,
    SUMMARY: tl.constexpr,
    ROWS: tl.constexpr,
    PARTS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_valid = rows < num_tokens
    parts = tl.arange(0, PARTS)
    valid = row_valid[:, None] & (parts < num_parts)[None, :]
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
    if STALE:
        reference = tl.load(reference_ptr + rows, mask=row_valid, other=0.0)
        no_column = overall == float("-inf")
        too_low = (overall < reference - MAX_BELOW) & ~no_column
        stale = (overall > reference + MAX_ABOVE) | too_low
        reference = tl.where(no_column, EMPTY_REFERENCE, tl.where(stale, overall, reference))
        tl.store(reference_ptr + rows, reference, mask=row_valid)
        tl.store(refresh_ptr + rows, stale.to(tl.int8), mask=row_valid)
    if SUMMARY:
        target_column = tl.load(target_column_ptr + rows, mask=row_valid, other=-1)
        target = tl.where(target_column == NO_SHARD, overall, target)
        log_sumexp = tl.log(sumexp)
        spread = sumexp_z / sumexp  # the mean logit minus the maximum, <= 0
        tl.store(logprob_ptr + rows, (target - overall) - log_sumexp, mask=row_valid)
        tl.store(entropy_ptr + rows, log_sumexp - spread, mask=row_valid)
        tl.store(lse_ptr + rows, overall + log_sumexp, mask=row_valid)
        tl.store(mean_logit_ptr + rows, overall + spread, mask=row_valid)
        tl.store(mean_minus_target_ptr + rows, spread + (overall - target), mask=row_valid)
    else:
        out = out_ptr + rows.to(tl.int64) * STATISTICS
        tl.store(out, overall, mask=row_valid)
        tl.store(out + 1, sumexp, mask=row_valid)
        tl.store(out + 2, sumexp_z, mask=row_valid)
        tl.store(out + 3, target, mask=row_valid)


def merge_parts(parts: torch.Tensor, stale: Optional[StaleCheck] = None) -> torch.Tensor:
    """``softmax.merge_statistics(parts)``: ``[k, n, 4]`` float32 (each ``[n, 4]`` contiguous) ->
    ``[n, 4]``, with an order of summation that depends on ``k`` only; with ``stale``, the
    references checked against the merged maxima too."""
    out = parts.new_empty(parts.shape[1], NUM_STATISTICS)
    _launch(parts, out, stale=stale, target_column=None, summary=None)
    return out


def summarize_parts(parts: torch.Tensor, target_column: torch.Tensor, out: SoftmaxSummary) -> None:
    """``softmax.summarize(softmax.merge_statistics(parts), target_column)`` for one target per row
    (``target_column [n]`` int64, contiguous), written into ``out``'s ``[n]`` float32 tensors
    (each with a unit stride)."""
    _launch(parts, None, stale=None, target_column=target_column, summary=out)


def _launch(parts, out, stale, target_column, summary) -> None:
    num_parts, num_tokens = parts.shape[:2]
    if num_tokens == 0:
        return
    width = triton.next_power_of_2(num_parts)
    rows = max(1, ELEMENTS // width)
    reference, refresh, *bounds = stale or (None, None, 0.0, 0.0, 0.0)
    merge_kernel[(triton.cdiv(num_tokens, rows),)](
        parts,
        out,
        num_parts,
        num_tokens,
        parts.stride(0),
        reference,
        refresh,
        target_column,
        *(summary or (None,) * len(SoftmaxSummary._fields)),
        STALE=stale is not None,
        MAX_ABOVE=bounds[0],
        MAX_BELOW=bounds[1],
        EMPTY_REFERENCE=bounds[2],
        SUMMARY=summary is not None,
        ROWS=rows,
        PARTS=width,
        num_warps=4,
    )
