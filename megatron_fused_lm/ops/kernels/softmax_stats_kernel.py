"""Forward kernel: the softmax statistics of ``hidden @ weight.T / T`` without storing the logits,
and, for the loss-in-forward path, the logits kept in a stored block (``triton_reference``).

A program owns one tile of ``block_m`` tokens and one vocabulary split of ``tiles_per_split``
column tiles; it folds each finished logits tile into running per-token statistics (``softmax``
order) and writes one ``[block_m, 4]`` slice of ``parts [num_splits, n, 4]``. With ``STORE_BLOCK``
it also stores the tile through a descriptor: ``exp(z - reference)``, or with ``STORE_OFFSETS``
float16 ``z - m`` and the tile's maximum ``m`` into ``reference [n, column tiles]``; ``REFRESH``
launches rewrite the row tiles that hold a row whose reference proved stale. For top-k
(``backends.triton_topk``), ``TILE_MAXIMA`` stores each tile's row maxima without a block, and
``COLLECT`` launches compute no statistics: they keep each row's logits at or above its threshold
in the row's slots of their split. ``docs/DESIGN.md`` says why splits ("The Triton backend") and
why each form ("The stored block").
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..softmax import NUM_STATISTICS
from .descriptors import addressable, descriptor
from .epilogue import (
    grouped_tile,
    inverse_temperature,
    kept_arguments,
    kept_tile,
    next_k_step,
    pick_candidates,
    product_step,
    temperature_arguments,
)
from .tiles import Tiles


def stores_offsets(block_dtype: torch.dtype) -> bool:
    """Whether a block of ``block_dtype`` holds offsets from tile maxima (else exponentials)."""
    return block_dtype == torch.float16


# Offsets below this are stored as it: their logits lie so far below the tile's maximum that p = 0
# in float32, and the logit read back stays finite.
LOWEST_OFFSET = tl.constexpr(-60000.0)


@triton.jit
def softmax_stats_kernel(
    hidden_desc,
    weight_desc,
    target_column_ptr,
    parts_ptr,
    num_tokens,
    vocab,
    hidden_size,
    tiles_per_split,
    num_splits,
    stride_parts_split,
    stride_parts_token,
    temperature_ptr,
    block_desc,
    reference_ptr,
    stride_reference_row,
    refresh_ptr,
    kept_ptr,
    stride_kept_row,
    kept_words,
    threshold_ptr,
    candidates_ptr,
    candidate_columns_ptr,
    slot_count_ptr,
    slots,
    HAS_KEPT: tl.constexpr,
    TILE_MAXIMA: tl.constexpr,
    COLLECT: tl.constexpr,
    PICKS: tl.constexpr,
    STORE_BLOCK: tl.constexpr,
    STORE_OFFSETS: tl.constexpr,
    REFRESH: tl.constexpr,
    UNIFORM_TEMPERATURE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    num_row_tiles = tl.cdiv(num_tokens, BLOCK_M)
    row_tile, split = grouped_tile(tl.program_id(0), num_row_tiles, num_splits, GROUP_M)
    row0 = row_tile * BLOCK_M
    first_col_tile = split * tiles_per_split
    num_col_tiles = tl.minimum(tl.cdiv(vocab, BLOCK_N) - first_col_tile, tiles_per_split)
    k_steps = tl.cdiv(hidden_size, BLOCK_K)

    rows = row0 + tl.arange(0, BLOCK_M)
    row_valid = rows < num_tokens
    target_column = tl.load(target_column_ptr + rows, mask=row_valid, other=-1)  # -1: another shard's
    inv_temperature = inverse_temperature(temperature_ptr, rows, row_valid, UNIFORM_TEMPERATURE)
    if STORE_BLOCK and not STORE_OFFSETS:
        reference = tl.load(reference_ptr + rows, mask=row_valid, other=0.0)
    if COLLECT:
        threshold = tl.load(threshold_ptr + rows, mask=row_valid, other=float("inf"))
        row_slots = (rows.to(tl.int64) * num_splits + split) * slots
        count = tl.zeros([BLOCK_M], tl.int32)
    num_steps = num_col_tiles * k_steps
    if REFRESH:
        # Only the row tiles with a row to rewrite walk their split; the others have no steps.
        refresh = tl.load(refresh_ptr + rows, mask=row_valid, other=0)
        num_steps = tl.where(tl.max(refresh, axis=0) > 0, num_steps, 0)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    sumexp = tl.zeros([BLOCK_M], tl.float32)
    sumexp_z = tl.zeros([BLOCK_M], tl.float32)
    target_logit = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    col0 = (first_col_tile - 1) * BLOCK_N
    k_step = k_steps - 1
    for _ in range(0, num_steps):
        k_step = next_k_step(k_step, k_steps)
        if k_step == 0:
            col0 += BLOCK_N
        acc = product_step(hidden_desc, weight_desc, row0, col0, k_step, acc, BLOCK_K, DOT_PRECISION)

        if k_step == k_steps - 1:
            # Offsets within the tile against scalars: no per-element column indices (registers).
            col_valid = (tl.arange(0, BLOCK_N) < vocab - col0)[None, :]
            if HAS_KEPT:
                col_valid = col_valid & kept_tile(kept_ptr, stride_kept_row, kept_words, rows, row_valid, col0, BLOCK_N)
            logits = tl.where(col_valid, acc * inv_temperature, float("-inf"))
            if COLLECT:
                count = pick_candidates(
                    logits,
                    threshold,
                    count,
                    row_slots,
                    row_valid,
                    col0,
                    candidates_ptr,
                    candidate_columns_ptr,
                    slots,
                    PICKS,
                    BLOCK_N,
                )
            else:
                tile_max = tl.max(logits, axis=1)
                new_max = tl.maximum(running_max, tile_max)
                # First tile: nothing to rescale (and -inf - new_max must not meet sumexp = 0).
                shift = tl.where(running_max == float("-inf"), 0.0, running_max - new_max)
                rescale = tl.exp(shift)
                if HAS_KEPT:  # a row that has kept nothing yet has new_max = -inf: its shifted logits stay -inf
                    shifted = logits - tl.where(new_max == float("-inf"), 0.0, new_max)[:, None]
                else:
                    shifted = logits - new_max[:, None]  # -inf on padding columns
                weights = tl.exp(shifted)  # 0 on padding columns
                sumexp_z = rescale * (sumexp_z + sumexp * shift) + tl.sum(
                    weights * tl.where(col_valid, shifted, 0.0), axis=1
                )
                sumexp = rescale * sumexp + tl.sum(weights, axis=1)
                running_max = new_max
                is_target = tl.arange(0, BLOCK_N)[None, :] == (target_column - col0)[:, None]
                target_logit += tl.sum(tl.where(is_target, logits, 0.0), axis=1)
                if STORE_BLOCK:
                    if STORE_OFFSETS:
                        if HAS_KEPT:  # a row keeping none of the tile's columns: every offset LOWEST_OFFSET
                            tile_max = tl.where(tile_max == float("-inf"), 0.0, tile_max)
                        # The tile's maximum is exact, so a row's largest logits come back exactly.
                        stored = tl.maximum(logits - tile_max[:, None], LOWEST_OFFSET).to(block_desc.dtype)
                        where = reference_ptr + rows.to(tl.int64) * stride_reference_row + col0 // BLOCK_N
                        tl.store(where, tile_max, mask=row_valid)
                    else:
                        # exp(z - reference) from the tile's exponentials: one exp per row, not per
                        # element. Where the maximum lies far above the reference this overflows; those
                        # rows are refreshed against their maximum, which this product stores exactly.
                        rebase = tl.exp(new_max - reference)
                        stored = (weights * rebase[:, None]).to(block_desc.dtype)
                    # Stored as two half-width tiles: half the staging shared memory, which leaves the
                    # operands a deeper pipeline or wider tiles (triton_tuning).
                    left, right = tl.split(tl.permute(tl.reshape(stored, [BLOCK_M, 2, BLOCK_N // 2]), [0, 2, 1]))
                    block_desc.store([row0, col0], left)
                    block_desc.store([row0, col0 + BLOCK_N // 2], right)
                elif TILE_MAXIMA:
                    where = reference_ptr + rows.to(tl.int64) * stride_reference_row + col0 // BLOCK_N
                    tl.store(where, tile_max, mask=row_valid)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)

    if COLLECT:
        tl.store(slot_count_ptr + rows.to(tl.int64) * num_splits + split, count, mask=row_valid)
    elif not REFRESH:
        out = parts_ptr + split.to(tl.int64) * stride_parts_split + rows.to(tl.int64) * stride_parts_token
        tl.store(out + 0, running_max, mask=row_valid)
        tl.store(out + 1, sumexp, mask=row_valid)
        tl.store(out + 2, sumexp_z, mask=row_valid)
        tl.store(out + 3, target_logit, mask=row_valid)


def split_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_column: torch.Tensor,
    temperature: torch.Tensor,
    kept_mask: torch.Tensor,
    tiles: Tiles,
    tiles_per_split: int,
    block: Optional[torch.Tensor] = None,
    reference: Optional[torch.Tensor] = None,
    tile_maxima: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Statistics ``[num_splits, n, 4]`` (float32) of each vocabulary split.

    ``hidden [n >= 1, H]`` and ``weight [V, H]`` share a dtype (any strides); ``target_column
    [n]`` (int64, contiguous) is the target's row in ``weight``, or -1 where this shard does not
    own it; ``temperature [n]`` (float32; stride 0: one for all rows) divides each row's logits;
    ``kept_mask`` (``kept_tokens``' form: ``[n, words]`` int32 with unit last stride, or ``[0]``)
    names the columns that enter. Columns are the ``softmax`` order (MAX, SUMEXP, SUMEXP_Z, TARGET).

    With a ``block [n, V]`` (unit last stride, 16-byte aligned rows) the kernel also stores every
    logit: a bfloat16 or float32 block as ``exp(z - reference[row])`` (``reference [n]`` float32,
    contiguous); a float16 block as ``z - m`` with ``m``, the maximum of its row's column tile of
    ``tiles.block_n`` columns, written to ``reference [n, ceil(V / block_n)]`` (float32, unit last
    stride). Without a block, ``tile_maxima [n, ceil(V / block_n)]`` (float32, unit last stride)
    takes each row's maximum of each column tile where given (``collect_candidates``' thresholds).
    """
    num_splits = triton.cdiv(triton.cdiv(weight.shape[0], tiles.block_n), tiles_per_split)
    parts = torch.empty(num_splits, hidden.shape[0], NUM_STATISTICS, dtype=torch.float32, device=hidden.device)
    _launch(
        hidden, weight, target_column, temperature, kept_mask, tiles, tiles_per_split, parts, block,
        tile_maxima if tile_maxima is not None else reference, tile_maxima=tile_maxima is not None,
    )  # fmt: skip
    return parts


