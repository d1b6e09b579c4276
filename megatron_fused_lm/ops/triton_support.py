"""Whether the Triton kernels, and the CuTe kernels, can run on a device (a leaf: the backends and the
held gradients ask)."""

from __future__ import annotations

import importlib
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


def cute_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the CuTe kernels cannot run on ``device``, or ``None`` if they can: a Hopper GPU (compute
    capability 9.0) with the ``cute`` extra installed (``nvidia-cutlass-dsl`` and TVM-FFI)."""
    if device.type != "cuda":
        return f"it needs a CUDA device, got {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"its kernels are for compute capability 9.0 (Hopper), this device has {capability[0]}.{capability[1]}"
    for module, extra in (("cutlass", "nvidia-cutlass-dsl"), ("tvm_ffi", "apache-tvm-ffi")):
        try:
            importlib.import_module(module)
        except ImportError:
            return f"{extra} is not installed (pip install 'megatron-fused-lm[cute]')"
    return None
