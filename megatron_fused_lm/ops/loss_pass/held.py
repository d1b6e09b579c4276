"""The held forward of the three-GEMM pass and its backward: a loss known in the forward gets its
gradients there, held in float32 until the backward scales them by the upstream gradient and rounds
each once (``docs/DESIGN.md``, "The three-GEMM pass" and "Precision").

1. ``run_held_pass`` runs the chunk loop (``chunks.run_loss_pass``) with a step that summarizes the
   chunk and evaluates the loss's per-row gradients (``chunks.ChunkLoss``; the labels path's
   cross-entropy has them in closed form: -1 for the hidden gradient, the declared weights for the
   weight's). The weight gradient goes where the sink says (``weight_grad.WeightGradSink``).
2. ``HeldGradients.apply`` attaches the loss to ``hidden`` and ``weight``; what the backward reads
   reaches it through ``save_for_backward`` (``Held``), what it needs besides tensors in one
   ``HeldSpec``.
3. ``finish`` (the backward; ``held_backward`` in a compiled graph), without a host synchronization
   on the Triton backend: the hidden gradient is exact for any upstream gradient (a scalar loss's
   held rows times ``c / s``; per-token losses hold each row's own gradient, times its upstream);
   the weight gradient is the held one times the upstream's scale plus, where the upstream is not
   the one the forward assumed, the weight gradient of the difference (``correct_weight``: the pass
   again on the saved rows, its stored block the forward's to the bit, behind a gate the Triton
   kernels read on the device).
"""

from __future__ import annotations

import dataclasses
from typing import List, NamedTuple, Optional

import torch

from ..backends.contract import Gradients, NeededGrads, ShardProblem, UpstreamGrads, deviates, finish_weight
from ..backends.registry import by_name
from ..boundary import autocast_off, new_summary
from ..distributed import all_reduce_sum
from ..inputs import may_synchronize
from ..options import OPTIONS_SCHEMA, HeadOptions, Keywords
from ..softmax import SoftmaxSummary
from .chunks import ChunkLoss, phases_for, run_loss_pass
from .weight_grad import WeightGradSink, record_correction

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class HeldSpec(Keywords):
    """What a pass's backward needs besides its tensors; the compiled backward's custom operator
    takes every field by name."""

    per_token: bool  # fused_linear_cross_entropy: losses [n] whose upstream is declared up to a scale
    has_weight_grad_into: bool  # the weight gradient went into the caller's weight_grad_into
    weight_grad_scale: float  # the upstream gradient the held gradients are for (the sink's)
    parts: int  # the held weight gradient's own float32 parts among the tensors
    correctable: bool  # the problem, its summary and the correction's basis are among the tensors
    dtype: torch.dtype  # the gradients' (the weight's)


class Held(NamedTuple):
    """The tensors a pass's backward reads, in ``save_for_backward``'s order (``flat``)."""

    hidden: Tensor  # [n, H] float32: the held hidden gradient, or [0]
    parts: List[Tensor]  # the held weight gradient's own float32 row parts, or none
    problem: Optional[ShardProblem]  # for a correction: the rows, weight, targets, temperatures, kept columns
    summary: Optional[SoftmaxSummary]  # ... the rows' summary
    reference: Optional[Tensor]  # ... what the block was stored against, where a pass keeps it per row
    basis: Optional[UpstreamGrads]  # ... per token the declared weights; a scalar loss its per-row gradients

    def flat(self) -> List[Tensor]:
        tensors = [self.hidden, *self.parts]
        if self.problem is not None:  # a term the basis lacks as an empty tensor (a pass with a basis has rows)
            basis = [self.hidden.new_empty(0) if grad is None else grad for grad in self.basis]
            tensors += [*self.problem, *self.summary, self.reference, *basis]
        return tensors

    @classmethod
    def unflat(cls, spec: HeldSpec, tensors: List[Tensor]) -> Held:
        hidden, parts, rest = tensors[0], tensors[1 : 1 + spec.parts], tensors[1 + spec.parts :]
        if not spec.correctable:
            return cls(hidden, parts, None, None, None, None)
        basis = UpstreamGrads(*(None if grad.numel() == 0 else grad for grad in rest[11:]))
        return cls(hidden, parts, ShardProblem(*rest[:5]), SoftmaxSummary(*rest[5:10]), rest[10], basis)


