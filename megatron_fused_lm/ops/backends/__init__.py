"""The implementations behind ``backend=``: for each path (``contract.RecomputeBackend``,
``contract.LossBackend``), a torch one that runs on any device and a Triton one for CUDA."""

from __future__ import annotations

from typing import Optional

import torch

from ..._logging import warn_once
from ..contract import LossBackend, RecomputeBackend
from ..options import check_backend
from ..triton_support import triton_unavailable_reason
from .torch_loss import TorchLoss
from .torch_recompute import TorchRecompute


def _runs_triton(backend: str, device: torch.device) -> bool:
    """``backend="triton"`` and ``"auto"`` run Triton where it can run, else the torch backend (with
    one logged warning)."""
    check_backend(backend)
    if backend == "torch":
        return False
    reason = triton_unavailable_reason(device)
    if reason is not None:
        warn_once(f"backend={backend!r} runs the torch backend instead: {reason}")
    return reason is None


def recompute_backend(backend: str, device: torch.device, token_chunk: Optional[int]) -> RecomputeBackend:
    """The four-GEMM path's implementation of ``backend`` for tensors on ``device``."""
    if _runs_triton(backend, device):
        from .triton_recompute import TritonRecompute

        return TritonRecompute(token_chunk=token_chunk)
    return TorchRecompute(token_chunk=token_chunk)


def loss_backend(
    backend: str, device: torch.device, token_chunk: Optional[int], entropy_grad: bool, weight_grad_accumulates: bool
) -> LossBackend:
    """The three-GEMM path's implementation of ``backend`` for tensors on ``device``, for a loss with
    (``entropy_grad``) or without an entropy term; with ``weight_grad_accumulates`` the held weight
    gradient is a caller's accumulator, which every chunk adds to."""
    if _runs_triton(backend, device):
        from .triton_loss import TritonLoss

        return TritonLoss(token_chunk, entropy_grad, weight_grad_accumulates)
    return TorchLoss(token_chunk, entropy_grad, weight_grad_accumulates)
