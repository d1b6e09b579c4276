"""Losses known in the forward: the gradients are finished there, in three GEMMs instead of four.

When the loss is a sum over tokens of ``loss_fn(logprob_t, entropy_t, inputs_t)`` and every
per-token input is known before the step, each token chunk is finished in one visit: its logits,
their statistics (merged across the tensor-parallel group: one small all-gather per chunk), the
chunk's log-probs and entropy, the per-token gradients ``dloss/dlogprob`` and ``dloss/dentropy``
by autograd on those ``[rows]`` vectors, then ``dz`` and the two gradient products. The gradients
are kept in float32 (``stored_gradients``); the backward multiplies them by the upstream scalar,
rounds each once into its parameter's dtype and all-reduces the hidden gradient over the group.

Two entry points share that forward:

- ``fused_linear_loss``: any per-token ``loss_fn``; returns the summed loss (a scalar).
- ``fused_linear_cross_entropy``: the per-token cross-entropy ``[...]`` that Megatron's labels path
  returns, finished in the forward for a *declared* upstream gradient ``c * declared_weights``
  (Megatron's SFT loss sums ``loss * loss_mask`` and scales the sum). Its backward checks what
  arrives: proportional to the declaration, it scales the stored gradients by ``c``; anything else
  is recomputed exactly from the saved statistics (four GEMMs, one host synchronization).

Neither is a custom operator (``loss_fn`` is Python code): ``torch.compile`` runs them eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple, Optional

import torch
import torch.distributed as dist

from .._logging import warn_once
from .backends import check_backend, resolve_backend
from .contract import NeededGrads, SavedStatistics, ShardProblem, ShardTargets, UpstreamGrads
from .distributed import all_reduce_sum, group_name
from .inputs import check_linear_inputs, check_options, select_rows
from .library import autocast_off, fused_backward
from .softmax_stats import merge_across_group, summarize
from .stored_gradients import StoredGradients

Tensor = torch.Tensor
LossFn = Callable[..., Tensor]


class FusedLoss(NamedTuple):
    """What ``fused_linear_loss`` returns."""

    loss: Tensor  # [] float32: the sum of the per-token losses; differentiable w.r.t. hidden and weight
    logprob: Tensor  # [...] float32, detached: a metric
    entropy: Tensor  # [...] float32, detached: a metric


@dataclass(frozen=True)
class LossOptions:
    """The three-GEMM path's options (``fused_linear_loss`` documents each)."""

    temperature: float
    backend: str
    token_chunk: Optional[int]
    tp_group: Optional[dist.ProcessGroup]
    reduce_hidden_grad: bool


