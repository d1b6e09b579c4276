"""Which forward made a tensor that a trainer hands to a ``FusedLMHead``.

The patched output layer returns the hidden states instead of the logits, and the head later needs
what that forward used (its weight, its group): the tensor it is given decides, not the order of
calls. Each fused forward's ``Origin`` is attached two ways:

- to the autograd graph, as the context of an identity node (``_Traced``) on the returned hidden
  states, so that anything derived from them with gradients on (views, slices, reshapes, copies
  such as ``.contiguous()`` or ``.float()``, a split of a packed batch) leads back to it;
- to the hidden states' storage, so that a tensor without a graph (a forward under ``no_grad``, a
  ``.detach()``) that shares it is recognized too.

A forward's ``Origin`` lives as long as its output's storage or its graph node does (the registry
forgets it at its next use, or the garbage collector's next pass, once neither is alive). It holds
its head weakly: hidden states kept past their model, or a registry entry not yet forgotten, do
not keep the model alive. ``FusedLMHead._call_for`` says what the head does when nothing
establishes the origin.
"""

from __future__ import annotations

import gc
import threading
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Set

import torch
from torch.multiprocessing.reductions import StorageWeakRef


@dataclass(frozen=True, eq=False)
class Origin:
    """One fused forward of one head: ``head_ref`` a weak reference to the ``FusedLMHead`` whose
    patch ran it and ``head_name`` that head's name, ``call`` what its output-layer call used (the
    head's ``HeadCall``), ``hidden_size`` and ``device`` those of the hidden states it returned."""

    head_ref: weakref.ref
    head_name: str
    call: Any
    hidden_size: int
    device: torch.device

    @property
    def head(self) -> Any:
        """The head, or ``None`` once it is gone (a head that is gone computes nothing)."""
        return self.head_ref()


class _Traced(torch.autograd.Function):
    """The identity on ``hidden``, whose graph node carries the forward's ``Origin``. ``weight`` is
    an input too, so that the output has a graph exactly where the stock logits ``hidden @
    weight.T`` would (a frozen body under a trained head), though no gradient flows to it here."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, origin: Origin) -> torch.Tensor:
        ctx.origin = origin
        ctx.set_materialize_grads(False)
        # The same storage, but not a view of the input to autograd: in-place operations on the
        # model's output stay allowed, as on the stock logits (a view made inside a custom
        # Function may not be modified in place).
        return hidden.detach()

    @staticmethod
    def backward(ctx, grad: Optional[torch.Tensor]):
        return grad, None, None


class _Entry:
    """A forward's output storage and its ``Origin``, held while the storage is alive."""

    __slots__ = ("storage", "origin")

    def __init__(self, storage: StorageWeakRef, origin: Origin):
        self.storage, self.origin = storage, origin


_lock = threading.Lock()
_entries: List[_Entry] = []


def _live_entries() -> List[_Entry]:
    """The entries whose output is still alive; the others are forgotten. Caller holds the lock."""
    _entries[:] = [entry for entry in _entries if not entry.storage.expired()]
    return _entries


@torch.compiler.disable
def _forget_expired(phase: str, info: dict) -> None:
    """After each garbage collection, the entries of outputs no longer alive (their calls hold the
    output weights), unless the lock is held (the collection ran inside a registry call, or another
    thread is in one: the next use forgets them)."""
    if phase == "stop" and _lock.acquire(blocking=False):
        try:
            _live_entries()
        finally:
            _lock.release()


gc.callbacks.append(_forget_expired)


# A compiled model runs these eagerly, between its graphs: they touch a lock and weak references.
@torch.compiler.disable
def traced(hidden: torch.Tensor, weight: torch.Tensor, origin: Origin) -> torch.Tensor:
    """``hidden`` as the output layer returns it, with ``origin`` attached to its graph (where the
    stock logits of ``weight`` would have one) and to its storage."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        hidden = _Traced.apply(hidden, weight, origin)
    register(hidden, origin)
    return hidden


@torch.compiler.disable
def register(output: Any, origin: Origin) -> None:
    """Tie ``output``'s storage to ``origin`` if it is a tensor of that forward's hidden states (a
    module that wraps the model returns them, or a copy of them)."""
    if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[-1] != origin.hidden_size:
        return
    storage = StorageWeakRef(output.untyped_storage())
    with _lock:
        entries = _live_entries()
        if not any(entry.storage == storage and entry.origin is origin for entry in entries):
            entries.append(_Entry(storage, origin))


def graph_origins(tensor: torch.Tensor) -> Set[Origin]:
    """The origins of the forwards ``tensor``'s graph leads back to, searched no further than the
    first marked node on each path."""
    found: Set[Origin] = set()
    seen = set()
    stack = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, _Traced._backward_cls):
            found.add(node.origin)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def storage_origin(tensor: torch.Tensor) -> Optional[Origin]:
    """The origin of the live forward whose output shares ``tensor``'s storage, if any."""
    storage = StorageWeakRef(tensor.untyped_storage())
    with _lock:
        for entry in reversed(_live_entries()):
            if entry.storage == storage:
                return entry.origin
    return None


def live_origins(hidden_size: int, device: torch.device) -> List[Origin]:
    """The origins of every forward (of any head, alive or not) whose output is still alive, with
    hidden states of this size on this device: the forwards that could have made a tensor whose
    origin nothing establishes."""
    with _lock:
        origins = [entry.origin for entry in _live_entries()]
    return [origin for origin in origins if (origin.hidden_size, origin.device) == (hidden_size, device)]
