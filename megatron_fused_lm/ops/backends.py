"""Choosing the implementation behind ``backend=`` (the ``contract.Backend`` protocol)."""

from __future__ import annotations

from typing import Optional

import torch

from .._logging import warn_once
from .contract import Backend
from .torch_backend import TorchBackend

BACKENDS = ("torch", "triton", "auto")


def check_backend(name: str) -> None:
    """``ValueError`` unless ``name`` is one of ``BACKENDS``."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {name!r}")


def triton_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the Triton backend cannot run on ``device``, or ``None`` if it can (CUDA with Triton)."""
    if device.type != "cuda":
        return f"it needs a CUDA device, got {device.type}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def resolve_backend(name: str, device: torch.device, token_chunk: Optional[int]) -> Backend:
    """The backend that runs ``backend=name`` with ``chunk_size=token_chunk`` for tensors on
    ``device``: ``"triton"`` and ``"auto"`` run Triton where it can run, else the torch backend
    (with one logged warning)."""
    check_backend(name)
    if name != "torch":
        reason = triton_unavailable_reason(device)
        if reason is None:
            from .triton_backend import TritonBackend

            return TritonBackend(token_chunk=token_chunk)
        warn_once(f"backend={name!r} runs the torch backend instead: {reason}")
    return TorchBackend(token_chunk=token_chunk)