def check_loss_inputs(
    loss_fn: LossFn, loss_inputs: Optional[Dict[str, Tensor]], lead_shape: torch.Size, device: torch.device
) -> Dict[str, Tensor]:
    """The per-token inputs flattened to ``[rows]``, after checking ``loss_fn`` is callable and each
    input is a tensor of ``lead_shape`` on ``device`` that needs no gradient."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if loss_inputs is None:
        return {}
    if not isinstance(loss_inputs, dict):
        raise TypeError(f"loss_inputs must be a dict of tensors, got {type(loss_inputs).__name__}")
    flat = {}
    for name, value in loss_inputs.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"loss_inputs[{name!r}] must be a tensor, got {type(value).__name__}")
        if value.shape != lead_shape:
            raise ValueError(f"loss_inputs[{name!r}] has shape {tuple(value.shape)}; expected {tuple(lead_shape)}")
        if value.device != device:
            raise ValueError(f"loss_inputs[{name!r}] is on {value.device}; expected {device}")
        if value.requires_grad:
            raise ValueError(f"loss_inputs[{name!r}] requires grad, but no gradient flows into loss inputs; detach it")
        flat[name] = value.reshape(-1)
    return flat


def per_token_losses(loss_fn: LossFn, logprob: Tensor, entropy: Tensor, inputs: Dict[str, Tensor]) -> Tensor:
    """``loss_fn(logprob [rows], entropy [rows], **inputs)`` as float32 ``[rows]``, or a clear error
    when it is not one loss per row."""
    losses = loss_fn(logprob, entropy, **inputs)
    if not isinstance(losses, Tensor) or not losses.dtype.is_floating_point:
        raise TypeError(f"loss_fn must return a float tensor of per-token losses, got {losses!r:.80}")
    if losses.shape != logprob.shape:
        raise ValueError(
            f"loss_fn must return one loss per token, shape {tuple(logprob.shape)}, got {tuple(losses.shape)}: "
            "it is called on chunks of rows and its results are summed, so it must not reduce across rows"
        )
    return losses.float()


class _ChunkLoss:
    """The per-chunk step both backends call (``contract.ChunkUpstream``): merge the chunk's shard
    statistics across the group, record its log-probs and entropy, and evaluate ``loss_fn`` and
    its per-token gradients."""

    def __init__(self, loss_fn: LossFn, inputs: Dict[str, Tensor], num_rows: int, device, tp_group):
        self.loss_fn, self.inputs, self.tp_group = loss_fn, inputs, tp_group
        self.logprob, self.entropy, self.lse, self.mean_logit = (
            torch.empty(num_rows, dtype=torch.float32, device=device) for _ in range(4)
        )
        self.total = torch.zeros((), dtype=torch.float32, device=device)

    def __call__(self, rows: slice, local_statistics: Tensor) -> tuple[SavedStatistics, UpstreamGrads]:
        summary = summarize(merge_across_group(local_statistics, self.tp_group))
        for name in ("logprob", "entropy", "lse", "mean_logit"):
            getattr(self, name)[rows] = getattr(summary, name)
        logprob = summary.logprob.detach().requires_grad_()
        entropy = summary.entropy.detach().requires_grad_()
        with torch.enable_grad():
            losses = per_token_losses(
                self.loss_fn, logprob, entropy, {name: value[rows] for name, value in self.inputs.items()}
            )
            total = losses.sum()
        self.total += total.detach()
        if not total.requires_grad:
            return summary.saved, UpstreamGrads(None, None)
        grad_logprob, grad_entropy = torch.autograd.grad(total, (logprob, entropy), allow_unused=True)
        return summary.saved, UpstreamGrads(grad_logprob, grad_entropy)


def _forward_gradients(
    hidden: Tensor, weight: Tensor, targets: ShardTargets, chunk_loss: _ChunkLoss, options: LossOptions, needed
) -> StoredGradients:
    """The backend's three-GEMM pass: this shard's gradients, kept in float32."""
    problem = ShardProblem(hidden, weight, targets, options.temperature)
    with autocast_off(hidden.device):
        backend = resolve_backend(options.backend, hidden.device, options.token_chunk)
        return backend.loss_gradients(problem, chunk_loss, needed)


def _take_stored(ctx, name: str) -> StoredGradients:
    """The gradients the forward stored; a second backward through the graph has nothing left."""
    stored, ctx.stored = ctx.stored, None
    if stored is None:
        raise RuntimeError(f"{name}: its gradients were used by an earlier backward")
    return stored


def _finished(
    stored: StoredGradients, scale: Tensor, options: LossOptions
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The stored gradients times the upstream ``scale``, each rounded once into its parameter's
    dtype, the hidden gradient then summed over the group when asked (in that dtype, as the
    recompute path and Megatron's column-parallel layer do)."""
    grads = stored.scaled(scale.float())
    if grads.hidden is not None and options.reduce_hidden_grad:
        all_reduce_sum(grads.hidden, options.tp_group)
    return grads


def _needed_grads(ctx, grad_enabled: bool) -> NeededGrads:
    # needs_input_grad ignores grad mode; under no_grad the forward computes no gradients.
    return NeededGrads(*(grad_enabled and needed for needed in ctx.needs_input_grad[:2]))


class _FusedLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, local_target, owned, loss_fn, inputs, options: LossOptions, grad_enabled):
        chunk_loss = _ChunkLoss(loss_fn, inputs, hidden.shape[0], hidden.device, options.tp_group)
        needed = _needed_grads(ctx, grad_enabled)
        ctx.stored = _forward_gradients(hidden, weight, ShardTargets(local_target, owned), chunk_loss, options, needed)
        ctx.options = options
        ctx.mark_non_differentiable(chunk_loss.logprob, chunk_loss.entropy)
        return chunk_loss.total, chunk_loss.logprob, chunk_loss.entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logprob, _grad_entropy):
        stored = _take_stored(ctx, "fused_linear_loss")
        return *_finished(stored, grad_loss, ctx.options), None, None, None, None, None, None


