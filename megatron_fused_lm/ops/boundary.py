"""The autograd boundary: the ops as PyTorch custom operators and autograd functions, each taking
the rows' tensors and one ``HeadOptions``.

- Recompute path (custom operators, so ``torch.compile`` keeps each whole and autocast stays
  outside): ``fused_forward(hidden [n, H], weight [vocab_shard, H], target_column [n], **options)
  -> (logprob, entropy, lse, mean_logit)``, each ``[n]`` float32, and the ``fused_backward`` it
  registers; ``logits_forward`` / ``logits_backward`` on a materialized logits shard. The options
  travel as the operators' keyword-only arguments (``HeadOptions.op_arguments``), and the autograd
  context rebuilds the object from them by name. Only O(n) statistics are saved; the backward
  recomputes.
- Loss-in-forward path (``loss_fn`` is Python, so no single operator can hold it): ``loss_pass``
  runs ``contract.run_loss_pass`` with each phase a custom operator (``loss_statistics``,
  ``loss_gradients``, the ``merge_statistics`` collective) and the loss's per-token gradients by
  ``torch.func``, all of which ``torch.compile`` traces; ``HeldGradientsFunction`` and
  ``DeclaredCrossEntropyFunction`` attach the held gradients to the graph and scale them in the
  backward (eagerly narrowed in place; compiled, by ``finish_held_gradients`` /
  ``declared_gradients``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import typing
from typing import Dict, List, Optional, Union

import torch

from .._logging import warn_once
from . import held_gradients
from .accumulation import PendingWeightGrad
from .backends import loss_backend, recompute_backend
from .chunking import BlockLogits, chunk_logit_grads, chunk_statistics
from .contract import Gradients, LossState, NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads, run_loss_pass
from .distributed import all_reduce_sum, merge_across_group
from .loss_in_forward import PROPORTIONAL_TOLERANCE, ChunkLoss, LossFn, proportional_scale
from .options import HeadOptions
from .softmax import NUM_STATISTICS, SoftmaxSummary, summarize

Tensor = torch.Tensor
Statistics = tuple[Tensor, Tensor, Tensor, Tensor]  # logprob, entropy, lse, mean_logit: [n] float32


def autocast_off(device: torch.device):
    # The statistics are float32 by contract: autocast must not turn products or reductions
    # inside the ops into 16-bit ones.
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _summary(stats: Tensor, target_column: Tensor, options: HeadOptions) -> Statistics:
    summary = summarize(merge_across_group(stats, options.tp_group), target_column)
    return summary.logprob, summary.entropy, summary.lse, summary.mean_logit


def _statistics_like(rows: Tensor) -> Statistics:
    return tuple(rows.new_empty(rows.shape[0], dtype=torch.float32) for _ in range(4))


def _empty_unless(needed: bool, like: Tensor) -> Tensor:
    # A custom operator returns tensors, never None: an unneeded gradient is an empty tensor.
    return torch.empty_like(like) if needed else like.new_empty(0)


def _save_for_backward(ctx, inputs: tuple[Tensor, ...], output: Statistics, options: HeadOptions) -> None:
    _, entropy, lse, mean_logit = output
    ctx.save_for_backward(*inputs, lse, mean_logit)
    ctx.options = options
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse, mean_logit)
    if not options.entropy_grad:
        ctx.mark_non_differentiable(entropy)


def _open_backward(ctx, grad_logprob: Optional[Tensor], grad_entropy: Optional[Tensor]):
    """``(saved inputs, saved statistics, float32 upstream gradients)``, or ``None`` when no
    gradient flows back (an entropy without gradient contributes none)."""
    upstream = UpstreamGrads.from_autograd(grad_logprob, grad_entropy if ctx.options.entropy_grad else None)
    if upstream is None:
        return None
    *inputs, lse, mean_logit = ctx.saved_tensors
    return tuple(inputs), SavedStatistics(lse, mean_logit), upstream


def with_head_options(function):
    """Give ``function(..., **options)`` the fields of ``HeadOptions`` as typed keyword-only
    parameters: a custom operator's schema is read from its signature, and the fields are written
    once, in ``HeadOptions``."""
    signature = inspect.signature(function)
    kept = [parameter for parameter in signature.parameters.values() if parameter.kind is not parameter.VAR_KEYWORD]
    types = typing.get_type_hints(HeadOptions)
    fields = [
        inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, annotation=types[field.name])
        for field in dataclasses.fields(HeadOptions)
    ]
    function.__signature__ = signature.replace(parameters=[*kept, *fields])
    return function


# The recompute path.


@torch.library.custom_op("megatron_fused_lm::fused_forward", mutates_args=())
@with_head_options
def fused_forward(
    hidden: Tensor,
    weight: Tensor,
    target_column: Tensor,
    **options,
) -> Statistics:
    """Log-prob, entropy and the saved statistics of each row, over the whole vocabulary."""
    options = HeadOptions(**options)
    problem = ShardProblem(hidden, weight, target_column, options.temperature)
    with autocast_off(hidden.device):
        stats = recompute_backend(options.backend, hidden.device, options.token_chunk).local_statistics(problem)
        return _summary(stats, target_column, options)


@fused_forward.register_fake
def _(hidden, weight, target_column, **options) -> Statistics:
    return _statistics_like(hidden)


@torch.library.custom_op("megatron_fused_lm::fused_backward", mutates_args=())
@with_head_options
def fused_backward(
    hidden: Tensor,
    weight: Tensor,
    target_column: Tensor,
    lse: Tensor,
    mean_logit: Tensor,
    grad_logprob: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    *,
    need_hidden: bool,
    need_weight: bool,
    **options,
) -> tuple[Tensor, Tensor]:
    """``(grad_hidden, grad_weight)``; an unneeded one is empty. The hidden gradient is summed
    over the group when ``reduce_hidden_grad``, else this rank's partial."""
    options = HeadOptions(**options)
    problem = ShardProblem(hidden, weight, target_column, options.temperature)
    with autocast_off(hidden.device):
        grads = recompute_backend(options.backend, hidden.device, options.token_chunk).local_gradients(
            problem,
            SavedStatistics(lse, mean_logit),
            UpstreamGrads(grad_logprob, grad_entropy),
            NeededGrads(need_hidden, need_weight),
        )
        if grads.hidden is not None and options.reduce_hidden_grad:
            all_reduce_sum(grads.hidden, options.tp_group)
    return (
        hidden.new_empty(0) if grads.hidden is None else grads.hidden,
        weight.new_empty(0) if grads.weight is None else grads.weight,
    )


