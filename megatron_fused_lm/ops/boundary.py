"""The ops as PyTorch custom operators, each with an explicit typed schema: the option fields it
uses are parameters of the names ``HeadOptions`` gives them.

- Recompute path (so ``torch.compile`` keeps each whole and autocast stays outside):
  ``fused_forward(hidden [n, H], weight [vocab_shard, H], target_column [n], temperature [n],
  kept_mask [n, words] or [0]) -> (logprob, entropy, lse, mean_logit)``, each ``[n]`` float32
  (``target_column [n, k]``: log-probs ``[n, k]``), and the ``fused_backward`` its autograd formula
  runs;
  ``logits_forward`` / ``logits_backward`` on a materialized logits shard. Only O(n) statistics
  are saved; the backward recomputes.
- Three-GEMM path (``held_pass``): its phases, ``loss_allocate``, ``loss_statistics``,
  ``loss_gradients``, the ``merge_statistics`` collective and, for several targets per row,
  ``target_logits``, which ``OperatorLossBackend`` hands
  to ``contract.run_loss_pass``, so that a compiled graph never traces into a backend.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional

import torch

from .backends import loss_backend, recompute_backend
from .chunking import BlockLogits, chunk_logit_grads, chunk_rows, chunk_statistics
from .contract import LossState, NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads
from .distributed import all_reduce_sum, group_by_name, merge_across_group
from .several_targets import gathered_logits, statistics_column, taken_logits
from .softmax import NUM_STATISTICS, SoftmaxSummary, summarize

Tensor = torch.Tensor
Statistics = tuple[Tensor, Tensor, Tensor, Tensor]  # logprob, entropy, lse, mean_logit: [n] float32


def autocast_off(device: torch.device):
    # The statistics are float32 by contract: autocast must not turn products or reductions
    # inside the ops into 16-bit ones.
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _summary(
    stats: Tensor, target_column: Tensor, target_logits: Optional[Tensor], tp_group_name: Optional[str]
) -> Statistics:
    """The rows' results from this shard's statistics; for several targets (``target_column [n,
    k]``) with their ``target_logits [n, k]`` on this shard, summed over the group first."""
    group = group_by_name(tp_group_name)
    if target_logits is not None:
        all_reduce_sum(target_logits, group)  # each rank holds its own ids' logits, 0 elsewhere
    summary = summarize(merge_across_group(stats, group), statistics_column(target_column), target_logits)
    return summary.logprob, summary.entropy, summary.lse, summary.mean_logit


def _statistics_like(rows: Tensor, target_column: Tensor) -> Statistics:
    # The log-prob has the targets' shape ([n] or [n, k]); the rest are [n].
    logprob = target_column.new_empty(target_column.shape, dtype=torch.float32)
    return (logprob, *(rows.new_empty(rows.shape[0], dtype=torch.float32) for _ in range(3)))


def _empty_unless(needed: bool, like: Tensor) -> Tensor:
    # A custom operator returns tensors, never None: an unneeded gradient is an empty tensor.
    return torch.empty_like(like) if needed else like.new_empty(0)


def _save_statistics(ctx, inputs: tuple, keyword_only_inputs: dict, output: Statistics) -> None:
    # The entropy of a call without entropy_grad is detached by the public op, so its upstream
    # gradient arrives as None.
    _, _, lse, mean_logit = output
    ctx.save_for_backward(*inputs, lse, mean_logit)
    ctx.options = keyword_only_inputs
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse, mean_logit)


def _open_backward(ctx, grad_logprob: Optional[Tensor], grad_entropy: Optional[Tensor]):
    """``(saved inputs, saved statistics, float32 upstream gradients)``, or ``None`` when no
    gradient flows back."""
    upstream = UpstreamGrads.from_autograd(grad_logprob, grad_entropy)
    if upstream is None:
        return None
    *inputs, lse, mean_logit = ctx.saved_tensors
    return tuple(inputs), SavedStatistics(lse, mean_logit), upstream


# The recompute path.


@torch.library.custom_op("megatron_fused_lm::fused_forward", mutates_args=())
def fused_forward(
    hidden: Tensor,
    weight: Tensor,
    target_column: Tensor,
    temperature: Tensor,
    kept_mask: Tensor,
    *,
    backend: str,
    token_chunk: Optional[int],
    tp_group_name: Optional[str],
    reduce_hidden_grad: bool,
    batch_invariant: bool,
) -> Statistics:
    """Log-prob, entropy and the saved statistics of each row, over the whole vocabulary
    (``reduce_hidden_grad`` and ``batch_invariant`` are the backward's: the forward is batch
    invariant either way). ``target_column [n, k]``: ``k`` targets per row, log-probs ``[n, k]``;
    ``kept_mask`` (``kept_tokens``' form): each row's softmax over its kept columns alone."""
    problem = ShardProblem(hidden, weight, statistics_column(target_column), temperature, kept_mask)
    with autocast_off(hidden.device):
        stats = recompute_backend(backend, token_chunk).local_statistics(problem)
        several = target_column.dim() == 2
        target_logits = gathered_logits(hidden, weight, target_column, temperature) if several else None
        return _summary(stats, target_column, target_logits, tp_group_name)


@fused_forward.register_fake
def _(hidden, weight, target_column, temperature, kept_mask, **options) -> Statistics:
    return _statistics_like(hidden, target_column)


@torch.library.custom_op("megatron_fused_lm::fused_backward", mutates_args=())
def fused_backward(
    hidden: Tensor,
    weight: Tensor,
    target_column: Tensor,
    temperature: Tensor,
    kept_mask: Tensor,
    lse: Tensor,
    mean_logit: Tensor,
    grad_logprob: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    *,
    need_hidden: bool,
    need_weight: bool,
    backend: str,
    token_chunk: Optional[int],
    tp_group_name: Optional[str],
    reduce_hidden_grad: bool,
    batch_invariant: bool,
) -> tuple[Tensor, Tensor]:
    """``(grad_hidden, grad_weight)``; an unneeded one is empty. The hidden gradient is summed
    over the group when ``reduce_hidden_grad``, else this rank's partial."""
    problem = ShardProblem(hidden, weight, target_column, temperature, kept_mask)
    with autocast_off(hidden.device):
        grads = recompute_backend(backend, token_chunk, batch_invariant).local_gradients(
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
def _(hidden, weight, *statistics_and_upstream, need_hidden, need_weight, **options) -> tuple[Tensor, Tensor]:
    return _empty_unless(need_hidden, hidden), _empty_unless(need_weight, weight)


def _fused_gradients(ctx, grad_logprob, grad_entropy, _grad_lse, _grad_mean_logit):
    opened = _open_backward(ctx, grad_logprob, grad_entropy)
    if opened is None:
        return None, None, None, None, None
    inputs, saved, upstream = opened
    need_hidden, need_weight = ctx.needs_input_grad[:2]
    grad_hidden, grad_weight = fused_backward(
        *inputs, *saved, *upstream, need_hidden=need_hidden, need_weight=need_weight, **ctx.options
    )
    return (grad_hidden if need_hidden else None), (grad_weight if need_weight else None), None, None, None


fused_forward.register_autograd(_fused_gradients, setup_context=_save_statistics)


# The unfused path, on a materialized logits shard.


def _scaled(logits: Tensor, temperature: Tensor) -> BlockLogits:
    # Out of place: logits.float() is logits itself when it is float32 already.
    return lambda rows: logits[rows].float() / temperature[rows, None]


@torch.library.custom_op("megatron_fused_lm::logits_forward", mutates_args=())
def logits_forward(
    logits: Tensor,
    target_column: Tensor,
    temperature: Tensor,
    kept_mask: Tensor,
    *,
    token_chunk: Optional[int],
    tp_group_name: Optional[str],
) -> Statistics:
    """Log-prob, entropy and the saved statistics of each row of a logits shard (``target_column
    [n, k]`` and ``kept_mask``: as for ``fused_forward``)."""
    with autocast_off(logits.device):
        rows = chunk_rows(token_chunk, logits.shape[-1])
        stats = chunk_statistics(_scaled(logits, temperature), statistics_column(target_column), kept_mask, rows)
        several = target_column.dim() == 2
        target_logits = taken_logits(logits, target_column, temperature) if several else None
        return _summary(stats, target_column, target_logits, tp_group_name)


@logits_forward.register_fake
def _(logits, target_column, temperature, kept_mask, **options) -> Statistics:
    return _statistics_like(logits, target_column)


@torch.library.custom_op("megatron_fused_lm::logits_backward", mutates_args=())
def logits_backward(
    logits: Tensor,
    target_column: Tensor,
    temperature: Tensor,
    kept_mask: Tensor,
    lse: Tensor,
    mean_logit: Tensor,
    grad_logprob: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    *,
    token_chunk: Optional[int],
) -> Tensor:
    """The gradient with respect to the logits shard, in its dtype (the float32 softmax is
    recomputed one chunk at a time; the saved logits are never modified)."""
    grad_logits = torch.empty_like(logits)
    with autocast_off(logits.device):
        logit_grads = chunk_logit_grads(
            _scaled(logits, temperature), target_column, SavedStatistics(lse, mean_logit),
            UpstreamGrads(grad_logprob, grad_entropy), temperature, kept_mask, chunk_rows(token_chunk, logits.shape[-1]),
        )  # fmt: skip
        for rows, grad in logit_grads:
            grad_logits[rows] = grad
    return grad_logits


@logits_backward.register_fake
def _(logits, *statistics_and_upstream, **options) -> Tensor:
    return torch.empty_like(logits)


def _logits_gradients(ctx, grad_logprob, grad_entropy, _grad_lse, _grad_mean_logit):
    opened = _open_backward(ctx, grad_logprob, grad_entropy)
    if opened is None:
        return None, None, None, None
    inputs, saved, upstream = opened
    return logits_backward(*inputs, *saved, *upstream, token_chunk=ctx.options["token_chunk"]), None, None, None


logits_forward.register_autograd(_logits_gradients, setup_context=_save_statistics)


# The three-GEMM path's phases.


@torch.library.custom_op("megatron_fused_lm::target_logits", mutates_args=())
def target_logits(
    hidden: Tensor, weight: Tensor, target_column: Tensor, temperature: Tensor, *, tp_group_name: Optional[str]
) -> Tensor:
    """Several targets' logits ``[k, m]`` (float32, divided by each row's temperature) for a chunk's
    ``k`` rows and their ``target_column [k, m]``, summed over the group (each rank holds its own
    ids')."""
    with autocast_off(hidden.device):
        logits = gathered_logits(hidden, weight, target_column, temperature)
        all_reduce_sum(logits, group_by_name(tp_group_name))
    return logits


@target_logits.register_fake
def _(hidden, weight, target_column, temperature, **options) -> Tensor:
    return hidden.new_empty(target_column.shape, dtype=torch.float32)


@torch.library.custom_op("megatron_fused_lm::merge_statistics", mutates_args=())
def merge_statistics(stats: Tensor, *, tp_group_name: Optional[str]) -> Tensor:
    """Every rank's shard statistics ``[k, 4]`` merged over the group (one all-gather)."""
    return merge_across_group(stats, group_by_name(tp_group_name)).clone()


@merge_statistics.register_fake
def _(stats, **options) -> Tensor:
    return torch.empty_like(stats)


def _allocate(
    hidden, weight, need_hidden, need_weight, backend, token_chunk, entropy_grad, batch_invariant
) -> List[Tensor]:
    # Allocation reads the shapes of the rows and the weight alone.
    problem = ShardProblem(
        hidden, weight, *(hidden.new_empty(0, dtype=dtype) for dtype in (torch.long, torch.float32, torch.int32))
    )
    needed = NeededGrads(need_hidden, need_weight)
    state = loss_backend(backend, token_chunk, entropy_grad, batch_invariant).allocate(problem, needed)
    return [state.block, state.reference, state.held_hidden, *state.held_weight]


@torch.library.custom_op("megatron_fused_lm::loss_allocate", mutates_args=())
def loss_allocate(
    hidden: Tensor,
    weight: Tensor,
    *,
    need_hidden: bool,
    need_weight: bool,
    backend: str,
    token_chunk: Optional[int],
    entropy_grad: bool,
    batch_invariant: bool,
) -> List[Tensor]:
    """The backend's ``allocate``: ``[block, reference, held_hidden, *held_weight]``."""
    return _allocate(hidden, weight, need_hidden, need_weight, backend, token_chunk, entropy_grad, batch_invariant)


@loss_allocate.register_fake
def _(hidden, weight, **options) -> List[Tensor]:
    # The same allocation on fake tensors gives the same shapes, dtypes and strides.
    return _allocate(hidden, weight, **options)


@torch.library.custom_op("megatron_fused_lm::loss_statistics", mutates_args=("block", "reference"))
def loss_statistics(
    hidden: Tensor,
    weight: Tensor,
    target_column: Tensor,
    temperature: Tensor,
    kept_mask: Tensor,
    block: Tensor,
    reference: Tensor,
    *,
    backend: str,
) -> Tensor:
    """The backend's ``chunk_statistics`` for a chunk's ``k`` rows (``hidden``, ``target_column``,
    ``temperature``, ``kept_mask``), into the block's first ``k`` rows: ``[k, 4]``."""
    problem = ShardProblem(hidden, weight, target_column, temperature, kept_mask)
    state = LossState(block, reference, hidden.new_empty(0), [])
    with autocast_off(hidden.device):
        return loss_backend(backend).chunk_statistics(problem, state, slice(0, hidden.shape[0]))


@loss_statistics.register_fake
def _(hidden, *tensors, **options) -> Tensor:
    return hidden.new_empty(hidden.shape[0], NUM_STATISTICS, dtype=torch.float32)


@torch.library.custom_op("megatron_fused_lm::loss_gradients", mutates_args=("block", "held_hidden", "held_weight"))
def loss_gradients(
    hidden: Tensor,
    weight: Tensor,
    target_column: Tensor,
    temperature: Tensor,
    kept_mask: Tensor,
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
    accumulate: bool,
    backend: str,
    batch_invariant: bool,
) -> None:
    """The backend's ``chunk_gradients`` for the rows ``[start, stop)``; ``summary`` holds the
    ``SoftmaxSummary`` fields in order."""
    problem = ShardProblem(hidden, weight, target_column, temperature, kept_mask)
    state = LossState(block, reference, held_hidden, held_weight)
    upstream = UpstreamGrads(grad_logprob, grad_entropy)
    with autocast_off(hidden.device):
        loss_backend(backend, batch_invariant=batch_invariant).chunk_gradients(
            problem, state, slice(start, stop), SoftmaxSummary(*summary), upstream, accumulate
        )


@loss_gradients.register_fake
def _(*args, **options) -> None:
    return None


class OperatorLossBackend:
    """The ``contract.LossBackend`` phases of the three-GEMM pass: the backend ``options`` name, run
    through the custom operators above."""

    def __init__(self, options):
        self.options = options

    def allocate(self, problem: ShardProblem, needed: NeededGrads) -> LossState:
        options = self.options
        block, reference, held_hidden, *held_weight = loss_allocate(
            problem.hidden, problem.weight, need_hidden=needed.hidden, need_weight=needed.weight,
            backend=options.backend, token_chunk=options.token_chunk, entropy_grad=options.entropy_grad,
            batch_invariant=options.batch_invariant,
        )  # fmt: skip
        return LossState(block, reference, held_hidden, held_weight)

    def chunk_statistics(self, problem: ShardProblem, state: LossState, rows: slice) -> Tensor:
        return loss_statistics(
            problem.hidden[rows], problem.weight, problem.target_column[rows], problem.temperature[rows],
            problem.kept_mask[rows], state.block, state.reference, backend=self.options.backend,
        )  # fmt: skip

    def chunk_gradients(
        self,
        problem: ShardProblem,
        state: LossState,
        rows: slice,
        summary: SoftmaxSummary,
        upstream: UpstreamGrads,
        accumulate: bool,
    ) -> None:
        loss_gradients(
            *problem, state.block, state.reference, state.held_hidden, state.held_weight, list(summary), *upstream,
            start=rows.start, stop=rows.stop, accumulate=accumulate, backend=self.options.backend,
            batch_invariant=self.options.batch_invariant,
        )  # fmt: skip