def run_held_pass(
    problem: ShardProblem,
    *,
    options: HeadOptions,
    sink: Optional[WeightGradSink],
    loss: Optional[ChunkLoss] = None,
    declared: Optional[Tensor] = None,
) -> tuple[Tensor, SoftmaxSummary]:
    """``(loss, summary)`` of one pass over ``problem`` (its ``hidden`` and ``weight`` detached, in
    the weight's dtype), the loss attached to ``hidden`` and ``weight`` (which carry the graph)
    where a gradient is needed: the scalar sum of ``loss``'s losses, or with ``declared [n]``
    float32 weights the per-token cross-entropy ``-logprob``, its upstream declared as
    ``sink.weight_grad_scale * declared``. ``sink``: where the weight gradient goes (``None``: none
    is needed)."""
    hidden, weight = problem.hidden, problem.weight
    problem = problem._replace(hidden=hidden.detach(), weight=weight.detach())
    enabled = torch.is_grad_enabled()
    needed = NeededGrads(enabled and hidden.requires_grad, enabled and weight.requires_grad and sink is not None)
    phases = phases_for(options)
    weight_grad_into = sink.weight_grad_into if sink is not None else None
    has_weight_grad_into = weight_grad_into is not None
    weight_grad_scale = sink.weight_grad_scale if sink is not None else 1.0
    summary = new_summary(problem.target_column)
    with autocast_off(hidden.device):
        state = phases.allocate(problem, needed, options, None if weight_grad_into is None else [weight_grad_into])
        if declared is not None:  # the labels path: -logprob, the hidden side's gradient -1 for every row
            minus_one = torch.full_like(declared, -1.0)
            weight_row_scale = declared if weight_grad_scale == 1.0 else declared * weight_grad_scale

        def step(rows: slice, local: Tensor):
            part = SoftmaxSummary(*(field[rows] for field in summary))
            phases.summarize_chunk(problem, rows, local=local, out=part, options=options)
            if declared is not None:
                return part, UpstreamGrads(minus_one[rows], None), weight_row_scale[rows]
            return part, loss(rows, part.logprob, part.entropy), None

        try:
            run_loss_pass(
                phases, problem, chunk_step=step, state=state, options=options, accumulate=has_weight_grad_into
            )
        except BaseException:
            if sink is not None and sink.pending is not None:
                sink.pending.release("stopped with an exception part way")
            raise
    value = -summary.logprob if declared is not None else _total(loss, hidden)
    if not (needed.hidden or needed.weight):
        return value, summary
    correctable = needed.weight and (declared is not None or has_weight_grad_into) and hidden.shape[0] > 0
    own_parts = [] if has_weight_grad_into else state.held_weight
    spec = HeldSpec(
        per_token=declared is not None,
        has_weight_grad_into=has_weight_grad_into,
        weight_grad_scale=weight_grad_scale,
        parts=len(own_parts),
        correctable=correctable,
        dtype=weight.dtype,
    )
    held = Held(state.held_hidden, own_parts, None, None, None, None)
    if correctable:
        basis = UpstreamGrads(declared, None) if declared is not None else loss.saved_grads
        held = held._replace(problem=problem, summary=summary, reference=state.reference, basis=basis)
    attached = HeldGradients.apply((value,), hidden, weight, spec, options, sink, *held.flat())
    if has_weight_grad_into:  # reports the node's release before its backward; per token, the losses weighed
        sink.pending.watch(attached.grad_fn, value, *(() if declared is None else (declared,)))
    return attached, summary


def _total(loss: ChunkLoss, hidden: Tensor) -> Tensor:
    total = loss.total
    return hidden.new_zeros((), dtype=torch.float32) if total is None else total


