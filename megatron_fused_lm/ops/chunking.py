"""Walking the rows in chunks of float32 logits: the loops the torch backend and the unfused
logits path share. ``block_logits(chunk)`` produces one chunk's float32 logits ``[rows, vocab_shard]``
(already divided by the temperature); nothing larger than one chunk's block exists at a time."""

from __future__ import annotations

from typing import Callable, Iterator, Tuple

import torch

from .contract import SavedStatistics, ShardTargets, UpstreamGrads
from .softmax_stats import NUM_STATISTICS, block_statistics, logit_grad

BlockLogits = Callable[[slice], torch.Tensor]


def token_chunks(num_tokens: int, chunk_size: int) -> Iterator[slice]:
    """Slices of ``[0, num_tokens)`` of at most ``chunk_size`` rows each."""
    for start in range(0, num_tokens, chunk_size):
        yield slice(start, min(start + chunk_size, num_tokens))


def chunk_statistics(block_logits: BlockLogits, targets: ShardTargets, chunk_size: int) -> torch.Tensor:
    """The shard's statistics ``[n, 4]`` (float32), one chunk of rows at a time."""
    num_tokens = targets.local.shape[0]
    stats = torch.empty(num_tokens, NUM_STATISTICS, dtype=torch.float32, device=targets.local.device)
    for chunk in token_chunks(num_tokens, chunk_size):
        stats[chunk] = block_statistics(block_logits(chunk), targets.local[chunk], targets.owned[chunk])
    return stats


def chunk_logit_grads(
    block_logits: BlockLogits,
    targets: ShardTargets,
    saved: SavedStatistics,
    upstream: UpstreamGrads,
    temperature: float,
    chunk_size: int,
) -> Iterator[Tuple[slice, torch.Tensor]]:
    """Yield ``(chunk, grad)``: the float32 gradient with respect to the *unscaled* logits of each
    chunk (``dz / temperature``), its logits recomputed by ``block_logits``."""
    for chunk in token_chunks(targets.local.shape[0], chunk_size):
        grad = logit_grad(
            block_logits(chunk),
            ShardTargets(*(part[chunk] for part in targets)),
            SavedStatistics(*(part[chunk] for part in saved)),
            UpstreamGrads(*(None if part is None else part[chunk] for part in upstream)),
        )
        yield chunk, grad.div_(temperature)
