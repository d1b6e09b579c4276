"""The three-GEMM pass of ``fused_linear_loss`` and ``fused_linear_cross_entropy``: a loss known in
the forward gets its gradients there, held until the backward scales them.

1. ``HeldPass.run``: per token chunk, the backend's logits block and shard statistics (GEMM 1),
   the merged statistics and the loss's per-token gradients (``ChunkLoss``), then ``dz`` and its
   two products (GEMMs 2 and 3) into the held hidden gradient and the weight gradient's sink: float32
   parts of the pass's own, or the caller's ``weight_grad_into``. The held gradients are those of
   the upstream gradient the forward assumes: ``weight_grad_scale`` times the loss (1 without a
   caller's sink), times the ``declared`` per-token weights for per-token losses.
2. ``HeldGradients.apply`` attaches the loss to ``hidden`` and ``weight``; the pass's tensors reach
   the backward through ``save_for_backward``.
3. ``HeldPass.backward`` reduces the upstream gradient to a scale ``c`` of the assumed one (a scalar
   loss's gradient itself; per-token losses, their proportional fit to the declared weights) and
   a. where it is the assumed one (always, for a scalar loss into its own parts), finishes the held
      gradients times ``c / weight_grad_scale``, each rounded once into its parameter's dtype;
   b. otherwise runs the pass again on the difference (three GEMMs, exact by linearity), adding into
      the same sink, with one warning, and finishes the sum.

``docs/DESIGN.md`` ("The three-GEMM pass") says why each step is where it is.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from .._logging import warn_once
from .accumulation import PendingWeightGrad
from .backends import loss_backend
from .boundary import OperatorLossBackend, autocast_off, merge_statistics, target_logits
from .contract import Gradients, LossState, NeededGrads, ShardProblem, run_loss_pass
from .distributed import all_reduce_sum
from .loss_in_forward import PROPORTIONAL_TOLERANCE, ChunkLoss, LossFn, proportional_scale
from .losses import cross_entropy
from .options import HeadOptions

Tensor = torch.Tensor


@dataclasses.dataclass(eq=False)
class HeldPass:
    """One three-GEMM pass and what its backward needs. ``problem``: the rows ``[n, H]`` and the
    weight shard, detached, in the weight's dtype; ``inputs``: ``loss_fn``'s inputs ``[n, ...]``;
    ``per_token``: ``losses.cross_entropy`` per token, its upstream declared up to a scalar as
    ``inputs["weight"]``, else the scalar sum of ``loss_fn``'s losses; ``weight_grad_into``: the
    caller's float32 ``[vocab_shard, H]`` sink, or ``None`` for parts of the pass's own;
    ``weight_grad_scale``: the upstream gradient the held gradients are for."""

    problem: ShardProblem
    loss_fn: LossFn
    inputs: Dict[str, Tensor]
    options: HeadOptions
    needed: NeededGrads
    per_token: bool = False
    weight_grad_into: Optional[Tensor] = None
    weight_grad_scale: float = 1.0
    pending: Optional[PendingWeightGrad] = None  # the added gradient's record, until the backward
    held: Optional[LossState] = None  # after run: the held gradients (the block is not kept)
    # After run: the merged statistics [n, 4] (and several targets' logits, [n, 4 + k]), which a
    # second pass reuses.
    merged: Optional[Tensor] = None
    dtype: Optional[torch.dtype] = None  # the gradients' (the weight's); set by run

    @property
    def into_caller(self) -> bool:
        return self.weight_grad_into is not None

    def run(self) -> ChunkLoss:
        """The forward's pass: the loss and its metrics (the returned ``ChunkLoss``) and the held
        gradients."""
        sink = [self.weight_grad_into] if self.into_caller else None
        if self.into_caller:
            self.pending = PendingWeightGrad(
                self.weight_grad_into, self.weight_grad_scale, self.problem.hidden.shape[0]
            )
        try:
            chunk_loss, state = self._pass(self.inputs, self.weight_grad_scale, sink, None)
        except BaseException:
            if self.pending is not None:
                self.pending.release("stopped with an exception part way")
            raise
        self.held, self.merged = LossState(None, None, state.held_hidden, state.held_weight), chunk_loss.merged
        self.dtype = self.problem.weight.dtype
        return chunk_loss

    def _pass(self, inputs: Dict[str, Tensor], upstream_scale, held_weight: Optional[List[Tensor]], merged):
        """``(ChunkLoss, LossState)`` of a pass whose per-token gradients are the loss's times
        ``upstream_scale`` (a float or a 0-dim tensor), on the merged statistics ``merged`` of an
        earlier pass where given (no communication), else merging its own."""
        if merged is None:
            group, problem = self.options.tp_group_name, self.problem

            def merge(rows: slice, local: Tensor) -> Tensor:
                stats = merge_statistics(local, tp_group_name=group)
                if problem.target_column.dim() == 1:
                    return stats
                # Several targets per row: their logits beside the statistics, [rows, 4 + k].
                columns, temperature = problem.target_column[rows], problem.temperature[rows]
                logits = target_logits(problem.hidden[rows], problem.weight, columns, temperature, tp_group_name=group)
                return torch.cat([stats, logits], dim=1)

        else:
            merge = lambda rows, local: merged[rows]  # noqa: E731
        scale = None if isinstance(upstream_scale, float) and upstream_scale == 1.0 else upstream_scale
        gradients = self.needed.hidden or self.needed.weight
        chunk_loss = ChunkLoss(
            self.loss_fn, inputs, self.problem.target_column, merge, self.options.entropy_grad, gradients, scale
        )
        state = run_loss_pass(OperatorLossBackend(self.options), self.problem, chunk_loss, self.needed, held_weight)
        return chunk_loss, state

    def run_again(self, difference: Tensor) -> None:
        """Add the gradients of ``difference`` to the held ones by the pass again, into the same sink:
        for a scalar loss the upstream gradient still missing (0-dim), for per-token losses the
        per-token upstream still missing (``[n]``)."""
        held_weight = self.held.held_weight if self.needed.weight else None
        inputs, upstream_scale = ({"weight": difference}, 1.0) if self.per_token else (self.inputs, difference)
        _, extra = self._pass(inputs, upstream_scale, held_weight, self.merged)
        if self.needed.hidden:
            self.held.held_hidden.add_(extra.held_hidden)

    def backward(self, upstream: Tensor, narrow_in_place: bool) -> Gradients:
        """The gradients for the loss's upstream gradient ``upstream`` (0-dim, or ``[n]``
        per token); the weight's is ``None`` where it went into ``weight_grad_into``."""
        assumed, upstream = self.weight_grad_scale, upstream.float()
        declared = self.inputs["weight"] if self.per_token else 1.0
        scale = proportional_scale(upstream, declared) if self.per_token else upstream
        if scale is not None and (
            not self.into_caller or bool((scale - assumed).abs() <= PROPORTIONAL_TOLERANCE * abs(assumed))
        ):
            return self.finish(scale / assumed, narrow_in_place)
        self._warn_of_second_pass(scale)
        self.run_again(upstream - assumed * declared)
        return self.finish(None, narrow_in_place)

    def finish(self, scale: Optional[Tensor], narrow_in_place: bool) -> Gradients:
        """The held gradients times ``scale`` (``None``: 1), each rounded once into its parameter's
        dtype, the hidden gradient then summed over the group when asked (in that dtype, as the
        recompute path and Megatron's column-parallel layer do)."""
        held_weight, dtypes = ([] if self.into_caller else self.held.held_weight), (self.dtype, self.dtype)
        with autocast_off(self.held.held_hidden.device):
            grads = loss_backend(self.options.backend).finish(
                self.held.held_hidden, held_weight, scale, dtypes, narrow_in_place
            )
        if grads.hidden is not None and self.options.reduce_hidden_grad:
            all_reduce_sum(grads.hidden, self.options.tp_group)
        return grads

    def _warn_of_second_pass(self, scale: Optional[Tensor]) -> None:
        if self.per_token:
            name, held = "fused_linear_cross_entropy", f"{self.weight_grad_scale:g} times the declared weights"
            received = "a gradient not proportional to them" if scale is None else f"{float(scale):g} times them"
        else:
            name, held, received = "fused_linear_loss", f"{self.weight_grad_scale:g}", f"{float(scale):g}"
        warn_once(
            f"megatron_fused_lm: {name} held its gradients for an upstream gradient of {held} but received {received}; "
            "the difference is corrected by a second pass (three GEMMs, exact; declare what the loss receives to "
            "avoid it)"
        )

    # What crosses into the backward: the tensors through save_for_backward, the rest on the node.

    @property
    def may_run_again(self) -> bool:
        return self.per_token or self.into_caller

    def pack(self) -> tuple[HeldPass, List[Tensor]]:
        """``(the pass without its tensors, its tensors)``, for the autograd node and its
        ``save_for_backward``: the held gradients (not a caller's sink, which other gradients
        change meanwhile) and, where a second pass may run, the problem (rows, weight, targets,
        temperatures, kept columns) and the loss's inputs."""
        held_weight = [] if self.into_caller else self.held.held_weight
        tensors = [self.held.held_hidden, *held_weight]
        if self.may_run_again:
            tensors += [*self.problem, self.merged, *self.inputs.values()]
        bare = dataclasses.replace(
            self, problem=ShardProblem(*[None] * len(ShardProblem._fields)),
            inputs=dict.fromkeys(self.inputs), held=LossState(None, None, None, [None] * len(held_weight)), merged=None,
        )  # fmt: skip
        return bare, tensors

    def unpack(self, tensors: List[Tensor]) -> HeldPass:
        """The pass ``pack`` stripped, with its tensors back."""
        held_hidden, *rest = tensors
        parts = len(self.held.held_weight)
        held_weight, rest = rest[:parts], rest[parts:]
        whole = dataclasses.replace(self, held=LossState(None, None, held_hidden, held_weight or self._sink()))
        if self.may_run_again:
            fields = len(ShardProblem._fields)
            whole.problem, whole.merged, values = ShardProblem(*rest[:fields]), rest[fields], rest[fields + 1 :]
            whole.inputs = dict(zip(self.inputs, values, strict=True))
        return whole

    def _sink(self) -> List[Tensor]:
        return [self.weight_grad_into] if self.into_caller else []