@fused_backward.register_fake
def _(hidden, weight, *statistics_and_upstream, need_hidden, need_weight, **options) -> tuple[Tensor, Tensor]:
    return _empty_unless(need_hidden, hidden), _empty_unless(need_weight, weight)


def _fused_setup_context(ctx, inputs, keyword_only_inputs, output) -> None:
    _save_for_backward(ctx, inputs, output, HeadOptions(**keyword_only_inputs))


def _fused_gradients(ctx, grad_logprob, grad_entropy, _grad_lse, _grad_mean_logit):
    opened = _open_backward(ctx, grad_logprob, grad_entropy)
    if opened is None:
        return None, None, None
    (hidden, weight, target_column), saved, upstream = opened
    need_hidden, need_weight = ctx.needs_input_grad[:2]
    grad_hidden, grad_weight = fused_backward(
        hidden, weight, target_column, *saved, *upstream, need_hidden=need_hidden, need_weight=need_weight,
        **ctx.options.op_arguments(),
    )  # fmt: skip
    return (grad_hidden if need_hidden else None), (grad_weight if need_weight else None), None


fused_forward.register_autograd(_fused_gradients, setup_context=_fused_setup_context)


# The unfused path, on a materialized logits shard (the options' backend and hidden-gradient
# reduction do not apply).


def _scaled(logits: Tensor, temperature: float) -> BlockLogits:
    # Out of place: logits.float() is logits itself when it is float32 already.
    return lambda rows: logits[rows].float() / temperature


def _chunk_rows(logits: Tensor, token_chunk: Optional[int]) -> int:
    return token_chunk or max(logits.shape[0], 1)


@torch.library.custom_op("megatron_fused_lm::logits_forward", mutates_args=())
@with_head_options
def logits_forward(
    logits: Tensor,
    target_column: Tensor,
    **options,
) -> Statistics:
    """Log-prob, entropy and the saved statistics of each row of a logits shard."""
    options = HeadOptions(**options)
    with autocast_off(logits.device):
        rows = _chunk_rows(logits, options.token_chunk)
        stats = chunk_statistics(_scaled(logits, options.temperature), target_column, rows)
        return _summary(stats, target_column, options)


