"""The Triton backend: a fused Triton forward, cuBLAS products and a Triton epilogue backward.

Forward: ``split_statistics`` computes ``[num_splits, n, 4]`` statistics straight from hidden and
weight tiles (nothing of size ``[n, vocab_shard]`` exists); ``merge_statistics`` merges the splits
on the GPU.

Backward, blocked in two dimensions so that the memory stays bounded and ``grad_weight`` stays
accurate without a float32 ``[vocab_shard, H]`` accumulator: an outer loop over token chunks of
``TOKEN_CHUNK`` rows, an inner loop over vocabulary chunks sized so that one float32 product block
plus one ``dz`` block in the weight's dtype take at most ``BLOCK_BYTES``. Per block, cuBLAS
recomputes ``hidden @ weight.T`` in float32, ``logit_grad_block`` turns it into ``dz / T`` in one
pass, and cuBLAS adds ``dz @ w`` into a float32 ``[token chunk, H]`` accumulator for
``grad_hidden`` (exact over the vocabulary chunks) and ``dz.T @ h`` into ``grad_weight`` (rounded
to the weight's dtype once per token chunk). Working set besides the returned gradients: the two
blocks plus the float32 ``[token chunk, H]`` accumulator.

Forward tile rule (measurements in ``docs/BENCHMARKS.md``): on CUDA, 16-bit inputs use
256 x 128 x 64 tiles, 8 warps, 3 stages, 8 token tiles per group and 8 column tiles per
vocabulary split; float32 inputs use 64 x 64 x 32 tiles with IEEE float32 products. Under the
Triton interpreter (CPU) the tiles are small so that tests run quickly.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .softmax_stats import NUM_STATISTICS, merge_statistics, token_chunks
from .triton_kernels.logit_grad_kernel import logit_grad_block
from .triton_kernels.softmax_stats_kernel import split_statistics
from .triton_kernels.tiles import Tiles

TOKEN_CHUNK = 8192
BLOCK_BYTES = 192 * 2**20
VOCAB_CHUNK_MULTIPLE = 256  # keeps the cuBLAS products on whole tiles

GPU_16BIT_TILES = Tiles(block_m=256, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, dot_precision="tf32")
GPU_FLOAT32_TILES = Tiles(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=3, dot_precision="ieee")
INTERPRETER_TILES = Tiles(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1, dot_precision="ieee")
GPU_TILES_PER_SPLIT = 8
INTERPRETER_TILES_PER_SPLIT = 2


def choose_tiles(weight: torch.Tensor) -> Tuple[Tiles, int]:
    """Tiles of the forward kernel and its column tiles per vocabulary split."""
    if not weight.is_cuda:
        return INTERPRETER_TILES, INTERPRETER_TILES_PER_SPLIT
    if weight.dtype == torch.float32:
        return GPU_FLOAT32_TILES, GPU_TILES_PER_SPLIT
    return GPU_16BIT_TILES, GPU_TILES_PER_SPLIT


def target_columns(local_target: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """``[n]`` int64: the target's row in this shard, or -1 where another shard owns it."""
    return torch.where(owned, local_target, -1).contiguous()


def local_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    temperature: float,
    chunk_size: Optional[int],
) -> torch.Tensor:
    """This shard's statistics ``[n, 4]`` (float32) for ``hidden [n, H]`` and ``weight
    [vocab_shard, H]`` (same dtype). ``chunk_size`` is unused: the forward needs no chunks."""
    if hidden.shape[0] == 0:
        return hidden.new_empty(0, NUM_STATISTICS, dtype=torch.float32)
    tiles, tiles_per_split = choose_tiles(weight)
    parts = split_statistics(
        hidden, weight, target_columns(local_target, owned), 1.0 / temperature, tiles, tiles_per_split
    )
    return merge_statistics(parts)


def add_product(out: torch.Tensor, left: torch.Tensor, right: torch.Tensor, accumulate: bool) -> None:
    """``out = left @ right`` (``+ out`` when ``accumulate``), the product accumulated in float32.

    ``out`` is float32 or ``left``'s dtype; ``left`` and ``right`` share a dtype. When
    ``accumulate`` is false, ``out`` may hold anything (beta = 0 ignores it).
    """
    beta = 1 if accumulate else 0
    if out.dtype == left.dtype:
        torch.addmm(out, left, right, beta=beta, out=out)
    elif out.is_cuda:
        torch.addmm(out, left, right, beta=beta, out_dtype=out.dtype, out=out)
    else:  # CPU (interpreter tests): no mixed-dtype addmm there.
        out.addmm_(left.to(out.dtype), right.to(out.dtype), beta=beta)


def local_gradients(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    lse: torch.Tensor,
    mean_logit: torch.Tensor,
    grad_logprob: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    temperature: float,
    chunk_size: Optional[int],
    need_hidden_grad: bool,
    need_weight_grad: bool,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """This shard's ``grad_hidden [n, H]`` (hidden's dtype, partial: this shard's vocabulary
    only) and ``grad_weight [vocab_shard, H]`` (weight's dtype); ``None`` where not needed.

    ``chunk_size`` (default ``TOKEN_CHUNK``) sets the tokens per outer chunk.
    """
    num_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    grad_hidden = hidden.new_empty(hidden.shape) if need_hidden_grad else None
    grad_weight = weight.new_empty(weight.shape) if need_weight_grad else None
    if num_tokens == 0:
        return grad_hidden, None if grad_weight is None else grad_weight.zero_()

    token_chunk = min(chunk_size or TOKEN_CHUNK, num_tokens)
    block_elements = BLOCK_BYTES // (4 + weight.element_size())
    vocab_chunk = block_elements // token_chunk // VOCAB_CHUNK_MULTIPLE * VOCAB_CHUNK_MULTIPLE
    vocab_chunk = min(vocab, max(VOCAB_CHUNK_MULTIPLE, vocab_chunk))
    products = hidden.new_empty(token_chunk, vocab_chunk, dtype=torch.float32)
    logit_grads = weight.new_empty(token_chunk, vocab_chunk)
    hidden_acc = hidden.new_empty(token_chunk, hidden_size, dtype=torch.float32) if need_hidden_grad else None
    target_column = target_columns(local_target, owned)
    lse, mean_logit = lse.contiguous(), mean_logit.contiguous()
    grad_logprob = None if grad_logprob is None else grad_logprob.contiguous()
    grad_entropy = None if grad_entropy is None else grad_entropy.contiguous()

    for tokens in token_chunks(num_tokens, token_chunk):
        rows = tokens.stop - tokens.start
        for columns in token_chunks(vocab, vocab_chunk):
            width = columns.stop - columns.start
            product = products[:rows, :width]
            add_product(product, hidden[tokens], weight[columns].t(), accumulate=False)
            block = logit_grad_block(
                logit_grads[:rows, :width], product,
                target_column[tokens] - columns.start,
                lse[tokens], mean_logit[tokens],
                None if grad_logprob is None else grad_logprob[tokens],
                None if grad_entropy is None else grad_entropy[tokens],
                1.0 / temperature,
            )
            if hidden_acc is not None:
                add_product(hidden_acc[:rows], block, weight[columns], accumulate=columns.start > 0)
            if grad_weight is not None:
                add_product(grad_weight[columns], block.t(), hidden[tokens], accumulate=tokens.start > 0)
        if grad_hidden is not None:
            grad_hidden[tokens] = hidden_acc[:rows]
    return grad_hidden, grad_weight