def collect_candidates(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    temperature: torch.Tensor,
    tiles: Tiles,
    tiles_per_split: int,
    threshold: torch.Tensor,
    candidates: torch.Tensor,
    candidate_columns: torch.Tensor,
    picks: int,
) -> torch.Tensor:
    """Each row's logits at or above its ``threshold [n]`` (float32) and their columns, into the
    row's slots of each split, ``candidates [n, num_splits, slots]`` (float32) and
    ``candidate_columns`` (int32, the same shape), the largest first within a tile: returns
    ``slot_count [n, num_splits]`` (int32), how many of a split's slots the row filled, ``slots + 1``
    where one of its logits found no room (more than ``picks`` in one column tile, or more than
    ``slots`` in the split). Arguments as for ``split_statistics``, with the same tiles: the logits
    are those the statistics came from, bit for bit."""
    slot_count = torch.empty(candidates.shape[:2], dtype=torch.int32, device=hidden.device)
    no_targets = torch.full(threshold.shape, -1, dtype=torch.int64, device=hidden.device)
    unwritten_parts = threshold.new_empty(1, 1, NUM_STATISTICS)  # collecting writes no statistics
    every = torch.empty(0, dtype=torch.int32, device=hidden.device)
    _launch(
        hidden, weight, no_targets, temperature, every, tiles, tiles_per_split, unwritten_parts, None, None,
        collect=(threshold, candidates, candidate_columns, slot_count, candidates.shape[2]), picks=picks,
    )  # fmt: skip
    return slot_count


