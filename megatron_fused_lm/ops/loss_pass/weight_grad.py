"""The weight gradient of a three-GEMM pass, from the forward that computes it to the backward that
hands it on: where it goes (``WeightGradSink``: float32 row parts of the pass's own, or the
caller's ``weight_grad_into``), how the parts are made, filled and rounded once into the weight's
dtype in their own memory, and the ledger of what a loss leaves in ``weight_grad_into`` until its
backward: the losses whose backward has not run (``outstanding_weight_grads``), and the backward
passes that corrected a gradient by a second pass (``weight_grad_corrections``).

A loss into ``weight_grad_into`` must be backpropagated: its backward gives the hidden gradient and
checks the ``weight_grad_scale`` the forward assumed. One released without it (a metric computed
with gradients on, a micro-batch skipped after a NaN check, an exception part way through its
forward) leaves its weight gradient in the accumulator, where nothing can tell it from the others:
its release is logged at once and listed for a trainer to check before its optimizer step.

Shared by the backends, so it imports none of them.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..._logging import logger, warn_once
from ..backends.contract import NeededGrads, ShardProblem
from ..inputs import checked_at_once, is_abstract, may_synchronize
from ..products import add_product

Tensor = torch.Tensor
ScaledCopy = Callable[[Tensor, Optional[Tensor], Tensor], Tensor]  # a backend's scaled_copy

NARROWING_SHARE = 8  # the first step narrows 1 / NARROWING_SHARE of a part's rows, through a temporary

# How far an upstream gradient may stray from ``c * declared_weights`` (relative to its largest
# entry) and still count as that: float32 rounding of a mask times a scale, not a different loss.
PROPORTIONAL_TOLERANCE = 1e-5


def deviates(difference: Tensor, upstream: Tensor) -> Tensor:
    """0-dim bool: whether ``difference`` (per row) exceeds ``PROPORTIONAL_TOLERANCE`` of the
    largest ``upstream``, on the device."""
    if upstream.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=upstream.device)
    return difference.abs().amax() > PROPORTIONAL_TOLERANCE * upstream.abs().amax()


def proportional_fit(upstream: Tensor, declared: Tensor) -> Tensor:
    """``c`` (0-dim float32) that best fits ``upstream ~ c * declared`` (``[n]`` float32, ``n >= 1``),
    on the device. Where ``c * declared`` explains nothing of the upstream (within
    ``PROPORTIONAL_TOLERANCE`` of its largest entry: declared weights all 0, an upstream orthogonal
    to them), 1, or 0 for an upstream of zeros: any scale is exact, the correction taking the
    rest, but the correction is divided by ``c``, so it must not vanish where one is needed."""
    norm, dot = (declared * declared).sum(), (upstream * declared).sum()
    scale = dot / norm.clamp(min=torch.finfo(torch.float32).tiny)
    largest = upstream.abs().amax()
    explains = scale.abs() * declared.abs().amax() > PROPORTIONAL_TOLERANCE * largest
    return torch.where(explains, scale, (largest > 0).float())


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
    def into(cls, weight_grad_into: Tensor, weight_grad_scale: float, num_rows: int) -> WeightGradSink:
        """The caller's ``weight_grad_into`` (checked by the public op), its record opened for
        ``num_rows`` rows."""
        pending = PendingWeightGrad(weight_grad_into, weight_grad_scale, num_rows)
        return cls(weight_grad_into, weight_grad_scale, pending)


def allocate_parts(hidden: Tensor, weight: Tensor, needed: NeededGrads) -> tuple[Tensor, List[Tensor]]:
    """``(held_hidden [n, H], held_weight parts)`` in float32 for the gradients ``needed`` asks for
    (a 1-D empty tensor and no parts for the others): one part for a float32 weight, two halves
    for a 16-bit one, so that the rounded result fits in the first half's memory. Zero rows give
    zeros: no chunk writes them."""
    empty = hidden.new_zeros if hidden.shape[0] == 0 else hidden.new_empty
    held_hidden = empty(hidden.shape, dtype=torch.float32) if needed.hidden else hidden.new_empty(0)
    held_weight = []
    if needed.weight:
        vocab = weight.shape[0]
        middle = vocab if weight.dtype == torch.float32 else -(-vocab // 2)
        held_weight = [
            empty(stop - start, weight.shape[1], dtype=torch.float32)
            for start, stop in ((0, middle), (middle, vocab))
            if stop > start
        ]
    return held_hidden, held_weight


def allocate_state(problem: ShardProblem, needed: NeededGrads, held_weight: Optional[List[Tensor]]):
    """``(held_hidden, held_weight, chosen)`` of a ``LossState`` for ``problem``, as
    ``allocate_parts`` makes them; the weight gradient added into ``held_weight`` where given (the
    caller's ``weight_grad_into`` as one part, or the held parts a correction adds to)."""
    hidden, weight = problem.hidden, problem.weight
    held_hidden, own = allocate_parts(hidden, weight, needed._replace(weight=needed.weight and not held_weight))
    parts = (held_weight or own) if needed.weight else []
    chosen = problem.target_column.new_empty(problem.target_column.shape, dtype=torch.float32)
    return held_hidden, parts, chosen if parts else hidden.new_empty(0)


def add_weight_product(held_weight: List[Tensor], logit_grads: Tensor, hidden: Tensor, accumulate: bool) -> None:
    """Add ``logit_grads.T @ hidden`` (``[rows, V]``, ``[rows, H]``, one dtype) to the parts (or
    write it, for the first chunk)."""
    start = 0
    for part in held_weight:
        add_product(part, logit_grads[:, start : start + part.shape[0]].t(), hidden, accumulate=accumulate)
        start += part.shape[0]


def narrowing_steps(num_rows: int) -> List[slice]:
    """The steps that narrow a float32 part of ``num_rows`` rows into its own memory: ``[0, a)``
    with ``a = ceil(num_rows / NARROWING_SHARE)``, then ``[a, 2a)``, ``[2a, 4a)`` ... until
    ``num_rows``.

    Narrowed row ``r`` lands in bytes ``[2rH, 2(r+1)H)``, over float32 rows ``[r/2, (r+1)/2)``. A
    step ``[a, b)`` with ``b <= 2a`` therefore writes only over rows below ``a``, read by earlier
    steps, and reads bytes ``[4aH, 4bH)``, above all it writes: it runs as one launch, without a
    temporary. Only the first step, which writes over what it reads, goes through a temporary (an
    eighth of the part in the weight's dtype: five launches in all)."""
    steps, start, stop = [], 0, min(-(-num_rows // NARROWING_SHARE), num_rows)
    while start < num_rows:
        steps.append(slice(start, stop))
        start, stop = stop, min(2 * stop, num_rows)
    return steps


def finish_weight(
    held_weight: List[Tensor],
    scale: Optional[Tensor],
    dtype: torch.dtype,
    narrow_in_place: bool,
    scaled_copy: ScaledCopy,
) -> Optional[Tensor]:
    """The held weight gradient (its float32 parts) times the upstream ``scale`` (0-dim float32;
    ``None``: 1), rounded once into ``dtype`` by the backend's ``scaled_copy``; ``None`` without
    parts. With ``narrow_in_place`` it is written into the parts' own memory, which it then
    occupies (eager autograd); otherwise into new memory (a custom operator may not return its
    inputs' memory)."""
    if not held_weight:
        return None
    (first, *rest), hidden_size = held_weight, held_weight[0].shape[1]
    shape = (sum(part.shape[0] for part in held_weight), hidden_size)
    if not rest:  # float32: the held part is the result
        return scaled_copy(first, scale, first if narrow_in_place else torch.empty_like(first))
    if narrow_in_place:
        out = torch.empty(0, dtype=dtype, device=first.device)
        out.set_(first.untyped_storage(), 0, shape, (hidden_size, 1))
    else:
        out = first.new_empty(shape, dtype=dtype)
    start = 0
    for index, part in enumerate(held_weight):
        overlapping = narrow_in_place and index == 0
        for rows in narrowing_steps(part.shape[0]) if overlapping else (slice(0, part.shape[0]),):
            target = out[start + rows.start : start + rows.stop]
            if overlapping and rows.start == 0:
                target.copy_(scaled_copy(part[rows], scale, target.new_empty(target.shape)))
            else:
                scaled_copy(part[rows], scale, target)
        start += part.shape[0]
    return out


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