@logits_forward.register_fake
def _(logits, target_column, **options) -> Statistics:
    return _statistics_like(logits)


@torch.library.custom_op("megatron_fused_lm::logits_backward", mutates_args=())
@with_head_options
def logits_backward(
    logits: Tensor,
    target_column: Tensor,
    lse: Tensor,
    mean_logit: Tensor,
    grad_logprob: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    **options,
) -> Tensor:
    """The gradient with respect to the logits shard, in its dtype (the float32 softmax is
    recomputed one chunk at a time; the saved logits are never modified)."""
    options = HeadOptions(**options)
    grad_logits = torch.empty_like(logits)
    with autocast_off(logits.device):
        logit_grads = chunk_logit_grads(
            _scaled(logits, options.temperature), target_column, SavedStatistics(lse, mean_logit),
            UpstreamGrads(grad_logprob, grad_entropy), options.temperature, _chunk_rows(logits, options.token_chunk),
        )  # fmt: skip
        for rows, grad in logit_grads:
            grad_logits[rows] = grad
    return grad_logits


@logits_backward.register_fake
def _(logits, *statistics_and_upstream, **options) -> Tensor:
    return torch.empty_like(logits)


def _logits_setup_context(ctx, inputs, keyword_only_inputs, output) -> None:
    _save_for_backward(ctx, inputs, output, HeadOptions(**keyword_only_inputs))


def _logits_gradients(ctx, grad_logprob, grad_entropy, _grad_lse, _grad_mean_logit):
    opened = _open_backward(ctx, grad_logprob, grad_entropy)
    if opened is None:
        return None, None
    (logits, target_column), saved, upstream = opened
    return logits_backward(logits, target_column, *saved, *upstream, **ctx.options.op_arguments()), None


logits_forward.register_autograd(_logits_gradients, setup_context=_logits_setup_context)


# The loss-in-forward path: its phases as custom operators (what torch.compile sees of them), the
# chunk loop and the loss's per-token gradients as traced Python, and the held gradients attached
# to the graph by an autograd function whose backward scales them.


@torch.library.custom_op("megatron_fused_lm::merge_statistics", mutates_args=())
@with_head_options
def merge_statistics(stats: Tensor, **options) -> Tensor:
    """Every rank's shard statistics ``[k, 4]`` merged over the group (one all-gather)."""
    return merge_across_group(stats, HeadOptions(**options).tp_group).clone()


@merge_statistics.register_fake
def _(stats, **options) -> Tensor:
    return torch.empty_like(stats)


def _loss_backend(device: torch.device, options: HeadOptions):
    return loss_backend(
        options.backend, device, options.token_chunk, options.entropy_grad, options.weight_grad_accumulates
    )


@torch.library.custom_op("megatron_fused_lm::loss_statistics", mutates_args=("block", "reference"))
@with_head_options
def loss_statistics(
    hidden: Tensor, weight: Tensor, target_column: Tensor, block: Tensor, reference: Tensor, *, start: int, stop: int,
    **options,
) -> Tensor:  # fmt: skip
    """The backend's ``chunk_statistics`` for the rows ``[start, stop)``: ``[k, 4]``."""
    options = HeadOptions(**options)
    problem = ShardProblem(hidden, weight, target_column, options.temperature)
    state = LossState(block, reference, hidden.new_empty(0), [])
    with autocast_off(hidden.device):
        return _loss_backend(hidden.device, options).chunk_statistics(problem, state, slice(start, stop))


@loss_statistics.register_fake
def _(hidden, weight, target_column, block, reference, *, start, stop, **options) -> Tensor:
    return hidden.new_empty(stop - start, NUM_STATISTICS, dtype=torch.float32)


