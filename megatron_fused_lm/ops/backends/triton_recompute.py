"""The Triton backend's four-GEMM path.

- Forward: ``split_statistics`` gives ``[num_splits, n, 4]`` statistics straight from hidden and
  weight tiles; ``merge_parts`` merges the splits (in an order set by their number alone).
- Backward, blocked over token chunks and vocabulary chunks so the working set stays bounded
  (``triton_tuning``): per block, ``logit_grad_block`` recomputes the logits and writes ``dz / T``
  in the weight's dtype, then cuBLAS (``rows_product`` with ``batch_invariant``) adds ``dz @ w``
  into a float32 ``[token chunk, H]`` accumulator for ``grad_hidden``, and cuBLAS ``dz.T @ h`` into
  ``grad_weight`` (rounded to the weight's dtype once per token chunk); float32 operands take
  ``rows_product`` for both (``float32_by_kernel``).
"""

from __future__ import annotations

import torch

from ..kernels.descriptors import addressable
from ..kernels.logit_grad_kernel import logit_grad_block
from ..kernels.merge_kernel import merge_parts
from ..kernels.rows_product_kernel import float32_by_kernel, k_major, rows_product
from ..kernels.softmax_stats_kernel import split_statistics
from ..options import HeadOptions
from ..products import add_product
from ..softmax import NUM_STATISTICS
from .contract import Gradients, NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads, token_chunks
from .triton_tuning import TOKEN_CHUNK, VOCAB_CHUNK_MULTIPLE


class TritonRecompute:
    """The four-GEMM path of the Triton backend (``self.tuning``: ``triton_tuning.TritonTuning``).
    ``options.token_chunk``: backward rows per token chunk (``TOKEN_CHUNK``);
    ``options.batch_invariant``: the hidden product by ``rows_product`` instead of cuBLAS (float32
    operands: both products, ``float32_by_kernel``)."""

    def local_statistics(self, problem: ShardProblem, options: HeadOptions) -> torch.Tensor:
        """This shard's statistics ``[n, 4]`` (float32)."""
        hidden, weight = problem.hidden, problem.weight
        if hidden.shape[0] == 0:
            return hidden.new_empty(0, NUM_STATISTICS, dtype=torch.float32)
        tiles = self.tuning.forward_tiles_for(weight.dtype)
        tiles_per_split = self.tuning.tiles_per_split_for(weight.shape[0], tiles, weight.device)
        parts = split_statistics(
            hidden,
            weight,
            target_column=problem.target_column,
            temperature=problem.temperature,
            kept_mask=problem.kept_mask,
            tiles=tiles,
            tiles_per_split=tiles_per_split,
            softcap=options.softcap,
        )
        return merge_parts(parts)

    def local_gradients(
        self,
        problem: ShardProblem,
        saved: SavedStatistics,
        upstream: UpstreamGrads,
        needed: NeededGrads,
        options: HeadOptions,
    ) -> Gradients:
        """This shard's gradients (``contract.Gradients`` gives their dtypes)."""
        hidden, weight = problem.hidden, problem.weight
        num_tokens, hidden_size = hidden.shape
        vocab = weight.shape[0]
        grad_hidden = hidden.new_empty(hidden.shape) if needed.hidden else None
        grad_weight = weight.new_empty(weight.shape) if needed.weight else None
        if num_tokens == 0:
            return Gradients(grad_hidden, None if grad_weight is None else grad_weight.zero_())

        token_chunk = min(options.token_chunk or TOKEN_CHUNK, num_tokens)
        accumulator_bytes = token_chunk * hidden_size * 4 if needed.hidden else 0
        gradient_bytes = sum(
            grad.numel() * grad.element_size() for grad in (grad_hidden, grad_weight) if grad is not None
        )
        dz_bytes = self.tuning.dz_block_bytes_for(gradient_bytes, accumulator_bytes)
        multiple = VOCAB_CHUNK_MULTIPLE
        vocab_chunk = dz_bytes // weight.element_size() // token_chunk
        vocab_chunk = min(vocab, max(multiple, vocab_chunk // multiple * multiple))
        # Row stride a multiple of VOCAB_CHUNK_MULTIPLE: the kernel stores through a tensor descriptor.
        logit_grads = weight.new_empty(token_chunk, -(-vocab_chunk // multiple) * multiple)
        hidden_acc = hidden.new_empty(token_chunk, hidden_size, dtype=torch.float32) if needed.hidden else None
        tiles = self.tuning.backward_tiles_for(weight.dtype, weight.device)
        by_kernel = float32_by_kernel(weight.dtype)
        programs = self.tuning.programs_for(weight.device)
        hidden_operand, weight_operand = addressable(hidden), addressable(weight)
        target_column, temperature = problem.target_column.contiguous(), problem.temperature
        saved = SavedStatistics(*(part.contiguous() for part in saved))
        upstream = UpstreamGrads(*(None if part is None else part.contiguous() for part in upstream))

        for tokens in token_chunks(num_tokens, token_chunk):
            rows = tokens.stop - tokens.start
            token_saved = SavedStatistics(*(part[tokens] for part in saved))
            # The weight products' right operand, k-major once for every vocabulary chunk.
            hidden_rows = k_major(hidden_operand[tokens]) if grad_weight is not None and by_kernel else None
            for columns in token_chunks(vocab, vocab_chunk):
                block = logit_grad_block(
                    logit_grads[:rows, : columns.stop - columns.start],
                    hidden_operand[tokens],
                    weight=weight_operand[columns],
                    target_column=target_column[tokens],
                    first_column=columns.start,
                    saved=token_saved,
                    upstream=upstream.rows(tokens),
                    temperature=temperature[tokens],
                    kept_mask=problem.kept_mask[tokens],
                    tiles=tiles,
                    num_programs=programs,
                    softcap=options.softcap,
                )
                if hidden_acc is not None and (options.batch_invariant or by_kernel):
                    # Each vocabulary chunk continues the row's float32 sum where the last left it
                    # (chunks start at multiples of the tiles' hidden step): one order whatever the chunks.
                    rows_product(
                        hidden_acc[:rows],
                        block,
                        right=weight_operand[columns],
                        accumulate=columns.start > 0,
                        tiles=tiles,
                    )
                elif hidden_acc is not None:
                    add_product(hidden_acc[:rows], block, weight[columns], accumulate=columns.start > 0)
                if grad_weight is not None and by_kernel:
                    rows_product(
                        grad_weight[columns],
                        block.t(),
                        right=hidden_rows,
                        accumulate=tokens.start > 0,
                        tiles=tiles,
                    )
                elif grad_weight is not None:
                    add_product(grad_weight[columns], block.t(), hidden[tokens], accumulate=tokens.start > 0)
            if grad_hidden is not None:
                grad_hidden[tokens] = hidden_acc[:rows]
        return Gradients(grad_hidden, grad_weight)
