"""The rows' exponentials references in one launch (``devkit.kernel_references`` has the torch form
it follows): each row's largest logit among evenly spaced weight rows and its chosen token,
softcapped where the head is and divided by its temperature, plus a headroom. An estimate the statistics check afterwards
(``merge_kernel``'s stale check), so its products need only be those of the weight's dtype."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .epilogue import capped_products, softcap_arguments

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


@triton.jit
def reference_kernel(
    hidden_ptr,
    stride_hidden,
    weight_ptr,
    stride_weight,
    target_column_ptr,
    temperature_ptr,
    softcap,
    reference_ptr,
    num_tokens,
    hidden_size,
    num_sampled,
    sample_stride,
    HEADROOM: tl.constexpr,
    UNIFORM_TEMPERATURE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < num_tokens
    hidden_rows = hidden_ptr + rows.to(tl.int64)[:, None] * stride_hidden
    estimate = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for first in range(0, num_sampled, BLOCK_N):
        sampled = first + tl.arange(0, BLOCK_N)
        weight_rows = weight_ptr + (sampled.to(tl.int64) * sample_stride)[:, None] * stride_weight
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, hidden_size, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            hidden = tl.load(
                hidden_rows + cols[None, :], mask=row_valid[:, None] & (cols < hidden_size)[None, :], other=0.0
            )
            weight = tl.load(
                weight_rows + cols[None, :],
                mask=(sampled < num_sampled)[:, None] & (cols < hidden_size)[None, :],
                other=0.0,
            )
            acc = tl.dot(hidden, weight.T, acc)
        acc = tl.where((sampled < num_sampled)[None, :], acc, float("-inf"))
        estimate = tl.maximum(estimate, tl.max(acc, axis=1))
    target_column = tl.load(target_column_ptr + rows, mask=row_valid, other=-1)
    chosen_rows = weight_ptr + tl.maximum(target_column, 0).to(tl.int64)[:, None] * stride_weight
    chosen = tl.zeros([BLOCK_M], tl.float32)
    for k in range(0, hidden_size, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        mask = row_valid[:, None] & (cols < hidden_size)[None, :]
        hidden = tl.load(hidden_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        chosen += tl.sum(hidden * tl.load(chosen_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32), axis=1)
    estimate = tl.where(target_column >= 0, tl.maximum(estimate, chosen), estimate)
    estimate = capped_products(estimate, softcap, HAS_SOFTCAP)  # increasing: the capped maximum
    if UNIFORM_TEMPERATURE:
        temperature = tl.load(temperature_ptr)
    else:
        temperature = tl.load(temperature_ptr + rows, mask=row_valid, other=1.0)
    tl.store(reference_ptr + rows, estimate / temperature + HEADROOM, mask=row_valid)


def row_references(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_column: torch.Tensor,
    temperature: torch.Tensor,
    sample_rows: int,
    headroom: float,
    out: torch.Tensor,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Each row's reference (above) into ``out [n]`` (float32, contiguous), which it returns:
    ``hidden [n, H]`` and ``weight [V, H]`` of one dtype with unit last strides, ``target_column [n]``
    int64 (-1: another shard's), ``temperature [n]`` float32 (stride 0: one for all rows), the logits'
    ``softcap`` (``None``: none)."""
    num_tokens, hidden_size = hidden.shape
    sample_stride = -(-weight.shape[0] // sample_rows)
    num_sampled = -(-weight.shape[0] // sample_stride)
    uniform = temperature.stride(0) == 0 or temperature.numel() <= 1
    softcap, softcap_flag = softcap_arguments(softcap)
    if num_tokens:
        reference_kernel[(triton.cdiv(num_tokens, BLOCK_M),)](
            hidden,
            hidden.stride(0),
            weight,
            weight.stride(0),
            target_column,
            temperature,
            softcap,
            out,
            num_tokens,
            hidden_size,
            num_sampled,
            sample_stride,
            HEADROOM=headroom,
            UNIFORM_TEMPERATURE=uniform,
            **softcap_flag,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            num_warps=4,
        )
    return out
