"""The three-GEMM pass in a compiled graph: each of the backend's phases a custom operator
(``torch.ops.megatron_fused_lm.loss_*``), so that the graph keeps the loss function's own code
traced between them and never traces into a backend. Each takes the problem's tensors, the pass's
state and every ``HeadOptions`` field by name (``boundary.operator``). ``weight_grad_into`` runs
eagerly only, so the weight gradient here is held in the pass's own float32 parts.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..backends.contract import ChunkGrads, LossState, NeededGrads, ShardProblem, UpstreamGrads
from ..backends.registry import by_name
from ..boundary import PROBLEM_SCHEMA, new_summary, operator, summarize_rows
from ..options import HeadOptions
from ..softmax import NUM_STATISTICS, SoftmaxSummary

Tensor = torch.Tensor
_STATE = "Tensor(a!) block, Tensor(b!) reference, Tensor(c!) held_hidden, Tensor(d!)[] held_weight, Tensor(e!) chosen"


def _allocate(hidden, weight, target_column, temperature, kept_mask, need_hidden, need_weight, options):
    """The backend's ``allocate``: ``[block, reference, held_hidden, chosen, *held_weight]``."""
    problem = ShardProblem(hidden, weight, target_column, temperature, kept_mask)
    state = by_name(options.backend).allocate(problem, NeededGrads(need_hidden, need_weight), options)
    return [state.block, state.reference, state.held_hidden, state.chosen, *state.held_weight]


loss_allocate = operator("loss_allocate", f"{PROBLEM_SCHEMA}, bool need_hidden, bool need_weight", "Tensor[]")(
    _allocate
)
# The same allocation on fake tensors gives the same shapes, dtypes and strides.
loss_allocate.register_fake(lambda *tensors, **fields: _allocate(*tensors, HeadOptions(**fields)))


@operator("loss_statistics", f"{PROBLEM_SCHEMA}, Tensor(a!) block, Tensor(b!) reference", "Tensor")
def loss_statistics(hidden, weight, target_column, temperature, kept_mask, block, reference, options) -> Tensor:
    """The backend's ``chunk_statistics`` for a chunk's ``k`` rows, into the block's first ``k`` rows."""
    problem = ShardProblem(hidden, weight, target_column, temperature, kept_mask)
    state = LossState(block, reference, hidden.new_empty(0), [], hidden.new_empty(0))
    return by_name(options.backend).chunk_statistics(problem, state, slice(0, hidden.shape[0]), options)


@loss_statistics.register_fake
def _(hidden, *tensors, **fields) -> Tensor:
    return hidden.new_empty(hidden.shape[0], NUM_STATISTICS, dtype=torch.float32)


@operator("loss_summary", f"Tensor local, {PROBLEM_SCHEMA}", "Tensor[]")
def loss_summary(local, hidden, weight, target_column, temperature, kept_mask, options) -> List[Tensor]:
    """A chunk's ``boundary.summarize_rows`` (its ``k`` rows), as ``SoftmaxSummary``'s tensors."""
    problem = ShardProblem(hidden, weight, target_column, temperature, kept_mask)
    return list(summarize_rows(by_name(options.backend), local, problem=problem, options=options))


@loss_summary.register_fake
def _(local, hidden, weight, target_column, *tensors, **fields) -> List[Tensor]:
    return list(new_summary(target_column))


@operator(
    "loss_gradients",
    f"{PROBLEM_SCHEMA}, {_STATE}, Tensor[] summary, Tensor? grad_logprob, Tensor? grad_entropy, "
    "Tensor? weight_row_scale, SymInt start, SymInt stop, bool accumulate",
    "()",
)
def loss_gradients(
    hidden,
    weight,
    target_column,
    temperature,
    kept_mask,
    block,
    reference,
    held_hidden,
    held_weight,
    chosen,
    summary,
    grad_logprob,
    grad_entropy,
    weight_row_scale,
    start,
    stop,
    accumulate,
    options,
) -> None:
    """The backend's ``chunk_gradients`` for the rows ``[start, stop)``."""
    upstream, summary = UpstreamGrads(grad_logprob, grad_entropy), SoftmaxSummary(*summary)
    chunk = ChunkGrads(
        slice(start, stop), summary, upstream=upstream, weight_row_scale=weight_row_scale, accumulate=accumulate
    )
    by_name(options.backend).chunk_gradients(
        ShardProblem(hidden, weight, target_column, temperature, kept_mask),
        LossState(block, reference, held_hidden, held_weight, chosen),
        chunk=chunk,
        options=options,
    )


@loss_gradients.register_fake
def _(*tensors, **fields) -> None:
    return None


@operator("loss_chosen_rows", "Tensor(a!)[] held_weight, Tensor target_column, Tensor chosen, Tensor hidden", "()")
def loss_chosen_rows(held_weight, target_column, chosen, hidden, options) -> None:
    """The backend's ``add_chosen_rows``."""
    by_name(options.backend).add_chosen_rows(held_weight, target_column, chosen, hidden)


@loss_chosen_rows.register_fake
def _(*tensors, **fields) -> None:
    return None


class OperatorPhases:
    """The backend's three-GEMM phases as the custom operators above, with the chunk's summary step
    (``chunks.EagerPhases`` has the same members eagerly)."""

    def __init__(self, options: HeadOptions):
        self.fields = options.fields()

    def allocate(
        self, problem: ShardProblem, needed: NeededGrads, options: HeadOptions, held_weight: Optional[List[Tensor]]
    ) -> LossState:
        block, reference, held_hidden, chosen, *parts = loss_allocate(*problem, *needed, **self.fields)
        return LossState(block, reference, held_hidden, parts, chosen)

    def chunk_statistics(self, problem: ShardProblem, state: LossState, rows: slice, options) -> Tensor:
        chunk = problem.rows(rows)
        return loss_statistics(*chunk, block=state.block, reference=state.reference, **self.fields)

    def summarize_chunk(self, problem: ShardProblem, rows: slice, local: Tensor, out: SoftmaxSummary, options) -> None:
        for field, value in zip(out, loss_summary(local, *problem.rows(rows), **self.fields), strict=True):
            field.copy_(value)

    def chunk_gradients(self, problem: ShardProblem, state: LossState, chunk: ChunkGrads, options) -> None:
        rows, summary, upstream, weight_row_scale, accumulate = chunk
        state_tensors = (state.block, state.reference, state.held_hidden, state.held_weight, state.chosen)
        loss_gradients(
            *problem,
            *state_tensors,
            list(summary),
            *upstream,
            weight_row_scale,
            rows.start,
            rows.stop,
            accumulate,
            **self.fields,
        )

    def add_chosen_rows(self, held_weight, target_column, chosen, hidden) -> None:
        loss_chosen_rows(held_weight, target_column, chosen, hidden, **self.fields)
