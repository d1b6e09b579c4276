"""The three-GEMM pass of ``fused_linear_loss`` and ``fused_linear_cross_entropy``: a loss known in
the forward gets its gradients there, held until the backward scales them.

1. ``run_held_pass``, per token chunk (``contract.run_loss_pass``): the backend's logits block and
   shard statistics (GEMM 1); the statistics merged over the group and summarized
   (``boundary.merge_and_summarize``); the loss's per-row gradients (``ChunkLoss``; the labels
   path's cross-entropy has them in closed form: -1 for the hidden gradient, the declared weights
   for the weight's); ``dz`` and its two products (GEMMs 2 and 3) into the held hidden gradient and
   the weight gradient's sink (``held_gradients.WeightGradSink``); then the chosen tokens' term.
2. ``HeldGradients.apply`` attaches the loss to ``hidden`` and ``weight``; what the backward reads
   reaches it through ``save_for_backward`` (``Held``), what it needs besides tensors in one
   ``HeldSpec``.
3. ``finish`` (the backward), without a host synchronization on the Triton backend: the hidden
   gradient is exact for any upstream gradient (a scalar loss's held rows times ``c / s``; per-token
   losses hold each row's own gradient, times its upstream); the weight gradient is the held one
   times the upstream's scale plus, where the upstream is not the one the forward assumed, the
   weight gradient of the difference (``correct_weight``: the pass again on the saved rows, its
   stored block the forward's to the bit, behind a gate the Triton kernels read on the device).

``docs/DESIGN.md`` ("The three-GEMM pass") says why each step is where it is.
"""

from __future__ import annotations

import dataclasses
from typing import List, NamedTuple, Optional

import torch

from . import backends
from .accumulation import record_correction
from .boundary import OPTIONS_SCHEMA, OperatorPhases, autocast_off, merge_and_summarize, new_summary
from .contract import Gradients, NeededGrads, ShardProblem, UpstreamGrads, run_loss_pass
from .distributed import all_reduce_sum
from .held_gradients import WeightGradSink
from .inputs import may_synchronize
from .loss_in_forward import ChunkLoss, deviates
from .options import HeadOptions, Keywords
from .several_targets import gathered_logits
from .softmax import SoftmaxSummary

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class HeldSpec(Keywords):
    """What a pass's backward needs besides its tensors; the compiled backward's custom operator
    takes every field by name."""

    per_token: bool  # fused_linear_cross_entropy: losses [n] whose upstream is declared up to a scale
    into_caller: bool  # the weight gradient went into a caller's accumulator
    scale: float  # the upstream gradient the held gradients are for (the sink's)
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
    rows: Tensor,
    weight: Tensor,
    problem: ShardProblem,
    options: HeadOptions,
    sink: Optional[WeightGradSink],
    loss: ChunkLoss,
    declared: Optional[Tensor] = None,
) -> tuple[Tensor, SoftmaxSummary]:
    """``(loss, summary)`` of one pass over ``problem`` (``rows`` and ``weight`` detached, in the
    weight's dtype), the loss attached to ``rows`` and ``weight`` (which carry the graph) where a
    gradient is needed: the scalar sum of ``loss``'s losses, or with ``declared [n]`` float32
    weights the per-token cross-entropy ``-logprob``, its upstream declared as ``sink.scale *
    declared``. ``sink``: where the weight gradient goes (``None``: none is needed)."""
    enabled = torch.is_grad_enabled()
    needed = NeededGrads(enabled and rows.requires_grad, enabled and weight.requires_grad and sink is not None)
    compiling = torch.compiler.is_compiling()
    backend = backends.by_name(options.backend)
    phases = OperatorPhases(options) if compiling else backend
    into = sink is not None and sink.accumulator is not None
    summary = new_summary(problem.target_column)
    with autocast_off(rows.device):
        state = phases.allocate(problem, needed, options, [sink.accumulator] if into else None)
        if declared is not None:  # the labels path: -logprob, the hidden side's gradient -1 for every row
            minus_one = torch.full_like(declared, -1.0)
            weight_scale = declared if sink is None or sink.scale == 1.0 else declared * sink.scale

        def step(chunk: slice, local: Tensor):
            part = SoftmaxSummary(*(field[chunk] for field in summary))
            phases.summarize_chunk(problem, chunk, local, part, options) if compiling else _summarize_chunk(
                backend, problem, chunk, local, part, options
            )
            if declared is not None:
                return part, UpstreamGrads(minus_one[chunk], None), weight_scale[chunk]
            return part, loss(chunk, part.logprob, part.entropy), None

        try:
            run_loss_pass(phases, problem, step, state, options, adds=into)
        except BaseException:
            if sink is not None and sink.pending is not None:
                sink.pending.release("stopped with an exception part way")
            raise
    value = -summary.logprob if declared is not None else _total(loss, rows)
    if not (needed.hidden or needed.weight):
        return value, summary
    correctable = needed.weight and (declared is not None or into) and rows.shape[0] > 0
    spec = HeldSpec(
        per_token=declared is not None, into_caller=into, scale=sink.scale if sink else 1.0,
        parts=0 if into else len(state.held_weight), correctable=correctable, dtype=weight.dtype,
    )  # fmt: skip
    held = Held(state.held_hidden, [] if into else state.held_weight, None, None, None, None)
    if correctable:
        basis = UpstreamGrads(declared, None) if declared is not None else loss.kept_grads
        held = held._replace(problem=problem, summary=summary, reference=state.reference, basis=basis)
    attached = HeldGradients.apply((value,), rows, weight, spec, options, sink, *held.flat())
    if into:  # reports the node's release before its backward; per token, the losses weighed by the declaration
        sink.pending.watch(attached.grad_fn, value, *(() if declared is None else (declared,)))
    return attached, summary


