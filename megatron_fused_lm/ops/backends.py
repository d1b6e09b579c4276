"""Choosing the implementation behind ``backend=``.

A backend is a module with two functions (see ``torch_backend`` for their contracts):
``local_statistics(hidden, weight, local_target, owned, temperature, chunk_size) -> [n, 4]`` and
``local_gradients(...) -> (grad_hidden partial or None, grad_weight or None)``. The collectives,
the input checks and the autograd plumbing are shared and live in ``fused``.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Optional

import torch

from .._logging import warn_once
from . import torch_backend

BACKENDS = ("torch", "triton", "auto")


def check_backend(name: str) -> None:
    """``ValueError`` unless ``name`` is one of ``BACKENDS``."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {name!r}")


def triton_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the Triton backend cannot run on ``device``, or ``None`` if it can.

    It runs on CUDA devices, and on the CPU under the Triton interpreter (``TRITON_INTERPRET=1``,
    set before the kernels are first imported), which the CPU tests use.
    """
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"it needs a CUDA device (or TRITON_INTERPRET=1 on the CPU), got {device.type}"


def resolve_backend(name: str, device: torch.device) -> ModuleType:
    """The backend module that runs ``backend=name`` for tensors on ``device``."""
    check_backend(name)
    if name == "torch":
        return torch_backend
    reason = triton_unavailable_reason(device)
    if reason is None:
        from . import triton_backend

        return triton_backend
    warn_once(f"backend={name!r} runs the torch backend instead: {reason}")
    return torch_backend
