"""A chunk's per-row terms of the loss-in-forward gradients, one launch between its statistics and its
products (``backends.triton_loss``; the torch code it replaces: ``softmax.chosen_logit_grad``,
``triton_loss.direct_factor`` and the scaled hidden rows):

- ``chosen [k]``: the chosen token's whole ``dz / T`` term, from the summary;
- ``factor [k]``: where the products read the stored exponentials as they are, the per-row factor
  that turns a row ``exp(z - r)`` into ``dz / T`` (no entropy term);
- ``operand [k, H]``: the weight gradient's other operand, the hidden rows times their weight-side
  factor (``factor`` times ``weight_row_scale``, or ``weight_row_scale`` alone), in the weight's dtype;
- ``chosen_weight [k]``: ``chosen`` times ``weight_row_scale``, for the weight gradient's chosen rows.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..softmax import SoftmaxSummary
from .epilogue import capped_slope, softcap_arguments, temperature_arguments

BLOCK_H = 1024


@triton.jit
def expm1(x):
    """``exp(x) - 1`` to float32's relative precision (Kahan's form near 0, where ``u - 1`` cancels;
    plain ``u - 1`` elsewhere, where ``u`` may be subnormal): Triton's language has no ``expm1``,
    and ``1 - p`` of a confident row's target is this of its log-prob."""
    u = tl.exp(x)
    near_zero = tl.where(u == 1.0, x, (u - 1.0) * x / tl.log(u))
    return tl.where(tl.abs(x) < 0.5, near_zero, u - 1.0)


@triton.jit
def row_terms_kernel(
    target_column_ptr,
    logprob_ptr,
    mean_minus_target_ptr,
    lse_ptr,
    reference_ptr,
    grad_logprob_ptr,
    grad_entropy_ptr,
    temperature_ptr,
    softcap,
    weight_row_scale_ptr,
    hidden_ptr,
    stride_hidden,
    operand_ptr,
    stride_operand,
    chosen_ptr,
    factor_ptr,
    chosen_weight_ptr,
    hidden_size,
    HAS_GRAD_LOGPROB: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    UNIFORM_TEMPERATURE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DIRECT: tl.constexpr,
    HAS_WEIGHT_ROW_SCALE: tl.constexpr,
    OPERAND: tl.constexpr,
    CHOSEN_WEIGHT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0)
    if UNIFORM_TEMPERATURE:
        inverse = 1.0 / tl.load(temperature_ptr)
    else:
        inverse = 1.0 / tl.load(temperature_ptr + row)
    logprob = tl.load(logprob_ptr + row)
    chosen = tl.zeros([], tl.float32)
    factor = tl.zeros([], tl.float32)
    if HAS_GRAD_LOGPROB:
        grad_logprob = tl.load(grad_logprob_ptr + row)
        chosen -= grad_logprob * expm1(logprob)
        if DIRECT:  # softmax.logit_grad at p = exp(r - lse): -g_lp p
            factor = -grad_logprob * tl.exp(tl.load(reference_ptr + row) - tl.load(lse_ptr + row)) * inverse
    if HAS_GRAD_ENTROPY:
        chosen += tl.load(grad_entropy_ptr + row) * tl.exp(logprob) * tl.load(mean_minus_target_ptr + row)
    if HAS_SOFTCAP:  # the cap's slope at the target's logit, logprob + lse
        chosen *= capped_slope(logprob + tl.load(lse_ptr + row), softcap, inverse)
    chosen = tl.where(tl.load(target_column_ptr + row) >= 0, chosen * inverse, 0.0)
    weight_factor = factor if DIRECT else tl.full([], 1.0, tl.float32)
    if HAS_WEIGHT_ROW_SCALE:
        weight_factor *= tl.load(weight_row_scale_ptr + row)
    if tl.program_id(1) == 0:
        tl.store(chosen_ptr + row, chosen)
        if DIRECT:
            tl.store(factor_ptr + row, factor)
        if CHOSEN_WEIGHT:
            scale = tl.load(weight_row_scale_ptr + row) if HAS_WEIGHT_ROW_SCALE else 1.0
            tl.store(chosen_weight_ptr + row, chosen * scale)
    if OPERAND:
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        valid = cols < hidden_size
        hidden = tl.load(hidden_ptr + row.to(tl.int64) * stride_hidden + cols, mask=valid, other=0.0)
        operand = (hidden.to(tl.float32) * weight_factor).to(operand_ptr.dtype.element_ty)
        tl.store(operand_ptr + row.to(tl.int64) * stride_operand + cols, operand, mask=valid)


def row_terms(
    target_column: torch.Tensor,
    summary: SoftmaxSummary,
    upstream,
    temperature: torch.Tensor,
    reference: Optional[torch.Tensor],
    weight_row_scale: Optional[torch.Tensor],
    hidden: torch.Tensor,
    operand: Optional[torch.Tensor],
    chosen_weight: Optional[torch.Tensor],
    softcap: Optional[float] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(chosen [k], factor [k] or None)`` of a chunk's ``k`` rows (one target each), and where
    given, ``operand [k, H]`` (the weight's dtype, unit last stride) and ``chosen_weight [k]``
    written.

    ``target_column [k]`` int64; ``summary``'s and ``upstream``'s (``UpstreamGrads``; ``None``: no
    term) ``[k]`` float32 tensors contiguous; ``temperature [k]`` (stride 0: one for all rows);
    ``reference [k]`` float32 where the products read stored exponentials (the fast path: ``factor``
    returned; under a ``softcap`` the block holds each column's slope too), ``None`` otherwise;
    ``softcap``: the logits' cap (``None``: none); ``weight_row_scale [k]`` float32 or ``None`` (1); ``hidden [k, H]``
    with a unit last stride."""
    rows, hidden_size = hidden.shape
    chosen = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    factor = torch.empty_like(chosen) if reference is not None else None
    if rows == 0:
        return chosen, factor
    grad_logprob, grad_entropy = upstream
    temperature, temperature_flag = temperature_arguments(temperature)
    softcap, softcap_flag = softcap_arguments(softcap)
    grid = (rows, triton.cdiv(hidden_size, BLOCK_H) if operand is not None else 1)
    row_terms_kernel[grid](
        target_column,
        summary.logprob,
        summary.mean_minus_target,
        summary.lse,
        reference,
        grad_logprob,
        grad_entropy,
        temperature,
        softcap,
        weight_row_scale,
        hidden,
        hidden.stride(0),
        operand,
        0 if operand is None else operand.stride(0),
        chosen,
        factor,
        chosen_weight,
        hidden_size,
        HAS_GRAD_LOGPROB=grad_logprob is not None,
        HAS_GRAD_ENTROPY=grad_entropy is not None,
        DIRECT=reference is not None,
        HAS_WEIGHT_ROW_SCALE=weight_row_scale is not None,
        OPERAND=operand is not None,
        CHOSEN_WEIGHT=chosen_weight is not None,
        BLOCK_H=BLOCK_H,
        **temperature_flag,
        **softcap_flag,
        num_warps=4,
    )
    return chosen, factor
