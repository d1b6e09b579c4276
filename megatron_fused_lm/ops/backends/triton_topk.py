"""The Triton backend's top-k: two launches over the shard's vocabulary splits, no logits stored.

1. The forward kernel: the statistics, and each row's maximum of each column tile
   (``softmax_stats_kernel.split_statistics``' ``tile_maxima``).
2. Each row's threshold: the ``k``-th largest of its tile maxima. ``k`` tiles hold a logit at or
   above it, so the row's ``k`` largest logits all are.
3. The candidates kernel (``topk_kernel.collect_candidates``): each row's logits at or above its
   threshold and their columns, up to ``picks`` a column tile, into the row's slots of each
   vocabulary split. It walks the splits as the forward kernel does: its products are the first
   launch's, bit for bit.
4. The ``k`` largest keys of each row's candidates (``top_keys.logit_keys``).
5. A row with a logit that found no slot (its largest logits crowded into a few tiles, or many
   equal to the threshold), or with fewer than ``k`` candidates (a NaN threshold, or launches
   whose products differed), takes the torch form's statistics and keys
   (``top_keys.shard_top_keys``): one read on the host per chunk of rows finds them.
Where ``k`` exceeds a quarter of the shard's column tiles, every row takes the torch form: the
threshold then falls so low among the rows' logits that their candidates outgrow the slots.
``docs/benchmarks/features.md`` (top-k) has how often, and what each form costs.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import triton

from ..chunking import BLOCK_BYTES, chunk_rows
from ..kernels.merge_kernel import merge_parts
from ..kernels.softmax_stats_kernel import split_statistics
from ..kernels.topk_kernel import collect_candidates
from ..softmax import NUM_STATISTICS
from ..top_keys import NO_KEY, logit_keys, shard_top_keys
from .contract import token_chunks
from .triton_tuning import TritonTuning

Tensor = torch.Tensor
# Random logits put about 1.15 k of a row's logits at or above its threshold, a few a tile at
# most: a split's slots hold twice its share of them (2.3 k / num_splits) and SLOT_MARGIN more.
SLOT_MARGIN = 8


def picks_for(k: int) -> int:
    """Candidates a row keeps from one column tile: one where ``k = 1`` (its maximum), else
    enough that a tile holding more of a row's largest logits is rare for random logits."""
    return 1 if k == 1 else 4 if k <= 256 else 8


def top_keys(
    hidden: Tensor,
    weight: Tensor,
    temperature: Tensor,
    softcap: Optional[float],
    k: int,
    first_id: int,
    block_logits: Callable[[Tensor], Tensor],
    token_chunk: Optional[int] = None,
    tuning: Optional[TritonTuning] = None,
) -> Tuple[Tensor, Tensor]:
    """``(stats [n, 4] float32, keys [n, k] int64)``: the shard's softmax statistics and each row's
    ``k`` largest keys (``top_keys.logit_keys``, ids from ``first_id``), steps 1 to 5 above.

    ``hidden [n, H]`` and ``weight [vocab_shard, H]`` share a 16-bit or float32 dtype;
    ``temperature [n]`` float32 (stride 0: one for all rows), ``softcap`` (``None``: no cap) as for
    ``split_statistics``; ``block_logits(rows)``: the float32 logits ``[len(rows), vocab_shard]`` of
    rows (a slice or indices), softcapped and divided by their temperature,
    for step 5. ``token_chunk``: rows per chunk, else as many as keep a chunk's tile maxima and
    slots within ``chunking.BLOCK_BYTES`` (the torch form's chunks as ``chunking.chunk_rows``);
    ``tuning``: fixed launch choices (the interpreter tests' small tiles)."""
    tuning = tuning or TritonTuning()
    num_rows, vocab_shard, device = hidden.shape[0], weight.shape[0], hidden.device
    tiles = tuning.forward_tiles_for(weight.dtype)
    tiles_per_split = tuning.tiles_per_split_for(vocab_shard, tiles, weight.device)
    column_tiles = triton.cdiv(vocab_shard, tiles.block_n)
    num_splits = triton.cdiv(column_tiles, tiles_per_split)
    whole_rows = chunk_rows(token_chunk, vocab_shard)
    if 4 * k > column_tiles or num_rows == 0:
        return shard_top_keys(block_logits, num_rows, k=k, first_id=first_id, rows_per_chunk=whole_rows, device=device)
    picks = picks_for(k)
    slots = min(tiles_per_split * picks, triton.cdiv(23 * k, 10 * num_splits) + SLOT_MARGIN)
    rows_per_chunk = token_chunk or max(1, BLOCK_BYTES // (4 * column_tiles + 8 * num_splits * slots))
    stats = torch.empty(num_rows, NUM_STATISTICS, dtype=torch.float32, device=device)
    keys = torch.empty(num_rows, k, dtype=torch.int64, device=device)
    no_targets = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    every_column = torch.empty(0, dtype=torch.int32, device=device)
    for rows in token_chunks(num_rows, rows_per_chunk):
        chunk_hidden, chunk_temperature, size = hidden[rows], temperature[rows], rows.stop - rows.start
        # 1. The statistics and the tile maxima.
        tile_maxima = torch.empty(size, column_tiles, dtype=torch.float32, device=device)
        parts = split_statistics(
            chunk_hidden,
            weight,
            target_column=no_targets[rows],
            temperature=chunk_temperature,
            kept_mask=every_column,
            tiles=tiles,
            tiles_per_split=tiles_per_split,
            tile_maxima=tile_maxima,
            softcap=softcap,
        )
        stats[rows] = merge_parts(parts)
        # 2. k tiles hold a logit at or above the k-th largest maximum.
        threshold = tile_maxima.topk(k, dim=1).values[:, -1].contiguous()
        del tile_maxima
        # 3, 4. The candidates from the same products, and their k largest keys.
        candidates = torch.empty(size, num_splits, slots, dtype=torch.float32, device=device)
        columns = torch.empty(size, num_splits, slots, dtype=torch.int32, device=device)
        slot_count = collect_candidates(
            chunk_hidden,
            weight,
            temperature=chunk_temperature,
            tiles=tiles,
            tiles_per_split=tiles_per_split,
            threshold=threshold,
            candidates=candidates,
            candidate_columns=columns,
            picks=picks,
            softcap=softcap,
        )
        filled = torch.arange(slots, device=device) < slot_count[:, :, None]
        chunk_keys = torch.where(filled, logit_keys(candidates, columns.long() + first_id), NO_KEY)
        keys[rows] = chunk_keys.view(size, -1).topk(k, dim=1).values
        # 5. Rows with a logit left out, or too few candidates: the torch form, statistics and all.
        settled = (slot_count <= slots).all(dim=1) & (slot_count.clamp(max=slots).sum(dim=1) >= k)
        left_out = (~settled).nonzero().squeeze(1) + rows.start
        if left_out.numel():
            stats[left_out], keys[left_out] = shard_top_keys(
                block_logits, left_out, k=k, first_id=first_id, rows_per_chunk=whole_rows, device=device
            )
    return stats, keys
