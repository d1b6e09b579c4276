"""Top-k's candidates kernel (``backends.triton_topk``): each row's logits at or above its threshold
and their columns, kept in the row's slots of each vocabulary split; no statistics, no logits
stored. Its programs walk the forward kernel's splits through the same ``epilogue`` functions
(``split_walk``, ``split_step``, ``split_logits``) with the same tiles, so a tile's logits are
those of ``softmax_stats_kernel``'s launch, bit for bit. ``docs/DESIGN.md`` ("Top-k by a threshold
from the tile maxima") says why slots and picks.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .descriptors import addressable, descriptor
from .epilogue import (
    inverse_temperature,
    softcap_arguments,
    split_logits,
    split_step,
    split_walk,
    temperature_arguments,
)
from .tiles import Tiles


@triton.jit
def pick_candidates(
    logits,
    threshold,
    count,
    row_slots,
    row_valid,
    first_col,
    candidates_ptr,
    candidate_columns_ptr,
    slots,
    PICKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``count [BLOCK_M]`` (int32) after keeping each row's logits of a ``[BLOCK_M, BLOCK_N]`` tile
    (first column ``first_col``) at or above its ``threshold``, largest first (of equal ones the
    lower column), in the row's slots from ``row_slots + count`` (below ``slots``): up to ``PICKS``
    a tile, each found by a row maximum, so that no atomics, scans or block-wide reductions stall
    the loop. A row with a logit left without a slot gets ``slots + 1``, for good."""
    columns = tl.arange(0, BLOCK_N)[None, :]
    above = logits >= threshold[:, None]
    hits = tl.sum(above.to(tl.int32), axis=1)
    remaining = tl.where(above, logits, float("-inf"))
    taken = tl.zeros_like(hits)
    for _ in tl.static_range(PICKS):
        value = tl.max(remaining, axis=1)
        column = tl.min(tl.where(remaining == value[:, None], columns, BLOCK_N), axis=1)
        take = (taken < hits) & (count < slots)
        tl.store(candidates_ptr + row_slots + count, value, mask=take & row_valid)
        tl.store(candidate_columns_ptr + row_slots + count, first_col + column, mask=take & row_valid)
        count += take.to(tl.int32)
        taken += take.to(tl.int32)
        remaining = tl.where(columns == column[:, None], float("-inf"), remaining)
    return tl.where(taken < hits, slots + 1, count)


@triton.jit
def collect_candidates_kernel(
    hidden_desc,
    weight_desc,
    num_tokens,
    vocab,
    hidden_size,
    tiles_per_split,
    num_splits,
    temperature_ptr,
    softcap,
    threshold_ptr,
    candidates_ptr,
    candidate_columns_ptr,
    slot_count_ptr,
    slots,
    PICKS: tl.constexpr,
    UNIFORM_TEMPERATURE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    row0, split, col0, k_step, k_steps, num_steps = split_walk(
        num_tokens,
        vocab,
        hidden_size=hidden_size,
        tiles_per_split=tiles_per_split,
        num_splits=num_splits,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        GROUP_M=GROUP_M,
    )
    rows = row0 + tl.arange(0, BLOCK_M)
    row_valid = rows < num_tokens
    inv_temperature = inverse_temperature(temperature_ptr, rows, row_valid, UNIFORM_TEMPERATURE)
    threshold = tl.load(threshold_ptr + rows, mask=row_valid, other=float("inf"))
    row_slots = (rows.to(tl.int64) * num_splits + split) * slots
    count = tl.zeros([BLOCK_M], tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, num_steps):
        col0, k_step, acc = split_step(
            hidden_desc,
            weight_desc,
            row0=row0,
            col0=col0,
            k_step=k_step,
            k_steps=k_steps,
            acc=acc,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            DOT_PRECISION=DOT_PRECISION,
        )
        if k_step == k_steps - 1:
            # Top-k keeps every column: no kept-columns mask.
            logits = split_logits(
                acc,
                inv_temperature,
                softcap,
                vocab=vocab,
                col0=col0,
                rows=rows,
                row_valid=row_valid,
                kept_ptr=None,
                stride_kept_row=0,
                kept_words=0,
                HAS_KEPT=False,
                HAS_SOFTCAP=HAS_SOFTCAP,
                BLOCK_N=BLOCK_N,
            )[0]
            count = pick_candidates(
                logits,
                threshold,
                count=count,
                row_slots=row_slots,
                row_valid=row_valid,
                first_col=col0,
                candidates_ptr=candidates_ptr,
                candidate_columns_ptr=candidate_columns_ptr,
                slots=slots,
                PICKS=PICKS,
                BLOCK_N=BLOCK_N,
            )
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    tl.store(slot_count_ptr + rows.to(tl.int64) * num_splits + split, count, mask=row_valid)


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
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Each row's logits at or above its ``threshold [n]`` (float32) and their columns, into the
    row's slots of each split, ``candidates [n, num_splits, slots]`` (float32) and
    ``candidate_columns`` (int32, the same shape), the largest first within a tile: returns
    ``slot_count [n, num_splits]`` (int32), how many of a split's slots the row filled, ``slots + 1``
    where one of its logits found no room (more than ``picks`` in one column tile, or more than
    ``slots`` in the split). Arguments as for ``softmax_stats_kernel.split_statistics``, with the
    same tiles and ``tiles_per_split``: the logits are those the statistics came from, bit for bit."""
    num_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    num_splits = candidates.shape[1]
    slot_count = torch.empty(candidates.shape[:2], dtype=torch.int32, device=hidden.device)
    temperature, temperature_flag = temperature_arguments(temperature)
    softcap, softcap_flag = softcap_arguments(softcap)
    collect_candidates_kernel[(triton.cdiv(num_tokens, tiles.block_m) * num_splits,)](
        descriptor(addressable(hidden), [tiles.block_m, tiles.block_k]),
        descriptor(addressable(weight), [tiles.block_n, tiles.block_k]),
        num_tokens,
        vocab,
        hidden_size,
        tiles_per_split,
        num_splits,
        temperature,
        softcap,
        threshold,
        candidates,
        candidate_columns,
        slot_count,
        candidates.shape[2],
        PICKS=picks,
        **temperature_flag,
        **softcap_flag,
        **tiles.launch_options(),
    )
    return slot_count
