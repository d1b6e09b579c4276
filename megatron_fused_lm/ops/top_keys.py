"""Top-k selection by int64 keys that order ``(logit, -id)``: one ``topk`` of keys ranks by logit
and, among equal logits, by the lower id; the keys of every rank merge by one more ``topk``."""

from __future__ import annotations

from typing import Callable, Tuple, Union

import torch

from .backends.contract import token_chunks
from .softmax import NUM_STATISTICS, block_statistics

Tensor = torch.Tensor
_LOW_BITS = 2**32 - 1
MAX_ID = 2**31 - 1
NO_KEY = torch.iinfo(torch.int64).min  # below every key: pads a shard narrower than k, an empty slot
# Candidates past the k-th logit that settle ties at the boundary without sorting the whole shard.
MARGIN = 16


def logit_keys(logits: Tensor, ids: Tensor) -> Tensor:
    """int64 keys (``logits``' shape) that order ``(logit, -id)``: the float32 logit's bits made
    order-preserving (negative floats' magnitude bits flipped; -0 counted as +0) in the high 32
    bits, ``2^31 - 1 - id`` in the low ones, so that of equal logits the lower id ranks first.
    ``ids``: int64, broadcast against ``logits``."""
    bits = (logits + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    ordered = bits ^ ((bits >> 31) & MAX_ID)
    return (ordered.long() << 32) | (MAX_ID - ids)


def keyed_logits(keys: Tensor) -> Tuple[Tensor, Tensor]:
    """``(float32 logits, int64 ids)`` of keys made by ``logit_keys``."""
    ordered = (keys >> 32).to(torch.int32)
    bits = ordered ^ ((ordered >> 31) & MAX_ID)
    return bits.view(torch.float32), MAX_ID - (keys & _LOW_BITS)


def chunk_top_keys(logits: Tensor, first_id: int, k: int) -> Tensor:
    """The ``k`` largest keys ``[n, k]`` of a chunk's logits ``[n, v]`` (column ``j`` is id
    ``first_id + j``), descending. Reads one flag on the host: whether a row needs the whole shard."""
    width = min(logits.shape[1], k + MARGIN)
    values, columns = logits.topk(width, dim=1)
    keys = logit_keys(values, columns + first_id).topk(k, dim=1).values
    if width < logits.shape[1]:
        # Every candidate past the k-th equal to it: an equal logit may be missing, with a lower id.
        unsettled = (values[:, k - 1] == values[:, -1]).nonzero().squeeze(1)
        if unsettled.numel():
            keys[unsettled] = logit_keys(logits[unsettled], shard_ids(first_id, logits)).topk(k, dim=1).values
    return keys


def shard_ids(first_id: int, logits: Tensor) -> Tensor:
    """The global ids ``[v]`` of a block of logits ``[n, v]`` whose first column is ``first_id``."""
    return torch.arange(first_id, first_id + logits.shape[1], device=logits.device)


def shard_top_keys(
    block_logits: Callable, rows: Union[int, Tensor], k: int, first_id: int, rows_per_chunk: int, device
) -> Tuple[Tensor, Tensor]:
    """``(stats [n, 4] float32, keys [n, k] int64)``: the softmax statistics and the ``k`` largest
    keys of ``rows`` (the first ``rows``, or those indices), one chunk of them at a time from their
    float32 logits ``block_logits(chunk)`` (a slice or indices): every backend's torch form."""
    count = rows if isinstance(rows, int) else rows.shape[0]
    keys = torch.empty(count, k, dtype=torch.int64, device=device)
    stats = torch.empty(count, NUM_STATISTICS, dtype=torch.float32, device=device)
    no_target = torch.full((count,), -1, dtype=torch.int64, device=device)
    for chunk in token_chunks(count, rows_per_chunk):
        logits = block_logits(chunk if isinstance(rows, int) else rows[chunk])
        stats[chunk] = block_statistics(logits, no_target[chunk])
        keys[chunk] = chunk_top_keys(logits, first_id, k)
    return stats, keys