@torch.library.custom_op("megatron_fused_lm::loss_gradients", mutates_args=("block", "held_hidden", "held_weight"))
@with_head_options
def loss_gradients(
    hidden: Tensor,
    weight: Tensor,
    target_column: Tensor,
    block: Tensor,
    reference: Tensor,
    held_hidden: Tensor,
    held_weight: List[Tensor],
    summary: List[Tensor],
    grad_logprob: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    *,
    start: int,
    stop: int,
    **options,
) -> None:
    """The backend's ``chunk_gradients`` for the rows ``[start, stop)``; ``summary`` holds the
    ``SoftmaxSummary`` fields in order."""
    options = HeadOptions(**options)
    problem = ShardProblem(hidden, weight, target_column, options.temperature)
    state = LossState(block, reference, held_hidden, held_weight)
    with autocast_off(hidden.device):
        _loss_backend(hidden.device, options).chunk_gradients(
            problem, state, slice(start, stop), SoftmaxSummary(*summary), UpstreamGrads(grad_logprob, grad_entropy)
        )


@loss_gradients.register_fake
def _(*args, **options) -> None:
    return None


def _allocate(hidden, weight, target_column, need_hidden, need_weight, options) -> List[Tensor]:
    problem = ShardProblem(hidden, weight, target_column, options.temperature)
    state = _loss_backend(hidden.device, options).allocate(problem, NeededGrads(need_hidden, need_weight))
    return [state.block, state.reference, state.held_hidden, *state.held_weight]


@torch.library.custom_op("megatron_fused_lm::loss_allocate", mutates_args=())
@with_head_options
def loss_allocate(
    hidden: Tensor, weight: Tensor, target_column: Tensor, need_hidden: bool, need_weight: bool, **options
) -> List[Tensor]:
    """The backend's ``allocate``: ``[block, reference, held_hidden, *held_weight]``."""
    return _allocate(hidden, weight, target_column, need_hidden, need_weight, HeadOptions(**options))


@loss_allocate.register_fake
def _(hidden, weight, target_column, need_hidden, need_weight, **options) -> List[Tensor]:
    # The same allocation on fake tensors gives the same shapes, dtypes and strides.
    return _allocate(hidden, weight, target_column, need_hidden, need_weight, HeadOptions(**options))


class OperatorLossBackend:
    """The ``contract.LossBackend`` of the public loss ops: the backend ``options`` name, its steps
    run through the custom operators above (so ``torch.compile`` never traces into a backend).
    With ``options.weight_grad_accumulates`` the weight gradient goes into ``weight_grad_into``
    (float32, the weight's shape) instead of held parts of its own."""

    def __init__(self, options: HeadOptions, weight_grad_into: Optional[Tensor] = None):
        self.options, self.weight_grad_into = options, weight_grad_into

    def allocate(self, problem: ShardProblem, needed: NeededGrads) -> LossState:
        accumulating = self.options.weight_grad_accumulates
        block, reference, held_hidden, *held_weight = loss_allocate(
            problem.hidden, problem.weight, problem.target_column, needed.hidden, needed.weight and not accumulating,
            **self.options.op_arguments(),
        )  # fmt: skip
        if accumulating and needed.weight:
            held_weight = [self.weight_grad_into]
        return LossState(block, reference, held_hidden, held_weight)

    def chunk_statistics(self, problem: ShardProblem, state: LossState, rows: slice) -> Tensor:
        return loss_statistics(
            problem.hidden, problem.weight, problem.target_column, state.block, state.reference, start=rows.start,
            stop=rows.stop, **self.options.op_arguments(),
        )  # fmt: skip

    def chunk_gradients(
        self, problem: ShardProblem, state: LossState, rows: slice, summary: SoftmaxSummary, upstream: UpstreamGrads
    ) -> None:
        loss_gradients(
            problem.hidden, problem.weight, problem.target_column, state.block, state.reference, state.held_hidden,
            state.held_weight, list(summary), *upstream, start=rows.start, stop=rows.stop,
            **self.options.op_arguments(),
        )  # fmt: skip


def loss_pass(
    hidden: Tensor, weight: Tensor, target_column: Tensor, loss_fn: LossFn, inputs: Dict[str, Tensor], options: HeadOptions,
    needed: NeededGrads, weight_grad_into: Optional[Tensor] = None, grad_scale: Union[float, Tensor, None] = None,
) -> tuple[ChunkLoss, LossState]:  # fmt: skip
    """The three-GEMM pass over detached rows: the chunk step (the loss, log-probs, entropy and
    saved statistics) and the state with the held gradients, which are those of ``grad_scale``
    times the loss (the weight's added into ``weight_grad_into`` with
    ``options.weight_grad_accumulates``)."""
    problem = ShardProblem(hidden.detach(), weight.detach(), target_column, options.temperature)
    merge = functools.partial(merge_statistics, **options.op_arguments())
    upstream = needed.hidden or needed.weight
    chunk_loss = ChunkLoss(loss_fn, inputs, target_column, merge, options.entropy_grad, upstream, grad_scale)
    state = run_loss_pass(OperatorLossBackend(options, weight_grad_into), problem, chunk_loss, needed)
    return chunk_loss, state


