"""The torch backend's three-GEMM path: a chunk's float32 logits block kept from its statistics to
its gradient, so the logits are computed once. Working set: the three blocks of
``torch_recompute`` and the float32 held gradients."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import held_gradients
from ..chunking import chunk_rows
from ..contract import LossState, NeededGrads, ShardProblem, UpstreamGrads
from ..kept_tokens import kept_block
from ..products import add_product
from ..several_targets import statistics_column
from ..softmax import SoftmaxSummary, block_logit_grad, block_statistics, chosen_logit_grad, zero_chosen


@dataclass(frozen=True)
class TorchLoss(held_gradients.HeldSteps):
    """``token_chunk``: rows per chunk (``torch_recompute.chunk_rows``); ``entropy_grad``: whether
    the loss has an entropy term (the block is float32 either way)."""

    token_chunk: Optional[int] = None
    entropy_grad: bool = True

    def allocate(self, problem: ShardProblem, needed: NeededGrads) -> LossState:
        hidden, weight = problem.hidden, problem.weight
        rows = min(chunk_rows(self.token_chunk, weight.shape[0]), max(hidden.shape[0], 1))
        block = hidden.new_empty(rows, weight.shape[0], dtype=torch.float32)
        return LossState(block, hidden.new_empty(0), *held_gradients.allocate(hidden, weight, needed))

    def chunk_statistics(self, problem: ShardProblem, state: LossState, rows: slice) -> torch.Tensor:
        logits = state.block[: rows.stop - rows.start]
        temperature = problem.temperature[rows, None]
        add_product(logits, problem.hidden[rows], problem.weight.t(), accumulate=False).div_(temperature)
        # Several targets per row: the statistics run with none, their logits are read apart.
        target_column = statistics_column(problem.target_column[rows])
        return block_statistics(logits, target_column, kept_block(problem.kept_mask, rows, logits.shape[1]))

    def chunk_gradients(
        self,
        problem: ShardProblem,
        state: LossState,
        rows: slice,
        summary: SoftmaxSummary,
        upstream: UpstreamGrads,
        accumulate: bool,
    ) -> None:
        """``dz`` in float32 with the chosen tokens' elements zeroed (their term is added in float32
        by ``add_chosen``), the products in the weight's dtype accumulating in float32."""
        weight, target_column, temperature = problem.weight, problem.target_column[rows], problem.temperature[rows]
        logits = state.block[: rows.stop - rows.start]
        kept = kept_block(problem.kept_mask, rows, logits.shape[1])
        grad = block_logit_grad(logits, target_column, summary.lse, summary.mean_logit, *upstream, kept)
        zero_chosen(grad, target_column)
        operand = grad.div_(temperature[:, None]).to(weight.dtype)
        del grad
        if state.held_hidden.dim() == 2:
            add_product(state.held_hidden[rows], operand, weight, accumulate=False)
        held_gradients.add_weight_product(state.held_weight, operand, problem.hidden[rows], accumulate)
        per_row = temperature.view(-1, *[1] * (target_column.dim() - 1))  # beside one or several targets' terms
        chosen = chosen_logit_grad(target_column, summary, *upstream) / per_row
        self.add_chosen_columns(state, rows, target_column, chosen, problem.hidden[rows], weight)
