"""Whether the Triton kernels can run on a device (a leaf: the backends and the held gradients ask)."""

from __future__ import annotations

import os
from typing import Optional

import torch


def triton_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the Triton kernels cannot run on ``device``, or ``None`` if they can: CUDA with Triton, or
    the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, which runs them in NumPy)."""
    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        return f"it needs a CUDA device, got {device.type}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None