class HeldGradients(torch.autograd.Function):
    """A pass's loss (0-dim, or ``[n]`` per token) as the output of ``hidden`` and ``weight``; the
    backward finishes the held gradients for the upstream gradient it receives (``finish``), once:
    a second backward through the same graph is an error (the held memory was narrowed in place)."""

    @staticmethod
    def forward(ctx, value: tuple, hidden, weight, spec: HeldSpec, options: HeadOptions, sink, *tensors):
        # The value comes in a tuple: not an input of the node, it becomes its output as it is.
        ctx.save_for_backward(*tensors)
        ctx.spec, ctx.options, ctx.sink, ctx.consumed, ctx.num_tensors = spec, options, sink, False, len(tensors)
        return value[0]

    @staticmethod
    def backward(ctx, upstream: Tensor):
        spec, options = ctx.spec, ctx.options
        if torch.compiler.is_compiling():
            grads = held_backward(upstream, list(ctx.saved_tensors), **spec.fields(), **options.fields())
            grads = Gradients(*(grad if grad.dim() == 2 else None for grad in grads))
        else:
            if ctx.consumed:  # the held gradients were narrowed in place: a second backward would read that
                name = "fused_linear_cross_entropy" if spec.per_token else "fused_linear_loss"
                raise RuntimeError(f"{name}: its gradients were used by an earlier backward")
            ctx.consumed = True
            if ctx.sink is not None and ctx.sink.pending is not None:
                ctx.sink.pending.close()  # the weight gradient added in the forward now has its backward
            weight_grad_into = ctx.sink.weight_grad_into if ctx.sink is not None else None
            held = Held.unflat(spec, list(ctx.saved_tensors))
            grads = finish(spec, options, held=held, upstream=upstream, weight_grad_into=weight_grad_into, narrow=True)
        return None, grads.hidden, grads.weight, None, None, None, *(None,) * ctx.num_tensors


def finish(
    spec: HeldSpec, options: HeadOptions, held: Held, upstream: Tensor, weight_grad_into: Optional[Tensor], narrow: bool
) -> Gradients:
    """The gradients for the loss's ``upstream`` gradient (0-dim, or ``[n]`` per token): the hidden
    one exact whatever arrives, summed over the group when asked (in its dtype, as the recompute
    path and Megatron's column-parallel layer do); the weight one into ``weight_grad_into`` (the
    caller's; ``None``: from the held parts, narrowed into their memory with ``narrow``), with its
    correction where the upstream is not the one assumed."""
    backend, upstream, weight_grad_scale = by_name(options.backend), upstream.float(), spec.weight_grad_scale
    if spec.has_weight_grad_into and weight_grad_into is None:
        raise RuntimeError("weight_grad_into runs eagerly only: its loss's backward cannot run in a compiled graph")
    with autocast_off(upstream.device):
        if spec.per_token:  # each row holds its own gradient: times its upstream
            hidden_factor, weight_factor = upstream, None  # without rows the held weight gradient is 0
            if spec.correctable:  # the weight gradient is held for the declared weights
                given = weight_grad_scale if spec.has_weight_grad_into else None  # None: fitted on the device
                weight_factor, grad_logprob, ran = backend.fit_declared(upstream, held.basis.logprob, given)
                correction = UpstreamGrads(torch.where(ran, grad_logprob, 0.0), None)  # where, not *: inf * 0
        else:
            hidden_factor = weight_factor = upstream / weight_grad_scale
            if spec.correctable:  # into weight_grad_into, for the upstream weight_grad_scale
                ran = deviates((upstream - weight_grad_scale).reshape(1), upstream.new_full((1,), weight_grad_scale))
                ratio = torch.where(ran, weight_factor - 1, 0.0)
                correction = UpstreamGrads(*(None if grad is None else grad * ratio for grad in held.basis))
        if spec.correctable:
            parts = [weight_grad_into] if spec.has_weight_grad_into else held.parts
            correct_weight(backend, options, held=held, upstream=correction, ran=ran, parts=parts)
            record_correction(ran, _correction_note(spec))
        hidden = None
        if held.hidden.dim() == 2:
            hidden = backend.scaled_copy(held.hidden, hidden_factor, torch.empty_like(held.hidden, dtype=spec.dtype))
            if options.reduce_hidden_grad:
                all_reduce_sum(hidden, options.tp_group)
        weight = None
        if not spec.has_weight_grad_into:
            weight = finish_weight(
                held.parts, weight_factor, dtype=spec.dtype, narrow_in_place=narrow, scaled_copy=backend.scaled_copy
            )
    return Gradients(hidden, weight)


