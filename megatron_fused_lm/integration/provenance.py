"""Which forward made a tensor that a trainer hands to a ``FusedLMHead``.

The patched output layer returns the hidden states instead of the logits, and the head later needs
what that forward used (its weight, its group): the tensor it is given decides, not the order of
calls. Each fused forward's ``Origin`` is attached two ways:

- to the autograd graph, as the context of an identity node (``_Traced``) on the returned hidden
  states, so that anything derived from them with gradients on (views, slices, reshapes, copies
  such as ``.contiguous()`` or ``.float()``, a split of a packed batch) leads back to it;
- to the hidden states' storage, so that a tensor without a graph (a forward under ``no_grad``, a
  ``.detach()``) that shares it is recognized too.

What a forward returns instead of hidden states (the labels path's per-token loss, the stock
logits inside ``head.stock_logits()`` or an inference forward) is marked the same two ways with what it is, so that the head
refuses it, and what derives from it, by where it comes from rather than by its shape (a loss
``[b, s]`` has the hidden states' last dimension wherever ``s`` equals the hidden size).

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
from typing import Any, List, NamedTuple, Optional, Set

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


HIDDEN_STATES = "hidden states"
PER_TOKEN_LOSS = "the per-token loss that the forward returned for labels= (the labels path)"
STOCK_LOGITS = (
    "the stock logits (which the output layer returns inside head.stock_logits(), to an inference forward and to "
    "a caller outside the model's forward)"
)


class Mark(NamedTuple):
    """What a forward returned (``returned``: ``HIDDEN_STATES``, ``PER_TOKEN_LOSS`` or
    ``STOCK_LOGITS``) and the forward that returned it."""

    origin: Origin
    returned: str


class _Traced(torch.autograd.Function):
    """The identity on ``tensor``, whose graph node carries its ``Mark``. ``weight`` is an input
    too, so that the output has a graph exactly where the stock logits ``hidden @ weight.T`` would
    (a frozen body under a trained head), though no gradient flows to it here."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, weight: torch.Tensor, mark: Mark) -> torch.Tensor:
        ctx.mark = mark
        ctx.set_materialize_grads(False)
        # The same storage, but not a view of the input to autograd: in-place operations on the
        # model's output stay allowed, as on the stock logits (a view made inside a custom
        # Function may not be modified in place).
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad: Optional[torch.Tensor]):
        return grad, None, None


class _Entry:
    """A forward's output storage and its ``Mark``, held while the storage is alive."""

    __slots__ = ("storage", "mark")

    def __init__(self, storage: StorageWeakRef, mark: Mark):
        self.storage, self.mark = storage, mark


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
def traced(tensor: torch.Tensor, weight: torch.Tensor, origin: Origin, returned: str = HIDDEN_STATES) -> torch.Tensor:
    """``tensor``, what the forward of ``origin`` returns (``returned``), with its mark attached to
    its graph (where the stock logits of ``weight`` would have one) and to its storage."""
    mark = Mark(origin, returned)
    if torch.is_grad_enabled() and (tensor.requires_grad or weight.requires_grad):
        tensor = _Traced.apply(tensor, weight, mark)
    _register(tensor, mark)
    return tensor


@torch.compiler.disable
def register(output: Any, origin: Origin, returned: str = HIDDEN_STATES) -> None:
    """Tie ``output``'s storage to what ``origin``'s forward returned: its hidden states if it is a
    tensor of their size (a module that wraps the model returns them, or a copy of them) and not
    already marked as something else (the labels path's loss, on its way out of the model)."""
    if not isinstance(output, torch.Tensor) or output.dim() == 0:
        return
    if returned == HIDDEN_STATES and output.shape[-1] != origin.hidden_size:
        return
    _register(output, Mark(origin, returned))


def _register(output: torch.Tensor, mark: Mark) -> None:
    storage = StorageWeakRef(output.untyped_storage())
    with _lock:
        entries = _live_entries()
        marked = [entry.mark for entry in entries if entry.storage == storage]
        if mark.returned == HIDDEN_STATES and any(other.returned != HIDDEN_STATES for other in marked):
            return
        if mark not in marked:
            entries.append(_Entry(storage, mark))


def graph_marks(tensor: torch.Tensor) -> Set[Mark]:
    """The marks of what the forwards returned that ``tensor``'s graph leads back to, searched no
    further than the first marked node on each path."""
    found: Set[Mark] = set()
    seen = set()
    stack = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, _Traced._backward_cls):
            found.add(node.mark)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def storage_mark(tensor: torch.Tensor) -> Optional[Mark]:
    """The mark of the live forward's output that shares ``tensor``'s storage, if any (what else
    than hidden states it is, where it is both)."""
    storage = StorageWeakRef(tensor.untyped_storage())
    with _lock:
        marks = [entry.mark for entry in reversed(_live_entries()) if entry.storage == storage]
    return next((mark for mark in marks if mark.returned != HIDDEN_STATES), marks[0] if marks else None)


def live_origins(hidden_size: int, device: torch.device) -> List[Origin]:
    """The origins of every forward (of any head, alive or not) whose hidden states are still
    alive, of this size on this device: the forwards that could have made a tensor whose origin
    nothing establishes."""
    with _lock:
        marks = [entry.mark for entry in _live_entries() if entry.mark.returned == HIDDEN_STATES]
    return [mark.origin for mark in marks if (mark.origin.hidden_size, mark.origin.device) == (hidden_size, device)]
