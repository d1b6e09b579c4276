"""The torch backend: walk the rows in chunks, each chunk's logits a float32 block in memory.

Peak working set per call, besides the inputs and the returned gradients: about three float32
``[token_chunk, vocab_shard]`` blocks (the logits, their exponentials and the gradient) and, for a
weight that is not float32, a float32 accumulator for ``grad_weight [vocab_shard, H]``. By default
one block takes ``DEFAULT_BLOCK_BYTES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .chunking import BlockLogits, chunk_logit_grads, chunk_statistics
from .contract import Gradients, NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads
from .products import add_product, float32_product

DEFAULT_BLOCK_BYTES = 256 * 2**20


@dataclass(frozen=True)
class TorchBackend:
    """``token_chunk``: rows per chunk; ``None`` keeps one float32 block at ``DEFAULT_BLOCK_BYTES``."""

    token_chunk: Optional[int] = None

    def chunk_rows(self, vocab_shard: int) -> int:
        """Rows per chunk for a shard of ``vocab_shard`` rows."""
        return self.token_chunk or max(1, DEFAULT_BLOCK_BYTES // (4 * vocab_shard))

    def local_statistics(self, problem: ShardProblem) -> torch.Tensor:
        """This shard's statistics ``[n, 4]`` (float32)."""
        return chunk_statistics(_block_logits(problem), problem.targets, self.chunk_rows(problem.weight.shape[0]))

    def local_gradients(
        self, problem: ShardProblem, saved: SavedStatistics, upstream: UpstreamGrads, needed: NeededGrads
    ) -> Gradients:
        """This shard's gradients (``contract.Gradients`` gives their dtypes)."""
        hidden, weight = problem.hidden, problem.weight
        grad_hidden = hidden.new_empty(hidden.shape) if needed.hidden else None
        grad_weight = weight.new_zeros(weight.shape, dtype=torch.float32) if needed.weight else None
        logit_grads = chunk_logit_grads(
            _block_logits(problem),
            problem.targets,
            saved,
            upstream,
            problem.temperature,
            self.chunk_rows(weight.shape[0]),
        )
        for chunk, grad in logit_grads:
            # The products run in the weight's dtype, as the stock path's logits gradient does;
            # each accumulates in float32, and a chunk's hidden gradient is rounded once.
            grad = grad.to(weight.dtype)
            if grad_hidden is not None:
                add_product(grad_hidden[chunk], grad, weight, accumulate=False)
            if grad_weight is not None:
                add_product(grad_weight, grad.t(), hidden[chunk], accumulate=True)
        return Gradients(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))


def _block_logits(problem: ShardProblem) -> BlockLogits:
    hidden, weight_t, temperature = problem.hidden, problem.weight.t(), problem.temperature
    return lambda chunk: float32_product(hidden[chunk], weight_t).div_(temperature)
