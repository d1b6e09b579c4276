"""The Triton backend's loss-in-forward pass, per token chunk:

1. ``chunk_statistics``: the forward kernel computes the statistics and stores the chunk's logits
   (``triton_reference``): as ``exp(z - r)`` against one reference ``r`` per row, the rows whose
   maximum escaped their reference stored again; or as float16 offsets from each column tile's
   maximum.
2. ``chunk_gradients``: a bfloat16 exponentials block without an entropy term is ``dz`` up to a
   per-row factor (the cap's slope stored in it under a softcap), the chosen token aside, and cuBLAS
   reads it as it is (``reads_block_directly``, the fast path); otherwise the ``dz`` kernel forms
   ``dz`` over the block (``dz_operand``). Then the two products in float32 and the chosen tokens'
   term (``kernels.chosen_token_kernel``).

``docs/DESIGN.md`` ("The stored block") derives the factor and says which form each case takes
and why.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..kernels.chosen_token_kernel import add_chosen_rows, finish_hidden_grad
from ..kernels.descriptors import addressable, addressable_empty
from ..kernels.fit_kernel import fit_declared
from ..kernels.merge_kernel import StaleCheck, merge_parts, summarize_parts
from ..kernels.reference_kernel import row_references
from ..kernels.row_terms_kernel import row_terms
from ..kernels.rows_product_kernel import float32_by_kernel, k_major, rows_product
from ..kernels.scale_kernel import scale_into
from ..kernels.softmax_stats_kernel import refresh_exponentials, split_statistics, stores_offsets
from ..kernels.stored_grad_kernel import stored_logit_grads
from ..options import HeadOptions
from ..products import add_product
from ..several_targets import statistics_column
from ..softmax import SoftmaxSummary, chosen_product_grad, logit_grad, zero_chosen
from . import contract, torch_loss
from .contract import ChunkGrads, LossState, NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads
from .triton_reference import (
    EMPTY_REFERENCE,
    MAX_ABOVE_REFERENCE,
    MAX_BELOW_REFERENCE,
    REFERENCE_HEADROOM,
    stored_dtype,
)
from .triton_tuning import REFERENCE_ROWS, loss_token_chunk


def direct_factor(
    reference: torch.Tensor, lse: torch.Tensor, grad_logprob: Optional[torch.Tensor], temperature: torch.Tensor
) -> torch.Tensor:
    """``f / T [n]``, which turns a stored row ``exp(z - reference)`` into ``dz / T`` for every column
    but the chosen token's when the loss has no entropy term: ``softmax.logit_grad`` at
    ``p = exp(reference - lse)``; 0 without a log-prob term."""
    if grad_logprob is None:
        return torch.zeros_like(lse)
    return logit_grad(torch.exp(reference - lse), None, grad_logprob, None, True, False).div_(temperature)


def chunk_reference(state: LossState, rows: slice) -> torch.Tensor:
    """What a chunk's rows of the block are stored against: their references (exponentials, one per
    row of the call) or their tiles' maxima (offsets, the chunk's first rows)."""
    if state.reference.dim() == 1:
        return state.reference[rows]
    return state.reference[: rows.stop - rows.start]


def reads_block_directly(block_dtype: torch.dtype, weight: torch.Tensor, options: HeadOptions) -> bool:
    """The fast-path predicate: the block holds exponentials in the weight's dtype and the loss has
    no entropy term, so ``dz = f * exp(z - r)`` (times the cap's slope under a ``softcap``, which
    the forward kernel stores with each exponential) for every column but the chosen token's, and
    the products read the block as it is, scaled per row."""
    return block_dtype == weight.dtype and not stores_offsets(block_dtype) and not options.entropy_grad


class TritonLoss:
    """The three-GEMM path of the Triton backend (``self.tuning``: ``triton_tuning.TritonTuning``).
    ``options.token_chunk``: rows per chunk (``triton_tuning.loss_token_chunk``); the block's form
    follows the loss's entropy term (``triton_reference.stored_dtype``); ``options.batch_invariant``
    runs the hidden product by ``rows_product`` instead of cuBLAS, float32 operands both products
    (``float32_by_kernel``). The chosen tokens' term and the
    scaled copies run the kernels of ``kernels.chosen_token_kernel`` and ``kernels.scale_kernel``."""

    gates_on_device = True  # a correcting pass's kernels read its gate (LossState.gate)

    def allocate(
        self,
        problem: ShardProblem,
        needed: NeededGrads,
        options: HeadOptions,
        held_weight: Optional[List[torch.Tensor]] = None,
    ) -> LossState:
        """The pass's tensors (``TorchLoss.allocate`` says which); the block in its stored form."""
        hidden, weight = problem.hidden, problem.weight
        num_tokens, vocab = hidden.shape[0], weight.shape[0]
        if options.batch_invariant and weight.dtype == torch.float32:
            raise ValueError(
                "batch_invariant=True on the three-GEMM path needs 16-bit weights: a float32 block is stored "
                "against row references from products whose order depends on the rows"
            )
        # Batch invariant, the block holds offsets from the kernel's own tile maxima, never exponentials
        # against row references (those come from products and reductions over the chunk's rows).
        block_dtype = stored_dtype(weight.dtype, options.entropy_grad or options.batch_invariant)
        tiles = self.tuning.forward_tiles_for(weight.dtype, block_dtype, weight.device)
        token_chunk = options.token_chunk or loss_token_chunk(
            num_tokens,
            vocab,
            bytes_per_logit=block_dtype.itemsize,
            tiles=tiles,
            budget=self.tuning.stored_block_bytes_for(weight.device),
        )
        token_chunk = min(token_chunk, max(num_tokens, 1))
        block = addressable_empty(hidden, token_chunk, vocab, block_dtype)
        # Per row of the call (exponentials: a correcting pass stores against the forward's), or per
        # row of the chunk and column tile (offsets: the tiles' maxima, which the kernel finds itself).
        shape = (token_chunk, -(-vocab // tiles.block_n)) if stores_offsets(block_dtype) else (max(num_tokens, 1),)
        reference = hidden.new_empty(shape, dtype=torch.float32)
        return LossState(block, reference, *contract.allocate_state(problem, needed, held_weight))

    def chunk_statistics(
        self, problem: ShardProblem, state: LossState, rows: slice, options: HeadOptions
    ) -> torch.Tensor:
        """The forward kernel over the chunk: its statistics ``[k, 4]``, its stored block and what
        the block is stored against (``state.reference``). A correcting pass (``state.gate``) stores
        the block alone, against the forward's references, which ``state.reference`` holds already:
        its statistics are the forward's (``None`` returned)."""
        num_rows = rows.stop - rows.start
        hidden, weight = addressable(problem.hidden[rows]), addressable(problem.weight)
        # Several targets per row: the statistics run with none, their logits are read apart.
        columns, block = statistics_column(problem.target_column[rows]).contiguous(), state.block[:num_rows]
        temperature, kept_mask = problem.temperature[rows], problem.kept_mask[rows]
        tiles = self.tuning.forward_tiles_for(weight.dtype, block.dtype, weight.device)
        tiles_per_split = self.tuning.tiles_per_split_for(weight.shape[0], tiles, weight.device)
        reference = chunk_reference(state, rows)
        splits = (hidden, weight, columns, temperature, kept_mask, tiles, tiles_per_split, block, reference)
        # What the backward reads the block as: dz up to a row factor, the cap's slope included.
        capping = dict(softcap=options.softcap, slope_in_block=reads_block_directly(block.dtype, weight, options))
        if state.gate is not None:
            split_statistics(*splits, gate=state.gate, **capping)
            return None
        if stores_offsets(block.dtype):
            return merge_parts(split_statistics(*splits, **capping))
        sample_rows = self.tuning.reference_rows or REFERENCE_ROWS
        row_references(
            hidden,
            weight,
            target_column=columns,
            temperature=temperature,
            sample_rows=sample_rows,
            headroom=REFERENCE_HEADROOM,
            out=reference,
            softcap=options.softcap,
        )
        parts = split_statistics(*splits, **capping)
        refresh = torch.empty(num_rows, dtype=torch.int8, device=hidden.device)
        local = merge_parts(
            parts, StaleCheck(reference, refresh, MAX_ABOVE_REFERENCE, MAX_BELOW_REFERENCE, EMPTY_REFERENCE)
        )
        refresh_exponentials(*splits, refresh, **capping)
        return local

    def summarize(self, parts: torch.Tensor, target_column: torch.Tensor, out: SoftmaxSummary) -> None:
        """``TorchLoss.summarize`` by the merge kernel (one target per row)."""
        summarize_parts(parts, target_column.contiguous(), out)

    def chunk_gradients(self, problem: ShardProblem, state: LossState, chunk: ChunkGrads, options: HeadOptions) -> None:
        """The chunk's operand (the stored block, or ``dz``), its two products, the chosen term
        (``TorchLoss.chunk_gradients`` says what ``weight_row_scale`` is)."""
        upstream = UpstreamGrads(*(None if grad is None else grad.contiguous() for grad in chunk.upstream))
        chunk, rows = chunk._replace(upstream=upstream), chunk.rows
        weight, hidden = addressable(problem.weight), addressable(problem.hidden[rows])
        columns = problem.target_column[rows].contiguous()
        block = state.block[: rows.stop - rows.start]
        direct = reads_block_directly(block.dtype, weight, options)
        if direct and columns.dim() == 2:  # the forward kernel zeroed one target's element, not several's
            zero_chosen(block, columns)
        terms = self.row_terms if columns.dim() == 1 else self.several_row_terms
        chosen, factor, operand = terms(problem, state, chunk=chunk, direct=direct, softcap=options.softcap)
        if not direct:
            block = self.dz_operand(problem, state, chunk=chunk, softcap=options.softcap)
        hidden_operand = hidden if operand is None else operand
        self.products(problem, state, chunk=chunk, operand=block, hidden_operand=hidden_operand, options=options)
        if state.held_hidden.dim() == 2:
            self.add_chosen(state.held_hidden[rows], columns, chosen=chosen, weight=weight, factor=factor)

    def row_terms(self, problem, state, chunk, direct, softcap):
        """``(chosen, factor, weight operand)`` of a chunk's rows, one target each
        (``kernels.row_terms_kernel``); the weight operand ``None`` where it is the hidden rows."""
        rows, summary, upstream, weight_row_scale, _ = chunk
        hidden = addressable(problem.hidden[rows])
        into_weight = bool(state.held_weight)
        operand = None
        if into_weight and (direct or weight_row_scale is not None):
            operand = addressable_empty(hidden, *hidden.shape, problem.weight.dtype)
        reference = chunk_reference(state, rows) if direct else None
        chosen_weight = state.chosen[rows] if into_weight else None
        chosen, factor = row_terms(
            problem.target_column[rows],
            summary,
            upstream=upstream,
            temperature=problem.temperature[rows],
            reference=reference,
            weight_row_scale=weight_row_scale,
            hidden=hidden,
            operand=operand,
            chosen_weight=chosen_weight,
            softcap=softcap,
        )
        return chosen, factor, operand

    def several_row_terms(self, problem, state, chunk, direct, softcap):
        """``row_terms`` for several targets per row, in torch: each distinct target's chosen term
        (``softmax.chosen_logit_grad``), the shared term taking the row sum of their gradients."""
        rows, summary, upstream, weight_row_scale, _ = chunk
        columns, hidden, temperature = problem.target_column[rows], problem.hidden[rows], problem.temperature[rows]
        chosen = chosen_product_grad(columns, summary, *upstream, temperature, softcap)
        factor = None
        if direct:
            grad_logprob = None if upstream.logprob is None else upstream.logprob.sum(1)
            factor = direct_factor(chunk_reference(state, rows), summary.lse, grad_logprob, temperature)
        scale = (
            factor if weight_row_scale is None else weight_row_scale if factor is None else factor * weight_row_scale
        )
        if state.held_weight:
            state.chosen[rows] = chosen if weight_row_scale is None else chosen * weight_row_scale.unsqueeze(1)
        operand = None if scale is None or not state.held_weight else (hidden * scale.unsqueeze(1)).to(hidden.dtype)
        return chosen, factor, operand

    def dz_operand(
        self, problem: ShardProblem, state: LossState, chunk: ChunkGrads, softcap: Optional[float]
    ) -> torch.Tensor:
        """``dz / T`` in the weight's dtype (chosen tokens' elements 0), formed by the ``dz`` kernel
        over the stored block itself, which has the weight's element size (``stored_dtype``)."""
        rows, summary, upstream, _, _ = chunk
        num_rows, weight = rows.stop - rows.start, problem.weight
        block = state.block[:num_rows]
        if block.dtype.itemsize != weight.dtype.itemsize:  # stored_dtype's promise; a view would misread
            raise RuntimeError(f"a {block.dtype} block cannot hold the {weight.dtype} dz in place")
        tiles = self.tuning.forward_tiles_for(weight.dtype, block.dtype, weight.device)
        saved = SavedStatistics(summary.lse.contiguous(), summary.mean_logit.contiguous())
        return stored_logit_grads(
            block,
            chunk_reference(state, rows),
            out=block.view(weight.dtype),
            target_column=problem.target_column[rows].contiguous(),
            saved=saved,
            upstream=upstream,
            temperature=problem.temperature[rows],
            offsets_tile_n=tiles.block_n if stores_offsets(block.dtype) else 0,
            softcap=softcap,
        )

    def products(self, problem, state, chunk, operand, hidden_operand, options: HeadOptions) -> None:
        """``operand @ W`` into the held hidden gradient (its factor is applied with the chosen term)
        and ``operand.T @ hidden_operand`` into the weight gradient (added to it with
        ``accumulate``), in float32; by ``rows_product`` for float32 operands (``float32_by_kernel``)."""
        rows, accumulate = chunk.rows, chunk.accumulate
        weight, tiles = problem.weight, self.tuning.backward_tiles_for(problem.weight.dtype, problem.weight.device)
        by_kernel = float32_by_kernel(weight.dtype)
        if state.held_hidden.dim() == 2 and (options.batch_invariant or by_kernel):
            rows_product(state.held_hidden[rows], operand, right=weight, accumulate=False, tiles=tiles)
        elif state.held_hidden.dim() == 2:
            add_product(state.held_hidden[rows], operand, weight, accumulate=False)
        # Gated: a kernel that reads the gate, where cuBLAS could not skip without the host reading it.
        if state.held_weight and (state.gate is not None or by_kernel):
            right = k_major(hidden_operand) if by_kernel else hidden_operand  # once for every part
            start = 0
            for part in state.held_weight:
                rows_product(
                    part,
                    operand[:, start : start + part.shape[0]].t(),
                    right=right,
                    accumulate=accumulate or state.gate is not None,
                    tiles=tiles,
                    gate=state.gate,
                )
                start += part.shape[0]
        elif state.held_weight:
            contract.add_weight_product(state.held_weight, operand, hidden_operand, accumulate)

    def scaled_copy(self, source: torch.Tensor, scale: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """``TorchLoss.scaled_copy`` by a kernel that reads the scale on the device (``mul`` by a 0-dim
        CUDA tensor broadcasts it as an operand, off PyTorch's vectorized elementwise path)."""
        if scale is None or not (source.is_contiguous() and out.is_contiguous()):
            return torch_loss.TorchLoss.scaled_copy(source, scale, out)
        scale_into(source, scale.contiguous(), out)
        return out

    def add_chosen(self, product, target_column, chosen, weight, factor=None) -> None:
        """``torch_loss.add_chosen_terms`` by the chosen-token kernel, one target column at a time
        (``weight`` addressable)."""
        columns = target_column if target_column.dim() == 2 else target_column[:, None]
        for target in range(columns.shape[1]):
            column, term = columns[:, target].contiguous(), chosen.reshape(columns.shape)[:, target].contiguous()
            first = factor if target == 0 else None
            finish_hidden_grad(product, first, chosen=term, target_column=column, weight=weight, out=product)

    def fit_declared(
        self, upstream: torch.Tensor, declared: torch.Tensor, weight_grad_scale: Optional[float]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``TorchLoss.fit_declared`` in one launch (``kernels.fit_kernel``)."""
        return fit_declared(
            upstream.contiguous(), declared.contiguous(), weight_grad_scale, contract.PROPORTIONAL_TOLERANCE
        )

    def add_chosen_rows(
        self, held_weight: List[torch.Tensor], target_column: torch.Tensor, chosen: torch.Tensor, hidden: torch.Tensor
    ) -> None:
        """``TorchLoss.add_chosen_rows`` by the chosen-token kernel (sorted runs, no atomics)."""
        columns = target_column if target_column.dim() == 2 else target_column[:, None]
        hidden = addressable(hidden)
        for target in range(columns.shape[1]):
            column, term = columns[:, target].contiguous(), chosen.reshape(columns.shape)[:, target].contiguous()
            add_chosen_rows(held_weight, column, term, hidden)
