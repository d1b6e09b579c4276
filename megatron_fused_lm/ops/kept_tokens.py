"""Kept-token sets (sampling-mask replay): each row's distribution renormalized over the ids its
sampler kept, ``logprob = z_y - logsumexp_{j in kept} z_j`` and the entropy over the kept set.

The public form, ``kept_tokens=KeptTokens(offsets=..., token_ids=...)`` (or the pair ``(offsets,
token_ids)``, or any object with those two attributes: vLLM's ``SamplingMask``): ``offsets [rows +
1]`` and ``token_ids [nnz]`` integer, row ``i``'s set ``token_ids[offsets[i]:offsets[i + 1]]``
(global ids, repeats allowed), the rows those an op computes, in order. The backends read one form, ``kept_mask [n,
words]`` int32 for this shard: bit ``c % 32`` of word ``c // 32`` set where column ``c`` is kept
(``words = ceil(vocab_shard / 32)``); a ``[0]`` tensor keeps every column. A column outside the set
counts as ``z = -inf``: probability and gradient 0, and a shard keeping none of a row's ids gives
``softmax.merge_statistics``' empty block. ``docs/DESIGN.md`` ("Contracts", kept tokens) says why a
bitmask.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from .distributed import group_rank, group_size
from .inputs import RowSelection, check_on_device, checked_at_once

Tensor = torch.Tensor
WORD_BITS = 32


class KeptTokens(NamedTuple):
    """Each computed row's kept set in CSR form: ``offsets [rows + 1]`` and ``token_ids [nnz]``
    integer tensors (int32 or int64) on the rows' device, row ``i``'s global ids
    ``token_ids[offsets[i]:offsets[i + 1]]``. Engines hand the two arrays over in either order
    (vLLM's ``SamplingMask(token_ids, offsets)``, our pair ``(offsets, token_ids)``): build it by
    name, ``KeptTokens(token_ids=..., offsets=...)``, or with a constructor below."""

    offsets: Tensor
    token_ids: Tensor

    @classmethod
    def from_sampling_masks(cls, masks: Iterable[Any], device: torch.device) -> KeptTokens:
        """One set per token of each completion, completions in order, from vLLM's per-completion
        ``SamplingMask`` (or anything with ``token_ids [nnz_i]`` and ``offsets [tokens_i + 1]``,
        as lists, numpy arrays or tensors): the rows of the completions' tokens concatenated."""
        offsets, token_ids, start = [torch.zeros(1, dtype=torch.long)], [], 0
        for index, mask in enumerate(masks):
            ids, spans = (
                torch.as_tensor(getattr(mask, name), dtype=torch.long, device="cpu")
                for name in ("token_ids", "offsets")
            )
            if spans.dim() != 1 or spans.numel() == 0 or spans[0] != 0 or spans[-1] != ids.numel():
                raise ValueError(
                    f"sampling mask {index}: its offsets must run from 0 to its {ids.numel()} token ids, got "
                    f"{spans.tolist()[:3]}...{spans.tolist()[-1:]}"
                )
            offsets.append(spans[1:] + start)
            token_ids.append(ids)
            start += ids.numel()
        return cls(torch.cat(offsets).to(device), torch.cat([torch.zeros(0, dtype=torch.long), *token_ids]).to(device))

    @classmethod
    def from_id_lists(cls, id_lists: Sequence[Sequence[int]], device: torch.device) -> KeptTokens:
        """One set per row from a list of each row's ids (SGLang's ``output_token_sampling_mask``
        in ``meta_info``: one list per output token)."""
        counts = torch.tensor([len(ids) for ids in id_lists], dtype=torch.long)
        token_ids = torch.tensor([token for ids in id_lists for token in ids], dtype=torch.long)
        return cls(torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(device), token_ids.to(device))


def as_kept_tokens(kept_tokens: Any) -> Optional[KeptTokens]:
    """The ops' ``kept_tokens`` argument as a ``KeptTokens``: read by name from an object with
    ``offsets`` and ``token_ids`` attributes (a ``KeptTokens``, vLLM's ``SamplingMask``), else a pair
    taken as ``(offsets, token_ids)``; ``None`` stays ``None``. The values are checked later
    (``checked_sets``)."""
    if kept_tokens is None:
        return None
    if hasattr(kept_tokens, "offsets") and hasattr(kept_tokens, "token_ids"):
        return KeptTokens(kept_tokens.offsets, kept_tokens.token_ids)
    if isinstance(kept_tokens, (tuple, list)) and len(kept_tokens) == 2:
        return KeptTokens(*kept_tokens)
    raise TypeError(
        "kept_tokens must be a KeptTokens(offsets=..., token_ids=...), an object with offsets and token_ids "
        f"(vLLM's SamplingMask), or a pair (offsets [rows + 1], token_ids [nnz]); got {type(kept_tokens).__name__}"
    )


def every_column(device: torch.device) -> Tensor:
    """The ``kept_mask`` that keeps every column."""
    return torch.empty(0, dtype=torch.int32, device=device)


def mask_words(vocab_shard: int) -> int:
    """Words per row of a ``kept_mask`` over ``vocab_shard`` columns."""
    return -(-vocab_shard // WORD_BITS)


class KeptSets(NamedTuple):
    """``kept_tokens`` checked against an op's rows for type, shape and count (``checked_sets``);
    their values are checked as the bitmask is built (``check_flags``)."""

    offsets: Tensor  # [num_sets + 1] int64
    token_ids: Tensor  # [nnz] int64, global ids
    targets: Tensor  # [num_rows] int64: each computed row's global target (max_rows padding: 0)
    num_sets: int  # the rows with a set; the num_rows - num_sets after them are max_rows padding
    first_id: int  # this shard's first global id
    vocab: int  # the whole vocabulary

    @property
    def num_rows(self) -> int:
        return self.targets.shape[0]


def checked_sets(
    kept_tokens: KeptTokens,
    selection: RowSelection,
    targets: Tensor,
    vocab_shard: int,
    tp_group: Optional[dist.ProcessGroup],
    vocab_size: Optional[int] = None,
) -> KeptSets:
    """``kept_tokens`` against the selected rows and the op's global ``targets`` (``[*selection.
    lead_shape]``): ``TypeError`` / ``ValueError`` for a wrong type, shape or count of sets (with
    ``max_rows``, the count the mask selects is checked by ``check_on_device``); ids at or past
    ``vocab_size`` (``None``: the padded shards' end) are outside the vocabulary."""
    offsets, token_ids = kept_tokens
    for name, tensor in (("offsets", offsets), ("token_ids", token_ids)):
        if not isinstance(tensor, Tensor) or tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
            raise TypeError(f"kept_tokens' {name} must be an integer tensor, got {getattr(tensor, 'dtype', tensor)}")
        if tensor.dim() != 1 or tensor.device != targets.device:
            raise ValueError(
                f"kept_tokens' {name} must be 1-D on {targets.device}, got shape {tuple(tensor.shape)} on {tensor.device}"
            )
    num_sets = offsets.shape[0] - 1
    num_rows = selection.lead_shape.numel() if selection.row_index is None else selection.row_index.shape[0]
    if selection.padding is None and num_sets != num_rows:
        raise ValueError(
            f"kept_tokens' offsets hold {num_sets} sets for the {num_rows} rows "
            f"{'mask= selects' if selection.row_index is not None else 'computed'}: one set per computed row (with mask=, "
            "the selected rows in order), offsets [rows + 1]"
        )
    chosen = selection.take_rows(targets).long()
    if selection.padding is not None:
        if not 0 <= num_sets <= num_rows:
            raise ValueError(
                f"kept_tokens' offsets hold {num_sets} sets, more than the {num_rows} rows that mask= can select "
                "(with max_rows): one set per selected row"
            )
        check_on_device((~selection.padding).sum() == num_sets, "kept_tokens holds a set per row mask= selects")
        chosen = torch.where(selection.padding, 0, chosen)  # the padding rows' stand-in target
    first_id = group_rank(tp_group) * vocab_shard
    # Contiguous: the Triton builder reads them at unit stride.
    offsets, token_ids, chosen = (tensor.long().contiguous() for tensor in (offsets, token_ids, chosen))
    vocab = vocab_shard * group_size(tp_group) if vocab_size is None else vocab_size
    return KeptSets(offsets, token_ids, chosen, num_sets, first_id, vocab)


# What a builder finds wrong, as flags [3] int32 (nonzero: found): offsets that do not start at 0,
# rise and end at nnz; an id outside the vocabulary; a row whose target is outside its set.
MALFORMED_OFFSETS, OUTSIDE_VOCABULARY, TARGET_LEFT_OUT = range(3)


def check_flags(flags: Tensor, sets: KeptSets) -> None:
    """``ValueError`` for the first of a builder's ``flags`` raised, at once where that is possible
    (``inputs.checked_at_once``); elsewhere one device-side assertion that names all three (no host
    synchronization, one launch)."""
    messages = [
        f"kept_tokens' offsets must start at 0, never decrease and end at len(token_ids) = {sets.token_ids.shape[0]}",
        f"a kept token id is outside the vocabulary [0, {sets.vocab})",
        "a row's target is outside its kept_tokens set",
    ]
    if checked_at_once(flags):
        for raised, message in zip(flags.tolist(), messages, strict=True):
            if raised:
                raise ValueError(message)
    else:
        check_on_device((flags == 0).all(), "kept_tokens: " + "; or ".join(messages))


def torch_kept_mask(sets: KeptSets, vocab_shard: int) -> Tensor:
    """``kept_mask [num_rows, words]`` of ``sets`` in torch, its values checked (the torch backend's
    builder and the reference of ``kernels.kept_mask_kernel``). A sum of distinct bits is their OR,
    so repeated ids are dropped first, after a sort: no host synchronization."""
    offsets, token_ids, num_sets = sets.offsets, sets.token_ids, sets.num_sets
    nnz = token_ids.shape[0]
    counts = offsets.diff()
    flags = torch.zeros(3, dtype=torch.int32, device=offsets.device)
    malformed = (offsets[0] != 0) | (offsets[-1] != nnz) | (counts < 0).any()
    flags[MALFORMED_OFFSETS] = malformed
    flags[OUTSIDE_VOCABULARY] = ((token_ids < 0) | (token_ids >= sets.vocab)).any()
    if num_sets > 0:  # malformed (and so reported), the last row takes every id: the sizes agree
        counts = torch.where(malformed, 0, counts.clamp(min=0))
        counts[-1] = torch.where(malformed, nnz, counts[-1])
    else:  # no row reads an id (any is reported as malformed offsets)
        token_ids = token_ids[:0]
    row = torch.repeat_interleave(torch.arange(num_sets, device=offsets.device), counts, output_size=token_ids.shape[0])
    hits = torch.zeros(num_sets, dtype=torch.int32, device=row.device)
    hits.index_add_(0, row, (token_ids == sets.targets[row]).int())
    flags[TARGET_LEFT_OUT] = (hits == 0).any()
    check_flags(flags, sets)
    # The max_rows padding rows keep their stand-in target: a finite softmax.
    row = torch.cat([row, torch.arange(num_sets, sets.num_rows, device=row.device)])
    column = torch.cat([token_ids, sets.targets[num_sets:]]) - sets.first_id
    num_rows, words = sets.num_rows, mask_words(vocab_shard)
    past_end = num_rows * vocab_shard
    owned = (column >= 0) & (column < vocab_shard)
    key = torch.where(owned, row * vocab_shard + column, past_end).sort().values
    first = torch.ones_like(key, dtype=torch.bool)
    first[1:] = key[1:] != key[:-1]
    keep = first & (key < past_end)
    row, column = key // vocab_shard, key % vocab_shard
    word = torch.where(keep, row * words + column // WORD_BITS, num_rows * words)  # the last word: a sink
    # Bit 31 is int32's sign, -2**31: added to bits 0 to 30 it gives the two's complement word
    # without overflow.
    shift = column % WORD_BITS
    bit = torch.where(shift == WORD_BITS - 1, -(2**31), torch.ones_like(column) << shift)
    bit = torch.where(keep, bit, 0).to(torch.int32)
    mask = torch.zeros(num_rows * words + 1, dtype=torch.int32, device=key.device).scatter_add_(0, word, bit)
    return mask[:-1].view(num_rows, words)


def kept_block(kept_mask: Tensor, rows: slice, num_columns: int) -> Optional[Tensor]:
    """``[rows, num_columns]`` bool: the kept columns ``[0, num_columns)`` of ``rows`` of a
    ``kept_mask``; ``None`` where it keeps every column."""
    if kept_mask.dim() != 2:
        return None
    columns = torch.arange(num_columns, device=kept_mask.device)
    words = kept_mask[rows][:, columns // WORD_BITS]
    return ((words >> (columns % WORD_BITS)) & 1).bool()
