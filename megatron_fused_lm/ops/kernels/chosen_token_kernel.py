"""The chosen token's gradient term, added in float32 outside the 16-bit operands
(``torch_loss.add_chosen_terms`` and ``TorchLoss.add_chosen_rows`` compute the same in torch):

- ``finish_hidden_grad``: ``grad_hidden[t] = f[t] * product[t] + c[t] * W[y_t]``, one pass over the
  chunk's float32 product ``[n, H]``;
- ``add_chosen_rows``: ``grad_weight[y] += sum over tokens t with y_t = y of c[t] * h[t]``, summed in
  float32 per row, in token order: a first launch links each token to the next one of its row
  (``chosen_links_kernel``, every pair of tokens compared, which costs less than a sort's launches
  for the chunks a pass takes), and the first token of each row walks its links and adds the sum:
  deterministic, no atomics, no host synchronization, two launches for both parts of the gradient.
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


LINK_BLOCK = 128  # tokens a links program owns, and compares at a time


@triton.jit
def chosen_links_kernel(target_column_ptr, first_ptr, next_ptr, num_tokens, BLOCK: tl.constexpr):
    """For each of a block of tokens: the first token of its row (``first``) and the next one after
    it (``next``, -1 for the last), found by comparing it with every token."""
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = tokens < num_tokens
    row = tl.load(target_column_ptr + tokens, mask=valid, other=0)
    first = tl.full([BLOCK], num_tokens, tl.int32)
    following = tl.full([BLOCK], num_tokens, tl.int32)
    for start in range(0, num_tokens, BLOCK):
        others = start + tl.arange(0, BLOCK)
        other_row = tl.load(target_column_ptr + others, mask=others < num_tokens, other=0)
        same = (row[:, None] == other_row[None, :]) & (others < num_tokens)[None, :]
        first = tl.minimum(first, tl.min(tl.where(same, others[None, :], num_tokens), axis=1))
        later = same & (others[None, :] > tokens[:, None])
        following = tl.minimum(following, tl.min(tl.where(later, others[None, :], num_tokens), axis=1))
    tl.store(first_ptr + tokens, first, mask=valid)
    tl.store(next_ptr + tokens, tl.where(following == num_tokens, -1, following), mask=valid)


@triton.jit
def add_chosen_rows_kernel(
    target_column_ptr,
    first_ptr,
    next_ptr,
    chosen_ptr,
    hidden_ptr,
    stride_hidden,
    part_ptr,
    stride_part,
    second_part_ptr,
    stride_second_part,
    first_part_rows,
    vocab,
    hidden_size,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    valid = cols < hidden_size
    row = tl.load(target_column_ptr + token)
    if (tl.load(first_ptr + token) == token) & (row >= 0) & (row < vocab):
        total = tl.zeros([BLOCK_H], tl.float32)
        member = token
        while member >= 0:
            term = tl.load(hidden_ptr + member.to(tl.int64) * stride_hidden + cols, mask=valid, other=0.0)
            total += tl.load(chosen_ptr + member) * term.to(tl.float32)
            member = tl.load(next_ptr + member)
        if row < first_part_rows:
            out = part_ptr + row.to(tl.int64) * stride_part + cols
        else:
            out = second_part_ptr + (row - first_part_rows).to(tl.int64) * stride_second_part + cols
        current = tl.load(out, mask=valid, other=0.0).to(tl.float32)
        tl.store(out, (current + total).to(out.dtype.element_ty), mask=valid)


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
        product,
        product.stride(0),
        chosen if factor is None else factor,
        chosen,
        target_column,
        weight,
        weight.stride(0),
        out,
        out.stride(0),
        hidden_size,
        HAS_FACTOR=factor is not None,
        BLOCK_H=BLOCK_H,
    )


def add_chosen_rows(
    grad_weight_parts: Sequence[torch.Tensor],
    target_column: torch.Tensor,
    chosen: torch.Tensor,
    hidden: torch.Tensor,
) -> None:
    """Add ``chosen[t] * hidden[t]`` to the weight gradient's row ``target_column[t]`` (< 0: none),
    summed in float32 per row in token order with one rounding per row. The gradient is held in one
    or two row parts ``[R, H]``, one after the other. ``target_column [n]`` int64 and ``chosen [n]``
    float32 contiguous, ``hidden [n, H]`` with a unit last stride."""
    num_tokens, hidden_size = hidden.shape
    if num_tokens == 0:
        return
    first, following = (torch.empty(num_tokens, dtype=torch.int32, device=hidden.device) for _ in range(2))
    chosen_links_kernel[(triton.cdiv(num_tokens, LINK_BLOCK),)](
        target_column, first, following, num_tokens, BLOCK=LINK_BLOCK, num_warps=8
    )
    part, *rest = grad_weight_parts
    second = rest[0] if rest else part
    add_chosen_rows_kernel[(num_tokens, triton.cdiv(hidden_size, BLOCK_H))](
        target_column,
        first,
        following,
        chosen,
        hidden,
        hidden.stride(0),
        part,
        part.stride(0),
        second,
        second.stride(0),
        part.shape[0],
        part.shape[0] + (second.shape[0] if rest else 0),
        hidden_size,
        BLOCK_H=BLOCK_H,
    )
