"""Kept-token sets (sampling-mask replay): each row's distribution renormalized over the ids its
sampler kept, ``logprob = z_y - logsumexp_{j in kept} z_j`` and the entropy over the kept set.

The public form, ``kept_tokens=(offsets, token_ids)``: ``offsets [rows + 1]`` and ``token_ids
[nnz]`` int64, row ``i``'s set ``token_ids[offsets[i]:offsets[i + 1]]`` (global ids, repeats
allowed), the rows those an op computes, in order. The backends read one form, ``kept_mask [n,
words]`` int32 for this shard: bit ``c % 32`` of word ``c // 32`` set where column ``c`` is kept
(``words = ceil(vocab_shard / 32)``); a ``[0]`` tensor keeps every column. A column outside the set
counts as ``z = -inf``: probability and gradient 0, and a shard keeping none of a row's ids gives
``softmax.merge_statistics``' empty block. ``docs/DESIGN.md`` ("Kept tokens") says why a bitmask.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .distributed import group_rank, group_size
from .inputs import RowSelection, check_on_device

Tensor = torch.Tensor
KeptTokens = Tuple[Tensor, Tensor]  # (offsets [rows + 1], token_ids [nnz]), int64
WORD_BITS = 32


def every_column(device: torch.device) -> Tensor:
    """The ``kept_mask`` that keeps every column."""
    return torch.empty(0, dtype=torch.int32, device=device)


def mask_words(vocab_shard: int) -> int:
    """Words per row of a ``kept_mask`` over ``vocab_shard`` columns."""
    return -(-vocab_shard // WORD_BITS)


class KeptPairs(NamedTuple):
    """The kept sets of an op's ``num_rows`` rows as (row, this shard's column) pairs, a column -1
    where another shard owns the id; ``max_rows`` padding rows keep their stand-in target."""

    row: Tensor  # [m] int64
    column: Tensor  # [m] int64
    num_rows: int


def kept_pairs(
    kept_tokens: Sequence[Tensor],
    selection: RowSelection,
    targets: Tensor,
    vocab_shard: int,
    tp_group: Optional[dist.ProcessGroup],
) -> KeptPairs:
    """Check ``kept_tokens`` against the selected rows and their global ``targets`` (the op's
    ``targets``, ``[*selection.lead_shape]``) and give its pairs on this rank's shard. ``TypeError`` /
    ``ValueError`` for a wrong type, shape or count of sets; the values (offsets that start at 0,
    rise and end at ``nnz``; ids inside the vocabulary; each row's target inside its set) by
    ``check_on_device``: at once on the CPU, a device-side assertion on a GPU."""
    if not isinstance(kept_tokens, (tuple, list)) or len(kept_tokens) != 2:
        raise TypeError("kept_tokens must be a pair (offsets [rows + 1], token_ids [nnz]) of int64 tensors")
    offsets, token_ids = kept_tokens
    for name, tensor in (("offsets", offsets), ("token_ids", token_ids)):
        if not isinstance(tensor, Tensor) or tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
            raise TypeError(f"kept_tokens' {name} must be an integer tensor, got {getattr(tensor, 'dtype', tensor)}")
        if tensor.dim() != 1 or tensor.device != targets.device:
            raise ValueError(
                f"kept_tokens' {name} must be 1-D on {targets.device}, got shape {tuple(tensor.shape)} on {tensor.device}"
            )
    num_sets = offsets.shape[0] - 1
    num_rows = selection.lead_shape.numel() if selection.rows is None else selection.rows.shape[0]
    if selection.padding is None and num_sets != num_rows:
        raise ValueError(
            f"kept_tokens' offsets hold {num_sets} sets for {num_rows} rows: one set per computed row (with mask=, "
            "the selected rows in order), offsets [rows + 1]"
        )
    if selection.padding is not None:
        if not 0 <= num_sets <= num_rows:
            raise ValueError(f"kept_tokens' offsets hold {num_sets} sets; mask= selects at most max_rows={num_rows}")
        check_on_device((~selection.padding).sum() == num_sets, "kept_tokens holds a set per row mask= selects")
    offsets, token_ids = offsets.long(), token_ids.long()
    nnz = token_ids.shape[0]
    vocab = vocab_shard * group_size(tp_group)
    check_on_device(
        (offsets[0] == 0) & (offsets[-1] == nnz) & (offsets.diff() >= 0).all(),
        f"kept_tokens' offsets must start at 0, never decrease and end at len(token_ids) = {nnz}",
    )
    if nnz > 0:
        check_on_device(
            ((token_ids >= 0) & (token_ids < vocab)).all(), f"a kept token id is outside the vocabulary [0, {vocab})"
        )
    row = torch.repeat_interleave(
        torch.arange(num_sets, device=offsets.device), offsets.diff().clamp(min=0), output_size=nnz
    )
    if num_sets > 0:
        chosen = selection.take_rows(targets).long()[:num_sets]
        hits = torch.zeros(num_sets, dtype=torch.int32, device=row.device).index_add_(
            0, row, (token_ids == chosen[row]).int()
        )
        check_on_device((hits > 0).all(), "a row's target is outside its kept_tokens set")
    if num_sets < num_rows:  # max_rows padding rows keep their stand-in target, id 0: a finite softmax
        row = torch.cat([row, torch.arange(num_sets, num_rows, device=row.device)])
        token_ids = torch.cat([token_ids, token_ids.new_zeros(num_rows - num_sets)])
    column = token_ids - group_rank(tp_group) * vocab_shard
    column = torch.where((column >= 0) & (column < vocab_shard), column, -1)
    return KeptPairs(row, column, num_rows)


def torch_kept_mask(pairs: KeptPairs, vocab_shard: int) -> Tensor:
    """``kept_mask [num_rows, words]`` from ``pairs`` in torch (the torch backend's; the Triton
    backend sets bits with atomics, ``kernels.kept_mask_kernel``). A sum of distinct bits is their
    OR, so repeated pairs are dropped first, after a sort: no host synchronization."""
    num_rows, words = pairs.num_rows, mask_words(vocab_shard)
    past_end = num_rows * vocab_shard
    key = torch.where(pairs.column >= 0, pairs.row * vocab_shard + pairs.column, past_end).sort().values
    first = torch.ones_like(key, dtype=torch.bool)
    first[1:] = key[1:] != key[:-1]
    keep = first & (key < past_end)
    row, column = key // vocab_shard, key % vocab_shard
    word = torch.where(keep, row * words + column // WORD_BITS, num_rows * words)  # the last word: a sink
    bit = torch.where(keep, torch.ones_like(column) << (column % WORD_BITS), 0)
    summed = torch.zeros(num_rows * words + 1, dtype=torch.int64, device=key.device).scatter_add_(0, word, bit)
    summed = summed[:-1]
    # Bit 31 set: the int32 word is negative, two's complement.
    return torch.where(summed >= 2**31, summed - 2**32, summed).to(torch.int32).view(num_rows, words)


def kept_block(kept_mask: Tensor, rows: slice, num_columns: int) -> Optional[Tensor]:
    """``[rows, num_columns]`` bool: the kept columns ``[0, num_columns)`` of ``rows`` of a
    ``kept_mask``; ``None`` where it keeps every column."""
    if kept_mask.dim() != 2:
        return None
    columns = torch.arange(num_columns, device=kept_mask.device)
    words = kept_mask[rows][:, columns // WORD_BITS]
    return ((words >> (columns % WORD_BITS)) & 1).bool()