def fused_linear_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    loss_fn: LossFn,
    *,
    loss_inputs: Optional[Dict[str, Tensor]] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    mask: Optional[Tensor] = None,
    backend: str = "torch",
    chunk_size: Optional[int] = None,
    reduce_hidden_grad: bool = True,
) -> FusedLoss:
    """``sum_t loss_fn(logprob_t, entropy_t, inputs_t)`` over the rows of
    ``softmax(hidden @ weight.T / temperature)``, with its gradients computed in the forward
    (three GEMMs): the per-token loss must be known before the step.

    ``loss_fn(logprob, entropy, **inputs) -> losses`` is called on chunks of rows: ``logprob``
    and ``entropy`` are float32 ``[rows]`` (requiring grad), ``inputs`` holds the same rows of each
    tensor in ``loss_inputs``. It must return one float loss per row, ``[rows]``, computed from
    that row alone: **the loss is the sum of what it returns over all chunks, so a function that
    reduces or normalizes across rows (a mean, a per-sequence max, a normalizer that depends on
    this step's log-probs) is wrong here.** Express normalizations as per-token weights among the
    inputs instead (``losses.token_mean_weights``). Ready-made functions: ``losses.cross_entropy``,
    ``losses.ClippedPolicyLoss``.

    Args:
        hidden, weight, targets, tp_group, temperature, backend, chunk_size, reduce_hidden_grad:
            as for ``fused_linear_logprob``. ``chunk_size`` is the rows per three-GEMM chunk;
            ``None`` picks one that bounds the working set.
        loss_fn: the per-token loss, as above.
        loss_inputs: per-token inputs of ``loss_fn``: a dict of tensors shaped like ``targets``
            (old log-probs, advantages, weights, ...), on hidden's device, needing no gradient;
            under tensor parallelism the same on every rank.
        mask: optional bool ``[...]``: only rows where it is True are computed and summed; the
            others have log-prob and entropy 0. The number of selected rows is read on the host.

    Returns:
        ``FusedLoss(loss, logprob, entropy)``: ``loss`` a float32 scalar, differentiable w.r.t.
        ``hidden`` (gradient in hidden's dtype) and ``weight`` (in the weight's dtype); ``logprob``
        and ``entropy`` float32 ``[...]`` metrics, detached. The gradients are computed in the
        forward and held in float32 until the backward, which multiplies them by the upstream
        gradient and rounds each once into its dtype (then, with ``reduce_hidden_grad``, sums the
        hidden gradient over ``tp_group``: one all-reduce); a second backward through the same
        graph is an error. Nothing flows into ``loss_inputs``.
    """
    check_linear_inputs(hidden, weight)
    check_options(temperature, chunk_size)
    check_backend(backend)
    selection = select_rows(targets, hidden.shape[:-1], mask, None, weight.shape[0], tp_group)
    inputs = check_loss_inputs(loss_fn, loss_inputs, hidden.shape[:-1], hidden.device)
    if selection.rows is not None:
        inputs = {name: value.index_select(0, selection.rows) for name, value in inputs.items()}
    options = LossOptions(float(temperature), backend, chunk_size, tp_group, reduce_hidden_grad)
    loss, logprob, entropy = _FusedLossFunction.apply(
        selection.take(hidden).to(weight.dtype),
        weight,
        *selection.targets,
        loss_fn,
        inputs,
        options,
        torch.is_grad_enabled(),
    )
    return FusedLoss(loss, selection.place(logprob), selection.place(entropy))


# The labels path: per-token cross-entropy for a declared upstream gradient.


def _declared_cross_entropy(logprob: Tensor, entropy: Tensor, *, declared_weight: Tensor) -> Tensor:
    return -declared_weight * logprob


# How far an upstream gradient may stray from ``c * declared_weights`` (relative to its largest
# entry) and still count as that: float32 rounding of a mask times a scale, not a different loss.
PROPORTIONAL_TOLERANCE = 1e-5