def _total(loss: ChunkLoss, rows: Tensor) -> Tensor:
    return rows.new_zeros((), dtype=torch.float32) if loss.total is None else loss.total


def _summarize_chunk(backend, problem: ShardProblem, rows: slice, local: Tensor, out: SoftmaxSummary, options) -> None:
    """A chunk's summary into ``out``, eagerly (``boundary.merge_and_summarize``)."""
    target_column = problem.target_column[rows]
    several = None
    if target_column.dim() == 2:
        several = gathered_logits(problem.hidden[rows], problem.weight, target_column, problem.temperature[rows])
    merge_and_summarize(backend, local, target_column, several, out, options)


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
            accumulator = ctx.sink.accumulator if ctx.sink is not None else None
            grads = finish(spec, options, Held.unflat(spec, list(ctx.saved_tensors)), upstream, accumulator, True)
        return None, grads.hidden, grads.weight, None, None, None, *(None,) * ctx.num_tensors


def finish(
    spec: HeldSpec, options: HeadOptions, held: Held, upstream: Tensor, accumulator: Optional[Tensor], narrow: bool
) -> Gradients:
    """The gradients for the loss's ``upstream`` gradient (0-dim, or ``[n]`` per token): the hidden
    one exact whatever arrives, summed over the group when asked (in its dtype, as the recompute
    path and Megatron's column-parallel layer do); the weight one into ``accumulator`` (a caller's;
    ``None``: from the held parts, narrowed into their memory with ``narrow``), with its correction
    where the upstream is not the one assumed."""
    backend, upstream, scale = backends.by_name(options.backend), upstream.float(), spec.scale
    with autocast_off(upstream.device):
        if spec.per_token:  # each row holds its own gradient: times its upstream
            hidden_scale, weight_scale = upstream, None  # without rows the held weight gradient is 0
            if spec.correctable:  # the weight gradient is held for the declared weights
                assumed = scale if spec.into_caller else None
                weight_scale, grad_logprob, ran = backend.fit_declared(upstream, held.basis.logprob, assumed)
                correction = UpstreamGrads(torch.where(ran, grad_logprob, 0.0), None)  # where, not *: inf * 0
        else:
            hidden_scale = weight_scale = upstream / scale
            if spec.correctable:  # into a caller's accumulator, for the upstream `scale`
                ran = deviates((upstream - scale).reshape(1), upstream.new_full((1,), scale))
                ratio = torch.where(ran, weight_scale - 1, 0.0)
                correction = UpstreamGrads(*(None if grad is None else grad * ratio for grad in held.basis))
        if spec.correctable:
            into = [accumulator] if spec.into_caller else held.parts
            correct_weight(backend, options, held, correction, ran, into)
            record_correction(ran, _correction_note(spec))
        hidden = None
        if held.hidden.dim() == 2:
            hidden = backend.scaled_copy(held.hidden, hidden_scale, torch.empty_like(held.hidden, dtype=spec.dtype))
            if options.reduce_hidden_grad:
                all_reduce_sum(hidden, options.tp_group)
        weight = None if spec.into_caller else backend.finish_weight(held.parts, weight_scale, spec.dtype, narrow)
    return Gradients(hidden, weight)


