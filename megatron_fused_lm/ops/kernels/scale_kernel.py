"""``out = source * scale`` for a scale that lives on the device, one value or one per row, rounded
once into ``out``'s dtype (``TritonLoss.scaled_copy`` says why a kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def scale_kernel(source_ptr, out_ptr, scale_ptr, numel, row_length, PER_ROW: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < numel
    if PER_ROW:
        scale = tl.load(scale_ptr + offsets // row_length, mask=valid, other=0.0).to(tl.float32)
    else:
        scale = tl.load(scale_ptr).to(tl.float32)
    values = tl.load(source_ptr + offsets, mask=valid).to(tl.float32)
    tl.store(out_ptr + offsets, (values * scale).to(out_ptr.dtype.element_ty), mask=valid)


def scale_into(source: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out = source * scale``: ``source`` and ``out`` contiguous CUDA tensors of one shape (``out``
    may be ``source``), ``scale`` a float tensor on the same device, 0-dim or one per row of
    ``source [n, ...]`` (contiguous)."""
    numel = source.numel()
    if numel:
        per_row = scale.dim() > 0
        row_length = numel // source.shape[0] if per_row else 1
        scale_kernel[(triton.cdiv(numel, BLOCK),)](
            source, out, scale, numel, row_length, PER_ROW=per_row, BLOCK=BLOCK, num_warps=8
        )
