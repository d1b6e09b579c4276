"""Where the weight gradient of a three-GEMM pass goes (``WeightGradSink``: float32 row parts of the
pass's own, made and finished by ``backends.contract``'s helpers, or the caller's
``weight_grad_into``), and the ledger of what a loss leaves in ``weight_grad_into`` until its
backward: the losses whose backward has not run (``outstanding_weight_grads``), and the backward
passes that corrected a gradient by a second pass (``weight_grad_corrections``).

A loss into ``weight_grad_into`` must be backpropagated: its backward gives the hidden gradient and
checks the ``weight_grad_scale`` the forward assumed. One released without it (a metric computed
with gradients on, a micro-batch skipped after a NaN check, an exception part way through its
forward) leaves its weight gradient in the accumulator, where nothing can tell it from the others:
its release is logged at once and listed for a trainer to check before its optimizer step.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..._logging import logger, warn_once
from ..inputs import checked_at_once, is_abstract, may_synchronize

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class WeightGradSink:
    """Where a three-GEMM pass puts the weight gradient, decided once by the public op: float32 row
    parts of the pass's own (``weight_grad_into`` is ``None``), finished into the weight's dtype by
    the backward; or the caller's float32 ``weight_grad_into``, into which the forward adds
    ``weight_grad_scale`` times the gradient, followed by ``pending`` until the backward."""

    weight_grad_into: Optional[Tensor] = None
    weight_grad_scale: float = 1.0  # the upstream gradient the held gradients are for
    pending: Optional[PendingWeightGrad] = None

    @classmethod
    def into(
        cls, weight_grad_into: Tensor, weight_grad_scale: float, num_rows: int, vocab_rows: Optional[int] = None
    ) -> WeightGradSink:
        """The caller's ``weight_grad_into`` (checked by the public op), its record opened for
        ``num_rows`` rows; the pass adds into its first ``vocab_rows`` rows (``None``: all), those of
        the true vocabulary."""
        pending = PendingWeightGrad(weight_grad_into, weight_grad_scale, num_rows)
        return cls(weight_grad_into[:vocab_rows], weight_grad_scale, pending)


# The ledger: the losses whose forward added into a weight_grad_into, until their backward.

_Key = Tuple[torch.device, int, Tuple[int, ...]]


def _key(weight_grad_into: Tensor) -> _Key:
    # By memory, not by object: Megatron hands out the same main_grad view, a caller may make a new one.
    return weight_grad_into.device, weight_grad_into.data_ptr(), tuple(weight_grad_into.shape)


_lock = threading.Lock()
_pending: List["PendingWeightGrad"] = []
_names = WeakIdKeyDictionary()  # weight_grad_into -> how messages call it; forgotten with the tensor

WAITING, CLOSED, RELEASED = "waits for its backward", "closed", "was released without its backward"


def name_weight_grad_into(weight_grad_into: Tensor, name: str) -> None:
    """How the warnings and ``outstanding_weight_grads`` call ``weight_grad_into`` (the integration
    names each head's ``main_grad`` after its model); by default ``weight_grad_into [shape]``."""
    with _lock:
        _names[weight_grad_into] = name


class PendingWeightGrad:
    """One loss's weight gradient in ``weight_grad_into``, from its forward until its backward: made
    before the forward's first product, ``watch``-ed by the loss's autograd node (whose release
    without a backward it reports), ``close``-d by that backward."""

    def __init__(self, weight_grad_into: Tensor, weight_grad_scale: float, num_rows: int):
        self.key = _key(weight_grad_into)
        self.weight_grad_scale, self.num_rows = weight_grad_scale, num_rows
        self.state, self.sentence = WAITING, ""
        self.value: Tuple[Tensor, ...] = ()
        with _lock:
            self.name = _names.get(weight_grad_into, f"weight_grad_into {list(weight_grad_into.shape)}")
            _pending.append(self)

    def watch(self, node: object, *value: Tensor) -> None:
        """Report a release of ``node`` (the loss's autograd node) that comes before ``close``.
        ``value``: the loss, or per-token losses and their weights, read only for a report."""
        self.value = tuple(tensor.detach() for tensor in value)
        finalizer = weakref.finalize(node, self.release, RELEASED)
        finalizer.atexit = False  # the end of the process is not a skipped backward

    def close(self) -> None:
        """The loss's backward ran: its gradient is accounted for."""
        with _lock:
            self.state, self.value = CLOSED, ()
            if self in _pending:
                _pending.remove(self)

    def release(self, how: str) -> None:
        """The loss will get no backward (``how`` says why): log it and keep it listed, as a
        sentence (the loss's value read once, here, and only for a loss that is still waiting)."""
        if self.state != WAITING:
            return
        sentence = self._sentence(how)
        with _lock:
            if self.state != WAITING:
                return
            self.state, self.sentence, self.value = RELEASED, sentence, ()
        logger.warning(f"megatron_fused_lm: {sentence}; its weight gradient stays in the accumulator")

    def describe(self) -> str:
        return self.sentence if self.state == RELEASED else self._sentence(WAITING)

    def _sentence(self, state: str) -> str:
        value = ""
        if self.value and may_synchronize(self.value[0]):
            loss = self.value[0] if len(self.value) == 1 else (self.value[0] * self.value[1]).sum()
            value = f" of value {float(loss):.6g}"
        return (
            f"a three-GEMM loss{value} over {self.num_rows} rows added {self.weight_grad_scale:g} times its weight "
            f"gradient into {self.name} in its forward and {state}"
        )


def outstanding_weight_grads(weight_grad_into: Optional[Tensor] = None, *, forget_released: bool = False) -> List[str]:
    """The three-GEMM losses whose forward added a weight gradient into ``weight_grad_into`` (into
    any when ``None``) and whose backward has not run, one sentence each: those still waiting for
    it, and those released without it. Empty before an optimizer step means every such gradient in
    the accumulator came with its backward. A released loss stays listed until a call with
    ``forget_released=True`` (once the trainer has zeroed the accumulator, or skipped the step)."""
    key = None if weight_grad_into is None else _key(weight_grad_into)
    with _lock:
        chosen = [pending for pending in _pending if key is None or pending.key == key]
        if forget_released:
            released = {id(pending) for pending in chosen if pending.state == RELEASED}
            _pending[:] = [pending for pending in _pending if id(pending) not in released]
    return [pending.describe() for pending in chosen]


# Per device, how many backward passes corrected a weight gradient (on a GPU counted on the device,
# no host synchronization), and what the last one would say.
_corrections: Dict[torch.device, Tensor] = {}
_correction_notes: Dict[torch.device, str] = {}


def record_correction(ran: Tensor, note: str) -> None:
    """A backward whose weight-gradient correction ran where the 0-dim bool ``ran`` holds: counted
    on ``ran``'s device for ``weight_grad_corrections`` (in a CUDA graph's replays too), and warned
    at once (``note``, once per process) where that takes no synchronization
    (``inputs.checked_at_once``). Meta and fake tensors have nothing to count."""
    if is_abstract(ran):
        return
    at_once = checked_at_once(ran)
    if at_once and bool(ran):
        warn_once(note)
    with _lock:
        counter = _corrections.get(ran.device)
        if counter is None:
            if not may_synchronize(ran):  # a counter made in a capture would be zeroed at each replay
                raise RuntimeError(
                    "megatron_fused_lm: run a three-GEMM loss's backward once before capturing it in a CUDA "
                    "graph (the warm-up makes the device's correction counter)"
                )
            counter = _corrections[ran.device] = torch.zeros((), dtype=torch.int64, device=ran.device)
        if not at_once:  # warned when read, by weight_grad_corrections
            _correction_notes[ran.device] = note
    counter.add_(ran)


def weight_grad_corrections() -> int:
    """How many backward passes of three-GEMM losses corrected a weight gradient by a second pass
    since the last call, on every device (one synchronization per GPU: call it where the trainer
    synchronizes anyway, at the optimizer step; one warning, the first time): their upstream
    gradient was not the one declared (``fused_linear_cross_entropy``'s weights,
    ``weight_grad_scale``). Each gradient is exact either way; declaring what the loss receives
    saves the pass. On the CPU each kind warns at once instead, the first time."""
    total = 0
    with _lock:
        counters, notes = dict(_corrections), dict(_correction_notes)
    for device, counter in counters.items():
        count = int(counter)
        counter.zero_()
        if count and device in notes:
            warn_once(notes[device])
        total += count
    return total
