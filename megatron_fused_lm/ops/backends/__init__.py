"""The implementations behind ``backend=``: for each path (``contract.RecomputeBackend``,
``contract.LossBackend``), a torch one that runs on any device and a Triton one for CUDA. A call
names its backend once, resolved (``options.resolved_backend``); the Triton modules are imported
only when it is ``"triton"``."""

from __future__ import annotations

from typing import Optional

import torch

from ..contract import LossBackend, RecomputeBackend
from ..kept_tokens import KeptSets, torch_kept_mask
from .torch_loss import TorchLoss
from .torch_recompute import TorchRecompute


def recompute_backend(backend: str, token_chunk: Optional[int], batch_invariant: bool = False) -> RecomputeBackend:
    """The four-GEMM path's implementation of the resolved ``backend`` (``"torch"`` or ``"triton"``;
    ``batch_invariant`` only with ``"triton"``: ``options.HeadOptions.checked`` refuses the rest)."""
    if backend == "triton":
        from .triton_recompute import TritonRecompute

        return TritonRecompute(token_chunk=token_chunk, batch_invariant=batch_invariant)
    return TorchRecompute(token_chunk=token_chunk)


def loss_backend(
    backend: str, token_chunk: Optional[int] = None, entropy_grad: bool = True, batch_invariant: bool = False
) -> LossBackend:
    """The three-GEMM path's implementation of the resolved ``backend``, for a loss with
    (``entropy_grad``) or without an entropy term. Only its allocation reads ``token_chunk`` and
    ``entropy_grad``: the later phases follow the block it allocated; ``batch_invariant``
    (``"triton"`` only, as for ``recompute_backend``) sets the block's form and the products."""
    if backend == "triton":
        from .triton_loss import TritonLoss

        return TritonLoss(token_chunk, entropy_grad, batch_invariant=batch_invariant)
    return TorchLoss(token_chunk, entropy_grad)


def kept_mask(backend: str, sets: KeptSets, vocab_shard: int) -> torch.Tensor:
    """The ``kept_mask`` of ``sets`` (``kept_tokens``' form), its values checked, built by the
    resolved ``backend``'s own code."""
    if backend == "triton":
        from ..kernels.kept_mask_kernel import kept_mask as triton_kept_mask

        return triton_kept_mask(sets, vocab_shard)
    return torch_kept_mask(sets, vocab_shard)
