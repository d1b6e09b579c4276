"""Matrix products accumulated in float32 whatever the inputs' dtype, shared by the backends."""

from __future__ import annotations

import torch


def add_product(out: torch.Tensor, left: torch.Tensor, right: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """``out = left @ right`` (``+ out`` when ``accumulate``), accumulated in float32; returns ``out``.

    ``out`` is float32 or ``left``'s dtype; ``left`` and ``right`` share a dtype. When
    ``accumulate`` is false, ``out`` may hold anything (beta = 0 ignores it). On CUDA, where
    ``left``'s contiguous dimension is not a whole number of 16-byte steps in an otherwise aligned
    layout (an odd vocabulary in the padded block: the depth of ``dz @ W``, the rows of ``dz.T @
    h``), the product runs as an aligned bulk and a tail under 16 bytes wide: cuBLAS runs the whole
    product 1.65x (rows) to 6x (depth) slower otherwise (docs/benchmarks/features.md). A split depth
    sums into float32 and rounds a 16-bit ``out`` once.
    """
    step = 16 // left.element_size()
    aligned = left.is_cuda and left.data_ptr() % 16 == 0
    if aligned and left.stride(1) == 1 and left.stride(0) % step == 0 and left.shape[1] % step and left.shape[1] > step:
        bulk = left.shape[1] - left.shape[1] % step
        if out.dtype == torch.float32:
            total = out
        elif accumulate:
            total = out.float()
        else:
            total = out.new_empty(out.shape, dtype=torch.float32)
        _addmm(total, left[:, :bulk], right[:bulk], accumulate)
        _addmm(total, left[:, bulk:], right[bulk:], True)
        return out if total is out else out.copy_(total)
    if aligned and left.stride(0) == 1 and left.stride(1) % step == 0 and left.shape[0] % step and left.shape[0] > step:
        bulk = left.shape[0] - left.shape[0] % step
        _addmm(out[:bulk], left[:bulk], right, accumulate)
        _addmm(out[bulk:], left[bulk:], right, accumulate)
        return out
    return _addmm(out, left, right, accumulate)


def _addmm(out: torch.Tensor, left: torch.Tensor, right: torch.Tensor, accumulate: bool) -> torch.Tensor:
    beta = 1 if accumulate else 0
    if out.dtype == left.dtype:
        torch.addmm(out, left, right, beta=beta, out=out)
    elif out.device.type == "cpu":  # CPU has no mixed-dtype addmm.
        out.addmm_(left.to(out.dtype), right.to(out.dtype), beta=beta)
    else:
        torch.addmm(out, left, right, beta=beta, out_dtype=out.dtype, out=out)
    return out


def float32_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left @ right`` as a new float32 tensor."""
    out = left.new_empty(left.shape[0], right.shape[1], dtype=torch.float32)
    return add_product(out, left, right, accumulate=False)