def correct_weight(
    backend, options: HeadOptions, held: Held, upstream: UpstreamGrads, ran: Tensor, parts: List[Tensor]
) -> None:
    """Add the weight gradient of the per-row ``upstream`` (0 where the 0-dim bool ``ran`` is false)
    into ``parts`` (``[weight_grad_into]``, or the held float32 parts): the pass again on the saved rows,
    summary and references, whose stored block is the forward's to the bit, so that a sum of the
    held and the corrected gradient rounds as one (a correction that only rescales cancels rather
    than adds their roundings). A backend that ``gates_on_device`` runs its kernels behind ``ran``;
    the torch backend reads it on the host, and runs either way while a CUDA graph is captured (it
    then adds zeros)."""
    if not backend.gates_on_device and may_synchronize(ran) and not bool(ran):
        return
    gate = ran if backend.gates_on_device else None
    state = backend.allocate(held.problem, NeededGrads(hidden=False, weight=True), options, parts)
    if state.reference.dim() == 1 and state.reference.numel():  # references per row: the forward's
        state = state._replace(reference=held.reference)
    state = state._replace(gate=gate)

    def step(rows: slice, local: Tensor):
        return SoftmaxSummary(*(field[rows] for field in held.summary)), upstream.rows(rows), None

    run_loss_pass(backend, held.problem, chunk_step=step, state=state, options=options, accumulate=True)


def _correction_note(spec: HeldSpec) -> str:
    name, held = "fused_linear_cross_entropy", f"{spec.weight_grad_scale:g} times the declared weights"
    if not spec.per_token:
        name, held = "fused_linear_loss", f"{spec.weight_grad_scale:g}"
    return (
        f"megatron_fused_lm: {name} held its weight gradient for an upstream gradient of {held} but received "
        "another; the difference is corrected by a second pass (two GEMMs, exact; declare what the loss receives "
        "to avoid it)"
    )


@torch.library.custom_op(
    "megatron_fused_lm::held_backward",
    mutates_args=(),
    schema=f"(Tensor upstream, Tensor[] tensors, *, {HeldSpec.schema()}, {OPTIONS_SCHEMA}) -> (Tensor, Tensor)",
)
def held_backward(upstream: Tensor, tensors: List[Tensor], **fields) -> tuple[Tensor, Tensor]:
    """``finish`` in a compiled graph, into new memory (a custom operator may not return its
    inputs' memory); ``weight_grad_into`` runs eagerly only. An unneeded gradient is empty."""
    spec_fields = {name: fields.pop(name) for name in HeldSpec.__dataclass_fields__}
    spec = HeldSpec(**spec_fields)
    held, options = Held.unflat(spec, tensors), HeadOptions(**fields)
    grads = finish(spec, options, held=held, upstream=upstream, weight_grad_into=None, narrow=False)
    return tuple(tensors[0].new_empty(0) if grad is None else grad for grad in grads)


@held_backward.register_fake
def _(upstream, tensors, *, parts, dtype, **fields) -> tuple[Tensor, Tensor]:
    held_hidden, held_weight = tensors[0], tensors[1 : 1 + parts]
    hidden = torch.empty_like(held_hidden, dtype=dtype) if held_hidden.dim() == 2 else held_hidden.new_empty(0)
    if not held_weight:
        return hidden, held_hidden.new_empty(0)
    return hidden, held_weight[0].new_empty(
        sum(part.shape[0] for part in held_weight), held_weight[0].shape[1], dtype=dtype
    )
