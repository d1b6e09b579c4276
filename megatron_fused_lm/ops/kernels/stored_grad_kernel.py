"""Loss-in-forward ``dz`` kernel: turn the block the forward kernel stored into ``dz / T``.

An exponentials block holds ``e = exp(z - r)`` per element, ``r`` the row's reference; with the
chunk's merged statistics each element gives ``p = e * exp(r - lse)`` and ``mean - z = (mean - r) -
log(e)``. An offsets block holds ``s = z - m``, ``m`` its column tile's maximum: ``z = m + s``. Then
``dz`` (``softmax.logit_grad``). The chosen token's element (each target's, for several) is
written as 0: its term is added in float32 from the statistics (``chosen_token_kernel``). An element whose exponential underflowed
(``e = 0``) has ``p = 0`` and contributes nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..backends.contract import SavedStatistics, UpstreamGrads
from .epilogue import (
    capped_slope,
    inverse_temperature,
    logit_grad_tile,
    row_upstream,
    row_upstream_arguments,
    softcap_arguments,
    temperature_arguments,
    zero_targets,
)

# Launch shape of this memory-bound pass (docs/benchmarks/constants.md has the sweep).
ROWS_PER_PROGRAM = 16
COLUMNS_PER_PROGRAM = 128
NUM_WARPS = 4


@triton.jit
def stored_grad_kernel(
    block_ptr,
    stride_block_row,
    grad_ptr,
    stride_grad_row,
    reference_ptr,
    stride_reference_row,
    target_column_ptr,
    lse_ptr,
    mean_logit_ptr,
    grad_logprob_ptr,
    grad_entropy_ptr,
    num_tokens,
    vocab,
    temperature_ptr,
    softcap,
    HAS_GRAD_LOGPROB: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    NUM_TARGETS: tl.constexpr,
    UNIFORM_TEMPERATURE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    OFFSETS_TILE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < num_tokens
    valid = row_valid[:, None] & (cols < vocab)[None, :]
    wide_rows = rows.to(tl.int64)[:, None]
    stored = tl.load(block_ptr + wide_rows * stride_block_row + cols[None, :], mask=valid, other=0.0).to(tl.float32)
    target_column, lse, mean_logit, grad_logprob, grad_entropy = row_upstream(
        rows,
        row_valid,
        target_column_ptr=target_column_ptr,
        lse_ptr=lse_ptr,
        mean_logit_ptr=mean_logit_ptr,
        grad_logprob_ptr=grad_logprob_ptr,
        grad_entropy_ptr=grad_entropy_ptr,
        HAS_GRAD_LOGPROB=HAS_GRAD_LOGPROB,
        HAS_GRAD_ENTROPY=HAS_GRAD_ENTROPY,
        NUM_TARGETS=NUM_TARGETS,
    )
    if OFFSETS_TILE_N > 0:
        # Every column of this program lies in one column tile of the forward kernel.
        tile = tl.program_id(0) * BLOCK_N // OFFSETS_TILE_N
        tile_max = tl.load(reference_ptr + rows.to(tl.int64) * stride_reference_row + tile, mask=row_valid, other=0.0)
        logits = tile_max[:, None] + stored
        prob = tl.exp(logits - lse[:, None])
        mean_minus_logit = mean_logit[:, None] - logits
    else:
        reference = tl.load(reference_ptr + rows, mask=row_valid, other=0.0)
        prob = stored * tl.exp(reference - lse)[:, None]
        # z = reference + log(stored): finite where the exponential underflowed, whose p = 0 then
        # zeroes the term.
        log_stored = tl.log(tl.maximum(stored, 1e-30))
        mean_minus_logit = (mean_logit - reference)[:, None] - log_stored
    grad = logit_grad_tile(
        prob,
        mean_minus_logit,
        grad_logprob[:, None],
        grad_entropy[:, None],
        HAS_GRAD_LOGPROB,
        HAS_GRAD_ENTROPY,
    )
    if NUM_TARGETS == 1:
        grad = tl.where(cols[None, :] == target_column[:, None], 0.0, grad)
    else:
        grad = zero_targets(
            grad,
            rows,
            row_valid=row_valid,
            first_col=tl.program_id(0) * BLOCK_N,
            target_column_ptr=target_column_ptr,
            NUM_TARGETS=NUM_TARGETS,
            BLOCK_N=BLOCK_N,
        )
    grad_out = grad_ptr + wide_rows * stride_grad_row + cols[None, :]
    inv_temperature = inverse_temperature(temperature_ptr, rows, row_valid, UNIFORM_TEMPERATURE)
    if HAS_SOFTCAP:  # the cap's slope at the stored logit
        if OFFSETS_TILE_N == 0:
            logits = reference[:, None] + log_stored
        grad = grad * capped_slope(logits, softcap, inv_temperature)
    tl.store(grad_out, (grad * inv_temperature).to(grad_ptr.dtype.element_ty), mask=valid)


def stored_logit_grads(
    block: torch.Tensor,
    reference: torch.Tensor,
    out: torch.Tensor,
    target_column: torch.Tensor,
    saved: SavedStatistics,
    upstream: UpstreamGrads,
    temperature: torch.Tensor,
    offsets_tile_n: int = 0,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """``dz / T`` ``[n, V]`` but the chosen tokens' elements (0), written into ``out`` (``[n, V]``,
    unit last stride, any dtype; it may be ``block`` itself viewed as a dtype of its element size),
    and returned.

    ``block [n, V]`` (unit last stride) holds ``exp(z - reference[row])`` with ``reference [n]``
    float32, or with ``offsets_tile_n`` (a power of two) the float16 offsets ``z - m`` from the
    maxima ``reference [n, ceil(V / offsets_tile_n)]`` (float32, unit last stride) of column tiles
    of that width; ``target_column [n]`` (int64, -1: another shard's; ``[n, k]`` contiguous for
    several targets, whose ``upstream`` log-prob gradients are then ``[n, k]``); ``temperature [n]`` (float32;
    stride 0: one for all rows) divides each row's logits; the logits' ``softcap`` (``None``: none),
    whose slope multiplies ``dz``; ``saved`` and ``upstream``
    hold ``[n]`` float32 contiguous tensors (``None``: no term). Each program reads its elements
    before it writes them, and no two programs share an element, so ``out`` may alias ``block``.
    """
    num_tokens, vocab = block.shape
    # A program's columns lie in one column tile of the offsets.
    columns = min(COLUMNS_PER_PROGRAM, offsets_tile_n) if offsets_tile_n else COLUMNS_PER_PROGRAM
    row_pointers, row_flags = row_upstream_arguments(target_column, saved, upstream)
    temperature, temperature_flag = temperature_arguments(temperature)
    softcap, softcap_flag = softcap_arguments(softcap)
    grid = (triton.cdiv(vocab, columns), triton.cdiv(num_tokens, ROWS_PER_PROGRAM))
    stored_grad_kernel[grid](
        block,
        block.stride(0),
        out,
        out.stride(0),
        reference,
        reference.stride(0) if offsets_tile_n else 0,
        *row_pointers,
        num_tokens,
        vocab,
        temperature,
        softcap,
        **row_flags,
        **temperature_flag,
        **softcap_flag,
        OFFSETS_TILE_N=offsets_tile_n,
        BLOCK_M=ROWS_PER_PROGRAM,
        BLOCK_N=columns,
        num_warps=NUM_WARPS,
    )
    return out
