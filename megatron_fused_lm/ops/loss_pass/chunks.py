"""The chunk loop of the three-GEMM pass and the per-chunk loss.

- ``run_loss_pass`` owns the loop: per token chunk, the phases' statistics (GEMM 1), the chunk's
  step (once per chunk, chunks in order, on every rank: it may communicate) and the phases'
  gradients (GEMMs 2 and 3); then each row's chosen-token term of the weight gradient, once. The
  phases are the backend's own eagerly (``EagerPhases``) and custom operators in a compiled graph
  (``compiled.OperatorPhases``), chosen once per pass by ``phases_for``.
- ``ChunkLoss`` is the loss half of a step: ``loss_fn`` on the chunk's log-probs and entropy, its
  value summed and its per-row gradients taken (a ready-made loss's closed form, else autograd).
- The contract of a per-token ``loss_fn``, checked once per call or once per definition: one loss
  per row, computed from that row alone; whether it has an entropy term.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from ..backends.contract import ChunkGrads, LossState, ShardProblem, UpstreamGrads, token_chunks
from ..backends.registry import by_name
from ..boundary import summarize_rows
from ..inputs import check_on_device, has_values, per_sequence_broadcast
from ..options import HeadOptions
from ..softmax import SoftmaxSummary
from .compiled import OperatorPhases
from .weight_grad import WeightGradSink

Tensor = torch.Tensor
LossFn = Callable[..., Tensor]


def check_loss_inputs(
    loss_fn: LossFn, loss_inputs: Optional[Dict[str, Tensor]], lead_shape: torch.Size, device: torch.device
) -> Dict[str, Tensor]:
    """The per-token inputs flattened to ``[rows, ...]``, after checking ``loss_fn`` is callable and
    each input is a tensor of ``lead_shape`` (then any trailing dimensions) on ``device`` that needs
    no gradient."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if loss_inputs is None:
        return {}
    if not isinstance(loss_inputs, dict):
        raise TypeError(f"loss_inputs must be a dict of tensors, got {type(loss_inputs).__name__}")
    return {
        name: check_per_token(f"loss_inputs[{name!r}]", value, lead_shape, device, trailing=True)
        for name, value in loss_inputs.items()
    }