def _finish(held_hidden, held_weight, scale, dtypes, options: HeadOptions, narrow_in_place: bool) -> Gradients:
    """The held gradients times the upstream ``scale`` (``None``: 1), each rounded once into its
    parameter's dtype (``dtypes``), the hidden gradient then summed over the group when asked (in
    that dtype, as the recompute path and Megatron's column-parallel layer do)."""
    scale = None if scale is None else scale.float()
    grads = held_gradients.scaled_gradients(held_hidden, held_weight, scale, *dtypes, narrow_in_place)
    if grads.hidden is not None and options.reduce_hidden_grad:
        all_reduce_sum(grads.hidden, options.tp_group)
    return grads


def _tensors(grads: Gradients, held_hidden: Tensor) -> tuple[Tensor, Tensor]:
    # A custom operator returns tensors, never None: a gradient not held is an empty tensor.
    return tuple(held_hidden.new_empty(0) if grad is None else grad for grad in grads)


def _gradients(tensors: tuple[Tensor, Tensor]) -> Gradients:
    return Gradients(*(None if grad.dim() < 2 else grad for grad in tensors))


@torch.library.custom_op("megatron_fused_lm::finish_held_gradients", mutates_args=())
@with_head_options
def finish_held_gradients(
    held_hidden: Tensor, held_weight: List[Tensor], scale: Tensor, hidden_dtype: torch.dtype,
    weight_dtype: torch.dtype, **options,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``_finish`` into new memory: what a compiled backward runs."""
    grads = _finish(held_hidden, held_weight, scale, (hidden_dtype, weight_dtype), HeadOptions(**options), False)
    return _tensors(grads, held_hidden)


@finish_held_gradients.register_fake
def _(held_hidden, held_weight, scale, hidden_dtype, weight_dtype, **options) -> tuple[Tensor, Tensor]:
    hidden = torch.empty_like(held_hidden, dtype=hidden_dtype) if held_hidden.dim() == 2 else held_hidden.new_empty(0)
    if not held_weight:
        return hidden, held_hidden.new_empty(0)
    rows = sum(part.shape[0] for part in held_weight)
    return hidden, held_weight[0].new_empty(rows, held_weight[0].shape[1], dtype=weight_dtype)


def finished(held_hidden, held_weight, scale, dtypes, options: HeadOptions) -> Gradients:
    """The backward's gradients: eagerly, narrowed into the held memory (no second weight-sized
    buffer); in a compiled graph, by ``finish_held_gradients`` into new memory."""
    if torch.compiler.is_compiling():
        return _gradients(finish_held_gradients(held_hidden, held_weight, scale, *dtypes, **options.op_arguments()))
    return _finish(held_hidden, held_weight, scale, dtypes, options, True)


class HeldGradientsFunction(torch.autograd.Function):
    """``loss`` as the output of ``hidden`` and ``weight``, whose gradients were held in the forward:
    the backward scales them by the upstream gradient."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, options: HeadOptions, held_hidden, *held_weight):
        ctx.save_for_backward(held_hidden, *held_weight)
        ctx.options, ctx.dtypes, ctx.consumed = options, (hidden.dtype, weight.dtype), False
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        if not torch.compiler.is_compiling():
            _consume(ctx, "fused_linear_loss")
        held_hidden, *held_weight = ctx.saved_tensors
        grads = finished(held_hidden, held_weight, grad_loss, ctx.dtypes, ctx.options)
        return None, grads.hidden, grads.weight, None, None, *(None for _ in held_weight)


def _accumulated_hidden(ctx, held_hidden: Tensor, ratio: Optional[Tensor], extra: Optional[Tensor]) -> Optional[Tensor]:
    """The hidden gradient of an accumulating pass (``_finish`` without a weight gradient): the held
    one times ``ratio`` (the upstream over the declared scale), or plus ``extra`` (a correcting
    pass's)."""
    total = held_hidden if extra is None else held_hidden + extra
    return _finish(total, [], ratio, (ctx.hidden_dtype, None), ctx.options, False).hidden


