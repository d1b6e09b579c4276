"""The labels path's backward check in one launch, on the device (``backends.contract.proportional_fit``
and ``deviates`` are the torch form it follows): the scale ``c`` that fits an upstream gradient
``u [n]`` to the declared weights ``w [n]`` (or a given one), the per-row gradient of the difference
``u - c w`` that a correction would take, and whether the difference is more than rounding."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def fit_kernel(
    upstream_ptr,
    declared_ptr,
    correction_ptr,
    scale_ptr,
    gate_ptr,
    num_rows,
    weight_grad_scale,
    tolerance,
    FIT: tl.constexpr,
    RELATIVE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if FIT:
        dot = tl.zeros([BLOCK], tl.float32)
        norm = tl.zeros([BLOCK], tl.float32)
        largest = tl.zeros([BLOCK], tl.float32)
        largest_declared = tl.zeros([BLOCK], tl.float32)
        for first in range(0, num_rows, BLOCK):
            rows = first + tl.arange(0, BLOCK)
            upstream = tl.load(upstream_ptr + rows, mask=rows < num_rows, other=0.0)
            declared = tl.load(declared_ptr + rows, mask=rows < num_rows, other=0.0)
            dot += upstream * declared
            norm += declared * declared
            largest = tl.maximum(largest, tl.abs(upstream))
            largest_declared = tl.maximum(largest_declared, tl.abs(declared))
        largest = tl.max(largest, axis=0)
        scale = tl.sum(dot, axis=0) / tl.maximum(tl.sum(norm, axis=0), 1.1754943508222875e-38)
        # Where c w explains nothing of u: 1, or 0 for u = 0 (backends.contract.proportional_fit says why).
        explains = tl.abs(scale) * tl.max(largest_declared, axis=0) > tolerance * largest
        scale = tl.where(explains, scale, tl.where(largest > 0, 1.0, 0.0))
    else:
        scale = tl.full([], weight_grad_scale, tl.float32)
    largest_difference = tl.zeros([BLOCK], tl.float32)
    largest_upstream = tl.zeros([BLOCK], tl.float32)
    for first in range(0, num_rows, BLOCK):
        rows = first + tl.arange(0, BLOCK)
        upstream = tl.load(upstream_ptr + rows, mask=rows < num_rows, other=0.0)
        difference = upstream - scale * tl.load(declared_ptr + rows, mask=rows < num_rows, other=0.0)
        largest_difference = tl.maximum(largest_difference, tl.abs(difference))
        largest_upstream = tl.maximum(largest_upstream, tl.abs(upstream))
        # The cross-entropy's gradient of the log-prob is minus its own.
        correction = -(difference / scale) if RELATIVE else -difference
        tl.store(correction_ptr + rows, correction, mask=rows < num_rows)
    tl.store(scale_ptr, scale)
    gate = tl.max(largest_difference, axis=0) > tolerance * tl.max(largest_upstream, axis=0)
    tl.store(gate_ptr, gate.to(tl.int8))


def fit_declared(
    upstream: torch.Tensor, declared: torch.Tensor, weight_grad_scale: Optional[float], tolerance: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scale [], log-prob gradient of the correction [n], gate [] bool)`` for ``upstream`` and
    ``declared`` (``[n]`` float32, contiguous): the scale fitted (``weight_grad_scale`` ``None``) or
    given, the
    correction's ``-(u - c w) / c`` for a fitted scale (its weight gradient is scaled by ``c`` with
    the held one) or ``-(u - c w)`` for a given one, and whether the difference exceeds
    ``tolerance`` times the largest upstream entry."""
    correction = torch.empty_like(upstream)
    scale = upstream.new_empty(())
    gate = torch.empty((), dtype=torch.int8, device=upstream.device)
    fit_kernel[(1,)](
        upstream,
        declared,
        correction,
        scale,
        gate,
        upstream.shape[0],
        1.0 if weight_grad_scale is None else weight_grad_scale,
        tolerance,
        FIT=weight_grad_scale is None,
        RELATIVE=weight_grad_scale is None,
        BLOCK=BLOCK,
        num_warps=4,
    )
    return scale, correction, gate.view(torch.bool)
