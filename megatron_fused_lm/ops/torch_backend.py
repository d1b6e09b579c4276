"""The torch backend: walk the rows in chunks, each chunk's logits a float32 block in memory.
The three-GEMM path (``loss_gradients``) keeps a chunk's block from its statistics to its
gradient, so it computes the logits once.

Peak working set per call, besides the inputs and the returned gradients: about three float32
``[token_chunk, vocab_shard]`` blocks (the logits, their exponentials and the gradient) and, for a
weight that is not float32, a float32 accumulator for ``grad_weight [vocab_shard, H]`` (narrowed in
place at the end, ``stored_gradients.WeightAccumulator``). By default one block takes
``DEFAULT_BLOCK_BYTES``. The three-GEMM path keeps both gradients in float32 for its backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .chunking import BlockLogits, chunk_logit_grads, chunk_statistics, token_chunks
from .contract import ChunkUpstream, Gradients, NeededGrads, SavedStatistics, ShardProblem, ShardTargets, UpstreamGrads
from .products import add_product, float32_product
from .softmax_stats import block_statistics, logit_grad
from .stored_gradients import StoredGradients, WeightAccumulator, take_chosen

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
        products = _GradientProducts(problem, needed)
        logit_grads = chunk_logit_grads(
            _block_logits(problem),
            problem.targets,
            saved,
            upstream,
            problem.temperature,
            self.chunk_rows(problem.weight.shape[0]),
        )
        for chunk, grad in logit_grads:
            products.add(chunk, grad)
        return products.result()

    def loss_gradients(
        self, problem: ShardProblem, chunk_upstream: ChunkUpstream, needed: NeededGrads
    ) -> StoredGradients:
        """Both gradients in float32, each chunk's float32 logits computed once (``contract.Backend``)."""
        products = _GradientProducts(problem, needed, torch.float32)
        block_logits = _block_logits(problem)
        for chunk in token_chunks(problem.hidden.shape[0], self.chunk_rows(problem.weight.shape[0])):
            logits = block_logits(chunk)
            targets = ShardTargets(*(part[chunk] for part in problem.targets))
            saved, upstream = chunk_upstream(chunk, block_statistics(logits, *targets))
            if needed.hidden or needed.weight:
                grad = logit_grad(logits, targets, saved, upstream).div_(problem.temperature)
                target_column = targets.columns()
                products.add(chunk, grad, chosen=(target_column, take_chosen(grad, target_column)))
        return products.stored()


class _GradientProducts:
    """The two gradient products, summed over chunks of the logits' gradient: the hidden gradient
    rounded per chunk into ``hidden_dtype`` (hidden's own by default), the weight gradient in a
    float32 accumulator."""

    def __init__(self, problem: ShardProblem, needed: NeededGrads, hidden_dtype: Optional[torch.dtype] = None):
        self.hidden, self.weight = problem.hidden, problem.weight
        dtype = hidden_dtype or self.hidden.dtype
        self.grad_hidden = self.hidden.new_empty(self.hidden.shape, dtype=dtype) if needed.hidden else None
        self.grad_weight = WeightAccumulator(self.weight) if needed.weight else None

    def add(self, chunk: slice, grad: torch.Tensor, chosen: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        """Add the products of ``grad [chunk rows, vocab_shard]`` (float32, w.r.t. the unscaled
        logits), and those of the chosen tokens' elements ``chosen = (target_column, values)``
        taken out of it (``stored_gradients.take_chosen``) in float32."""
        # The products run in the weight's dtype, as the stock path's logits gradient does;
        # each accumulates in float32, and a chunk's hidden gradient is rounded once.
        grad = grad.to(self.weight.dtype)
        if self.grad_hidden is not None:
            product = add_product(self.grad_hidden[chunk], grad, self.weight, accumulate=False)
            if chosen is not None:
                target_column, values = chosen
                product.addcmul_(values.unsqueeze(1), self.weight[target_column.clamp(min=0)])
        if self.grad_weight is not None:
            self.grad_weight.add(grad, self.hidden[chunk])
            if chosen is not None:
                self.grad_weight.add_rows(*chosen, self.hidden[chunk])

    def result(self) -> Gradients:
        """The gradients in their parameters' dtypes."""
        return Gradients(self.grad_hidden, None if self.grad_weight is None else self.grad_weight.result())

    def stored(self) -> StoredGradients:
        """The gradients kept in float32 for the loss path's backward."""
        return StoredGradients(self.grad_hidden, self.grad_weight, self.hidden.dtype)


def _block_logits(problem: ShardProblem) -> BlockLogits:
    hidden, weight_t, temperature = problem.hidden, problem.weight.t(), problem.temperature
    return lambda chunk: float32_product(hidden[chunk], weight_t).div_(temperature)
