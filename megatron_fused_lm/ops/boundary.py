"""The autograd boundary: the ops as PyTorch custom operators and autograd functions, each taking
the rows' tensors and one ``HeadOptions``.

- Recompute path (custom operators, so ``torch.compile`` keeps each whole and autocast stays
  outside): ``fused_forward(hidden [n, H], weight [vocab_shard, H], target_column [n], **options)
  -> (logprob, entropy, lse, mean_logit)``, each ``[n]`` float32, and the ``fused_backward`` it
  registers; ``logits_forward`` / ``logits_backward`` on a materialized logits shard. The options
  travel as the operators' keyword-only arguments (``HeadOptions.op_arguments``), and the autograd
  context rebuilds the object from them by name. Only O(n) statistics are saved; the backward
  recomputes.
- Loss-in-forward path (autograd functions: ``loss_fn`` is Python): ``FusedLossFunction`` and
  ``DeclaredCrossEntropyFunction`` run ``contract.run_loss_pass`` in the forward and scale the
  held gradients in the backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import typing
from typing import Dict, Optional

import torch

from .._logging import warn_once
from .backends import loss_backend, recompute_backend
from .chunking import BlockLogits, chunk_logit_grads, chunk_statistics
from .contract import NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads, run_loss_pass
from .distributed import all_reduce_sum, merge_across_group
from .held_gradients import HeldGradients
from .loss_in_forward import ChunkLoss, LossFn, proportional_scale
from .options import HeadOptions
from .softmax import summarize

Tensor = torch.Tensor
Statistics = tuple[Tensor, Tensor, Tensor, Tensor]  # logprob, entropy, lse, mean_logit: [n] float32


def autocast_off(device: torch.device):
    # The statistics are float32 by contract: autocast must not turn products or reductions
    # inside the ops into 16-bit ones.
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _summary(stats: Tensor, options: HeadOptions) -> Statistics:
    summary = summarize(merge_across_group(stats, options.tp_group))
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
        return _summary(stats, options)


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
        return _summary(stats, options)


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


# The loss-in-forward path.


def _held_gradients(
    hidden: Tensor, weight: Tensor, target_column: Tensor, chunk_loss: ChunkLoss, options: HeadOptions, needed
) -> Optional[HeldGradients]:
    problem = ShardProblem(hidden, weight, target_column, options.temperature)
    with autocast_off(hidden.device):
        backend = loss_backend(options.backend, hidden.device, options.token_chunk)
        return run_loss_pass(backend, problem, chunk_loss, needed)


def _needed_grads(ctx, grad_enabled: bool) -> NeededGrads:
    # needs_input_grad ignores grad mode; under no_grad the forward computes no gradients.
    return NeededGrads(*(grad_enabled and needed for needed in ctx.needs_input_grad[:2]))


def _take_held(ctx, name: str) -> HeldGradients:
    """The gradients the forward held; a second backward through the graph has nothing left."""
    held, ctx.held = ctx.held, None
    if held is None:
        raise RuntimeError(f"{name}: its gradients were used by an earlier backward")
    return held


def _finished(held: HeldGradients, scale: Tensor, options: HeadOptions) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The held gradients times the upstream ``scale``, each rounded once into its parameter's
    dtype, the hidden gradient then summed over the group when asked (in that dtype, as the
    recompute path and Megatron's column-parallel layer do)."""
    grads = held.scaled(scale.float())
    if grads.hidden is not None and options.reduce_hidden_grad:
        all_reduce_sum(grads.hidden, options.tp_group)
    return grads


class FusedLossFunction(torch.autograd.Function):
    """``(loss [], logprob [n], entropy [n])`` of ``loss_fn`` over the rows; the gradients are
    finished in the forward."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        target_column,
        loss_fn: LossFn,
        inputs: Dict[str, Tensor],
        options: HeadOptions,
        grad_enabled,
    ):
        chunk_loss = ChunkLoss(loss_fn, inputs, hidden.shape[0], hidden.device, options.tp_group)
        needed = _needed_grads(ctx, grad_enabled)
        ctx.held = _held_gradients(hidden, weight, target_column, chunk_loss, options, needed)
        ctx.options = options
        ctx.mark_non_differentiable(chunk_loss.logprob, chunk_loss.entropy)
        return chunk_loss.total, chunk_loss.logprob, chunk_loss.entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logprob, _grad_entropy):
        held = _take_held(ctx, "fused_linear_loss")
        return *_finished(held, grad_loss, ctx.options), None, None, None, None, None


class DeclaredCrossEntropyFunction(torch.autograd.Function):
    """Per-token ``-logprob [n]``, the gradients finished in the forward for an upstream gradient
    ``c * declared [n]``; any other upstream gradient is recomputed exactly."""

    @staticmethod
    def forward(ctx, hidden, weight, target_column, declared, loss_fn: LossFn, options: HeadOptions, grad_enabled):
        chunk_loss = ChunkLoss(loss_fn, {"weight": declared}, hidden.shape[0], hidden.device, options.tp_group)
        needed = _needed_grads(ctx, grad_enabled)
        ctx.held = _held_gradients(hidden, weight, target_column, chunk_loss, options, needed)
        ctx.options = options
        ctx.save_for_backward(hidden, weight, target_column, declared, chunk_loss.lse, chunk_loss.mean_logit)
        return -chunk_loss.logprob

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, target_column, declared, lse, mean_logit = ctx.saved_tensors
        held = _take_held(ctx, "fused_linear_cross_entropy")
        scale = proportional_scale(grad_losses, declared)
        if scale is not None:
            return *_finished(held, scale, ctx.options), None, None, None, None, None
        warn_once(
            "megatron_fused_lm: the upstream gradient of fused_linear_cross_entropy is not proportional to the "
            "declared weights; its gradients are recomputed exactly (four GEMMs instead of three)"
        )
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden, grad_weight = fused_backward(
            hidden, weight, target_column, lse, mean_logit, -grad_losses.float(), None, need_hidden=need_hidden,
            need_weight=need_weight, **ctx.options.op_arguments(),
        )  # fmt: skip
        grad_hidden, grad_weight = (grad_hidden if need_hidden else None), (grad_weight if need_weight else None)
        return grad_hidden, grad_weight, None, None, None, None, None
