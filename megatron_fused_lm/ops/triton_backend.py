"""The Triton backend: a fused Triton forward; a Triton recompute + ``dz`` kernel and cuBLAS products
in the backward.

Forward: ``split_statistics`` computes ``[num_splits, n, 4]`` statistics straight from hidden and
weight tiles (nothing of size ``[n, vocab_shard]`` exists); ``merge_statistics`` merges the splits
on the GPU.

Backward, blocked in two dimensions so that the memory stays bounded and ``grad_weight`` stays
accurate without a float32 ``[vocab_shard, H]`` accumulator: an outer loop over token chunks of
``TOKEN_CHUNK`` rows, an inner loop over vocabulary chunks sized so that one ``dz`` block in the
weight's dtype fills what the memory target leaves (``dz_block_bytes``). Per block,
``logit_grad_block`` recomputes ``hidden @ weight.T`` tile by tile and writes ``dz / T`` straight
from its epilogue, and cuBLAS adds ``dz @ w`` into a float32 ``[token chunk, H]`` accumulator for
``grad_hidden`` (exact over the vocabulary chunks) and ``dz.T @ h`` into ``grad_weight`` (rounded
to the weight's dtype once per token chunk). Working set besides the returned gradients: the
``dz`` block plus the float32 ``[token chunk, H]`` accumulator.

Both kernels read their operands through tensor descriptors (TMA on Hopper), which need unit last
strides and 16-byte aligned rows: other layouts are copied once per call (``addressable``).

Tile rule (measurements in ``docs/BENCHMARKS.md``): on CUDA, 16-bit inputs use 256 x 128 x 64
forward tiles and 128 x 256 x 64 backward tiles, 8 warps, 3 stages, 8 token tiles per group; the
forward's column tiles per split (6 to 16) are chosen per shape to fill the last wave of programs;
the backward grid is persistent, one program per multiprocessor. float32 inputs use 64 x 64 x 32
tiles with IEEE float32 products. Under the Triton interpreter (CPU) the tiles are small so that
tests run quickly and exercise several splits and several tiles per program.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .products import add_product
from .softmax_stats import NUM_STATISTICS, merge_statistics, token_chunks
from .triton_kernels.descriptors import addressable
from .triton_kernels.logit_grad_kernel import logit_grad_block
from .triton_kernels.softmax_stats_kernel import split_statistics
from .triton_kernels.tiles import Tiles

TOKEN_CHUNK = 8192
# The backward's working set besides the returned gradients is held to the memory target,
# WORKING_SET_BYTES plus WORKING_SET_GRADIENT_SHARE of the gradient bytes; RESERVE_BYTES of it
# stay for the statistics and small temporaries, the float32 accumulator takes its share, and the
# dz block gets the rest (fewer, larger blocks measured up to 5 % faster at 4096 tokens).
WORKING_SET_BYTES = 256 * 2**20
WORKING_SET_GRADIENT_SHARE = 0.1
RESERVE_BYTES = 32 * 2**20
BLOCK_BYTES: Optional[int] = None  # fixes the dz block's size instead (tests force many blocks)
VOCAB_CHUNK_MULTIPLE = 256  # keeps the cuBLAS products on whole tiles

GPU_16BIT_TILES = Tiles(block_m=256, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, dot_precision="tf32")
GPU_16BIT_GRAD_TILES = Tiles(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, dot_precision="tf32")
GPU_FLOAT32_TILES = Tiles(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=8, num_stages=3, dot_precision="ieee")
INTERPRETER_TILES = Tiles(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1, dot_precision="ieee")
TILES_PER_SPLIT = range(6, 17)  # candidates on CUDA; the rule picks the one that fills the last wave best
INTERPRETER_TILES_PER_SPLIT = 2
INTERPRETER_PROGRAMS = 2  # stands in for the multiprocessor count under the interpreter


def choose_tiles(weight: torch.Tensor) -> Tuple[Tiles, Tiles]:
    """Tiles of the forward kernel and of the backward kernel."""
    if not weight.is_cuda:
        return INTERPRETER_TILES, INTERPRETER_TILES
    if weight.dtype == torch.float32:
        return GPU_FLOAT32_TILES, GPU_FLOAT32_TILES
    return GPU_16BIT_TILES, GPU_16BIT_GRAD_TILES


def num_programs(device: torch.device) -> int:
    """Programs that run at once with the 16-bit tiles (one per multiprocessor: they take most
    of its shared memory)."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_tiles_per_split(num_tokens: int, vocab: int, tiles: Tiles, device: torch.device) -> int:
    """Column tiles per vocabulary split: the candidate whose programs, run ``num_programs`` at a
    time, leave the least idle time in the last wave (ties: fewer splits)."""
    if device.type != "cuda":
        return INTERPRETER_TILES_PER_SPLIT
    slots = num_programs(device)
    row_tiles, col_tiles = -(-num_tokens // tiles.block_m), -(-vocab // tiles.block_n)

    def column_tiles_per_slot(per_split: int) -> int:
        programs = row_tiles * -(-col_tiles // per_split)
        return -(-programs // slots) * per_split

    candidates = {min(per_split, col_tiles) for per_split in TILES_PER_SPLIT}
    return min(candidates, key=lambda per_split: (column_tiles_per_slot(per_split), -per_split))


def dz_block_bytes(gradient_bytes: int, accumulator_bytes: int) -> int:
    """Bytes of the backward's ``dz`` block (``BLOCK_BYTES`` if set)."""
    if BLOCK_BYTES is not None:
        return BLOCK_BYTES
    budget = WORKING_SET_BYTES + WORKING_SET_GRADIENT_SHARE * gradient_bytes
    return int(budget - accumulator_bytes - RESERVE_BYTES)


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
    tiles = choose_tiles(weight)[0]
    tiles_per_split = choose_tiles_per_split(hidden.shape[0], weight.shape[0], tiles, weight.device)
    parts = split_statistics(
        hidden, weight, target_columns(local_target, owned), 1.0 / temperature, tiles, tiles_per_split
    )
    return merge_statistics(parts)


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
    gradients = [grad for grad in (grad_hidden, grad_weight) if grad is not None]
    gradient_bytes = sum(grad.numel() * grad.element_size() for grad in gradients)
    accumulator_bytes = token_chunk * hidden_size * 4 if need_hidden_grad else 0
    vocab_chunk = dz_block_bytes(gradient_bytes, accumulator_bytes) // weight.element_size() // token_chunk
    multiple = VOCAB_CHUNK_MULTIPLE
    vocab_chunk = min(vocab, max(multiple, vocab_chunk // multiple * multiple))
    # Row stride a multiple of VOCAB_CHUNK_MULTIPLE: the kernel stores through a tensor descriptor.
    logit_grads = weight.new_empty(token_chunk, -(-vocab_chunk // multiple) * multiple)
    hidden_acc = hidden.new_empty(token_chunk, hidden_size, dtype=torch.float32) if need_hidden_grad else None
    tiles, programs = choose_tiles(weight)[1], num_programs(weight.device)
    hidden_operand, weight_operand = addressable(hidden), addressable(weight)
    target_column = target_columns(local_target, owned)
    lse, mean_logit = lse.contiguous(), mean_logit.contiguous()
    grad_logprob = None if grad_logprob is None else grad_logprob.contiguous()
    grad_entropy = None if grad_entropy is None else grad_entropy.contiguous()

    for tokens in token_chunks(num_tokens, token_chunk):
        rows = tokens.stop - tokens.start
        for columns in token_chunks(vocab, vocab_chunk):
            block = logit_grad_block(
                logit_grads[:rows, : columns.stop - columns.start],
                hidden_operand[tokens], weight_operand[columns],
                target_column[tokens] - columns.start,
                lse[tokens], mean_logit[tokens],
                None if grad_logprob is None else grad_logprob[tokens],
                None if grad_entropy is None else grad_entropy[tokens],
                1.0 / temperature, tiles, programs,
            )
            if hidden_acc is not None:
                add_product(hidden_acc[:rows], block, weight[columns], accumulate=columns.start > 0)
            if grad_weight is not None:
                add_product(grad_weight[columns], block.t(), hidden[tokens], accumulate=tokens.start > 0)
        if grad_hidden is not None:
            grad_hidden[tokens] = hidden_acc[:rows]
    return grad_hidden, grad_weight
