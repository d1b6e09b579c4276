"""The Triton backend's ``kept_mask`` builder: one program per row walks its set, sets the bits of
this shard's ids with atomic ORs (a repeated id sets its bit again) and raises the ``kept_tokens``
flags of what it finds wrong, in one launch (``kept_tokens.torch_kept_mask`` is the torch
reference, and the torch backend's builder)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kept_tokens import MALFORMED_OFFSETS, OUTSIDE_VOCABULARY, TARGET_LEFT_OUT, KeptSets, check_flags, mask_words

IDS_PER_STEP = 256
# The flags' positions, as constants the kernel can read.
MALFORMED = tl.constexpr(MALFORMED_OFFSETS)
OUTSIDE = tl.constexpr(OUTSIDE_VOCABULARY)
LEFT_OUT = tl.constexpr(TARGET_LEFT_OUT)


@triton.jit
def kept_mask_kernel(
    offsets_ptr,
    token_ids_ptr,
    targets_ptr,
    mask_ptr,
    flags_ptr,
    num_sets,
    nnz,
    vocab,
    first_id,
    vocab_shard,
    words,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    out = mask_ptr + row.to(tl.int64) * words
    target = tl.load(targets_ptr + row)
    if row >= num_sets:  # a max_rows padding row keeps its stand-in target: a finite softmax
        column = target - first_id
        owned = (column >= 0) & (column < vocab_shard)
        tl.atomic_or(out + (column >> 5), (tl.full([], 1, tl.int32) << (column & 31).to(tl.int32)), mask=owned)
    else:
        start = tl.load(offsets_ptr + row)
        stop = tl.load(offsets_ptr + row + 1)
        malformed = (start > stop) | (start < 0) | (stop > nnz)
        malformed = malformed | ((row == 0) & (start != 0)) | ((row == num_sets - 1) & (stop != nnz))
        stop = tl.where(malformed, start, stop)  # a malformed span reads nothing
        outside = tl.zeros([], tl.int32)
        found = tl.zeros([], tl.int32)
        for first in range(start, stop, BLOCK):
            at = first + tl.arange(0, BLOCK)
            valid = at < stop
            ids = tl.load(token_ids_ptr + at, mask=valid, other=0)
            outside = tl.maximum(outside, tl.max((valid & ((ids < 0) | (ids >= vocab))).to(tl.int32), axis=0))
            found = tl.maximum(found, tl.max((valid & (ids == target)).to(tl.int32), axis=0))
            column = ids - first_id
            owned = valid & (column >= 0) & (column < vocab_shard)
            bit = tl.full([BLOCK], 1, tl.int32) << (column & 31).to(tl.int32)
            tl.atomic_or(out + (column >> 5), bit, mask=owned, sem="relaxed")
        tl.atomic_max(flags_ptr + MALFORMED, 1, mask=malformed)
        tl.atomic_max(flags_ptr + OUTSIDE, 1, mask=outside > 0)
        tl.atomic_max(flags_ptr + LEFT_OUT, 1, mask=(found == 0) & ~malformed)


def kept_mask(sets: KeptSets, vocab_shard: int) -> torch.Tensor:
    """``kept_mask [num_rows, words]`` int32 of ``sets`` (``kept_tokens`` gives the form), its
    values checked (``kept_tokens.check_flags``)."""
    device = sets.offsets.device
    mask = torch.zeros(sets.num_rows, mask_words(vocab_shard), dtype=torch.int32, device=device)
    flags = torch.zeros(3, dtype=torch.int32, device=device)
    if sets.num_rows > 0:
        kept_mask_kernel[(sets.num_rows,)](
            sets.offsets,
            sets.token_ids,
            sets.targets,
            mask,
            flags,
            sets.num_sets,
            sets.token_ids.shape[0],
            sets.vocab,
            sets.first_id,
            vocab_shard,
            mask.shape[1],
            BLOCK=IDS_PER_STEP,
        )
    if sets.num_sets == 0:  # no row checks the offsets: [0] is the only right one
        flags[MALFORMED_OFFSETS] = (sets.offsets[0] != 0) | (sets.token_ids.shape[0] != 0)
    check_flags(flags, sets)
    return mask