def _remember_accumulation(
    ctx, hidden: Tensor, options: HeadOptions, weight_grad_scale: float, pending: PendingWeightGrad, correct, *value
) -> None:
    """What an accumulating pass's backward reads: the options, the hidden gradient's dtype, the
    declared scale, the added gradient's record (which reports the node's release before its
    backward; ``value`` gives the loss's value for that report) and the correcting pass."""
    ctx.options, ctx.hidden_dtype, ctx.consumed = options, hidden.dtype, False
    ctx.weight_grad_scale, ctx.pending, ctx.correct = weight_grad_scale, pending, correct
    pending.watch(ctx, *value)


def _warn_of_correction(name: str, declared: float, received: str) -> None:
    warn_once(
        f"megatron_fused_lm: {name} declared weight_grad_scale={declared:g} but its loss received {received}; the "
        "weight gradient is corrected by a second pass (declare what the loss receives to avoid it)"
    )


class AccumulatedGradientsFunction(torch.autograd.Function):
    """``loss`` as the output of ``hidden`` and ``weight`` when the pass added ``weight_grad_scale``
    (``s``) times the weight gradient into a caller's accumulator in the forward: the backward
    gives the weight no gradient and the hidden gradient for the upstream ``c`` it receives. For
    ``c == s`` (within ``PROPORTIONAL_TOLERANCE``; one host synchronization) that is the held one
    times ``c / s``; otherwise ``correct(c - s)``, a second pass, adds the difference to the
    accumulator and returns its hidden gradient (one warning)."""

    @staticmethod
    def forward(
        ctx, loss, hidden, weight, options: HeadOptions, weight_grad_scale: float, pending, correct, held_hidden
    ):
        ctx.save_for_backward(held_hidden)
        _remember_accumulation(ctx, hidden, options, weight_grad_scale, pending, correct, loss)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        _consume(ctx, "fused_linear_loss")
        (held_hidden,) = ctx.saved_tensors
        upstream, declared = grad_loss.float(), ctx.weight_grad_scale
        if bool((upstream - declared).abs() <= PROPORTIONAL_TOLERANCE * abs(declared)):
            return None, _accumulated_hidden(ctx, held_hidden, upstream / declared, None), *(None,) * 6
        _warn_of_correction("fused_linear_loss", declared, f"an upstream gradient of {float(upstream):g}")
        extra = ctx.correct(upstream - declared)
        return None, _accumulated_hidden(ctx, held_hidden, None, extra), *(None,) * 6


class AccumulatedCrossEntropyFunction(torch.autograd.Function):
    """Per-token ``-logprob [n]`` as the output of ``hidden`` and ``weight`` when the pass added the
    weight gradient for the upstream ``weight_grad_scale * declared`` (``s * d``) into a caller's
    accumulator in the forward. The backward gives the weight no gradient; for an upstream ``u =
    c * d`` with ``c == s`` (one host synchronization) the hidden gradient is the held one times
    ``c / s``; for any other ``u``, ``correct(u - s * d)``, a second pass, adds the difference to
    the accumulator and returns its hidden gradient (one warning)."""

    @staticmethod
    def forward(
        ctx, losses, hidden, weight, options: HeadOptions, declared, weight_grad_scale: float, pending, correct,
        held_hidden,
    ):  # fmt: skip
        ctx.save_for_backward(declared, held_hidden)
        _remember_accumulation(ctx, hidden, options, weight_grad_scale, pending, correct, losses, declared)
        return losses.clone()

    @staticmethod
    def backward(ctx, grad_losses):
        _consume(ctx, "fused_linear_cross_entropy")
        declared_weights, held_hidden = ctx.saved_tensors
        declared = ctx.weight_grad_scale
        scale = proportional_scale(grad_losses, declared_weights)
        if scale is not None and bool((scale - declared).abs() <= PROPORTIONAL_TOLERANCE * abs(declared)):
            return None, _accumulated_hidden(ctx, held_hidden, scale / declared, None), *(None,) * 7
        received = "an upstream gradient not proportional to the declared weights"
        if scale is not None:
            received = f"{float(scale):g} times the declared weights"
        _warn_of_correction("fused_linear_cross_entropy", declared, received)
        extra = ctx.correct(grad_losses.float() - declared * declared_weights)
        return None, _accumulated_hidden(ctx, held_hidden, None, extra), *(None,) * 7


