"""Walking the rows in chunks of float32 logits: the loops the torch backend's recompute path and the
unfused logits path share. ``block_logits(rows)`` produces one chunk's float32 logits
``[rows, vocab_shard]``, already softcapped and divided by each row's temperature; nothing larger than one chunk's block
exists at a time."""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch

from .backends.contract import SavedStatistics, ShardProblem, UpstreamGrads, token_chunks
from .kept_tokens import kept_block
from .products import float32_product
from .softmax import NUM_STATISTICS, block_logit_grad, block_statistics, product_grad, softcapped

BlockLogits = Callable[[slice], torch.Tensor]
BLOCK_BYTES = 256 * 2**20  # one float32 logits block, when token_chunk is None


def product_logits(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: torch.Tensor, softcap: Optional[float]
) -> BlockLogits:
    """``block_logits`` of the products ``hidden [n, H] @ weight.T`` (float32), ``softcapped`` and
    over each row's ``temperature [n]``; rows by a slice or indices."""
    weight_t = weight.t()
    return lambda rows: softcapped(float32_product(hidden[rows], weight_t), softcap).div_(temperature[rows, None])


def given_logits(logits: torch.Tensor, temperature: torch.Tensor, softcap: Optional[float]) -> BlockLogits:
    """``block_logits`` of materialized logits ``[n, v]``: a float32 copy (``.float()`` would be the
    logits themselves when float32), ``softcapped`` and over each row's ``temperature [n]``."""
    return lambda rows: softcapped(logits[rows].to(torch.float32, copy=True), softcap).div_(temperature[rows, None])


def chunk_rows(token_chunk: Optional[int], vocab_shard: int) -> int:
    """Rows per chunk: ``token_chunk``, or as many as keep one float32 block at ``BLOCK_BYTES``."""
    return token_chunk or max(1, BLOCK_BYTES // (4 * vocab_shard))


def blocked_statistics(
    block_logits: BlockLogits, target_column: torch.Tensor, kept_mask: torch.Tensor, token_chunk: int
) -> torch.Tensor:
    """The shard's statistics ``[n, 4]`` (float32), one chunk of rows at a time, over each row's
    kept columns (``kept_mask``, ``kept_tokens``' form)."""
    num_tokens = target_column.shape[0]
    stats = torch.empty(num_tokens, NUM_STATISTICS, dtype=torch.float32, device=target_column.device)
    for rows in token_chunks(num_tokens, token_chunk):
        logits = block_logits(rows)
        stats[rows] = block_statistics(logits, target_column[rows], kept_block(kept_mask, rows, logits.shape[1]))
    return stats


def chunk_logit_grads(
    block_logits: BlockLogits,
    problem: ShardProblem,
    saved: SavedStatistics,
    upstream: UpstreamGrads,
    token_chunk: int,
    softcap: Optional[float],
) -> Iterator[Tuple[slice, torch.Tensor]]:
    """Yield ``(rows, grad)``: the float32 gradient with respect to the products ``h . w`` of each
    chunk of ``problem``'s rows (``softmax.product_grad``: ``dz / temperature``, per row, times the
    softcap's slope; 0 outside the kept columns), its logits recomputed by ``block_logits``."""
    for rows in token_chunks(problem.target_column.shape[0], token_chunk):
        logits, chunk_upstream = block_logits(rows), upstream.rows(rows)
        grad = block_logit_grad(
            logits,
            problem.target_column[rows],
            lse=saved.lse[rows],
            mean_logit=saved.mean_logit[rows],
            grad_logprob=chunk_upstream.logprob,
            grad_entropy=chunk_upstream.entropy,
            kept=kept_block(problem.kept_mask, rows, logits.shape[1]),
        )
        yield rows, product_grad(grad, logits, problem.temperature[rows, None], softcap)