def proportional_scale(upstream: Tensor, declared: Tensor) -> Optional[Tensor]:
    """``c`` (a 0-dim float32 tensor) such that ``upstream == c * declared`` up to
    ``PROPORTIONAL_TOLERANCE``, or ``None`` when there is none (one host synchronization)."""
    upstream, declared = upstream.float(), declared.float()
    norm = (declared * declared).sum()
    scale = torch.where(norm > 0, (upstream * declared).sum() / norm.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    deviation = (upstream - scale * declared).abs().max() if upstream.numel() else upstream.new_zeros(())
    bound = PROPORTIONAL_TOLERANCE * upstream.abs().max() if upstream.numel() else upstream.new_zeros(())
    return scale if bool(deviation <= bound) else None


class _DeclaredCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, local_target, owned, declared, options: LossOptions, grad_enabled):
        inputs = {"declared_weight": declared}
        chunk_loss = _ChunkLoss(_declared_cross_entropy, inputs, hidden.shape[0], hidden.device, options.tp_group)
        needed = _needed_grads(ctx, grad_enabled)
        ctx.stored = _forward_gradients(hidden, weight, ShardTargets(local_target, owned), chunk_loss, options, needed)
        ctx.options = options
        ctx.save_for_backward(hidden, weight, local_target, owned, declared, chunk_loss.lse, chunk_loss.mean_logit)
        return -chunk_loss.logprob

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, local_target, owned, declared, lse, mean_logit = ctx.saved_tensors
        stored = _take_stored(ctx, "fused_linear_cross_entropy")
        scale = proportional_scale(grad_losses, declared)
        if scale is not None:
            return *_finished(stored, scale, ctx.options), None, None, None, None, None
        # Not the declared loss: the exact gradient of this upstream, by the recompute path.
        warn_once(
            "megatron_fused_lm: the upstream gradient of fused_linear_cross_entropy is not proportional to the "
            "declared weights; its gradients are recomputed exactly (four GEMMs instead of three)"
        )
        options: LossOptions = ctx.options
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden, grad_weight = fused_backward(
            hidden, weight, local_target, owned, lse, mean_logit, -grad_losses.float(), None,
            options.temperature, options.backend, options.token_chunk, group_name(options.tp_group),
            options.reduce_hidden_grad, need_hidden, need_weight,
        )  # fmt: skip
        grad_hidden, grad_weight = (grad_hidden if need_hidden else None), (grad_weight if need_weight else None)
        return grad_hidden, grad_weight, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    declared_weights: Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    backend: str = "torch",
    chunk_size: Optional[int] = None,
    reduce_hidden_grad: bool = True,
) -> Tensor:
    """Per-token cross-entropy ``-logprob [...]`` (float32), its gradients computed in the forward
    (three GEMMs) for an upstream gradient declared up to a scalar: ``c * declared_weights``.

    This is the shape of Megatron's SFT loss, ``sum(losses * loss_mask) * scale``: declare the
    loss mask (or any per-token weights) and the scale may stay unknown. The backward checks the
    upstream gradient it receives (one host synchronization): proportional to ``declared_weights``
    (within ``PROPORTIONAL_TOLERANCE``), it returns the stored gradients times ``c``; otherwise it
    recomputes the exact gradient for what arrived, at the cost of the fourth GEMM. Either way the
    result is that of ``fused_linear_logprob``.

    Args:
        declared_weights: ``[...]`` (``targets``' shape) float per-token weights, needing no
            gradient, the same on every rank of ``tp_group``.
        the rest: as for ``fused_linear_logprob``.
    """
    check_linear_inputs(hidden, weight)
    check_options(temperature, chunk_size)
    check_backend(backend)
    selection = select_rows(targets, hidden.shape[:-1], None, None, weight.shape[0], tp_group)
    declared = check_loss_inputs(
        _declared_cross_entropy, {"declared_weights": declared_weights}, hidden.shape[:-1], hidden.device
    )["declared_weights"]
    if not declared.dtype.is_floating_point and declared.dtype != torch.bool:
        raise TypeError(f"declared_weights must be float or bool, got {declared.dtype}")
    options = LossOptions(float(temperature), backend, chunk_size, tp_group, reduce_hidden_grad)
    losses = _DeclaredCrossEntropyFunction.apply(
        selection.take(hidden).to(weight.dtype),
        weight,
        *selection.targets,
        declared.float(),
        options,
        torch.is_grad_enabled(),
    )
    return selection.place(losses)
