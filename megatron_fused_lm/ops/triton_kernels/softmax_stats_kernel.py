"""Forward kernel: softmax statistics of ``hidden @ weight.T / T`` without storing the logits.

The vocabulary is cut into *splits* of ``tiles_per_split`` column tiles. A program owns one tile
of ``block_m`` tokens and one split: it walks the split's column tiles, each one the product of a
token tile and a weight tile over the whole hidden dimension (float32 accumulator, tensor cores),
and folds each finished logits tile into running per-token statistics (max, sum-exp, exp-weighted
logits measured from the max, target logit; see ``softmax_stats``). One program writes one
``[block_m, 4]`` slice of ``parts [num_splits, n, 4]``; ``merge_statistics`` combines the splits.

Splitting the vocabulary gives ``token tiles x splits`` programs, so a few thousand tokens still
fill the GPU, while each program reuses its hidden tile over many weight tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..softmax_stats import NUM_STATISTICS
from .tiles import Tiles


@triton.jit
def softmax_stats_kernel(
    hidden_ptr, weight_ptr, target_column_ptr, parts_ptr,
    num_tokens, vocab, hidden_size, tiles_per_split, num_splits,
    stride_hidden_token, stride_hidden_k, stride_weight_row, stride_weight_k,
    stride_parts_split, stride_parts_token,
    inv_temperature,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Program -> (token tile, split), GROUP_M token tiles at a time across all splits (L2 reuse).
    pid = tl.program_id(0)
    num_row_tiles = tl.cdiv(num_tokens, BLOCK_M)
    programs_per_group = GROUP_M * num_splits
    first_row_tile = (pid // programs_per_group) * GROUP_M
    rows_in_group = tl.minimum(num_row_tiles - first_row_tile, GROUP_M)
    row_tile = first_row_tile + (pid % programs_per_group) % rows_in_group
    split = (pid % programs_per_group) // rows_in_group

    first_col_tile = split * tiles_per_split
    num_col_tiles = tl.minimum(tl.cdiv(vocab, BLOCK_N) - first_col_tile, tiles_per_split)
    k_steps = tl.cdiv(hidden_size, BLOCK_K)

    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < num_tokens
    # Rows past the end read row 0 (no mask in the main loop); their results are never stored.
    rows_safe = tl.where(row_valid, rows, 0).to(tl.int64)
    target_column = tl.load(target_column_ptr + rows_safe)  # -1 where another shard owns the target
    ks = tl.arange(0, BLOCK_K)
    hidden_ptrs = hidden_ptr + rows_safe[:, None] * stride_hidden_token + ks[None, :] * stride_hidden_k

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    sumexp = tl.zeros([BLOCK_M], tl.float32)
    sumexp_z = tl.zeros([BLOCK_M], tl.float32)
    target_logit = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # One flat loop over (column tile, k step): the loads of the next tile are pipelined behind
    # the previous tile's statistics instead of draining the pipeline at every tile.
    for step in range(0, num_col_tiles * k_steps):
        col_tile = first_col_tile + step // k_steps
        k0 = (step % k_steps) * BLOCK_K
        cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_safe = tl.where(cols < vocab, cols, 0).to(tl.int64)
        weight_ptrs = weight_ptr + cols_safe[None, :] * stride_weight_row + (k0 + ks)[:, None] * stride_weight_k
        if EVEN_K:
            hidden_tile = tl.load(hidden_ptrs + k0 * stride_hidden_k)
            weight_tile = tl.load(weight_ptrs)
        else:
            k_valid = (k0 + ks) < hidden_size
            hidden_tile = tl.load(hidden_ptrs + k0 * stride_hidden_k, mask=k_valid[None, :], other=0.0)
            weight_tile = tl.load(weight_ptrs, mask=k_valid[:, None], other=0.0)
        acc = tl.dot(hidden_tile, weight_tile, acc, input_precision=DOT_PRECISION)

        if k0 + BLOCK_K >= hidden_size:
            col_valid = (cols < vocab)[None, :]
            logits = tl.where(col_valid, acc * inv_temperature, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(logits, axis=1))
            # First tile: nothing to rescale (and -inf - new_max must not meet sumexp = 0).
            shift = tl.where(running_max == float("-inf"), 0.0, running_max - new_max)
            rescale = tl.exp(shift)
            shifted = logits - new_max[:, None]  # -inf on padding columns
            weights = tl.exp(shifted)  # 0 on padding columns
            sumexp_z = rescale * (sumexp_z + sumexp * shift) + tl.sum(
                weights * tl.where(col_valid, shifted, 0.0), axis=1
            )
            sumexp = rescale * sumexp + tl.sum(weights, axis=1)
            running_max = new_max
            is_target = cols[None, :] == target_column[:, None]
            target_logit += tl.sum(tl.where(is_target, logits, 0.0), axis=1)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)

    out = parts_ptr + split * stride_parts_split + rows_safe * stride_parts_token
    tl.store(out + 0, running_max, mask=row_valid)
    tl.store(out + 1, sumexp, mask=row_valid)
    tl.store(out + 2, sumexp_z, mask=row_valid)
    tl.store(out + 3, target_logit, mask=row_valid)


def split_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_column: torch.Tensor,
    inv_temperature: float,
    tiles: Tiles,
    tiles_per_split: int,
) -> torch.Tensor:
    """Statistics ``[num_splits, n, 4]`` (float32) of each vocabulary split.

    ``hidden [n >= 1, H]`` and ``weight [V, H]`` share a dtype (any strides); ``target_column
    [n]`` (int64, contiguous) is the target's row in ``weight``, or -1 where this shard does not
    own it. Columns are the ``softmax_stats`` order (MAX, SUMEXP, SUMEXP_Z, TARGET).
    """
    num_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    num_splits = triton.cdiv(triton.cdiv(vocab, tiles.block_n), tiles_per_split)
    parts = torch.empty(num_splits, num_tokens, NUM_STATISTICS, dtype=torch.float32, device=hidden.device)
    grid = (triton.cdiv(num_tokens, tiles.block_m) * num_splits,)
    softmax_stats_kernel[grid](
        hidden, weight, target_column, parts,
        num_tokens, vocab, hidden_size, tiles_per_split, num_splits,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        parts.stride(0), parts.stride(1),
        inv_temperature,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        EVEN_K=hidden_size % tiles.block_k == 0, DOT_PRECISION=tiles.dot_precision,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return parts