def correct_weight(backend, options: HeadOptions, held: Held, upstream: UpstreamGrads, ran: Tensor, into: list) -> None:
    """Add the weight gradient of the per-row ``upstream`` (0 where the 0-dim bool ``ran`` is false)
    into the float32 parts ``into``: the pass again on the saved rows, summary and references, whose
    stored block is the forward's to the bit, so that a sum of the held and the corrected gradient
    rounds as one (a correction that only rescales cancels rather than adds their roundings). A backend that
    ``gates_on_device`` runs its kernels behind ``ran``; the torch backend reads it on the host,
    and runs either way while a CUDA graph is captured (it then adds zeros)."""
    if not backend.gates_on_device and may_synchronize(ran) and not bool(ran):
        return
    gate = ran if backend.gates_on_device else None
    state = backend.allocate(held.problem, NeededGrads(hidden=False, weight=True), options, into)
    if state.reference.dim() == 1 and state.reference.numel():  # references per row: the forward's
        state = state._replace(reference=held.reference)
    state = state._replace(gate=gate)

    def step(rows: slice, local: Tensor):
        return SoftmaxSummary(*(field[rows] for field in held.summary)), upstream.rows(rows), None

    run_loss_pass(backend, held.problem, step, state, options, adds=True)


def _correction_note(spec: HeldSpec) -> str:
    name, held = "fused_linear_cross_entropy", f"{spec.scale:g} times the declared weights"
    if not spec.per_token:
        name, held = "fused_linear_loss", f"{spec.scale:g}"
    return (
        f"megatron_fused_lm: {name} held its weight gradient for an upstream gradient of {held} but received "
        "another; the difference is corrected by a second pass (two GEMMs, exact; declare what the loss receives "
        "to avoid it)"
    )


@torch.library.custom_op(
    "megatron_fused_lm::held_backward", mutates_args=(),
    schema=f"(Tensor upstream, Tensor[] tensors, *, {HeldSpec.schema()}, {OPTIONS_SCHEMA}) -> (Tensor, Tensor)",
)  # fmt: skip
def held_backward(upstream: Tensor, tensors: List[Tensor], **fields) -> tuple[Tensor, Tensor]:
    """``finish`` in a compiled graph, into new memory (a custom operator may not return its
    inputs' memory); ``weight_grad_into`` runs eagerly only. An unneeded gradient is empty."""
    spec_fields = {name: fields.pop(name) for name in HeldSpec.__dataclass_fields__}
    spec = HeldSpec(**spec_fields)
    grads = finish(spec, HeadOptions(**fields), Held.unflat(spec, tensors), upstream, None, False)
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
