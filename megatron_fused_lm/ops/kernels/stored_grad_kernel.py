"""Loss-in-forward ``dz`` kernel: turn the exponentials the forward kernel stored into ``dz / T``.

The block holds ``e = exp(z - r)`` per element, ``r`` the row's reference; with the chunk's merged
statistics each element gives ``p = e * exp(r - lse)`` and ``mean - z = (mean - r) - log(e)``, then
``dz`` (``softmax.logit_grad``). The chosen token's element is written as 0: its term is added in
float32 from the statistics (``held_gradients``). An element whose exponential underflowed
(``e = 0``) has ``p = 0`` and contributes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..contract import SavedStatistics, UpstreamGrads
from .epilogue import logit_grad_tile, row_upstream, row_upstream_arguments

# Launch shape of this memory-bound pass (docs/BENCHMARKS.md has the sweep).
ROWS_PER_PROGRAM = 16
COLUMNS_PER_PROGRAM = 128
NUM_WARPS = 4


@triton.jit
def stored_grad_kernel(
    exp_ptr,
    stride_exp_row,
    grad_ptr,
    stride_grad_row,
    reference_ptr,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < num_tokens
    valid = row_valid[:, None] & (cols < vocab)[None, :]
    wide_rows = rows.to(tl.int64)[:, None]
    stored = tl.load(exp_ptr + wide_rows * stride_exp_row + cols[None, :], mask=valid, other=0.0).to(tl.float32)
    target_column, lse, mean_logit, grad_logprob, grad_entropy = row_upstream(
        rows, row_valid, target_column_ptr, lse_ptr, mean_logit_ptr, grad_logprob_ptr, grad_entropy_ptr,
        HAS_GRAD_LOGPROB, HAS_GRAD_ENTROPY,
    )  # fmt: skip
    reference = tl.load(reference_ptr + rows, mask=row_valid, other=0.0)
    # z = reference + log(stored): finite where the exponential underflowed, whose p = 0 then
    # zeroes the term.
    grad = logit_grad_tile(
        stored * tl.exp(reference - lse)[:, None],
        (mean_logit - reference)[:, None] - tl.log(tl.maximum(stored, 1e-30)),
        grad_logprob[:, None],
        grad_entropy[:, None],
        HAS_GRAD_LOGPROB,
        HAS_GRAD_ENTROPY,
    )
    grad = tl.where(cols[None, :] == target_column[:, None], 0.0, grad)
    grad_out = grad_ptr + wide_rows * stride_grad_row + cols[None, :]
    tl.store(grad_out, (grad * inv_temperature).to(grad_ptr.dtype.element_ty), mask=valid)


def stored_logit_grads(
    stored_exp: torch.Tensor,
    reference: torch.Tensor,
    out: torch.Tensor,
    target_column: torch.Tensor,
    saved: SavedStatistics,
    upstream: UpstreamGrads,
    inv_temperature: float,
) -> torch.Tensor:
    """``dz / T`` ``[n, V]`` but the chosen tokens' elements (0), written into ``out`` (``[n, V]``,
    unit last stride, any dtype; it may be ``stored_exp`` itself viewed as a dtype of its element
    size), and returned.

    ``stored_exp [n, V]`` (unit last stride) holds ``exp(z - reference[row])``, ``reference [n]``
    float32; ``target_column [n]`` (int64, -1: another shard's); ``saved`` and ``upstream`` hold
    ``[n]`` float32 contiguous tensors (``None``: no term). Each program reads its elements before
    it writes them, and no two programs share an element, so ``out`` may alias ``stored_exp``.
    """
    num_tokens, vocab = stored_exp.shape
    row_pointers, row_flags = row_upstream_arguments(target_column, saved, upstream)
    grid = (triton.cdiv(vocab, COLUMNS_PER_PROGRAM), triton.cdiv(num_tokens, ROWS_PER_PROGRAM))
    stored_grad_kernel[grid](
        stored_exp,
        stored_exp.stride(0),
        out,
        out.stride(0),
        reference,
        *row_pointers,
        num_tokens,
        vocab,
        inv_temperature,
        **row_flags,
        BLOCK_M=ROWS_PER_PROGRAM,
        BLOCK_N=COLUMNS_PER_PROGRAM,
        num_warps=NUM_WARPS,
    )
    return out
