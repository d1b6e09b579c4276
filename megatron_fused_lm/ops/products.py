"""Matrix products accumulated in float32 whatever the inputs' dtype, shared by the backends."""

from __future__ import annotations

import torch


def add_product(out: torch.Tensor, left: torch.Tensor, right: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """``out = left @ right`` (``+ out`` when ``accumulate``), accumulated in float32; returns ``out``.

    ``out`` is float32 or ``left``'s dtype; ``left`` and ``right`` share a dtype. When
    ``accumulate`` is false, ``out`` may hold anything (beta = 0 ignores it).
    """
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
