"""Three-GEMM gradient kernel: turn the exponentials the forward kernel stored into ``dz``, in place.

The forward (``split_statistics`` with ``stored_exp``) left every logit of a token chunk as
``e = exp(z - m) * EXP_SCALE`` with ``m`` the running maximum of its column tile (``tile_max``).
Once the chunk's statistics are merged, each element becomes

    p = e / EXP_SCALE * exp(m - lse),   z = m + log(e / EXP_SCALE),

then ``dz`` (``logit_grad_formula``), divided by ``T`` and stored in the weight's dtype over ``e`` itself (same element size), ready for
the two cuBLAS gradient products. An element whose exponential underflowed (``e = 0``) has
``p = 0`` and contributes nothing.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..contract import SavedStatistics, UpstreamGrads
from .logit_grad_formula import logit_grad_tile
from .softmax_stats_kernel import EXP_SCALE

# Launch shape measured on an H100 (2026-11-22, 2048 x 151936 block): 16 rows x 128 columns with 4
# warps moved 2.5 TB/s, 32 rows 1.8 TB/s, 64 rows 1.2 TB/s.
ROWS_PER_PROGRAM = 16
NUM_WARPS = 4


@triton.jit
def stored_grad_kernel(
    exp_ptr,
    grad_ptr,
    stride_row,
    tile_max_ptr,
    stride_tile_max,
    target_column_ptr,
    lse_ptr,
    mean_logit_ptr,
    grad_logprob_ptr,
    grad_entropy_ptr,
    num_tokens,
    vocab,
    inv_temperature,
    HAS_GRAD_LOGPROB: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    EXP_SCALE: tl.constexpr,
    LOG_EXP_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program -> (row block, the forward's column tile): one tile_max entry per row.
    col_tile = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < num_tokens
    valid = row_valid[:, None] & (cols < vocab)[None, :]
    offsets = rows.to(tl.int64)[:, None] * stride_row + cols[None, :]
    stored = tl.load(exp_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    tile_max = tl.load(tile_max_ptr + rows.to(tl.int64) * stride_tile_max + col_tile, mask=row_valid, other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_valid, other=0.0)
    prob = stored * (tl.exp(tile_max - lse) / EXP_SCALE)[:, None]
    # Stand-ins for the terms that are off: logit_grad_tile reads them only when their flag is on.
    mean_minus_logit = prob
    grad_entropy = lse
    if HAS_GRAD_ENTROPY:
        mean_logit = tl.load(mean_logit_ptr + rows, mask=row_valid, other=0.0)
        grad_entropy = tl.load(grad_entropy_ptr + rows, mask=row_valid, other=0.0)
        # z = tile_max + log(stored) - log(EXP_SCALE); finite where the exponential underflowed,
        # whose p = 0 then zeroes the term.
        mean_minus_logit = (mean_logit - tile_max + LOG_EXP_SCALE)[:, None] - tl.log(tl.maximum(stored, 1e-30))
    grad_logprob = lse
    is_target = prob != prob
    if HAS_GRAD_LOGPROB:
        grad_logprob = tl.load(grad_logprob_ptr + rows, mask=row_valid, other=0.0)
        target_column = tl.load(target_column_ptr + rows, mask=row_valid, other=-1)  # -1: not here
        is_target = cols[None, :] == target_column[:, None]
    grad = logit_grad_tile(
        prob, mean_minus_logit, is_target, grad_logprob, grad_entropy, HAS_GRAD_LOGPROB, HAS_GRAD_ENTROPY
    )
    tl.store(grad_ptr + offsets, (grad * inv_temperature).to(grad_ptr.dtype.element_ty), mask=valid)


def stored_logit_grads(
    stored_exp: torch.Tensor,
    tile_max: torch.Tensor,
    grad_dtype: torch.dtype,
    target_column: torch.Tensor,
    saved: SavedStatistics,
    upstream: UpstreamGrads,
    inv_temperature: float,
    tile_width: int,
    rows_per_program: int = ROWS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """``dz / T`` ``[n, V]`` in ``grad_dtype``, written over ``stored_exp [n, V]`` (unit last
    stride; ``grad_dtype`` of its element size) and returned as a view of the same memory.

    ``tile_max [n, cdiv(V, tile_width)]`` float32 and ``tile_width`` are the forward's;
    ``target_column [n]`` (int64) is the target's column, -1 where this shard does not own it;
    ``saved`` and ``upstream`` hold ``[n]`` float32 contiguous tensors (``None``: no term).
    ``rows_per_program`` and ``num_warps`` shape the launch.
    """
    num_tokens, vocab = stored_exp.shape
    grad = stored_exp.view(grad_dtype)
    grad_logprob, grad_entropy = upstream
    grid = (triton.cdiv(vocab, tile_width), triton.cdiv(num_tokens, rows_per_program))
    stored_grad_kernel[grid](
        stored_exp,
        grad,
        stored_exp.stride(0),
        tile_max,
        tile_max.stride(0),
        target_column,
        saved.lse,
        saved.mean_logit,
        saved.lse if grad_logprob is None else grad_logprob,  # unread placeholder when absent
        saved.lse if grad_entropy is None else grad_entropy,
        num_tokens,
        vocab,
        inv_temperature,
        HAS_GRAD_LOGPROB=grad_logprob is not None,
        HAS_GRAD_ENTROPY=grad_entropy is not None,
        EXP_SCALE=EXP_SCALE,
        LOG_EXP_SCALE=math.log(EXP_SCALE),
        BLOCK_M=rows_per_program,
        BLOCK_N=tile_width,
        num_warps=num_warps,
    )
    return grad
