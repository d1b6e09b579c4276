"""The backends by name: ``TorchBackend``, ``triton.TritonBackend`` and ``cute.CuteBackend``, each one
object for both paths (``contract.Backend``), resolved once per call (``resolve``) and named in the
options (``by_name``); the Triton and CuTe modules are imported only when a call runs them."""

from __future__ import annotations

import inspect
import sys
from typing import Dict, List, Union

import torch

from ..chunking import chunk_rows
from ..kept_tokens import KeptSets, torch_kept_mask
from ..options import resolved_backend
from ..top_keys import shard_top_keys
from .contract import BACKEND_MEMBERS, BACKEND_METHODS, BACKEND_PARAMETERS
from .torch_loss import TorchLoss
from .torch_recompute import TorchRecompute


class TorchBackend(TorchRecompute, TorchLoss):
    """The torch backend: cuBLAS products and PyTorch code, no Triton."""

    name = "torch"

    def kept_mask(self, sets: KeptSets, vocab_shard: int) -> torch.Tensor:
        """The ``kept_mask`` of ``sets`` (``kept_tokens``' form), its values checked."""
        return torch_kept_mask(sets, vocab_shard)

    def top_keys(self, hidden, weight, temperature, softcap, k, first_id, block_logits, token_chunk):
        """``triton_topk.top_keys``' contract by the torch form alone (``block_logits`` capped already)."""
        rows_per_chunk = chunk_rows(token_chunk, weight.shape[0])
        return shard_top_keys(
            block_logits, hidden.shape[0], k=k, first_id=first_id, rows_per_chunk=rows_per_chunk, device=hidden.device
        )


_by_name: Dict[str, object] = {"torch": TorchBackend()}


def by_name(name: str):
    """The backend registered under ``name`` (``"torch"``, ``"triton"``, ``"cute"``, or a resolved
    backend's)."""
    if name == "triton" and name not in _by_name:
        from .triton import TritonBackend

        _by_name[name] = TritonBackend()
    if name == "cute" and name not in _by_name:
        from .cute import CuteBackend

        _by_name[name] = CuteBackend()
    return _by_name[name]


def missing_members(backend: object) -> List[str]:
    """The members of ``contract.Backend`` that ``backend`` lacks or has in another form: an attribute
    where a method belongs, a method whose parameters are named otherwise (the ops pass them by
    name; given as the Protocol's), a name that is not a string."""
    missing = []
    for name in BACKEND_MEMBERS:
        member = getattr(backend, name, None)
        if member is None or (name in BACKEND_METHODS and not callable(member)):
            missing.append(name)
        elif name in BACKEND_METHODS and tuple(inspect.signature(member).parameters) != BACKEND_PARAMETERS[name]:
            missing.append(f"{name}({', '.join(BACKEND_PARAMETERS[name])})")
    if "name" not in missing and not isinstance(backend.name, str):
        missing.append("name (a string)")
    return missing


def resolve(backend: Union[str, object], device: torch.device):
    """The backend a call on tensors of ``device`` runs, chosen once: ``"torch"``, ``"triton"``,
    ``"cute"`` or ``"auto"`` (``options.resolved_backend``), or a backend object
    (``triton.TritonBackend`` with its own tuning, which runs as the torch backend where Triton
    cannot, with one logged warning; or one of one's own, which runs as given). An object is
    registered under its ``name`` (``"triton"`` and ``"cute"`` are the built-ins'); one of another
    class or state under a name already taken is refused (``ValueError``)."""
    if isinstance(backend, str):
        return by_name(resolved_backend(backend, device))
    name = getattr(backend, "name", None)
    registered = isinstance(name, str) and _by_name.get(name) is backend  # checked when it was registered
    missing = [] if registered else missing_members(backend)
    if missing:
        raise TypeError(
            f"backend must be 'torch', 'triton', 'cute', 'auto' or a backend object (contract.Backend), got {backend!r}, "
            f"which lacks {', '.join(missing)}"
        )
    if _runs_triton(backend) and resolved_backend("triton", device) == "torch":
        return by_name("torch")
    if backend.name in ("triton", "cute"):  # the built-ins' names, whichever object comes first
        if not _runs_triton(backend):
            raise ValueError(
                f"backend {backend!r} is named {backend.name!r}, a built-in's name; give it a name of its own"
            )
        by_name(backend.name)
    held = _by_name.setdefault(backend.name, backend)
    # The options carry the name, and the ops look the backend up by it: one name, one behaviour.
    if not _alike(held, backend):
        raise ValueError(
            f"backend {backend!r} is named {backend.name!r}, the name of another backend object ({held!r}) of "
            "another class or state; pass that object, or give this one a name of its own"
        )
    return held


def _runs_triton(backend: object) -> bool:
    """Whether ``backend`` runs Triton's kernels (``triton.TritonBackend`` or a subclass); a backend
    object of one's own runs wherever it is given."""
    # No Triton-based object exists unless its module was imported: nothing is imported here.
    module = sys.modules.get(f"{__package__}.triton")
    return module is not None and isinstance(backend, module.TritonBackend)


def _alike(held: object, backend: object) -> bool:
    """Whether ``backend`` behaves as ``held``, registered under its name: the same object, or one of
    the same class that compares equal (``TritonBackend``'s tuning) or holds no state of its own."""
    if held is backend:
        return True
    if type(held) is not type(backend):
        return False
    try:
        if bool(held == backend):
            return True
    except Exception:  # an __eq__ over tensors, say: not known to be alike
        return False
    return getattr(held, "__dict__", None) == {} and getattr(backend, "__dict__", None) == {}