def _consume(ctx, name: str) -> None:
    # The held gradients are narrowed in place: a second backward (retain_graph) would read that.
    if ctx.consumed:
        raise RuntimeError(f"{name}: its gradients were used by an earlier backward")
    ctx.consumed = True
    pending = getattr(ctx, "pending", None)
    if pending is not None:  # the weight gradient added in the forward now has its backward
        pending.close()


def _declared(
    grad_losses, declared, held_hidden, held_weight, hidden, weight, target_column, lse, mean_logit,
    options: HeadOptions, needed: NeededGrads, narrow_in_place: bool,
) -> Gradients:  # fmt: skip
    """The declared cross-entropy's gradients: the held ones times ``c`` where the upstream gradient
    is ``c * declared`` (one host synchronization), else the exact gradient of what arrived,
    recomputed (four GEMMs, one warning)."""
    scale = proportional_scale(grad_losses, declared)
    if scale is not None:
        return _finish(held_hidden, held_weight, scale, (hidden.dtype, weight.dtype), options, narrow_in_place)
    warn_once(
        "megatron_fused_lm: the upstream gradient of fused_linear_cross_entropy is not proportional to the "
        "declared weights; its gradients are recomputed exactly (four GEMMs instead of three)"
    )
    grads = fused_backward(
        hidden, weight, target_column, lse, mean_logit, -grad_losses.float(), None, need_hidden=needed.hidden,
        need_weight=needed.weight, **options.op_arguments(),
    )  # fmt: skip
    return Gradients(*(grad if need else None for grad, need in zip(grads, needed, strict=True)))


@torch.library.custom_op("megatron_fused_lm::declared_gradients", mutates_args=())
@with_head_options
def declared_gradients(
    grad_losses: Tensor, declared: Tensor, held_hidden: Tensor, held_weight: List[Tensor], hidden: Tensor,
    weight: Tensor, target_column: Tensor, lse: Tensor, mean_logit: Tensor, need_hidden: bool, need_weight: bool,
    **options,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``_declared`` into new memory: what a compiled backward runs."""
    needed = NeededGrads(need_hidden, need_weight)
    grads = _declared(
        grad_losses, declared, held_hidden, held_weight, hidden, weight, target_column, lse, mean_logit,
        HeadOptions(**options), needed, False,
    )  # fmt: skip
    return _tensors(grads, held_hidden)


@declared_gradients.register_fake
def _(
    grad_losses,
    declared,
    held_hidden,
    held_weight,
    hidden,
    weight,
    target_column,
    lse,
    mean_logit,
    need_hidden,
    need_weight,
    **options,
):
    return _empty_unless(need_hidden, hidden), _empty_unless(need_weight, weight)


class DeclaredCrossEntropyFunction(torch.autograd.Function):
    """Per-token ``-logprob [n]`` as the output of ``hidden`` and ``weight``, whose gradients were
    held in the forward for an upstream gradient ``c * declared``."""

    @staticmethod
    def forward(
        ctx, losses, hidden, weight, target_column, declared, lse, mean_logit, options, held_hidden, *held_weight
    ):
        ctx.save_for_backward(hidden, weight, target_column, declared, lse, mean_logit, held_hidden, *held_weight)
        ctx.options, ctx.consumed = options, False
        return losses.clone()

    @staticmethod
    def backward(ctx, grad_losses):
        compiling = torch.compiler.is_compiling()
        if not compiling:
            _consume(ctx, "fused_linear_cross_entropy")
        hidden, weight, target_column, declared, lse, mean_logit, held_hidden, *held_weight = ctx.saved_tensors
        needed = NeededGrads(*ctx.needs_input_grad[1:3])
        arguments = (grad_losses, declared, held_hidden, held_weight, hidden, weight, target_column, lse, mean_logit)
        if compiling:
            grads = _gradients(declared_gradients(*arguments, *needed, **ctx.options.op_arguments()))
        else:
            grads = _declared(*arguments, ctx.options, needed, True)
        return None, grads.hidden, grads.weight, None, None, None, None, None, None, *(None for _ in held_weight)
