"""The chosen token's gradient term, added in float32 outside the 16-bit operands (``held_gradients``
has the torch code that computes the same):

- ``finish_hidden_grad``: ``grad_hidden[t] = f[t] * product[t] + c[t] * W[y_t]``, one pass over the
  chunk's float32 product ``[n, H]``;
- ``add_chosen_rows``: ``grad_weight[y] += sum over tokens t with y_t = y of c[t] * h[t]``, summed in
  float32 per row. The tokens come sorted by their row, and the first token of each run sums the
  run: deterministic, no atomics, no host synchronization.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

BLOCK_H = 256


@triton.jit
def finish_hidden_grad_kernel(
    product_ptr,
    stride_product,
    factor_ptr,
    chosen_ptr,
    target_column_ptr,
    weight_ptr,
    stride_weight,
    out_ptr,
    stride_out,
    hidden_size,
    HAS_FACTOR: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    valid = cols < hidden_size
    grad = tl.load(product_ptr + row * stride_product + cols, mask=valid, other=0.0)
    if HAS_FACTOR:
        grad *= tl.load(factor_ptr + row)
    target_column = tl.load(target_column_ptr + row)
    if target_column >= 0:
        chosen_row = tl.load(weight_ptr + target_column * stride_weight + cols, mask=valid, other=0.0)
        grad += tl.load(chosen_ptr + row) * chosen_row.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, grad.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def add_chosen_rows_kernel(
    sorted_rows_ptr,
    order_ptr,
    chosen_ptr,
    hidden_ptr,
    stride_hidden,
    grad_ptr,
    stride_grad,
    first_row,
    num_rows,
    num_tokens,
    hidden_size,
    BLOCK_H: tl.constexpr,
):
    position = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    valid = cols < hidden_size
    row = tl.load(sorted_rows_ptr + position)
    previous = tl.load(sorted_rows_ptr + tl.maximum(position - 1, 0))
    starts_run = (position == 0) | (previous != row)
    if starts_run & (row >= first_row) & (row < first_row + num_rows):
        total = tl.zeros([BLOCK_H], tl.float32)
        member = position
        in_run = True
        while in_run:
            token = tl.load(order_ptr + member).to(tl.int64)
            term = tl.load(hidden_ptr + token * stride_hidden + cols, mask=valid, other=0.0).to(tl.float32)
            total += tl.load(chosen_ptr + token) * term
            member += 1
            in_run = tl.load(sorted_rows_ptr + member, mask=member < num_tokens, other=-1) == row
        out = grad_ptr + (row - first_row).to(tl.int64) * stride_grad + cols
        current = tl.load(out, mask=valid, other=0.0).to(tl.float32)
        tl.store(out, (current + total).to(grad_ptr.dtype.element_ty), mask=valid)


def finish_hidden_grad(
    product: torch.Tensor,
    factor: Optional[torch.Tensor],
    chosen: torch.Tensor,
    target_column: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out [n, H] = f * product + c * weight[target_column]`` (the last term where
    ``target_column >= 0``). ``product [n, H]`` float32, ``factor`` (``None``: 1) and ``chosen``
    ``[n]`` float32, ``target_column [n]`` int64, ``weight [V, H]``; unit last strides."""
    num_tokens, hidden_size = product.shape
    if num_tokens == 0:
        return
    grid = (num_tokens, triton.cdiv(hidden_size, BLOCK_H))
    finish_hidden_grad_kernel[grid](
        product, product.stride(0), chosen if factor is None else factor, chosen, target_column, weight,
        weight.stride(0), out, out.stride(0), hidden_size, HAS_FACTOR=factor is not None, BLOCK_H=BLOCK_H,
    )  # fmt: skip


def add_chosen_rows(
    grad_weight_parts: Sequence[torch.Tensor],
    target_column: torch.Tensor,
    chosen: torch.Tensor,
    hidden: torch.Tensor,
) -> None:
    """Add ``chosen[t] * hidden[t]`` to the weight gradient's row ``target_column[t]`` (-1: none),
    summed in float32 with one rounding per row. The gradient may be held in row parts ``[R, H]``,
    one after the other. ``chosen [n]``
    float32, ``hidden [n, H]``; unit last strides. Tokens with ``chosen == 0`` add nothing and are
    skipped."""
    num_tokens, hidden_size = hidden.shape
    if num_tokens == 0:
        return
    rows = torch.where(chosen != 0, target_column, -1)
    sorted_rows, order = torch.sort(rows, stable=True)
    grid = (num_tokens, triton.cdiv(hidden_size, BLOCK_H))
    first_row = 0
    for part in grad_weight_parts:
        add_chosen_rows_kernel[grid](
            sorted_rows, order, chosen, hidden, hidden.stride(0), part, part.stride(0), first_row, part.shape[0],
            num_tokens, hidden_size, BLOCK_H=BLOCK_H,
        )  # fmt: skip
        first_row += part.shape[0]