def check_per_token(
    name: str, value: Tensor, lead_shape: torch.Size, device: torch.device, trailing: bool = False
) -> Tensor:
    """``value`` flattened to ``[rows]`` (``trailing``: ``[*lead_shape, ...]`` to ``[rows, ...]``, a
    teacher's ``k`` log-probs per row, say), after checking it is a tensor of that shape on
    ``device`` that needs no gradient (errors name it ``name``). One value per sequence (``[b]`` or
    ``[b, 1]`` for rows ``[b, s]``, a GRPO advantage) is broadcast over the positions; a float
    tensor of another precision (a float64 rollout buffer's) is taken as float32, the precision the
    losses are computed in."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    value = per_sequence_broadcast(value, lead_shape)
    if (value.shape[: len(lead_shape)] if trailing else value.shape) != lead_shape:
        expected = f"{tuple(lead_shape)}{' (then any trailing dimensions)' if trailing else ''}"
        raise ValueError(
            f"{name} has shape {tuple(value.shape)}; expected {expected}, or one value per sequence ([b] or [b, 1] "
            "for rows [b, s])"
        )
    if value.device != device:
        raise ValueError(f"{name} is on {value.device}; expected {device}")
    if value.requires_grad:
        raise ValueError(f"{name} requires grad, but no gradient flows into loss inputs; detach it")
    if value.dtype.is_floating_point and value.dtype != torch.float32:
        value = value.float()
    return value.reshape(lead_shape.numel(), *value.shape[len(lead_shape) :])


def check_declared_inputs(
    loss_fn: LossFn, targets: Tensor, inputs: Dict[str, Tensor], mask: Optional[Tensor], lead_shape: torch.Size
) -> None:
    """The checks ``loss_fn`` declares (``loss_fn.check_inputs(targets [rows, ...], inputs (as
    ``check_loss_inputs`` gives them), mask [rows] or None)``, e.g. ``TopkDistillation``'s): once per
    call, on the rows as the caller gave them, so that rows the mask leaves out (and ``max_rows``'
    padding, which reads some row's inputs) can be told apart. They check on the device."""
    check = getattr(loss_fn, "check_inputs", None)
    if check is not None:
        rows = lead_shape.numel()
        check(
            targets.reshape(rows, *targets.shape[len(lead_shape) :]), inputs, None if mask is None else mask.reshape(-1)
        )


def per_token_losses(loss_fn: LossFn, logprob: Tensor, entropy: Tensor, inputs: Dict[str, Tensor]) -> Tensor:
    """``loss_fn(logprob [rows] (or [rows, k]), entropy [rows], **inputs)`` as float32 ``[rows]``, or
    a clear error when it is not one loss per row."""
    return _one_loss_per_row(loss_fn(logprob, entropy, **inputs), logprob, entropy)


def _one_loss_per_row(losses, logprob: Tensor, entropy: Tensor) -> Tensor:
    if not isinstance(losses, Tensor) or not losses.dtype.is_floating_point:
        raise TypeError(f"loss_fn must return a float tensor of per-token losses, got {losses!r:.80}")
    if losses.shape != entropy.shape:
        if logprob.dim() == 2 and losses.shape == logprob.shape:
            why = (
                "one value per target: with several targets per row it must combine them into one loss (e.g. .sum(-1))"
            )
        else:
            why = "it is called on chunks of rows and its results are summed, so it must not reduce across rows"
        raise ValueError(
            f"loss_fn must return one loss per row, shape [rows]; given log-probs {tuple(logprob.shape)} it returned "
            f"{tuple(losses.shape)}: {why}"
        )
    return losses.float()


# How far a row's loss may move between a chunk and its halves, relative to the chunk's largest
# loss: 64 float32 roundings, what elementwise code run at other lengths (vectorized bodies, scalar
# tails, another order of a fused expression) moves it, far below any dependence on other rows.
ROW_TOLERANCE = 64 * torch.finfo(torch.float32).eps
_rows_checked: set = set()


def _definition(loss_fn: LossFn) -> object:
    """What decides how ``loss_fn`` treats its rows, so that a loss made anew each step is checked
    once: a function's code (a lambda, a bound method's function with its object's definition, a
    ``functools.partial``'s function), or a callable object's class with its settings (its
    attributes, where they can be hashed; otherwise the object itself)."""
    if hasattr(loss_fn, "__code__"):
        return loss_fn.__code__
    if hasattr(loss_fn, "__func__"):
        return loss_fn.__func__.__code__, _definition(loss_fn.__self__)
    if hasattr(loss_fn, "func") and hasattr(loss_fn, "keywords"):
        return _definition(loss_fn.func)
    try:
        settings = tuple(sorted(vars(loss_fn).items()))
        hash(settings)
    except TypeError:
        return id(loss_fn)
    return type(loss_fn), settings


def check_rows_independent(loss_fn: LossFn, logprob: Tensor, entropy: Tensor, inputs: Dict[str, Tensor]) -> None:
    """An error unless ``loss_fn`` gives each row of a chunk the loss it gives that row among the
    chunk's halves: a function that reduces or normalizes across its rows gives a loss that changes
    with the chunking. Checked the first time a definition is used with two rows or more where
    values exist (``has_values``): three more calls of ``loss_fn`` under ``no_grad`` and
    ``inputs.check_on_device`` (``ValueError`` on the CPU, a device-side assertion on a GPU: no
    host synchronization)."""
    if logprob.shape[0] < 2 or not has_values(logprob):
        return
    definition = _definition(loss_fn)
    if definition in _rows_checked:
        return
    half = logprob.shape[0] // 2
    with torch.no_grad():
        whole = per_token_losses(loss_fn, logprob, entropy, inputs)
        halves = [
            per_token_losses(
                loss_fn, logprob[rows], entropy[rows], {name: value[rows] for name, value in inputs.items()}
            )
            for rows in (slice(0, half), slice(half, None))
        ]
        parts = torch.cat(halves)
        largest = whole.abs().nan_to_num(0.0, 0.0, 0.0).max()
        close = (parts - whole).abs() <= ROW_TOLERANCE * (whole.abs() + largest)
        check_on_device(
            (close | (parts == whole) | (parts.isnan() & whole.isnan())).all(),
            "loss_fn gives a row another loss when the other rows of its chunk change (the two halves of a chunk "
            "gave other losses than the whole): it is called on chunks of rows and its results are summed, so it "
            "must compute each row's loss from that row alone. Express a mean or a per-sequence normalization as "
            "per-token weights among loss_inputs (losses.token_mean_weights)",
        )
    _rows_checked.add(definition)


def has_entropy_term(loss_fn: LossFn, inputs: Dict[str, Tensor], logprob_shape: Tuple[int, ...] = ()) -> bool:
    """Whether ``loss_fn``'s value depends on the entropy: its ``entropy_grad`` attribute where it
    declares one (the ready-made losses do), else ``probe_entropy_term`` on one row shaped as the
    per-row ``inputs`` (``[rows, ...]``) and log-probs (``logprob_shape``: ``(k,)`` for several
    targets per row) are."""
    declared = getattr(loss_fn, "entropy_grad", None)
    if declared is not None:
        return bool(declared)
    shapes = tuple((name, _probe_sizes(value.shape[1:])) for name, value in inputs.items())
    return probe_entropy_term(loss_fn, shapes, _probe_sizes(logprob_shape))


def _probe_sizes(sizes) -> Tuple[int, ...]:
    """``sizes`` for the probe's one row; in a compiled graph each 1, which broadcasts: a size there
    may be symbolic (a ``k`` that varied between calls), which cannot cross
    ``assume_constant_result``, and the probe asks only whether the entropy is used."""
    return tuple(1 if torch.compiler.is_compiling() else int(size) for size in sizes)


@torch.compiler.assume_constant_result
def probe_entropy_term(
    loss_fn: LossFn, input_shapes: Tuple[Tuple[str, Tuple[int, ...]], ...], logprob_shape: Tuple[int, ...]
) -> bool:
    """Whether ``loss_fn`` depends on the entropy, by a probe on one row of zeros on the CPU (each
    input ``[1, *shape]``, the log-probs ``[1, *logprob_shape]``); ``torch.compile`` evaluates it
    once, at trace time. A function the probe cannot run raises ``TypeError`` naming the attribute
    that replaces the probe: its failure says nothing about the entropy, and guessing would pick a
    path silently."""
    logprob = torch.zeros(1, *logprob_shape, requires_grad=True)
    entropy = torch.zeros(1, requires_grad=True)
    # The probe is no part of the caller's graph: identity hooks keep activation checkpointing's
    # saved-tensor hooks (and their early stop of a recomputation) out of it.
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor):
        try:
            losses = loss_fn(logprob, entropy, **{name: torch.zeros(1, *shape) for name, shape in input_shapes})
        except Exception as error:
            raise TypeError(
                f"loss_fn failed on the probe that asks whether its loss uses the entropy (one row of zeros on the "
                f"CPU, inputs {[name for name, _ in input_shapes]}): {type(error).__name__}: {error}. Give it an "
                "attribute entropy_grad (True if its loss depends on the entropy, else False) to skip the probe"
            ) from error
        total = _one_loss_per_row(losses, logprob, entropy).sum()
        return total.requires_grad and torch.autograd.grad(total, entropy, allow_unused=True)[0] is not None


class ChunkLoss:
    """``loss_fn`` on each chunk of a pass (the loss half of a ``ChunkStep``): its losses kept for
    ``total`` and, with ``gradients``, its per-row gradients (the entropy's only when
    ``entropy_grad``) times ``sink``'s ``weight_grad_scale`` (the upstream gradient the held gradients
    assume; 1 without a sink), every chunk's saved where the sink is a caller's ``weight_grad_into``
    (``saved_grads``: a correction's basis); a ``max_rows`` padding row (``valid`` false) adds neither."""

    def __init__(
        self,
        loss_fn: LossFn,
        inputs: Dict[str, Tensor],
        entropy_grad: bool,
        gradients: bool,
        sink: Optional[WeightGradSink] = None,
        valid: Optional[Tensor] = None,
    ):
        self.loss_fn, self.inputs, self.entropy_grad, self.gradients = loss_fn, inputs, entropy_grad, gradients
        self.weight_grad_scale = sink.weight_grad_scale if sink is not None else 1.0
        self.valid, self.save_grads = valid, sink is not None and sink.weight_grad_into is not None
        self.chunk_losses: list = []  # each chunk's per-token losses (by autograd: their sum), 1-D
        self.chunk_grads: list = []  # with save_grads, each chunk's UpstreamGrads

    def __call__(self, rows: slice, logprob: Tensor, entropy: Tensor) -> UpstreamGrads:
        inputs = {name: value[rows] for name, value in self.inputs.items()}
        check_rows_independent(self.loss_fn, logprob, entropy, inputs)
        valid = None if self.valid is None else self.valid[rows]

        def kept(losses: Tensor) -> Tensor:
            return losses if valid is None else torch.where(valid, losses, 0.0)

        def total(logprob: Tensor, entropy: Tensor) -> Tensor:
            return kept(per_token_losses(self.loss_fn, logprob, entropy, inputs)).sum()

        grads = UpstreamGrads(None, None)
        with_grads = getattr(self.loss_fn, "with_grads", None)  # a ready-made loss's closed form
        if not self.gradients:
            losses = kept(per_token_losses(self.loss_fn, logprob, entropy, inputs))
        elif with_grads is not None:
            losses, *row_grads = with_grads(logprob, entropy, **inputs)
            losses, grads = kept(losses), UpstreamGrads(*row_grads)
        else:
            grad_logprob, grad_entropy, losses = per_token_grads(total, logprob, entropy)
            grads = UpstreamGrads(grad_logprob, grad_entropy)
        self.chunk_losses.append(losses.reshape(-1))
        grads = grads._replace(entropy=grads.entropy if self.entropy_grad else None)
        grads = UpstreamGrads(*(None if grad is None else self._scaled(grad, valid) for grad in grads))
        if self.save_grads:
            self.chunk_grads.append(grads)
        return grads

    @property
    def total(self) -> Optional[Tensor]:
        """The loss, ``[]`` float32: the chunks' per-token losses summed at once, in one order however
        the rows are chunked (no add per chunk); a loss that autograd differentiates keeps each
        chunk's sum instead, which the total adds. ``None`` before the first chunk."""
        if not self.chunk_losses:
            return None
        return (self.chunk_losses[0] if len(self.chunk_losses) == 1 else torch.cat(self.chunk_losses)).sum()

    @property
    def saved_grads(self) -> UpstreamGrads:
        """Every row's gradients (``save_grads``), chunk after chunk."""
        return UpstreamGrads(*(_joined(grads) for grads in zip(*self.chunk_grads, strict=True)))

    def _scaled(self, grad: Tensor, valid: Optional[Tensor]) -> Tensor:
        if valid is not None:
            grad = torch.where(valid.view(-1, *[1] * (grad.dim() - 1)), grad, 0.0)
        return grad if self.weight_grad_scale == 1.0 else grad * self.weight_grad_scale


def _joined(chunks: tuple) -> Optional[Tensor]:
    if chunks[0] is None:
        return None
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def per_token_grads(total: Callable[[Tensor, Tensor], Tensor], logprob: Tensor, entropy: Tensor):
    """``(d total / d logprob, d total / d entropy, total)`` (``None`` for an input ``total`` does not
    use): by autograd eagerly, which saved-tensor hooks (activation checkpointing) allow, and by
    ``torch.func`` in a compiled graph, which ``torch.compile`` traces."""
    if torch.compiler.is_compiling():
        (grad_logprob, grad_entropy), value = torch.func.grad_and_value(total, argnums=(0, 1))(logprob, entropy)
        return grad_logprob, grad_entropy, value
    logprob, entropy = logprob.detach().requires_grad_(), entropy.detach().requires_grad_()
    with torch.enable_grad():
        value = total(logprob, entropy)
    if not value.requires_grad:
        return None, None, value
    return (*torch.autograd.grad(value, (logprob, entropy), allow_unused=True), value.detach())


# ``chunk_step(rows, local_statistics [k, 4]) -> (summary, upstream, weight_row_scale)``: merges a
# chunk's shard statistics across the group (it may communicate), summarizes them and evaluates
# the loss's per-row gradients: those of the hidden gradient, and ``weight_row_scale [k]`` (or
# ``None``: 1) times them for the weight gradient.
ChunkStep = Callable[[slice, Tensor], "tuple[SoftmaxSummary, UpstreamGrads, Optional[Tensor]]"]


def run_loss_pass(
    phases, problem: ShardProblem, chunk_step: ChunkStep, state: LossState, options: HeadOptions, accumulate: bool
) -> None:
    """The three-GEMM pass over ``state`` (``phases.allocate``'s): per token chunk, the phases'
    statistics (GEMM 1), ``chunk_step`` (once per chunk, chunks in order, on every rank) and, when
    a gradient is needed, the phases' gradients (GEMMs 2 and 3; the weight gradient written by the
    first chunk, or added to what ``state.held_weight`` holds where ``accumulate``: a
    ``weight_grad_into``, a correction's parts); then each row's chosen-token term of the weight
    gradient, once."""
    for rows in token_chunks(problem.hidden.shape[0], state.token_chunk):
        summary, upstream, weight_row_scale = chunk_step(rows, phases.chunk_statistics(problem, state, rows, options))
        if state.held_hidden.dim() == 2 or state.held_weight:
            chunk = ChunkGrads(
                rows,
                summary=summary,
                upstream=upstream,
                weight_row_scale=weight_row_scale,
                accumulate=accumulate or rows.start > 0,
            )
            phases.chunk_gradients(problem, state, chunk=chunk, options=options)
    if state.held_weight:
        phases.add_chosen_rows(state.held_weight, problem.target_column, state.chosen, problem.hidden)


class EagerPhases:
    """A backend's own three-GEMM phases, run eagerly, with the chunk's summary step beside them."""

    def __init__(self, backend):
        self.backend = backend
        self.allocate, self.chunk_statistics = backend.allocate, backend.chunk_statistics
        self.chunk_gradients, self.add_chosen_rows = backend.chunk_gradients, backend.add_chosen_rows

    def summarize_chunk(self, problem: ShardProblem, rows: slice, local: Tensor, out: SoftmaxSummary, options):
        summarize_rows(self.backend, local, problem=problem.rows(rows), options=options, out=out)


def phases_for(options: HeadOptions):
    """The route of a pass, chosen here once: the backend's phases eagerly, its custom operators in
    a compiled graph (which must not trace into a backend)."""
    if torch.compiler.is_compiling():
        return OperatorPhases(options)
    return EagerPhases(by_name(options.backend))