class HeldGradients(torch.autograd.Function):
    """The loss of a ``HeldPass`` (its value: 0-dim, or ``[n]`` per token) as the output of
    ``hidden`` and ``weight``; the backward finishes the held gradients for the upstream gradient
    it receives (``HeldPass.backward``), once: a second backward through the same graph is an
    error (the held memory was narrowed in place)."""

    @staticmethod
    def forward(ctx, value: Tensor, hidden: Tensor, weight: Tensor, held_pass: HeldPass, *tensors: Tensor):
        ctx.save_for_backward(*tensors)
        ctx.held_pass, ctx.consumed, ctx.num_tensors = held_pass, False, len(tensors)
        if held_pass.pending is not None:  # reports the node's release before its backward
            # per token, the last tensor is the declared weights, which the report weighs the losses by
            held_pass.pending.watch(ctx, value, *tensors[-1:] if held_pass.per_token else ())
        return value.clone()

    @staticmethod
    def backward(ctx, upstream: Tensor):
        if torch.compiler.is_compiling():
            grads = _compiled_backward(ctx.held_pass, list(ctx.saved_tensors), upstream)
        else:
            _consume(ctx, ctx.held_pass)  # before the saved tensors are read
            grads = ctx.held_pass.unpack(list(ctx.saved_tensors)).backward(upstream, narrow_in_place=True)
        return None, grads.hidden, grads.weight, None, *(None,) * ctx.num_tensors


