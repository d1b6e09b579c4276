"""The ops as PyTorch custom operators (``torch.library``), so that ``torch.compile`` keeps each
one whole (fake implementations give it the output shapes; it never traces into Triton), autocast
stays outside them, and their gradients are registered with them.

Two operators per path, a forward and the backward it registers:

- ``megatron_fused_lm::fused_forward(hidden [n, H], weight [vocab_shard, H], local_target [n],
  owned [n], ...) -> (logprob, entropy, lse, mean_logit)``, each ``[n]`` float32, and
  ``megatron_fused_lm::fused_backward(...) -> (grad_hidden, grad_weight)``;
- ``megatron_fused_lm::logits_forward(logits [n, vocab_shard], local_target, owned, ...)`` (same
  outputs) and ``megatron_fused_lm::logits_backward(...) -> grad_logits``.

A custom operator takes tensors and plain values, so the options travel as such (the backend by
name, the tensor-parallel group by its registered name) and become one options dataclass in the
autograd context. Only O(n) statistics are saved besides the inputs; the backward recomputes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from .backends import resolve_backend
from .chunking import BlockLogits, chunk_logit_grads, chunk_statistics
from .contract import NeededGrads, SavedStatistics, ShardProblem, ShardTargets, UpstreamGrads
from .distributed import all_reduce_sum, group_by_name
from .softmax_stats import merge_across_group, summarize

Tensor = torch.Tensor
Statistics = tuple[Tensor, Tensor, Tensor, Tensor]  # logprob, entropy, lse, mean_logit: [n] float32


@dataclass(frozen=True)
class FusedOptions:
    """The fused op's options (``fused_linear_logprob`` documents each)."""

    temperature: float
    backend: str
    token_chunk: Optional[int]
    tp_group_name: Optional[str]
    entropy_grad: bool
    reduce_hidden_grad: bool


@dataclass(frozen=True)
class LogitsOptions:
    """The unfused op's options (``logits_logprob`` documents each)."""

    temperature: float
    token_chunk: Optional[int]  # rows per chunk of the float32 softmax; None: one pass
    tp_group_name: Optional[str]
    entropy_grad: bool


def autocast_off(device: torch.device):
    # The statistics are float32 by contract: autocast must not turn products or reductions
    # inside the ops into 16-bit ones.
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _summary(stats: Tensor, tp_group_name: Optional[str]) -> Statistics:
    summary = summarize(merge_across_group(stats, group_by_name(tp_group_name)))
    return summary.logprob, summary.entropy, summary.lse, summary.mean_logit


def _statistics_like(rows: Tensor) -> Statistics:
    return tuple(rows.new_empty(rows.shape[0], dtype=torch.float32) for _ in range(4))


def _empty_unless(needed: bool, like: Tensor) -> Tensor:
    # A custom operator returns tensors, never None: an unneeded gradient is an empty tensor.
    return torch.empty_like(like) if needed else like.new_empty(0)


def _save_for_backward(ctx, inputs: tuple[Tensor, ...], output: Statistics, options) -> None:
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


# The fused path.


@torch.library.custom_op("megatron_fused_lm::fused_forward", mutates_args=())
def fused_forward(
    hidden: Tensor,
    weight: Tensor,
    local_target: Tensor,
    owned: Tensor,
    temperature: float,
    backend: str,
    token_chunk: Optional[int],
    tp_group_name: Optional[str],
    entropy_grad: bool,
    reduce_hidden_grad: bool,
) -> Statistics:
    """Log-prob, entropy and the saved statistics of each row, over the whole vocabulary."""
    problem = ShardProblem(hidden, weight, ShardTargets(local_target, owned), temperature)
    with autocast_off(hidden.device):
        stats = resolve_backend(backend, hidden.device, token_chunk).local_statistics(problem)
        return _summary(stats, tp_group_name)


@fused_forward.register_fake
def _(hidden, weight, local_target, owned, *options) -> Statistics:
    return _statistics_like(hidden)


