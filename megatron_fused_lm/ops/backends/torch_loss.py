"""The torch backend's three-GEMM path: a chunk's float32 logits block kept from its statistics to
its gradient, so the logits are computed once. Working set: the three blocks of
``torch_recompute`` and the float32 held gradients."""

from __future__ import annotations

from typing import List, Optional

import torch

from .. import held_gradients
from ..chunking import chunk_rows
from ..contract import LossState, NeededGrads, ShardProblem, UpstreamGrads
from ..kept_tokens import kept_block
from ..options import HeadOptions
from ..products import add_product
from ..several_targets import statistics_column
from ..softmax import (
    SoftmaxSummary,
    block_logit_grad,
    block_statistics,
    chosen_logit_grad,
    merge_statistics,
    summarize,
    zero_chosen,
)


class TorchLoss(held_gradients.HeldSteps):
    """The three-GEMM path of the torch backend: a float32 block of ``chunking.chunk_rows`` rows
    (``options.token_chunk``) whatever the loss."""

    gates_on_device = False  # a correcting pass runs or not as the host reads its gate

    def allocate(
        self,
        problem: ShardProblem,
        needed: NeededGrads,
        options: HeadOptions,
        held_weight: Optional[List[torch.Tensor]] = None,
    ) -> LossState:
        """The pass's tensors; the weight gradient into ``held_weight`` where given (a caller's
        accumulator), else into float32 parts of its own when needed."""
        hidden, weight = problem.hidden, problem.weight
        rows = min(chunk_rows(options.token_chunk, weight.shape[0]), max(hidden.shape[0], 1))
        block = hidden.new_empty(rows, weight.shape[0], dtype=torch.float32)
        return LossState(block, hidden.new_empty(0), *held_gradients.allocate_state(problem, needed, held_weight))

    def chunk_statistics(self, problem: ShardProblem, state: LossState, rows: slice) -> torch.Tensor:
        """The chunk's float32 logits into the block (GEMM 1) and their statistics ``[k, 4]``."""
        logits = state.block[: rows.stop - rows.start]
        temperature = problem.temperature[rows, None]
        add_product(logits, problem.hidden[rows], problem.weight.t(), accumulate=False).div_(temperature)
        # Several targets per row: the statistics run with none, their logits are read apart.
        target_column = statistics_column(problem.target_column[rows])
        return block_statistics(logits, target_column, kept_block(problem.kept_mask, rows, logits.shape[1]))

    def summarize(self, parts: torch.Tensor, target_column: torch.Tensor, out: SoftmaxSummary) -> None:
        """The rows' summary of their statistics merged over ``parts [P, k, 4]`` (one per rank),
        written into ``out``'s ``[k]`` tensors."""
        merged = parts[0] if parts.shape[0] == 1 else merge_statistics(parts)
        for field, value in zip(out, summarize(merged, target_column), strict=True):
            field.copy_(value)

    def chunk_gradients(
        self,
        problem: ShardProblem,
        state: LossState,
        rows: slice,
        summary: SoftmaxSummary,
        upstream: UpstreamGrads,
        weight_scale: Optional[torch.Tensor],
        accumulate: bool,
        options: HeadOptions,
    ) -> None:
        """``dz`` in float32 with the chosen tokens' elements zeroed (their term is added in float32
        by ``add_chosen`` and, once per call, ``add_chosen_rows``), the products in the weight's
        dtype accumulating in float32; the weight gradient's upstream is ``weight_scale`` times the
        hidden gradient's, row by row."""
        weight, target_column, temperature = problem.weight, problem.target_column[rows], problem.temperature[rows]
        logits = state.block[: rows.stop - rows.start]
        kept = kept_block(problem.kept_mask, rows, logits.shape[1])
        grad = block_logit_grad(logits, target_column, summary.lse, summary.mean_logit, *upstream, kept)
        zero_chosen(grad, target_column)
        operand = grad.div_(temperature[:, None]).to(weight.dtype)
        if state.held_hidden.dim() == 2:
            add_product(state.held_hidden[rows], operand, weight, accumulate=False)
        if state.held_weight:
            if weight_scale is not None:  # the weight's own operand, rounded once as the hidden's is
                operand = grad.mul_(weight_scale[:, None]).to(weight.dtype)
            held_gradients.add_weight_product(state.held_weight, operand, problem.hidden[rows], accumulate)
        per_row = temperature.view(-1, *[1] * (target_column.dim() - 1))  # beside one or several targets' terms
        chosen = chosen_logit_grad(target_column, summary, *upstream) / per_row
        if state.held_hidden.dim() == 2:
            self.add_chosen(state.held_hidden[rows], target_column, chosen, weight)
        if state.held_weight:
            state.chosen[rows] = chosen if weight_scale is None else chosen * weight_scale.view(per_row.shape)
