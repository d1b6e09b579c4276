"""The Triton backend's ``kept_mask`` builder: one atomic OR per (row, column) pair, so repeated ids
need no sort (``kept_tokens.torch_kept_mask`` is the torch reference, and the torch backend's)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kept_tokens import KeptPairs, mask_words

PAIRS_PER_PROGRAM = 1024


@triton.jit
def kept_mask_kernel(row_ptr, column_ptr, mask_ptr, num_pairs, words, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = at < num_pairs
    row = tl.load(row_ptr + at, mask=valid, other=0)
    column = tl.load(column_ptr + at, mask=valid, other=-1)
    owned = valid & (column >= 0)  # -1: another shard's id
    bit = tl.full([BLOCK], 1, tl.int32) << (column & 31).to(tl.int32)
    tl.atomic_or(mask_ptr + row * words + (column >> 5), bit, mask=owned, sem="relaxed")


def kept_mask(pairs: KeptPairs, vocab_shard: int) -> torch.Tensor:
    """``kept_mask [num_rows, words]`` int32 from ``pairs`` (``kept_tokens`` gives the format)."""
    words = mask_words(vocab_shard)
    mask = torch.zeros(pairs.num_rows, words, dtype=torch.int32, device=pairs.row.device)
    num_pairs = pairs.row.shape[0]
    if num_pairs > 0:
        grid = (triton.cdiv(num_pairs, PAIRS_PER_PROGRAM),)
        kept_mask_kernel[grid](pairs.row, pairs.column, mask, num_pairs, words, BLOCK=PAIRS_PER_PROGRAM)
    return mask
