"""Forward kernel: the softmax statistics of ``hidden @ weight.T / T`` without storing the logits,
and, for the loss-in-forward path, the logits kept in a stored block (``triton_reference``).

A program owns one tile of ``block_m`` tokens and one vocabulary split of ``tiles_per_split``
column tiles; it folds each finished logits tile into running per-token statistics (``softmax``
order) and writes one ``[block_m, 4]`` slice of ``parts [num_splits, n, 4]``. ``STORE_TILE_MAXIMA``
stores each row's maximum ``m`` of each tile into ``reference [n, column tiles]`` (top-k's
thresholds, ``backends.triton_topk``); with ``STORE_BLOCK`` the kernel also stores the tile through
a descriptor: float16 ``z - m`` beside those maxima, else ``exp(z - reference)``, and ``REFRESH``
launches rewrite the row tiles that hold a row whose reference proved stale. ``topk_kernel`` walks
the same splits through the same ``epilogue`` functions (``split_walk``, ``split_step``,
``split_logits``), so its logits are this kernel's, bit for bit. ``docs/DESIGN.md`` says why splits
("The Triton backend") and why each form ("The stored block").
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..softmax import NUM_STATISTICS
from .descriptors import addressable, descriptor
from .epilogue import (
    capped_slope,
    inverse_temperature,
    kept_arguments,
    softcap_arguments,
    split_logits,
    split_step,
    split_walk,
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
    softcap,
    block_desc,
    reference_ptr,
    stride_reference_row,
    refresh_ptr,
    kept_ptr,
    stride_kept_row,
    kept_words,
    gate_ptr,
    HAS_KEPT: tl.constexpr,
    STORE_TILE_MAXIMA: tl.constexpr,
    STORE_BLOCK: tl.constexpr,
    REFRESH: tl.constexpr,
    GATED: tl.constexpr,
    UNIFORM_TEMPERATURE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SLOPE_IN_BLOCK: tl.constexpr,
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
    target_column = tl.load(target_column_ptr + rows, mask=row_valid, other=-1)  # -1: another shard's
    inv_temperature = inverse_temperature(temperature_ptr, rows, row_valid, UNIFORM_TEMPERATURE)
    if STORE_BLOCK and not STORE_TILE_MAXIMA:
        reference = tl.load(reference_ptr + rows, mask=row_valid, other=0.0)
    if REFRESH:
        # Only the row tiles with a row to rewrite walk their split; the others have no steps.
        refresh = tl.load(refresh_ptr + rows, mask=row_valid, other=0)
        num_steps = tl.where(tl.max(refresh, axis=0) > 0, num_steps, 0)
    if GATED:  # a closed gate: no steps (a correcting pass that may not run, decided on the device)
        num_steps = tl.where(tl.load(gate_ptr) != 0, num_steps, 0)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    sumexp = tl.zeros([BLOCK_M], tl.float32)
    sumexp_z = tl.zeros([BLOCK_M], tl.float32)
    target_logit = tl.zeros([BLOCK_M], tl.float32)
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
            logits, col_valid = split_logits(
                acc,
                inv_temperature,
                softcap,
                vocab=vocab,
                col0=col0,
                rows=rows,
                row_valid=row_valid,
                kept_ptr=kept_ptr,
                stride_kept_row=stride_kept_row,
                kept_words=kept_words,
                HAS_KEPT=HAS_KEPT,
                HAS_SOFTCAP=HAS_SOFTCAP,
                BLOCK_N=BLOCK_N,
            )
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
                if STORE_TILE_MAXIMA:
                    if HAS_KEPT:  # a row keeping none of the tile's columns: every offset LOWEST_OFFSET
                        tile_max = tl.where(tile_max == float("-inf"), 0.0, tile_max)
                    # The tile's maximum is exact, so a row's largest logits come back exactly.
                    stored = tl.maximum(logits - tile_max[:, None], LOWEST_OFFSET).to(block_desc.dtype)
                else:
                    # exp(z - reference) from the tile's exponentials: one exp per row, not per
                    # element. Where the maximum lies far above the reference this overflows; those
                    # rows are refreshed against their maximum, which this product stores exactly.
                    # The chosen token's element is 0: its term is added in float32 apart.
                    rebase = tl.exp(new_max - reference)
                    stored = weights * rebase[:, None]
                    if SLOPE_IN_BLOCK:  # dz's per-column factor, the cap's slope: dz stays f * stored per row
                        stored *= capped_slope(logits, softcap, inv_temperature)
                    stored = tl.where(is_target, 0.0, stored).to(block_desc.dtype)
            if STORE_TILE_MAXIMA:
                where = reference_ptr + rows.to(tl.int64) * stride_reference_row + col0 // BLOCK_N
                tl.store(where, tile_max, mask=row_valid)
            if STORE_BLOCK:
                # Stored as two half-width tiles: half the staging shared memory, which leaves the
                # operands a deeper pipeline or wider tiles (triton_tuning).
                left, right = tl.split(tl.permute(tl.reshape(stored, [BLOCK_M, 2, BLOCK_N // 2]), [0, 2, 1]))
                block_desc.store([row0, col0], left)
                block_desc.store([row0, col0 + BLOCK_N // 2], right)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)

    if not REFRESH:
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
    gate: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    slope_in_block: bool = False,
) -> torch.Tensor:
    """Statistics ``[num_splits, n, 4]`` (float32) of each vocabulary split.

    ``hidden [n >= 1, H]`` and ``weight [V, H]`` share a dtype (any strides); ``target_column
    [n]`` (int64, contiguous) is the target's row in ``weight``, or -1 where this shard does not
    own it; ``temperature [n]`` (float32; stride 0: one for all rows) divides each row's logits,
    ``softcap`` (a positive float, or ``None``) caps them first (``epilogue.capped_products``);
    ``kept_mask`` (``kept_tokens``' form: ``[n, words]`` int32 with unit last stride, or ``[0]``)
    names the columns that enter. Columns are the ``softmax`` order (MAX, SUMEXP, SUMEXP_Z, TARGET).

    With a ``block [n, V]`` (unit last stride, 16-byte aligned rows) the kernel also stores every
    logit: a bfloat16 or float32 block as ``exp(z - reference[row])`` (``reference [n]`` float32,
    contiguous), times the cap's slope ``1 - tanh^2`` with ``slope_in_block`` and a ``softcap`` (the
    products then read ``dz`` from it up to a per-row factor), the target's element 0 (the
    loss-in-forward pass adds its term in float32 apart);
    a float16 block as ``z - m`` with ``m``, the maximum of its row's column tile of
    ``tiles.block_n`` columns, written to ``reference [n, ceil(V / block_n)]`` (float32, unit last
    stride). Without a block, ``tile_maxima [n, ceil(V / block_n)]`` (float32, unit last stride)
    takes each row's maximum of each column tile where given (top-k's thresholds,
    ``topk_kernel.collect_candidates``). With a ``gate`` (a 0-dim tensor on the device) the launch
    does nothing where it is 0 (the statistics are then not written).
    """
    num_splits = triton.cdiv(triton.cdiv(weight.shape[0], tiles.block_n), tiles_per_split)
    parts = torch.empty(num_splits, hidden.shape[0], NUM_STATISTICS, dtype=torch.float32, device=hidden.device)
    offsets = block is not None and stores_offsets(block.dtype)
    _launch(
        hidden,
        weight,
        target_column=target_column,
        temperature=temperature,
        kept_mask=kept_mask,
        tiles=tiles,
        tiles_per_split=tiles_per_split,
        parts=parts,
        block=block,
        reference=reference if tile_maxima is None else tile_maxima,
        store_tile_maxima=offsets or tile_maxima is not None,
        gate=gate,
        softcap=softcap,
        slope_in_block=slope_in_block,
    )
    return parts


def refresh_exponentials(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_column: torch.Tensor,
    temperature: torch.Tensor,
    kept_mask: torch.Tensor,
    tiles: Tiles,
    tiles_per_split: int,
    block: torch.Tensor,
    reference: torch.Tensor,
    refresh: torch.Tensor,
    softcap: Optional[float] = None,
    slope_in_block: bool = False,
) -> None:
    """Rewrite an exponentials ``block`` as ``exp(z - reference[row])`` (``split_statistics``) in every token tile that holds a row
    with ``refresh`` set (``[n]`` int8); other tiles are left alone, so no host synchronization is
    needed to find the rows. Arguments as for ``split_statistics``, with the same tiles."""
    unwritten_parts = reference.new_empty(1, 1, NUM_STATISTICS)  # refresh mode writes no statistics
    _launch(
        hidden,
        weight,
        target_column=target_column,
        temperature=temperature,
        kept_mask=kept_mask,
        tiles=tiles,
        tiles_per_split=tiles_per_split,
        parts=unwritten_parts,
        block=block,
        reference=reference,
        refresh=refresh,
        softcap=softcap,
        slope_in_block=slope_in_block,
    )


def _launch(
    hidden,
    weight,
    target_column,
    temperature,
    kept_mask,
    tiles,
    tiles_per_split,
    parts,
    block,
    reference,
    refresh=None,
    store_tile_maxima=False,
    gate=None,
    softcap=None,
    slope_in_block=False,
):
    num_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    num_splits = triton.cdiv(triton.cdiv(vocab, tiles.block_n), tiles_per_split)
    grid = (triton.cdiv(num_tokens, tiles.block_m) * num_splits,)
    temperature, temperature_flag = temperature_arguments(temperature)
    softcap, softcap_flag = softcap_arguments(softcap)
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
        softcap,
        None if block is None else descriptor(block, [tiles.block_m, tiles.block_n // 2]),
        reference,
        reference.stride(0) if reference is not None else 0,
        refresh,
        *kept_pointers,
        gate,
        **kept_flag,
        STORE_TILE_MAXIMA=store_tile_maxima,
        STORE_BLOCK=block is not None,
        REFRESH=refresh is not None,
        GATED=gate is not None,
        **temperature_flag,
        **softcap_flag,
        SLOPE_IN_BLOCK=slope_in_block and softcap_flag["HAS_SOFTCAP"],
        **tiles.with_kept_columns(kept_flag["HAS_KEPT"] and block is not None).launch_options(),
    )
