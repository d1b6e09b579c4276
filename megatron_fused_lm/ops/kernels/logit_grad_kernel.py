"""Recompute backward kernel: recompute one ``[token chunk, vocabulary chunk]`` block of logits and
write ``dz / T`` in the weight's dtype, ready for the two cuBLAS gradient products; neither the
float32 product nor any other ``[tokens, vocab]``-sized intermediate reaches memory. The grid is
persistent: one program per multiprocessor runs the tiles ``pid, pid + programs, ...``, so the next
tile's loads are in flight during a tile's epilogue and store.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..backends.contract import SavedStatistics, UpstreamGrads
from .descriptors import descriptor
from .epilogue import (
    add_targets,
    capped_tanh,
    grouped_tile,
    inverse_temperature,
    kept_arguments,
    kept_tile,
    logit_grad_tile,
    next_k_step,
    product_step,
    row_upstream,
    row_upstream_arguments,
    softcap_arguments,
    temperature_arguments,
)
from .tiles import Tiles


@triton.jit
def logit_grad_kernel(
    hidden_desc,
    weight_desc,
    out_desc,
    target_column_ptr,
    lse_ptr,
    mean_logit_ptr,
    grad_logprob_ptr,
    grad_entropy_ptr,
    num_tokens,
    vocab,
    hidden_size,
    first_column,
    temperature_ptr,
    softcap,
    kept_ptr,
    stride_kept_row,
    kept_words,
    HAS_KEPT: tl.constexpr,
    HAS_GRAD_LOGPROB: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    NUM_TARGETS: tl.constexpr,
    UNIFORM_TEMPERATURE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_row_tiles = tl.cdiv(num_tokens, BLOCK_M)
    num_col_tiles = tl.cdiv(vocab, BLOCK_N)
    k_steps = tl.cdiv(hidden_size, BLOCK_K)
    my_tiles = tl.cdiv(num_row_tiles * num_col_tiles - pid, num_programs)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    tile = pid - num_programs
    k_step = k_steps - 1
    row0 = 0
    col0 = 0
    for _ in range(0, my_tiles * k_steps):
        k_step = next_k_step(k_step, k_steps)
        if k_step == 0:
            tile += num_programs
            row_tile, col_tile = grouped_tile(tile, num_row_tiles, num_col_tiles, GROUP_M)
            row0 = row_tile * BLOCK_M
            col0 = col_tile * BLOCK_N
        acc = product_step(
            hidden_desc,
            weight_desc,
            row0=row0,
            col0=col0,
            k_step=k_step,
            acc=acc,
            BLOCK_K=BLOCK_K,
            DOT_PRECISION=DOT_PRECISION,
        )

        if k_step == k_steps - 1:
            # Rows and columns past the block compute finite junk that the store clips.
            rows = row0 + tl.arange(0, BLOCK_M)
            target_column, lse, mean_logit, grad_logprob, grad_entropy = row_upstream(
                rows,
                rows < num_tokens,
                target_column_ptr=target_column_ptr,
                lse_ptr=lse_ptr,
                mean_logit_ptr=mean_logit_ptr,
                grad_logprob_ptr=grad_logprob_ptr,
                grad_entropy_ptr=grad_entropy_ptr,
                HAS_GRAD_LOGPROB=HAS_GRAD_LOGPROB,
                HAS_GRAD_ENTROPY=HAS_GRAD_ENTROPY,
                NUM_TARGETS=NUM_TARGETS,
            )
            inv_temperature = inverse_temperature(temperature_ptr, rows, rows < num_tokens, UNIFORM_TEMPERATURE)
            if HAS_SOFTCAP:
                tanh = capped_tanh(acc, softcap)
                logits = softcap * tanh * inv_temperature
            else:
                logits = acc * inv_temperature
            grad = logit_grad_tile(
                tl.exp(logits - lse[:, None]),
                mean_logit[:, None] - logits,
                grad_logprob[:, None],
                grad_entropy[:, None],
                HAS_GRAD_LOGPROB,
                HAS_GRAD_ENTROPY,
            )
            if HAS_KEPT:  # a column left out: 0, whatever its (unmasked, perhaps overflowing) p gave
                kept = kept_tile(
                    kept_ptr,
                    stride_kept_row,
                    kept_words=kept_words,
                    rows=rows,
                    row_valid=rows < num_tokens,
                    first_col=first_column + col0,
                    BLOCK_N=BLOCK_N,
                )
                grad = tl.where(kept, grad, 0.0)
            if HAS_GRAD_LOGPROB and NUM_TARGETS == 1:
                # Offsets within the tile against per-row scalars: no per-element column indices.
                is_target = tl.arange(0, BLOCK_N)[None, :] == (target_column - first_column - col0)[:, None]
                grad = tl.where(is_target, grad + grad_logprob[:, None], grad)
            elif HAS_GRAD_LOGPROB:
                grad = add_targets(
                    grad,
                    rows,
                    row_valid=rows < num_tokens,
                    first_col=first_column + col0,
                    target_column_ptr=target_column_ptr,
                    grad_logprob_ptr=grad_logprob_ptr,
                    NUM_TARGETS=NUM_TARGETS,
                    BLOCK_N=BLOCK_N,
                )
            if HAS_SOFTCAP:  # the cap's slope (softmax.product_grad)
                grad = grad * (1.0 - tanh * tanh)
            out_desc.store([row0, col0], (grad * inv_temperature).to(out_desc.dtype))
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)


def logit_grad_block(
    out: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_column: torch.Tensor,
    first_column: int,
    saved: SavedStatistics,
    upstream: UpstreamGrads,
    temperature: torch.Tensor,
    kept_mask: torch.Tensor,
    tiles: Tiles,
    num_programs: int,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Fill ``out [n, v]`` (the weight's dtype, unit last stride, rows 16-byte aligned) with the
    gradient with respect to ``hidden @ weight.T`` for ``hidden [n >= 1, H]`` and the vocabulary
    block ``weight [v >= 1, H]`` that starts at the shard's row ``first_column`` (both
    ``descriptors.addressable``).

    ``target_column [n]`` (int64, the shard's encoding); ``temperature [n]`` (float32; stride 0:
    one for all rows) divides each row's logits, ``softcap`` (``None``: none) caps them first and
    its slope multiplies their gradient; ``kept_mask`` (``kept_tokens``' form, the rows'
    over the whole shard, or ``[0]``) zeroes the columns left out; ``saved`` and ``upstream`` hold ``[n]``
    float32 contiguous tensors; a ``None`` upstream gradient contributes nothing. The grid has
    ``num_programs`` programs (fewer if there are fewer tiles).
    """
    num_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    num_tiles = triton.cdiv(num_tokens, tiles.block_m) * triton.cdiv(vocab, tiles.block_n)
    row_pointers, row_flags = row_upstream_arguments(target_column, saved, upstream)
    temperature, temperature_flag = temperature_arguments(temperature)
    softcap, softcap_flag = softcap_arguments(softcap)
    kept_pointers, kept_flag = kept_arguments(kept_mask)
    logit_grad_kernel[(min(num_tiles, num_programs),)](
        descriptor(hidden, [tiles.block_m, tiles.block_k]),
        descriptor(weight, [tiles.block_n, tiles.block_k]),
        descriptor(out, [tiles.block_m, tiles.block_n]),
        *row_pointers,
        num_tokens,
        vocab,
        hidden_size,
        first_column,
        temperature,
        softcap,
        *kept_pointers,
        **kept_flag,
        **row_flags,
        **temperature_flag,
        **softcap_flag,
        **tiles.launch_options(),
    )
    return out
