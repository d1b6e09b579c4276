"""The Triton backend's loss-in-forward pass, per token chunk:

1. ``chunk_statistics``: the forward kernel computes the statistics and stores the chunk's logits
   as ``exp(z - r)`` against one reference ``r`` per row (``triton_reference``); the rows whose
   maximum escaped their reference are stored again.
2. ``chunk_gradients``: without an entropy term the stored block is ``dz`` up to a per-row factor,
   the chosen token aside, and cuBLAS reads it as it is (``reads_block_directly``, the fast path);
   otherwise the ``dz`` kernel first rewrites it (``dz_operand``, the reference path). Then the
   two products in float32 and the chosen tokens' term (``held_gradients``).

``docs/DESIGN.md`` ("The stored block") derives the factor and says why the chosen token's term is
kept out of the 16-bit block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..contract import NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads
from ..held_gradients import HeldGradients
from ..kernels.descriptors import addressable, addressable_empty
from ..kernels.softmax_stats_kernel import refresh_stored_exp, split_statistics
from ..kernels.stored_grad_kernel import stored_logit_grads
from ..products import add_product
from ..softmax import MAX, SoftmaxSummary, chosen_logit_grad, logit_grad, merge_statistics, zero_chosen
from .triton_reference import row_references, stale_references, stored_dtype
from .triton_tuning import REFERENCE_ROWS, TritonTuning, loss_token_chunk


def direct_factor(
    reference: torch.Tensor, lse: torch.Tensor, grad_logprob: Optional[torch.Tensor], inv_temperature: float
) -> torch.Tensor:
    """``f / T [n]``, which turns a stored row ``exp(z - reference)`` into ``dz / T`` for every column
    but the chosen token's when the loss has no entropy term: ``softmax.logit_grad`` at
    ``p = exp(reference - lse)``; 0 without a log-prob term."""
    if grad_logprob is None:
        return torch.zeros_like(lse)
    return logit_grad(torch.exp(reference - lse), None, grad_logprob, None, True, False).mul_(inv_temperature)


@dataclass(frozen=True)
class TritonLoss:
    """``token_chunk``: rows per chunk (``triton_tuning.loss_token_chunk``); ``tuning``: fixed choices."""

    token_chunk: Optional[int] = None
    tuning: TritonTuning = field(default_factory=TritonTuning)

    def start(self, problem: ShardProblem, needed: NeededGrads) -> TritonLossPass:
        return TritonLossPass(problem, needed, self.token_chunk, self.tuning)


class TritonLossPass:
    """One call's phases (``contract.LossPass``)."""

    def __init__(self, problem: ShardProblem, needed: NeededGrads, token_chunk: Optional[int], tuning: TritonTuning):
        hidden, weight = problem.hidden, problem.weight
        num_tokens, vocab = hidden.shape[0], weight.shape[0]
        self.problem, self.tuning = problem, tuning
        self.inv_temperature = 1.0 / problem.temperature
        self.tiles = tuning.forward_tiles_for(weight.dtype)
        block_dtype = stored_dtype(weight.dtype)
        # The products can read the stored block itself only where it has the weight's dtype;
        # elsewhere (float16 operands) dz goes to a block of its own.
        self.block_is_operand = block_dtype == weight.dtype
        bytes_per_logit = block_dtype.itemsize + (0 if self.block_is_operand else weight.element_size())
        token_chunk = token_chunk or loss_token_chunk(num_tokens, vocab, bytes_per_logit, self.tiles)
        self.token_chunk = min(token_chunk, max(num_tokens, 1))
        self.gradients = HeldGradients.allocate(hidden, weight, needed)
        self.stored = addressable_empty(hidden, self.token_chunk, vocab, block_dtype)
        self.logit_grads = (
            self.stored if self.block_is_operand else addressable_empty(hidden, self.token_chunk, vocab, weight.dtype)
        )
        self.hidden_operand, self.weight_operand = addressable(hidden), addressable(weight)
        self.target_column = problem.target_column.contiguous()
        self.reference: Optional[torch.Tensor] = None  # the current chunk's, from its statistics to its gradient

    def chunk_statistics(self, rows: slice) -> torch.Tensor:
        """The forward kernel over the chunk: its statistics ``[k, 4]`` and its stored block."""
        hidden, columns, block = (
            self.hidden_operand[rows],
            self.target_column[rows],
            self.stored[: rows.stop - rows.start],
        )
        weight = self.weight_operand
        tiles_per_split = self.tuning.tiles_per_split_for(hidden.shape[0], weight.shape[0], self.tiles, weight.device)
        sample_rows = self.tuning.reference_rows or REFERENCE_ROWS
        reference = row_references(hidden, weight, columns, self.inv_temperature, sample_rows)
        parts = split_statistics(
            hidden, weight, columns, self.inv_temperature, self.tiles, tiles_per_split, block, reference
        )
        local = merge_statistics(parts)
        self.reference, refresh = stale_references(reference, local[:, MAX])
        refresh_stored_exp(
            hidden, weight, self.inv_temperature, self.tiles, tiles_per_split, block, self.reference, refresh
        )
        return local

    def reads_block_directly(self, upstream: UpstreamGrads) -> bool:
        """The fast-path predicate: without an entropy term ``dz = f * exp(z - r)`` for every column
        but the chosen token's, so the products read the stored block as it is, scaled per row."""
        return self.block_is_operand and upstream.entropy is None

    def chunk_gradients(self, rows: slice, summary: SoftmaxSummary, upstream: UpstreamGrads) -> None:
        """The chunk's operand (the stored block, or ``dz``), its two products, the chosen term."""
        upstream = UpstreamGrads(*(None if grad is None else grad.contiguous() for grad in upstream))
        columns = self.target_column[rows]
        if self.reads_block_directly(upstream):
            operand, factor = self.direct_operand(rows, summary, upstream)
        else:
            operand, factor = self.dz_operand(rows, summary, upstream), None
        self.products(rows, operand, factor)
        chosen = chosen_logit_grad(columns, summary, *upstream).mul_(self.inv_temperature)
        self.gradients.add_chosen(rows, columns, chosen, self.hidden_operand[rows], self.weight_operand, factor)

    def direct_operand(
        self, rows: slice, summary: SoftmaxSummary, upstream: UpstreamGrads
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored block with the chosen tokens' elements zeroed, and its per-row factor."""
        block = self.stored[: rows.stop - rows.start]
        zero_chosen(block, self.target_column[rows])
        return block, direct_factor(self.reference, summary.lse, upstream.logprob, self.inv_temperature)

    def dz_operand(self, rows: slice, summary: SoftmaxSummary, upstream: UpstreamGrads) -> torch.Tensor:
        """``dz / T`` formed from the stored block by the ``dz`` kernel (chosen tokens' elements 0)."""
        num_rows = rows.stop - rows.start
        saved = SavedStatistics(summary.lse.contiguous(), summary.mean_logit.contiguous())
        return stored_logit_grads(
            self.stored[:num_rows], self.reference, self.logit_grads[:num_rows], self.target_column[rows], saved,
            upstream, self.inv_temperature,
        )  # fmt: skip

    def products(self, rows: slice, operand: torch.Tensor, factor: Optional[torch.Tensor]) -> None:
        """``operand @ W`` into the held hidden gradient (the factor is applied with the chosen term)
        and ``operand.T @ (f * h)`` into the weight gradient, accumulated in float32."""
        held, weight = self.gradients, self.problem.weight
        if held.hidden is not None:
            add_product(held.hidden[rows], operand, weight, accumulate=False)
        if held.weight is not None:
            hidden = self.problem.hidden[rows]
            if factor is not None:
                hidden = (hidden * factor.unsqueeze(1)).to(weight.dtype)
            held.weight.add(operand, hidden)

    def held(self) -> HeldGradients:
        return self.gradients