def _consume(ctx, held_pass: HeldPass) -> None:
    # The held gradients are narrowed in place: a second backward (retain_graph) would read that.
    if ctx.consumed:
        name = "fused_linear_cross_entropy" if held_pass.per_token else "fused_linear_loss"
        raise RuntimeError(f"{name}: its gradients were used by an earlier backward")
    ctx.consumed = True
    if held_pass.pending is not None:  # the weight gradient added in the forward now has its backward
        held_pass.pending.close()


def attach(held_pass: HeldPass, value: Tensor, hidden: Tensor, weight: Tensor) -> Tensor:
    """``value`` (the pass's loss) as the output of ``hidden`` and ``weight`` whose gradients the
    pass holds, where any is needed; otherwise ``value`` itself."""
    if not (held_pass.needed.hidden or held_pass.needed.weight):
        return value
    bare, tensors = held_pass.pack()
    return HeldGradients.apply(value, hidden, weight, bare, *tensors)


# A compiled backward runs the same HeldPass.backward inside one custom operator: its proportional
# check reads a value on the host, and its memory is new (a custom operator may not narrow in place).


@torch.library.custom_op("megatron_fused_lm::held_backward", mutates_args=())
def held_backward(
    upstream: Tensor,
    tensors: List[Tensor],
    *,
    parts: int,
    dtype: torch.dtype,
    backend: str,
    token_chunk: Optional[int],
    tp_group_name: Optional[str],
    reduce_hidden_grad: bool,
    batch_invariant: bool,
) -> tuple[Tensor, Tensor]:
    """``HeldPass.backward`` of a pass ``pack``-ed into ``tensors`` (its own ``parts`` held weight
    parts: ``weight_grad_into`` runs eagerly only); per-token losses where ``upstream`` is ``[n]``.
    ``(grad_hidden, grad_weight)``, an unneeded one empty."""
    # Compiled, a scalar loss holds its own parts and never runs again: its tensors are the held ones.
    per_token = upstream.dim() > 0
    options = HeadOptions(backend, token_chunk, tp_group_name, False, reduce_hidden_grad, batch_invariant)
    needed = NeededGrads(tensors[0].dim() == 2, parts > 0)
    bare = HeldPass(
        ShardProblem(*[None] * len(ShardProblem._fields)), cross_entropy, dict.fromkeys(["weight"] if per_token else []),
        options, needed, per_token, held=LossState(None, None, None, [None] * parts), dtype=dtype,
    )  # fmt: skip
    grads = bare.unpack(tensors).backward(upstream, narrow_in_place=False)
    return tuple(tensors[0].new_empty(0) if grad is None else grad for grad in grads)


@held_backward.register_fake
def _(upstream, tensors, *, parts, dtype, **options) -> tuple[Tensor, Tensor]:
    held_hidden, held_weight = tensors[0], tensors[1 : 1 + parts]
    hidden = torch.empty_like(held_hidden, dtype=dtype) if held_hidden.dim() == 2 else held_hidden.new_empty(0)
    if not held_weight:
        return hidden, held_hidden.new_empty(0)
    return hidden, held_weight[0].new_empty(
        sum(part.shape[0] for part in held_weight), held_weight[0].shape[1], dtype=dtype
    )


def _compiled_backward(bare: HeldPass, tensors: List[Tensor], upstream: Tensor) -> Gradients:
    options = bare.options
    grads = held_backward(
        upstream, tensors, parts=len(bare.held.held_weight), dtype=bare.dtype, backend=options.backend,
        token_chunk=options.token_chunk, tp_group_name=options.tp_group_name,
        reduce_hidden_grad=options.reduce_hidden_grad, batch_invariant=options.batch_invariant,
    )  # fmt: skip
    return Gradients(*(grad if grad.dim() == 2 else None for grad in grads))
