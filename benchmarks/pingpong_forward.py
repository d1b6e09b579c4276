"""A candidate Hopper form of the package's forward kernel (``softmax_stats_kernel``), in Triton's
Gluon dialect (Triton 3.6): the same statistics and stored block, with each tile's epilogue beside
the next tile's products. Not used by the package: measured slower than the Triton kernel
(``docs/benchmarks/constants.md``, the ping-pong candidate); kept so that the measurement can be repeated.

A program owns one tile of ``BLOCK_M`` tokens and one vocabulary split, as the Triton kernel does,
and runs three partitions:

1. a loader warp streams (hidden, weight) tiles through a ring of ``STAGES`` shared buffers by TMA;
2. two consumer warpgroups take the split's column tiles in turn (even, odd), each with its own
   register accumulator; a turn barrier passes the tensor cores from one to the other as soon as
   a tile's products are issued, so one group's epilogue (statistics, then the block's store)
   runs while the other's products do;
3. each group folds its tiles into its own running statistics and writes them as one part, so a
   split gives two parts of ``parts [2 * num_splits, n, 4]``, merged like any others.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megatron_fused_lm.ops.softmax import NUM_STATISTICS

BLOCK_M = 128  # tokens of a tile: one warpgroup's accumulator rows
BLOCK_N = 128  # vocabulary rows of a tile: 128 x 128 float32 is 128 registers a thread
BLOCK_K = 64
STAGES = 4
GROUP_M = 8
CONSUMERS = 2  # parts per split
# 4 + 4 + 1 warps run as three warpgroups (384 threads): 168 registers each on average, shared
# out as 240 to each consumer group and 24 to the loader.
MAX_REGISTERS = 168
LOADER_REGISTERS = 24
CONSUMER_REGISTERS = 240
LOWEST_OFFSET = gl.constexpr(-60000.0)  # as softmax_stats_kernel.LOWEST_OFFSET


@gluon.jit
def _load_operands(
    hidden_desc, weight_desc, hidden_bufs, weight_bufs, ready, empty, row0, first_col, num_steps, k_steps,
    STAGES: gl.constexpr,
):  # fmt: skip
    block_n: gl.constexpr = weight_desc.block_type.shape[0]
    block_k: gl.constexpr = weight_desc.block_type.shape[1]
    for step in range(num_steps):
        slot = step % STAGES
        # A fresh barrier counts as released once, so the first lap does not wait.
        mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), hidden_desc.block_type.nbytes + weight_desc.block_type.nbytes)
        k = (step % k_steps) * block_k
        tma.async_copy_global_to_shared(hidden_desc, [row0, k], ready.index(slot), hidden_bufs.index(slot))
        col0 = first_col + (step // k_steps) * block_n
        tma.async_copy_global_to_shared(weight_desc, [col0, k], ready.index(slot), weight_bufs.index(slot))


@gluon.jit
def _fold_tiles(
    hidden_bufs, weight_bufs, ready, empty, turn, store_buf, block_desc, target_column_ptr, parts_ptr,
    reference_ptr, row0, num_tokens, vocab, first_col, num_col_tiles, k_steps, part, stride_parts_split,
    stride_parts_token, stride_reference_row, inv_temperature,
    GROUP: gl.constexpr, STORE_BLOCK: gl.constexpr, STORE_OFFSETS: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    block_m: gl.constexpr = hidden_bufs.shape[1]
    block_n: gl.constexpr = weight_bufs.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)

    rows = row0 + gl.arange(0, block_m, layout=row_layout)
    row_valid = rows < num_tokens
    target_column = gl.load(target_column_ptr + rows, mask=row_valid, other=-1)  # -1: another shard's
    if STORE_BLOCK and not STORE_OFFSETS:
        reference = gl.load(reference_ptr + rows, mask=row_valid, other=0.0)
    offsets_in_tile = gl.arange(0, block_n, layout=col_layout)
    running_max = gl.full([block_m], float("-inf"), gl.float32, row_layout)
    sumexp = gl.zeros([block_m], gl.float32, row_layout)
    sumexp_z = gl.zeros([block_m], gl.float32, row_layout)
    target_logit = gl.zeros([block_m], gl.float32, row_layout)

    turns = 0
    for tile in range(GROUP, num_col_tiles, 2):
        # 1. Wait for the tensor cores (group 0's first turn is free).
        mbarrier.wait(turn.index(GROUP), (turns & 1) ^ (1 - GROUP))
        first_step = tile * k_steps
        acc = gl.zeros([block_m, block_n], gl.float32, acc_layout)
        for k_step in range(k_steps):
            step = first_step + k_step
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            acc = warpgroup_mma(
                hidden_bufs.index(slot), weight_bufs.index(slot).permute((1, 0)), acc, use_acc=k_step > 0, is_async=True
            )
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # The product of the step before has retired: its buffers go back to the loader.
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k_step > 0)
        # 2. Every product of the tile is issued: the other group's turn.
        mbarrier.arrive(turn.index(1 - GROUP))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((first_step + k_steps - 1) % STAGES))

        # 3. The epilogue, beside the other group's products: softmax_stats_kernel's fold.
        col0 = first_col + tile * block_n
        col_valid = (offsets_in_tile < vocab - col0)[None, :]
        logits = gl.where(col_valid, acc * inv_temperature, float("-inf"))
        tile_max = gl.max(logits, axis=1)
        new_max = gl.maximum(running_max, tile_max)
        shift = gl.where(running_max == float("-inf"), 0.0, running_max - new_max)
        rescale = gl.exp(shift)
        shifted = logits - new_max[:, None]
        weights = gl.exp(shifted)
        sumexp_z = rescale * (sumexp_z + sumexp * shift) + gl.sum(weights * gl.where(col_valid, shifted, 0.0), axis=1)
        sumexp = rescale * sumexp + gl.sum(weights, axis=1)
        running_max = new_max
        is_target = offsets_in_tile[None, :] == (target_column - col0)[:, None]
        target_logit += gl.sum(gl.where(is_target, logits, 0.0), axis=1)
        if STORE_BLOCK:
            if STORE_OFFSETS:
                stored = gl.maximum(logits - tile_max[:, None], LOWEST_OFFSET).to(block_desc.dtype)
                where = reference_ptr + rows.to(gl.int64) * stride_reference_row + col0 // block_n
                gl.store(where, tile_max, mask=row_valid)
            else:
                stored = (weights * gl.exp(new_max - reference)[:, None]).to(block_desc.dtype)
            tma.store_wait(pendings=0)  # this group's previous tile has left the buffer
            store_buf.store(stored)
            fence_async_shared()
            tma.async_copy_shared_to_global(block_desc, [row0, col0], store_buf)
        turns += 1

    out = parts_ptr + part.to(gl.int64) * stride_parts_split + rows.to(gl.int64) * stride_parts_token
    gl.store(out + 0, running_max, mask=row_valid)
    gl.store(out + 1, sumexp, mask=row_valid)
    gl.store(out + 2, sumexp_z, mask=row_valid)
    gl.store(out + 3, target_logit, mask=row_valid)
    if STORE_BLOCK:
        tma.store_wait(pendings=0)


@gluon.jit
def _fold_odd_tiles(
    hidden_bufs, weight_bufs, ready, empty, turn, store_buf, block_desc, target_column_ptr, parts_ptr,
    reference_ptr, row0, num_tokens, vocab, first_col, num_col_tiles, k_steps, part, stride_parts_split,
    stride_parts_token, stride_reference_row, inv_temperature,
    STORE_BLOCK: gl.constexpr, STORE_OFFSETS: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    _fold_tiles(
        hidden_bufs, weight_bufs, ready, empty, turn, store_buf, block_desc, target_column_ptr, parts_ptr,
        reference_ptr, row0, num_tokens, vocab, first_col, num_col_tiles, k_steps, part, stride_parts_split,
        stride_parts_token, stride_reference_row, inv_temperature, 1, STORE_BLOCK, STORE_OFFSETS, STAGES,
    )  # fmt: skip


@gluon.jit
def softmax_stats_hopper_kernel(
    hidden_desc, weight_desc, block_desc, target_column_ptr, parts_ptr, reference_ptr, num_tokens, vocab,
    hidden_size, tiles_per_split, num_splits, stride_parts_split, stride_parts_token, stride_reference_row,
    inv_temperature,
    STORE_BLOCK: gl.constexpr, STORE_OFFSETS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGISTERS: gl.constexpr, LOADER_REGISTERS: gl.constexpr,
):  # fmt: skip
    block_m: gl.constexpr = hidden_desc.block_type.shape[0]
    block_k: gl.constexpr = hidden_desc.block_type.shape[1]
    block_n: gl.constexpr = weight_desc.block_type.shape[0]
    # The program's (row tile, split), GROUP_M row tiles across all splits before the next group
    # (softmax_stats_kernel's grouped_tile).
    num_row_tiles = gl.cdiv(num_tokens, block_m)
    per_group = GROUP_M * num_splits
    first_row_tile = (gl.program_id(0) // per_group) * GROUP_M
    rows_in_group = gl.minimum(num_row_tiles - first_row_tile, GROUP_M)
    within = gl.program_id(0) % per_group
    row0 = (first_row_tile + within % rows_in_group) * block_m
    split = within // rows_in_group
    first_col_tile = split * tiles_per_split
    num_col_tiles = gl.minimum(gl.cdiv(vocab, block_n) - first_col_tile, tiles_per_split)
    first_col = first_col_tile * block_n
    k_steps = gl.cdiv(hidden_size, block_k)

    hidden_bufs = gl.allocate_shared_memory(hidden_desc.dtype, [STAGES, block_m, block_k], hidden_desc.layout)
    weight_bufs = gl.allocate_shared_memory(weight_desc.dtype, [STAGES, block_n, block_k], weight_desc.layout)
    if STORE_BLOCK:
        store_bufs = gl.allocate_shared_memory(block_desc.dtype, [2, block_m, block_n], block_desc.layout)
        even_store, odd_store = store_bufs.index(0), store_bufs.index(1)
    else:
        even_store, odd_store = hidden_bufs, hidden_bufs  # never written: no block
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)

    gl.warp_specialize(
        [
            (
                _fold_tiles,
                (hidden_bufs, weight_bufs, ready, empty, turn, even_store, block_desc, target_column_ptr, parts_ptr,
                 reference_ptr, row0, num_tokens, vocab, first_col, num_col_tiles, k_steps, 2 * split,
                 stride_parts_split, stride_parts_token, stride_reference_row, inv_temperature,
                 0, STORE_BLOCK, STORE_OFFSETS, STAGES),
            ),
            (
                _fold_odd_tiles,
                (hidden_bufs, weight_bufs, ready, empty, turn, odd_store, block_desc, target_column_ptr, parts_ptr,
                 reference_ptr, row0, num_tokens, vocab, first_col, num_col_tiles, k_steps, 2 * split + 1,
                 stride_parts_split, stride_parts_token, stride_reference_row, inv_temperature,
                 STORE_BLOCK, STORE_OFFSETS, STAGES),
            ),
            (
                _load_operands,
                (hidden_desc, weight_desc, hidden_bufs, weight_bufs, ready, empty, row0, first_col,
                 num_col_tiles * k_steps, k_steps, STAGES),
            ),
        ],
        [4, 1],
        [CONSUMER_REGISTERS, LOADER_REGISTERS],
    )  # fmt: skip


def _descriptor(tensor: torch.Tensor, block_shape: list) -> TensorDescriptor:
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[tensor.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block_shape, dtype)
    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), block_shape, layout)


def split_statistics_hopper(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_column: torch.Tensor,
    inv_temperature: float,
    tiles_per_split: int,
    block: Optional[torch.Tensor] = None,
    reference: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``softmax_stats_kernel.split_statistics`` on Hopper: the same arguments (16-bit operands,
    a 16-bit block) with this kernel's fixed ``BLOCK_M x BLOCK_N`` tiles; two parts per split."""
    num_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    num_splits = triton.cdiv(triton.cdiv(vocab, BLOCK_N), tiles_per_split)
    parts = torch.empty(CONSUMERS * num_splits, num_tokens, NUM_STATISTICS, dtype=torch.float32, device=hidden.device)
    offsets = block is not None and block.dtype == torch.float16
    grid = (triton.cdiv(num_tokens, BLOCK_M) * num_splits,)
    softmax_stats_hopper_kernel[grid](
        _descriptor(hidden, [BLOCK_M, BLOCK_K]),
        _descriptor(weight, [BLOCK_N, BLOCK_K]),
        None if block is None else _descriptor(block, [BLOCK_M, BLOCK_N]),
        target_column,
        parts,
        reference,
        num_tokens,
        vocab,
        hidden_size,
        tiles_per_split,
        num_splits,
        parts.stride(0),
        parts.stride(1),
        reference.stride(0) if reference is not None else 0,
        inv_temperature,
        STORE_BLOCK=block is not None,
        STORE_OFFSETS=offsets,
        GROUP_M=GROUP_M,
        STAGES=STAGES,
        CONSUMER_REGISTERS=CONSUMER_REGISTERS,
        LOADER_REGISTERS=LOADER_REGISTERS,
        num_warps=4,
        maxnreg=MAX_REGISTERS,
    )
    return parts
