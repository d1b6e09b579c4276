"""Whether the Triton kernels can run on a device (a leaf: the backends and the held gradients ask)."""

from __future__ import annotations

from typing import Optional

import torch


def triton_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the Triton kernels cannot run on ``device``, or ``None`` if they can (CUDA with Triton)."""
    if device.type != "cuda":
        return f"it needs a CUDA device, got {device.type}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None