def refresh_exponentials(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    temperature: torch.Tensor,
    kept_mask: torch.Tensor,
    tiles: Tiles,
    tiles_per_split: int,
    block: torch.Tensor,
    reference: torch.Tensor,
    refresh: torch.Tensor,
) -> None:
    """Rewrite an exponentials ``block`` as ``exp(z - reference[row])`` in every token tile that holds a row
    with ``refresh`` set (``[n]`` int8); other tiles are left alone, so no host synchronization is
    needed to find the rows. Arguments as for ``split_statistics``, with the same tiles."""
    no_targets = torch.full_like(reference, -1, dtype=torch.int64)
    unwritten_parts = reference.new_empty(1, 1, NUM_STATISTICS)  # refresh mode writes no statistics
    _launch(
        hidden, weight, no_targets, temperature, kept_mask, tiles, tiles_per_split, unwritten_parts, block,
        reference, refresh,
    )  # fmt: skip


def _launch(
    hidden, weight, target_column, temperature, kept_mask, tiles, tiles_per_split, parts, block, reference,
    refresh=None, tile_maxima=False, collect=None, picks=1,
):  # fmt: skip
    num_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    num_splits = triton.cdiv(triton.cdiv(vocab, tiles.block_n), tiles_per_split)
    grid = (triton.cdiv(num_tokens, tiles.block_m) * num_splits,)
    temperature, temperature_flag = temperature_arguments(temperature)
    kept_pointers, kept_flag = kept_arguments(kept_mask)
    softmax_stats_kernel[grid](
        descriptor(addressable(hidden), [tiles.block_m, tiles.block_k]),
        descriptor(addressable(weight), [tiles.block_n, tiles.block_k]),
        target_column,
        parts,
        num_tokens,
        vocab,
        hidden_size,
        tiles_per_split,
        num_splits,
        parts.stride(0),
        parts.stride(1),
        temperature,
        None if block is None else descriptor(block, [tiles.block_m, tiles.block_n // 2]),
        reference,
        reference.stride(0) if reference is not None else 0,
        refresh,
        *kept_pointers,
        *(collect or (None, None, None, None, 0)),
        **kept_flag,
        TILE_MAXIMA=tile_maxima,
        COLLECT=collect is not None,
        PICKS=picks,
        STORE_BLOCK=block is not None,
        STORE_OFFSETS=block is not None and stores_offsets(block.dtype),
        REFRESH=refresh is not None,
        **temperature_flag,
        **tiles.with_kept_columns(kept_flag["HAS_KEPT"] and block is not None).launch_options(),
    )
