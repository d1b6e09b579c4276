"""The implementations behind ``backend=``: ``TorchBackend``, chunked PyTorch code on any device, and
``triton.TritonBackend``, the Triton kernels on CUDA. Each is one object for both paths
(``contract`` says what a path asks of it), resolved once per call (``resolve``) and named in the
options (``by_name``); the Triton modules are imported only when a call runs it."""

from __future__ import annotations

from typing import Dict, Union

import torch

from ..chunking import chunk_rows
from ..kept_tokens import KeptSets, torch_kept_mask
from ..options import resolved_backend
from ..top_keys import shard_top_keys
from .torch_loss import TorchLoss
from .torch_recompute import TorchRecompute


class TorchBackend(TorchRecompute, TorchLoss):
    """The torch backend: cuBLAS products and PyTorch code, no Triton."""

    name = "torch"

    def kept_mask(self, sets: KeptSets, vocab_shard: int) -> torch.Tensor:
        """The ``kept_mask`` of ``sets`` (``kept_tokens``' form), its values checked."""
        return torch_kept_mask(sets, vocab_shard)

    def top_keys(self, hidden, weight, temperature, k, first_id, block_logits, token_chunk):
        """``triton_topk.top_keys``' contract by the torch form alone."""
        rows = chunk_rows(token_chunk, weight.shape[0])
        return shard_top_keys(block_logits, hidden.shape[0], k, first_id, rows, hidden.device)


_by_name: Dict[str, object] = {"torch": TorchBackend()}


def by_name(name: str):
    """The backend registered under ``name`` (``"torch"``, ``"triton"``, or a resolved backend's)."""
    if name == "triton" and name not in _by_name:
        from .triton import TritonBackend

        _by_name[name] = TritonBackend()
    return _by_name[name]


def resolve(backend: Union[str, object], device: torch.device):
    """The backend a call on tensors of ``device`` runs, chosen once: ``"torch"``, ``"triton"`` or
    ``"auto"`` (``options.resolved_backend``), or a backend object (``triton.TritonBackend`` with its
    own tuning), which runs as the torch backend where Triton cannot (one logged warning)."""
    if isinstance(backend, str):
        return by_name(resolved_backend(backend, device))
    if not callable(getattr(backend, "local_statistics", None)) or not isinstance(getattr(backend, "name", None), str):
        raise TypeError(f"backend must be 'torch', 'triton', 'auto' or a backend object, got {backend!r}")
    if backend.name != "torch" and resolved_backend("triton", device) == "torch":
        return by_name("torch")
    return _by_name.setdefault(backend.name, backend)
