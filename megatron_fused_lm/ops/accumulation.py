"""Three-GEMM losses whose forward added a weight gradient into a caller's accumulator
(``weight_grad_into``: Megatron's ``main_grad``) and whose backward has not run.

Such a loss must be backpropagated: its backward gives the hidden gradient and checks the scale
the forward assumed. One released without it (a metric computed with gradients on, a micro-batch
skipped after a NaN check, an exception in the middle of its forward) leaves its weight gradient
in the accumulator, where nothing can tell it from the others: its release is logged at once, and
``outstanding_weight_grads`` lists it, with the losses still waiting for their backward, for a
trainer to check before its optimizer step.
"""

from __future__ import annotations

import threading
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from .._logging import logger

_Key = Tuple[torch.device, int, Tuple[int, ...]]


def _key(accumulator: torch.Tensor) -> _Key:
    # By memory, not by object: Megatron hands out the same main_grad view, a caller may make a new one.
    return accumulator.device, accumulator.data_ptr(), tuple(accumulator.shape)


_lock = threading.Lock()
_pending: List["PendingWeightGrad"] = []
_names: Dict[_Key, str] = {}


def name_weight_grad_into(weight_grad_into: torch.Tensor, name: str) -> None:
    """How the warnings and ``outstanding_weight_grads`` call the accumulator ``weight_grad_into``
    (the integration names each head's ``main_grad`` after its model); by default
    ``weight_grad_into [shape]``."""
    with _lock:
        _names[_key(weight_grad_into)] = name


class PendingWeightGrad:
    """One loss's weight gradient in an accumulator, from its forward until its backward: made
    before the forward's first product, ``watch``-ed by the loss's autograd node (whose release
    without a backward it reports), ``close``-d by that backward."""

    def __init__(self, accumulator: torch.Tensor, weight_grad_scale: float, rows: int):
        self.key = _key(accumulator)
        self.weight_grad_scale, self.rows = weight_grad_scale, rows
        self.loss: Optional[torch.Tensor] = None
        self.released, self.sentence = False, ""
        with _lock:
            self.name = _names.get(self.key, f"weight_grad_into {list(accumulator.shape)}")
            _pending.append(self)

    def watch(self, node: object, loss: torch.Tensor) -> None:
        """Report a release of ``node`` (the loss's autograd node) that comes before ``close``."""
        self.loss = loss.detach()
        finalizer = weakref.finalize(node, self.release, "was released without its backward")
        finalizer.atexit = False  # the end of the process is not a skipped backward

    def close(self) -> None:
        """The loss's backward ran: its gradient is accounted for."""
        with _lock:
            if self in _pending:
                _pending.remove(self)

    def release(self, how: str) -> None:
        """The loss will get no backward (``how`` says why): log it and keep it listed, as a
        sentence (the loss's value read once, here)."""
        sentence = self._sentence(how)
        with _lock:
            if self not in _pending or self.released:
                return
            self.released, self.sentence, self.loss = True, sentence, None
        logger.warning(f"megatron_fused_lm: {sentence}; its weight gradient stays in the accumulator")

    def describe(self) -> str:
        return self.sentence if self.released else self._sentence("waits for its backward")

    def _sentence(self, state: str) -> str:
        loss = self.loss
        value = "" if loss is None or _capturing(loss) else f" of value {float(loss):.6g}"
        return (
            f"a three-GEMM loss{value} over {self.rows} rows added {self.weight_grad_scale:g} times its weight "
            f"gradient into {self.name} in its forward and {state}"
        )


def _capturing(tensor: torch.Tensor) -> bool:
    # Reading a value would synchronize, which a CUDA graph capture forbids.
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def outstanding_weight_grads(weight_grad_into: Optional[torch.Tensor] = None) -> List[str]:
    """The three-GEMM losses whose forward added a weight gradient into ``weight_grad_into`` (into
    any accumulator when ``None``) and whose backward has not run, one sentence each: those still
    waiting for it, and those released without it, which are listed once. Empty before an
    optimizer step means every such gradient in the accumulator came with its backward."""
    key = None if weight_grad_into is None else _key(weight_grad_into)
    with _lock:
        chosen = [pending for pending in _pending if key is None or pending.key == key]
        released = {id(pending) for pending in chosen if pending.released}
        _pending[:] = [pending for pending in _pending if id(pending) not in released]
    return [pending.describe() for pending in chosen]
