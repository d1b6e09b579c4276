"""The torch backend's three-GEMM path: a chunk's float32 logits block kept from its statistics to
its gradient, so the logits are computed once. Working set: the three blocks of
``torch_recompute`` and the float32 held gradients."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..contract import NeededGrads, ShardProblem, UpstreamGrads
from ..held_gradients import HeldGradients
from ..products import add_product
from ..softmax import SoftmaxSummary, block_logit_grad, block_statistics, chosen_logit_grad, zero_chosen
from .torch_recompute import block_logits, chunk_rows


@dataclass(frozen=True)
class TorchLoss:
    """``token_chunk``: rows per chunk (``torch_recompute.chunk_rows``)."""

    token_chunk: Optional[int] = None

    def start(self, problem: ShardProblem, needed: NeededGrads) -> TorchLossPass:
        return TorchLossPass(problem, needed, chunk_rows(self.token_chunk, problem.weight.shape[0]))


class TorchLossPass:
    """One call's phases (``contract.LossPass``)."""

    def __init__(self, problem: ShardProblem, needed: NeededGrads, token_chunk: int):
        self.problem, self.token_chunk = problem, token_chunk
        self.block_logits = block_logits(problem)
        self.gradients = HeldGradients.allocate(problem.hidden, problem.weight, needed)
        self.logits: Optional[torch.Tensor] = None  # the current chunk's, from its statistics to its gradient

    def chunk_statistics(self, rows: slice) -> torch.Tensor:
        self.logits = self.block_logits(rows)
        return block_statistics(self.logits, self.problem.target_column[rows])

    def chunk_gradients(self, rows: slice, summary: SoftmaxSummary, upstream: UpstreamGrads) -> None:
        """``dz`` in float32 with the chosen tokens' elements zeroed (their term is added in float32
        by ``held_gradients``), the products in the weight's dtype accumulating in float32."""
        problem, held = self.problem, self.gradients
        logits, self.logits = self.logits, None
        target_column = problem.target_column[rows]
        grad = block_logit_grad(logits, target_column, summary.lse, summary.mean_logit, *upstream)
        del logits
        zero_chosen(grad, target_column)
        operand = grad.div_(problem.temperature).to(problem.weight.dtype)
        del grad
        if held.hidden is not None:
            add_product(held.hidden[rows], operand, problem.weight, accumulate=False)
        if held.weight is not None:
            held.weight.add(operand, problem.hidden[rows])
        chosen = chosen_logit_grad(target_column, summary, *upstream) / problem.temperature
        held.add_chosen(rows, target_column, chosen, problem.hidden[rows], problem.weight)

    def held(self) -> HeldGradients:
        return self.gradients
