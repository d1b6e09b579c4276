"""The torch backend's three-GEMM path: a chunk's float32 logits block kept from its statistics to
its gradient, so the logits are computed once. Working set: the three blocks of
``torch_recompute`` and the float32 held gradients."""

from __future__ import annotations

from typing import List, Optional

import torch

from ..chunking import chunk_rows
from ..kept_tokens import kept_block
from ..options import HeadOptions
from ..products import add_product
from ..several_targets import statistics_column
from ..softmax import (
    SoftmaxSummary,
    TargetIndex,
    block_logit_grad,
    block_statistics,
    chosen_product_grad,
    merge_statistics,
    product_grad,
    softcapped,
    summarize,
    zero_chosen,
)
from . import contract
from .contract import ChunkGrads, LossState, NeededGrads, ShardProblem, deviates, proportional_fit


class TorchLoss:
    """The three-GEMM path of the torch backend: a float32 block of ``chunking.chunk_rows`` rows
    (``options.token_chunk``) whatever the loss, and the steps on the held gradients, element by
    element in torch."""

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
        state = LossState(block, hidden.new_empty(0), *contract.allocate_state(problem, needed, held_weight))
        one_target = problem.target_column.dim() == 1  # several: the statistics run with none (statistics_column)
        return state._replace(target_index=TargetIndex.of(problem.target_column) if one_target else None)

    def chunk_statistics(
        self, problem: ShardProblem, state: LossState, rows: slice, options: HeadOptions
    ) -> torch.Tensor:
        """The chunk's float32 logits into the block (GEMM 1) and their statistics ``[k, 4]``."""
        logits = state.block[: rows.stop - rows.start]
        products = add_product(logits, problem.hidden[rows], problem.weight.t(), accumulate=False)
        softcapped(products, options.softcap).div_(problem.temperature[rows, None])
        # Several targets per row: the statistics run with none, their logits are read apart.
        target_column = statistics_column(problem.target_column[rows])
        kept = kept_block(problem.kept_mask, rows, logits.shape[1])
        return block_statistics(logits, target_column, kept, index=rows_of(state.target_index, rows))

    def summarize(self, parts: torch.Tensor, target_column: torch.Tensor, out: SoftmaxSummary) -> None:
        """The rows' summary of their statistics merged over ``parts [P, k, 4]`` (one per rank),
        written into ``out``'s ``[k]`` tensors."""
        merged = parts[0] if parts.shape[0] == 1 else merge_statistics(parts)
        summarize(merged, target_column, out=out)

    def chunk_gradients(self, problem: ShardProblem, state: LossState, chunk: ChunkGrads, options: HeadOptions) -> None:
        """``dz`` in float32 with the chosen tokens' elements zeroed (their term is added in float32
        by ``add_chosen_terms`` and, once per call, ``add_chosen_rows``), the products in the weight's
        dtype accumulating in float32; the weight gradient's upstream is ``weight_row_scale`` times the
        hidden gradient's, row by row."""
        rows, summary, upstream, weight_row_scale, accumulate = chunk
        weight, target_column, temperature = problem.weight, problem.target_column[rows], problem.temperature[rows]
        index = rows_of(state.target_index, rows)
        logits = state.block[: rows.stop - rows.start]
        kept = kept_block(problem.kept_mask, rows, logits.shape[1])
        grad = block_logit_grad(
            logits,
            target_column,
            lse=summary.lse,
            mean_logit=summary.mean_logit,
            grad_logprob=upstream.logprob,
            grad_entropy=upstream.entropy,
            kept=kept,
            with_chosen=False,
        )
        # The chosen token's whole term is added in float32 (add_chosen_terms, add_chosen_rows).
        zero_chosen(grad, target_column, index)
        operand = product_grad(grad, logits, temperature[:, None], options.softcap).to(weight.dtype)
        if state.held_hidden.dim() == 2:
            add_product(state.held_hidden[rows], operand, weight, accumulate=False)
        if state.held_weight:
            if weight_row_scale is not None:  # the weight's own operand, rounded once as the hidden's is
                operand = grad.mul_(weight_row_scale[:, None]).to(weight.dtype)
            contract.add_weight_product(state.held_weight, operand, problem.hidden[rows], accumulate)
        chosen = chosen_product_grad(target_column, summary, *upstream, temperature, options.softcap, index)
        if state.held_hidden.dim() == 2:
            add_chosen_terms(state.held_hidden[rows], target_column, chosen, weight, index=index)
        if state.held_weight and weight_row_scale is not None:  # per row, beside one or several targets' terms
            chosen = chosen * weight_row_scale.view(-1, *[1] * (chosen.dim() - 1))
        if state.held_weight:
            state.chosen[rows] = chosen

    # The steps on the held gradients; the Triton backend has kernels for each.

    @staticmethod
    def fit_declared(
        upstream: torch.Tensor, declared: torch.Tensor, weight_grad_scale: Optional[float]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The labels path's backward check, on the device: ``(scale [], correction [n], ran [])``,
        the scale ``c`` of the declared weights ``w`` (``weight_grad_scale``, or else fitted to the
        upstream gradient ``u``), the log-prob gradient of the difference ``-(u - c w)`` that the weight
        gradient still lacks (over ``c`` where fitted: it is scaled by ``c`` with the held one), and
        whether the difference is more than rounding."""
        given = weight_grad_scale is not None
        scale = upstream.new_tensor(weight_grad_scale) if given else proportional_fit(upstream, declared)
        difference = upstream - scale * declared
        correction = -difference if given else -difference / scale
        return scale, correction, deviates(difference, upstream)

    @staticmethod
    def scaled_copy(source: torch.Tensor, scale: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """``out = source * scale`` (``scale`` a 0-dim float32 tensor, one per row ``[n]``, or
        ``None``: 1), computed in float32 and rounded once into ``out``'s dtype; ``out`` may be
        ``source``. Returns ``out``."""
        if scale is None:
            return out.copy_(source)
        return torch.mul(source, scale if scale.dim() == 0 else scale.unsqueeze(1), out=out)

    @staticmethod
    def add_chosen_rows(
        held_weight: List[torch.Tensor], target_column: torch.Tensor, chosen: torch.Tensor, hidden: torch.Tensor
    ) -> None:
        """Add ``chosen[t] * hidden[t]`` to the weight gradient's row ``target_column[t]`` (its
        float32 row parts in order), summed per row in float32 in a fixed order (deterministic);
        ``[n]`` or, several targets, ``[n, m]`` columns and terms; columns ``< 0``: no term."""
        columns, per_row = target_column.reshape(-1), target_column.shape[1] if target_column.dim() == 2 else 1
        rows = hidden if per_row == 1 else hidden.repeat_interleave(per_row, dim=0)  # one row per term
        values = chosen.reshape(-1, 1) * rows.float()
        # Terms outside a part go to distinct rows as zeros, so that none piles onto one row.
        spare = torch.arange(columns.shape[0], device=hidden.device)
        start = 0
        for part in held_weight:
            inside = (columns >= start) & (columns < start + part.shape[0])
            part_rows = torch.where(inside, columns - start, spare % part.shape[0])
            part.index_put_((part_rows,), torch.where(inside.unsqueeze(1), values, 0.0), accumulate=True)
            start += part.shape[0]


def rows_of(index: Optional[TargetIndex], rows: slice) -> Optional[TargetIndex]:
    return None if index is None else index.rows(rows)


def add_chosen_terms(
    product: torch.Tensor,
    target_column: torch.Tensor,
    chosen: torch.Tensor,
    weight: torch.Tensor,
    factor: Optional[torch.Tensor] = None,
    index: Optional[TargetIndex] = None,
) -> None:
    """Finish a chunk's hidden gradient rows in place: the product ``[k, H]`` (float32) becomes
    ``factor * product + chosen * weight[target_column]``. ``target_column``, ``chosen`` and
    ``factor`` ``[k]`` (``factor`` ``None``: 1; columns ``< 0``: another shard's token, no term);
    several targets, ``[k, m]``: each column's term added in turn. ``index``:
    ``TargetIndex.of(target_column)`` of one target per row, where the caller keeps it (several
    targets make their own)."""
    if factor is not None:
        product.mul_(factor.unsqueeze(1))
    columns = target_column.view(target_column.shape[0], -1)
    index = index if columns.shape[1] == 1 else None
    for target in range(columns.shape[1]):
        column, elsewhere = index or TargetIndex.of(columns[:, target])
        coefficient = chosen.view(columns.shape)[:, target].masked_fill(elsewhere, 0.0).unsqueeze(1)
        product.addcmul_(coefficient, weight[column])  # promoted to float32 in the op