@torch.library.custom_op("megatron_fused_lm::fused_backward", mutates_args=())
def fused_backward(
    hidden: Tensor,
    weight: Tensor,
    local_target: Tensor,
    owned: Tensor,
    lse: Tensor,
    mean_logit: Tensor,
    grad_logprob: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    temperature: float,
    backend: str,
    token_chunk: Optional[int],
    tp_group_name: Optional[str],
    reduce_hidden_grad: bool,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[Tensor, Tensor]:
    """``(grad_hidden, grad_weight)``; an unneeded one is empty. The hidden gradient is summed
    over the group when ``reduce_hidden_grad``, else this rank's partial."""
    problem = ShardProblem(hidden, weight, ShardTargets(local_target, owned), temperature)
    with autocast_off(hidden.device):
        grads = resolve_backend(backend, hidden.device, token_chunk).local_gradients(
            problem,
            SavedStatistics(lse, mean_logit),
            UpstreamGrads(grad_logprob, grad_entropy),
            NeededGrads(need_hidden, need_weight),
        )
        if grads.hidden is not None and reduce_hidden_grad:
            all_reduce_sum(grads.hidden, group_by_name(tp_group_name))
    return (
        hidden.new_empty(0) if grads.hidden is None else grads.hidden,
        weight.new_empty(0) if grads.weight is None else grads.weight,
    )


@fused_backward.register_fake
def _(hidden, weight, *rest) -> tuple[Tensor, Tensor]:
    need_hidden, need_weight = rest[-2:]
    return _empty_unless(need_hidden, hidden), _empty_unless(need_weight, weight)


def _fused_setup_context(ctx, inputs, output) -> None:
    hidden, weight, local_target, owned, *options = inputs
    _save_for_backward(ctx, (hidden, weight, local_target, owned), output, FusedOptions(*options))


def _fused_gradients(ctx, grad_logprob, grad_entropy, _grad_lse, _grad_mean_logit):
    opened = _open_backward(ctx, grad_logprob, grad_entropy)
    if opened is None:
        return (None,) * 10
    (hidden, weight, local_target, owned), saved, upstream = opened
    options: FusedOptions = ctx.options
    need_hidden, need_weight = ctx.needs_input_grad[:2]
    grad_hidden, grad_weight = fused_backward(
        hidden, weight, local_target, owned, *saved, *upstream, options.temperature, options.backend,
        options.token_chunk, options.tp_group_name, options.reduce_hidden_grad, need_hidden, need_weight,
    )  # fmt: skip
    return (grad_hidden if need_hidden else None, grad_weight if need_weight else None) + (None,) * 8


fused_forward.register_autograd(_fused_gradients, setup_context=_fused_setup_context)


# The unfused path, on a materialized logits shard.


def _scaled(logits: Tensor, temperature: float) -> BlockLogits:
    # Out of place: logits.float() is logits itself when it is float32 already.
    return lambda chunk: logits[chunk].float() / temperature


def _chunk_rows(logits: Tensor, token_chunk: Optional[int]) -> int:
    return token_chunk or max(logits.shape[0], 1)


@torch.library.custom_op("megatron_fused_lm::logits_forward", mutates_args=())
def logits_forward(
    logits: Tensor,
    local_target: Tensor,
    owned: Tensor,
    temperature: float,
    token_chunk: Optional[int],
    tp_group_name: Optional[str],
    entropy_grad: bool,
) -> Statistics:
    """Log-prob, entropy and the saved statistics of each row of a logits shard."""
    with autocast_off(logits.device):
        targets = ShardTargets(local_target, owned)
        stats = chunk_statistics(_scaled(logits, temperature), targets, _chunk_rows(logits, token_chunk))
        return _summary(stats, tp_group_name)


@logits_forward.register_fake
def _(logits, local_target, owned, *options) -> Statistics:
    return _statistics_like(logits)


@torch.library.custom_op("megatron_fused_lm::logits_backward", mutates_args=())
def logits_backward(
    logits: Tensor,
    local_target: Tensor,
    owned: Tensor,
    lse: Tensor,
    mean_logit: Tensor,
    grad_logprob: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    temperature: float,
    token_chunk: Optional[int],
) -> Tensor:
    """The gradient with respect to the logits shard, in its dtype (the float32 softmax is
    recomputed one chunk at a time; the saved logits are never modified)."""
    grad_logits = torch.empty_like(logits)
    with autocast_off(logits.device):
        logit_grads = chunk_logit_grads(
            _scaled(logits, temperature), ShardTargets(local_target, owned), SavedStatistics(lse, mean_logit),
            UpstreamGrads(grad_logprob, grad_entropy), temperature, _chunk_rows(logits, token_chunk),
        )  # fmt: skip
        for chunk, grad in logit_grads:
            grad_logits[chunk] = grad
    return grad_logits


@logits_backward.register_fake
def _(logits, *rest) -> Tensor:
    return torch.empty_like(logits)


def _logits_setup_context(ctx, inputs, output) -> None:
    logits, local_target, owned, *options = inputs
    _save_for_backward(ctx, (logits, local_target, owned), output, LogitsOptions(*options))


def _logits_gradients(ctx, grad_logprob, grad_entropy, _grad_lse, _grad_mean_logit):
    opened = _open_backward(ctx, grad_logprob, grad_entropy)
    if opened is None:
        return (None,) * 7
    (logits, local_target, owned), saved, upstream = opened
    options: LogitsOptions = ctx.options
    grad_logits = logits_backward(
        logits, local_target, owned, *saved, *upstream, options.temperature, options.token_chunk
    )
    return (grad_logits,) + (None,) * 6


logits_forward.register_autograd(_logits_gradients, setup_context=_logits_setup_context)
