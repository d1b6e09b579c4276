"""The torch backend's four-GEMM path: walk the rows in chunks, each chunk's logits a float32 block
in memory. Working set per call besides the inputs and the returned gradients: about three float32
``[token_chunk, vocab_shard]`` blocks and, for a weight that is not float32, a float32 accumulator
for ``grad_weight`` (``contract.allocate_parts``), narrowed into its own memory at the end."""

from __future__ import annotations

from typing import Optional

import torch

from ..chunking import BlockLogits, blocked_statistics, chunk_logit_grads, chunk_rows, product_logits
from ..options import HeadOptions
from ..products import add_product
from . import contract
from .contract import Gradients, NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads


def block_logits(problem: ShardProblem, softcap: Optional[float]) -> BlockLogits:
    """A chunk's float32 logits ``[rows, vocab_shard]`` (``chunking.product_logits``)."""
    return product_logits(problem.hidden, problem.weight, problem.temperature, softcap)


class TorchRecompute:
    """The four-GEMM path of the torch backend (``options.token_chunk``: rows per chunk, as
    ``chunking.chunk_rows``)."""

    def local_statistics(self, problem: ShardProblem, options: HeadOptions) -> torch.Tensor:
        """This shard's statistics ``[n, 4]`` (float32)."""
        rows_per_chunk = chunk_rows(options.token_chunk, problem.weight.shape[0])
        logits = block_logits(problem, options.softcap)
        return blocked_statistics(logits, problem.target_column, problem.kept_mask, rows_per_chunk)

    def local_gradients(
        self,
        problem: ShardProblem,
        saved: SavedStatistics,
        upstream: UpstreamGrads,
        needed: NeededGrads,
        options: HeadOptions,
    ) -> Gradients:
        """This shard's gradients (``contract.Gradients`` gives their dtypes). The products run in
        the weight's dtype, as the stock path's logits gradient does; each accumulates in float32,
        and a chunk's hidden gradient is rounded once."""
        hidden, weight = problem.hidden, problem.weight
        grad_hidden = torch.empty_like(hidden) if needed.hidden else None
        _, held_weight = contract.allocate_parts(hidden, weight, NeededGrads(hidden=False, weight=needed.weight))
        grads = chunk_logit_grads(
            block_logits(problem, options.softcap),
            problem,
            saved=saved,
            upstream=upstream,
            token_chunk=chunk_rows(options.token_chunk, weight.shape[0]),
            softcap=options.softcap,
        )
        for chunk, grad in grads:
            grad = grad.to(weight.dtype)
            if grad_hidden is not None:
                add_product(grad_hidden[chunk], grad, weight, accumulate=False)
            contract.add_weight_product(held_weight, grad, hidden[chunk], accumulate=chunk.start > 0)
        grad_weight = contract.finish_weight(
            held_weight, None, dtype=weight.dtype, narrow_in_place=True, scaled_copy=self.scaled_copy
        )
        return Gradients(grad_hidden, grad_weight)
