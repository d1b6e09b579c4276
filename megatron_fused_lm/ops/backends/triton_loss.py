"""The Triton backend's loss-in-forward pass, per token chunk:

1. ``chunk_statistics``: the forward kernel computes the statistics and stores the chunk's logits
   (``triton_reference``): as ``exp(z - r)`` against one reference ``r`` per row, the rows whose
   maximum escaped their reference stored again; or as float16 offsets from each column tile's
   maximum.
2. ``chunk_gradients``: a bfloat16 exponentials block without an entropy term is ``dz`` up to a
   per-row factor, the chosen token aside, and cuBLAS reads it as it is (``reads_block_directly``,
   the fast path); otherwise the ``dz`` kernel forms ``dz`` over the block (``dz_operand``). Then
   the two products in float32 and the chosen tokens' term (``held_gradients``).

``docs/DESIGN.md`` ("The stored block") derives the factor and says which form each case takes
and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import held_gradients
from ..contract import LossState, NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads
from ..kernels.chosen_token_kernel import add_chosen_rows, finish_hidden_grad
from ..kernels.descriptors import addressable, addressable_empty
from ..kernels.merge_kernel import merge_parts
from ..kernels.rows_product_kernel import rows_product
from ..kernels.scale_kernel import scale_into
from ..kernels.softmax_stats_kernel import refresh_exponentials, split_statistics, stores_offsets
from ..kernels.stored_grad_kernel import stored_logit_grads
from ..products import add_product
from ..several_targets import statistics_column
from ..softmax import MAX, SoftmaxSummary, chosen_logit_grad, logit_grad, zero_chosen
from .triton_reference import row_references, stale_references, stored_dtype
from .triton_tuning import REFERENCE_ROWS, TritonTuning, loss_token_chunk


def direct_factor(
    reference: torch.Tensor, lse: torch.Tensor, grad_logprob: Optional[torch.Tensor], temperature: torch.Tensor
) -> torch.Tensor:
    """``f / T [n]``, which turns a stored row ``exp(z - reference)`` into ``dz / T`` for every column
    but the chosen token's when the loss has no entropy term: ``softmax.logit_grad`` at
    ``p = exp(reference - lse)``; 0 without a log-prob term."""
    if grad_logprob is None:
        return torch.zeros_like(lse)
    return logit_grad(torch.exp(reference - lse), None, grad_logprob, None, True, False).div_(temperature)


def reads_block_directly(state: LossState, weight: torch.Tensor, upstream: UpstreamGrads) -> bool:
    """The fast-path predicate: the block holds exponentials in the weight's dtype and the loss has
    no entropy term, so ``dz = f * exp(z - r)`` for every column but the chosen token's and the
    products read the block as it is, scaled per row."""
    block_dtype = state.block.dtype
    return block_dtype == weight.dtype and not stores_offsets(block_dtype) and upstream.entropy is None


@dataclass(frozen=True)
class TritonLoss(held_gradients.HeldSteps):
    """``token_chunk``: rows per chunk (``triton_tuning.loss_token_chunk``); ``entropy_grad``:
    whether the loss has an entropy term (``triton_reference.stored_dtype``); ``batch_invariant``:
    the hidden product by ``rows_product`` instead of cuBLAS; ``tuning``: fixed choices. The chosen
    tokens' term and the scaled copies run the kernels of ``kernels.chosen_token_kernel`` and
    ``kernels.scale_kernel``."""

    token_chunk: Optional[int] = None
    entropy_grad: bool = True
    batch_invariant: bool = False
    tuning: TritonTuning = field(default_factory=TritonTuning)

    def allocate(self, problem: ShardProblem, needed: NeededGrads) -> LossState:
        hidden, weight = problem.hidden, problem.weight
        num_tokens, vocab = hidden.shape[0], weight.shape[0]
        if self.batch_invariant and weight.dtype == torch.float32:
            raise ValueError(
                "batch_invariant=True on the three-GEMM path needs 16-bit weights: a float32 block is stored "
                "against row references from products whose order depends on the rows"
            )
        # Batch invariant, the block holds offsets from the kernel's own tile maxima, never exponentials
        # against row references (those come from products and reductions over the chunk's rows).
        block_dtype = stored_dtype(weight.dtype, self.entropy_grad or self.batch_invariant)
        tiles = self.tuning.forward_tiles_for(weight.dtype, block_dtype, weight.device)
        token_chunk = self.token_chunk or loss_token_chunk(num_tokens, vocab, block_dtype.itemsize, tiles)
        token_chunk = min(token_chunk, max(num_tokens, 1))
        block = addressable_empty(hidden, token_chunk, vocab, block_dtype)
        # Per row (exponentials), or per row and column tile (offsets: the tiles' maxima).
        shape = (token_chunk, -(-vocab // tiles.block_n)) if stores_offsets(block_dtype) else (token_chunk,)
        reference = hidden.new_empty(shape, dtype=torch.float32)
        return LossState(block, reference, *held_gradients.allocate(hidden, weight, needed))

    def chunk_statistics(self, problem: ShardProblem, state: LossState, rows: slice) -> torch.Tensor:
        """The forward kernel over the chunk: its statistics ``[k, 4]``, its stored block and what
        the block is stored against (``state.reference``)."""
        num_rows = rows.stop - rows.start
        hidden, weight = addressable(problem.hidden[rows]), addressable(problem.weight)
        # Several targets per row: the statistics run with none, their logits are read apart.
        columns, block = statistics_column(problem.target_column[rows]).contiguous(), state.block[:num_rows]
        temperature, kept_mask = problem.temperature[rows], problem.kept_mask[rows]
        tiles = self.tuning.forward_tiles_for(weight.dtype, block.dtype, weight.device)
        tiles_per_split = self.tuning.tiles_per_split_for(weight.shape[0], tiles, weight.device)
        offsets = stores_offsets(block.dtype)
        if offsets:  # the kernel writes each tile's maximum into the state
            reference = state.reference[:num_rows]
        else:
            sample_rows = self.tuning.reference_rows or REFERENCE_ROWS
            reference = row_references(hidden, weight, columns, temperature, sample_rows)
        parts = split_statistics(
            hidden, weight, columns, temperature, kept_mask, tiles, tiles_per_split, block, reference
        )
        local = merge_parts(parts)
        if offsets:
            return local
        reference, refresh = stale_references(reference, local[:, MAX])
        state.reference[:num_rows] = reference
        refresh_exponentials(hidden, weight, temperature, kept_mask, tiles, tiles_per_split, block, reference, refresh)
        return local

    def chunk_gradients(
        self,
        problem: ShardProblem,
        state: LossState,
        rows: slice,
        summary: SoftmaxSummary,
        upstream: UpstreamGrads,
        accumulate: bool,
    ) -> None:
        """The chunk's operand (the stored block, or ``dz``), its two products, the chosen term."""
        upstream = UpstreamGrads(*(None if grad is None else grad.contiguous() for grad in upstream))
        if reads_block_directly(state, problem.weight, upstream):
            operand, factor = self.direct_operand(problem, state, rows, summary, upstream)
        else:
            operand, factor = self.dz_operand(problem, state, rows, summary, upstream), None
        self.products(problem, state, rows, operand, factor, accumulate)
        columns = problem.target_column[rows].contiguous()
        temperature = problem.temperature[rows].view(-1, *[1] * (columns.dim() - 1))  # beside one or several targets
        chosen = chosen_logit_grad(columns, summary, *upstream).div_(temperature)
        hidden, weight = addressable(problem.hidden[rows]), addressable(problem.weight)
        self.add_chosen_columns(state, rows, columns, chosen, hidden, weight, factor)

    def direct_operand(
        self, problem: ShardProblem, state: LossState, rows: slice, summary: SoftmaxSummary, upstream: UpstreamGrads
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored block with the chosen tokens' elements zeroed, and its per-row factor."""
        num_rows = rows.stop - rows.start
        block = state.block[:num_rows]
        zero_chosen(block, problem.target_column[rows])
        grad_logprob = upstream.logprob
        if grad_logprob is not None and grad_logprob.dim() == 2:  # several targets: the shared term takes their sum
            grad_logprob = grad_logprob.sum(1)
        factor = direct_factor(state.reference[:num_rows], summary.lse, grad_logprob, problem.temperature[rows])
        return block, factor

    def dz_operand(
        self, problem: ShardProblem, state: LossState, rows: slice, summary: SoftmaxSummary, upstream: UpstreamGrads
    ) -> torch.Tensor:
        """``dz / T`` in the weight's dtype (chosen tokens' elements 0), formed by the ``dz`` kernel
        over the stored block itself, which has the weight's element size (``stored_dtype``)."""
        num_rows, weight = rows.stop - rows.start, problem.weight
        block = state.block[:num_rows]
        if block.dtype.itemsize != weight.dtype.itemsize:  # stored_dtype's promise; a view would misread
            raise RuntimeError(f"a {block.dtype} block cannot hold the {weight.dtype} dz in place")
        tiles = self.tuning.forward_tiles_for(weight.dtype, block.dtype, weight.device)
        saved = SavedStatistics(summary.lse.contiguous(), summary.mean_logit.contiguous())
        return stored_logit_grads(
            block, state.reference[:num_rows], block.view(weight.dtype), problem.target_column[rows].contiguous(),
            saved, upstream, problem.temperature[rows], tiles.block_n if stores_offsets(block.dtype) else 0,
        )  # fmt: skip

    def products(
        self,
        problem: ShardProblem,
        state: LossState,
        rows: slice,
        operand: torch.Tensor,
        factor: Optional[torch.Tensor],
        accumulate: bool,
    ) -> None:
        """``operand @ W`` into the held hidden gradient (the factor is applied with the chosen term)
        and ``operand.T @ (f * h)`` into the weight gradient (added to it with ``accumulate``), in
        float32."""
        weight = problem.weight
        if state.held_hidden.dim() == 2 and self.batch_invariant:
            rows_product(state.held_hidden[rows], operand, weight, False, self.tuning.backward_tiles_for(weight.dtype))
        elif state.held_hidden.dim() == 2:
            add_product(state.held_hidden[rows], operand, weight, accumulate=False)
        if state.held_weight:
            hidden = problem.hidden[rows]
            if factor is not None:
                hidden = (hidden * factor.unsqueeze(1)).to(weight.dtype)
            held_gradients.add_weight_product(state.held_weight, operand, hidden, accumulate)

    def scaled_copy(self, source: torch.Tensor, scale: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """``HeldSteps.scaled_copy`` by a kernel that reads the scale on the device (``mul`` by a 0-dim
        CUDA tensor broadcasts it as an operand, off PyTorch's vectorized elementwise path)."""
        if scale is None or not (source.is_contiguous() and out.is_contiguous()):
            return super().scaled_copy(source, scale, out)
        scale_into(source, scale, out)
        return out

    def add_chosen(
        self,
        state: LossState,
        rows: slice,
        target_column: torch.Tensor,
        chosen: torch.Tensor,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        factor: Optional[torch.Tensor] = None,
    ) -> None:
        """``HeldSteps.add_chosen`` by the chosen-token kernels (``hidden``, ``weight`` addressable)."""
        if state.held_hidden.dim() == 2:
            product = state.held_hidden[rows]
            finish_hidden_grad(product, factor, chosen, target_column, weight, product)
        if state.held_weight:
            add_chosen_rows(state.held_weight, target_column, chosen, hidden)
