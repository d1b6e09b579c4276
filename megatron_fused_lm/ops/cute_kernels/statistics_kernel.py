"""CuTe DSL forward kernel (Hopper, sm90a): the softmax statistics of ``hidden @ weight.T / T``
per vocabulary split, without storing the logits; the same ``[parts, n, 4]`` statistics as the
Triton ``softmax_stats_kernel`` (``softmax`` order), merged by the same ``merge_parts``.

The pipeline of one persistent CTA (three warpgroups):

1. Work: a cluster of ``cluster_m`` CTAs takes ``cluster_m`` neighbouring token tiles of
   ``BLOCK_M`` rows and one vocabulary split of ``tiles_per_split`` column tiles of ``BLOCK_N``;
   units go in groups of ``group_m`` clusters' token tiles across all splits
   (``epilogue.grouped_tile``'s order), so the hidden rows and weight rows that running units
   share stay in L2.
2. Loads: one warp of warpgroup 0 streams (hidden, weight) slices of ``BLOCK_K`` columns through a
   ring of shared-memory stages by TMA; in a cluster each CTA loads its share of the weight slice
   and multicasts it to every CTA of the cluster.
3. Products: warpgroups 1 and 2 take a split's column tiles in turn (even, odd), each into its own
   float32 register accumulator by wgmma, so one group's epilogue runs beside the other's products.
4. Epilogue: a thread folds the accumulator elements it holds into running statistics of its own
   columns, in base-2 units (``exp2`` and one multiply per element), with no shuffles per tile.
5. At a split's end the four threads that hold a row's columns merge their statistics, and one
   writes the row's part: ``parts[2 * split + group]``, in natural units.

``docs/DESIGN.md`` ("The CuTe backend") says why each choice.
"""

from __future__ import annotations

import math
from pathlib import Path

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from .file_cache import cached_kernel

BLOCK_M = 128  # token rows of a tile: two m64 wgmma atoms per consumer warpgroup
BLOCK_N = 128  # vocabulary columns of a tile
BLOCK_K = 64  # hidden columns of one stage: one 128-byte swizzle row of bfloat16
CONSUMER_GROUPS = 2  # warpgroups that take column tiles in turn
THREADS = 128 * (1 + CONSUMER_GROUPS)
LOADER_REGISTERS = 40  # the loader warpgroup's registers after setmaxnreg; the consumers take the rest
CONSUMER_REGISTERS = 232
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# A thread's accumulator holds 2 (row halves) x 2 (m64 atoms) rows of the tile (wgmma's C layout).
ROWS_PER_THREAD = 4


class StatisticsKernel:
    """One compiled configuration: ``cluster_m`` CTAs per cluster (1 or 2: the weight slice is
    multicast to both), ``group_m`` clusters' token tiles per group of units, ``stages`` shared
    memory stages, ``uniform_temperature`` (one temperature for all rows, read from element 0)."""

    def __init__(self, cluster_m: int, group_m: int, stages: int, uniform_temperature: bool):
        self.cluster_m = cluster_m
        self.group_m = group_m
        self.stages = stages
        self.uniform_temperature = uniform_temperature

    @cute.jit
    def __call__(
        self,
        hidden: cute.Tensor,  # [n, H] bfloat16 or float16, unit stride along H
        weight: cute.Tensor,  # [V, H], hidden's dtype
        target_column: cute.Tensor,  # [n] int64: the target's row in weight, or negative
        temperature: cute.Tensor,  # [n] float32 (or [1]: uniform)
        parts: cute.Tensor,  # [2 * num_splits, n, 4] float32
        tiles_per_split: Int32,
        num_splits: Int32,
        num_clusters: Int32,
        stream,
    ):
        dtype = self.dtype = hidden.element_type
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            dtype,
            dtype,
            LayoutEnum.from_tensor(hidden).sm90_mma_major_mode(),
            LayoutEnum.from_tensor(weight).sm90_mma_major_mode(),
            Float32,
            (1, 1, 1),
            tiler_mn=(64, BLOCK_N),
        )
        a_layout = self._smem_layout(hidden, BLOCK_M)
        b_layout = self._smem_layout(weight, BLOCK_N)
        a_stage = cute.slice_(a_layout, (None, None, 0))
        b_stage = cute.slice_(b_layout, (None, None, 0))
        a_atom, a_tma = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), hidden, a_stage, (BLOCK_M, BLOCK_K)
        )
        b_op = (
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            if cutlass.const_expr(self.cluster_m > 1)
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        )
        b_atom, b_tma = cute.nvgpu.cpasync.make_tiled_tma_atom(
            b_op, weight, b_stage, (BLOCK_N, BLOCK_K), num_multicast=self.cluster_m
        )

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            a: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(a_layout)], 1024]
            b: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(b_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(
            tiled_mma,
            a_atom,
            a_tma,
            b_atom,
            b_tma,
            a_layout,
            b_layout,
            target_column,
            temperature,
            parts,
            tiles_per_split,
            num_splits,
        ).launch(
            grid=(num_clusters * self.cluster_m, 1, 1),
            block=(THREADS, 1, 1),
            cluster=(self.cluster_m, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    def _smem_layout(self, tensor: cute.Tensor, rows: int):
        """A K-major, 128-byte-swizzled ``[rows, BLOCK_K, stages]`` layout that wgmma reads."""
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.from_tensor(tensor), tensor.element_type, BLOCK_K),
            tensor.element_type,
        )
        return cute.tile_to_shape(atom, (rows, BLOCK_K, self.stages), order=(0, 1, 2))

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        a_atom: cute.CopyAtom,
        a_tma: cute.Tensor,
        b_atom: cute.CopyAtom,
        b_tma: cute.Tensor,
        a_layout: cute.ComposedLayout,
        b_layout: cute.ComposedLayout,
        target_column: cute.Tensor,
        temperature: cute.Tensor,
        parts: cute.Tensor,
        tiles_per_split: Int32,
        num_splits: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        group = cute.arch.make_warp_uniform(tidx // 128)
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(a_atom)
            cute.nvgpu.cpasync.prefetch_descriptor(b_atom)
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster = cute.arch.block_idx()[0] // self.cluster_m
        num_clusters = cute.arch.grid_dim()[0] // self.cluster_m

        storage = SmemAllocator().allocate(self.shared_storage)
        a_bytes = cute.size_in_bytes(self.dtype, cute.slice_(a_layout, (None, None, 0)))
        b_bytes = cute.size_in_bytes(self.dtype, cute.slice_(b_layout, (None, None, 0)))
        # Each consumer warp releases a stage to every CTA whose weight share it holds.
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.cluster_m),
            tx_count=a_bytes + b_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, 1, 1)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, 1), is_relaxed=True)

        s_a = storage.a.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        s_b = storage.b.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        # (BLOCK_M, BLOCK_K, row tiles, k steps) and (BLOCK_N, BLOCK_K, column tiles, k steps)
        g_a = cute.local_tile(a_tma, (BLOCK_M, BLOCK_K), (None, None))
        g_b = cute.local_tile(b_tma, (BLOCK_N, BLOCK_K), (None, None))
        t_as, t_ag = cute.nvgpu.cpasync.tma_partition(
            a_atom, 0, cute.make_layout(1), cute.group_modes(s_a, 0, 2), cute.group_modes(g_a, 0, 2)
        )
        t_bs, t_bg = cute.nvgpu.cpasync.tma_partition(
            b_atom, rank, cute.make_layout(self.cluster_m), cute.group_modes(s_b, 0, 2), cute.group_modes(g_b, 0, 2)
        )
        k_steps = Int32(cute.size(g_a, mode=[3]))
        num_row_tiles = Int32(cute.size(g_a, mode=[2]))
        num_col_tiles = Int32(cute.size(g_b, mode=[2]))
        num_row_groups = (num_row_tiles + self.cluster_m - 1) // self.cluster_m
        num_units = num_row_groups * num_splits
        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_m, 1))

        if group == 0:
            cute.arch.setmaxregister_decrease(LOADER_REGISTERS)
            if warp == 0:
                b_mask = cutlass.Int16(
                    (1 << self.cluster_m) - 1 if self.cluster_m > 1 else 0
                )  # every CTA of the cluster
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                unit = cluster
                while unit < num_units:
                    row_tile, _, first_tile, count = self._unit(
                        unit, num_row_groups, num_splits, tiles_per_split, num_col_tiles
                    )
                    row_tile = row_tile + rank
                    for tile in range(count):
                        for k in range(k_steps):
                            ring.producer_acquire(state)
                            barrier = ring.producer_get_barrier(state)
                            cute.copy(a_atom, t_ag[(None, row_tile, k)], t_as[(None, state.index)], tma_bar_ptr=barrier)
                            cute.copy(
                                b_atom,
                                t_bg[(None, first_tile + tile, k)],
                                t_bs[(None, state.index)],
                                tma_bar_ptr=barrier,
                                mcast_mask=b_mask,
                            )
                            ring.producer_commit(state)
                            state.advance()
                    unit += num_clusters
                ring.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            consumer = group - 1
            thr_mma = tiled_mma.get_slice(tidx % 128)
            t_ca = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
            t_cb = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
            k_blocks = cute.size(t_ca, mode=[2])
            # Each accumulator element's (row, column) in the tile.
            coords = thr_mma.partition_C(cute.make_identity_tensor((BLOCK_M, BLOCK_N)))
            acc = cute.make_rmem_tensor(coords.shape, Float32)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # each tile starts from a zeroed acc
            running_max = cute.make_rmem_tensor((ROWS_PER_THREAD,), Float32)
            sumexp = cute.make_rmem_tensor((ROWS_PER_THREAD,), Float32)
            sumexp_z = cute.make_rmem_tensor((ROWS_PER_THREAD,), Float32)
            target = cute.make_rmem_tensor((ROWS_PER_THREAD,), Float32)
            scale = cute.make_rmem_tensor((ROWS_PER_THREAD,), Float32)  # log2(e) / T
            inverse = cute.make_rmem_tensor((ROWS_PER_THREAD,), Float32)  # 1 / T
            target_local = cute.make_rmem_tensor((ROWS_PER_THREAD,), Int32)
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            num_tokens = Int32(cute.size(parts, mode=[1]))
            vocab = Int32(cute.size(b_tma, mode=[0]))
            # Tiles alternate between the groups across units (``tile_count`` of this CTA so far), and a
            # group's products start only once the other's last stage is awaited: a group then never
            # waits on a stage a whole ring ahead, whose barrier parity would be a lap stale.
            if consumer == 1:
                _give_turn(0)
            tile_count = Int32(0)
            unit = cluster
            while unit < num_units:
                row_tile, split, first_tile, count = self._unit(
                    unit, num_row_groups, num_splits, tiles_per_split, num_col_tiles
                )
                row0 = (row_tile + rank) * BLOCK_M
                for r in cutlass.range_constexpr(ROWS_PER_THREAD):
                    row = row0 + coords[_row_elements(r)[0]][0]
                    inv = Float32(0.0)
                    column = Int32(-1)
                    if row < num_tokens:
                        inv = 1.0 / temperature[0 if cutlass.const_expr(self.uniform_temperature) else row]
                        column = Int32(target_column[row])
                    inverse[r] = inv
                    scale[r] = inv * LOG2E
                    target_local[r] = column
                    running_max[r] = -Float32.inf
                    sumexp[r] = 0.0
                    sumexp_z[r] = 0.0
                    target[r] = 0.0
                for tile in range(count):
                    if (tile_count + tile) % CONSUMER_GROUPS == consumer:
                        _take_turn(consumer)
                        read, release = self._product(
                            tiled_mma, ring, read, release, acc, t_ca, t_cb, k_steps, k_blocks, consumer
                        )
                        col0 = (first_tile + tile) * BLOCK_N
                        statistics = (running_max, sumexp, sumexp_z, target)
                        if col0 + BLOCK_N <= vocab:
                            self._fold(acc, coords, col0, vocab, scale, target_local, statistics, False)
                        else:
                            self._fold(acc, coords, col0, vocab, scale, target_local, statistics, True)
                    else:  # the other group's tile
                        read.advance(k_steps)
                        release.advance(k_steps)
                tile_count += count
                self._write(
                    parts,
                    coords,
                    row0,
                    CONSUMER_GROUPS * split + consumer,
                    num_tokens,
                    inverse,
                    (running_max, sumexp, sumexp_z, target),
                )
                unit += num_clusters
            if tile_count % CONSUMER_GROUPS == consumer:
                _take_turn(consumer)  # the turn given after the last tile: every arrive met by a wait

    @cute.jit
    def _unit(
        self, unit: Int32, num_row_groups: Int32, num_splits: Int32, tiles_per_split: Int32, num_col_tiles: Int32
    ):
        """``(first row tile, split, first column tile, column tiles)`` of work unit ``unit``: groups
        of ``group_m`` clusters' token tiles walk all splits before the next group."""
        per_group = self.group_m * num_splits
        first = (unit // per_group) * self.group_m
        rows_in_group = cutlass.min(num_row_groups - first, self.group_m)
        within = unit % per_group
        split = within // rows_in_group
        first_tile = split * tiles_per_split
        count = cutlass.min(num_col_tiles - first_tile, tiles_per_split)
        return (first + within % rows_in_group) * self.cluster_m, split, first_tile, count

    @cute.jit
    def _product(
        self,
        tiled_mma,
        ring,
        read,
        release,
        acc,
        t_ca,
        t_cb,
        k_steps: Int32,
        k_blocks: cutlass.Constexpr,
        consumer: Int32,
    ):
        """``acc = `` this group's next tile, all hidden steps; the pipeline states after it. One wgmma
        batch stays in flight while the next stage is awaited; each stage is released once read; the
        turn passes to the other group once the last stage is awaited."""
        acc.fill(0.0)
        cute.nvgpu.warpgroup.fence()  # the epilogue's reads of acc come before the products overwrite it
        ring.consumer_wait(read)
        for kb in cutlass.range_constexpr(k_blocks):
            cute.gemm(tiled_mma, acc, t_ca[(None, None, kb, read.index)], t_cb[(None, None, kb, read.index)], acc)
        cute.nvgpu.warpgroup.commit_group()
        read.advance()
        for _ in range(1, k_steps):
            ring.consumer_wait(read)
            for kb in cutlass.range_constexpr(k_blocks):
                cute.gemm(tiled_mma, acc, t_ca[(None, None, kb, read.index)], t_cb[(None, None, kb, read.index)], acc)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(1)
            ring.consumer_release(release)
            release.advance()
            read.advance()
        _give_turn(1 - consumer)
        cute.nvgpu.warpgroup.wait_group(0)
        ring.consumer_release(release)
        release.advance()
        return read, release

    @cute.jit
    def _fold(self, acc, coords, col0: Int32, vocab: Int32, scale, target_local, statistics, masked: cutlass.Constexpr):
        """Fold a finished tile into the thread's running statistics of its own columns (base-2
        units: ``y = z log2(e)``); ``masked``: the tile runs past the vocabulary."""
        running_max, sumexp, sumexp_z, target = statistics
        for r in cutlass.range_constexpr(ROWS_PER_THREAD):
            elements = _row_elements(r)
            wanted = target_local[r] - col0
            if cutlass.Uint32(wanted) < BLOCK_N:  # rare: the row's target is in this tile (negative: none)
                found = Float32(0.0)
                for i in cutlass.range_constexpr(len(elements)):
                    if coords[elements[i]][1] == wanted:
                        found = acc[elements[i]]
                target[r] += found
            tile_max = -Float32.inf
            for i in cutlass.range_constexpr(len(elements)):
                y = acc[elements[i]] * scale[r]
                if cutlass.const_expr(masked):
                    y = y if col0 + coords[elements[i]][1] < vocab else -Float32.inf
                acc[elements[i]] = y
                tile_max = cute.arch.fmax(tile_max, y)
            new_max = cute.arch.fmax(running_max[r], tile_max)
            base = new_max if new_max != -Float32.inf else Float32(0.0)  # no column yet: y - base stays -inf
            shift = running_max[r] - base if running_max[r] != -Float32.inf else Float32(0.0)
            rescale = cute.math.exp2(shift, fastmath=True)
            tile_sum = Float32(0.0)
            tile_sum_z = Float32(0.0)
            for i in cutlass.range_constexpr(len(elements)):
                offset = acc[elements[i]] - base
                weight = cute.math.exp2(offset, fastmath=True)
                tile_sum += weight
                tile_sum_z += weight * (offset if offset != -Float32.inf else Float32(0.0))
            sumexp_z[r] = rescale * (sumexp_z[r] + sumexp[r] * shift) + tile_sum_z
            sumexp[r] = rescale * sumexp[r] + tile_sum
            running_max[r] = new_max

    @cute.jit
    def _write(self, parts, coords, row0: Int32, part: Int32, num_tokens: Int32, inverse, statistics):
        """Merge the statistics of the four threads that share each row (the quad of lanes) and write
        the row's part in natural units."""
        running_max, sumexp, sumexp_z, target = statistics
        lane = cute.arch.lane_idx()
        for r in cutlass.range_constexpr(ROWS_PER_THREAD):
            top = running_max[r]
            total = sumexp[r]
            total_z = sumexp_z[r]
            chosen = target[r]
            for offset in cutlass.range_constexpr(1, 3):
                other_max = cute.arch.shuffle_sync_bfly(top, offset=offset)
                other_sum = cute.arch.shuffle_sync_bfly(total, offset=offset)
                other_sum_z = cute.arch.shuffle_sync_bfly(total_z, offset=offset)
                chosen += cute.arch.shuffle_sync_bfly(chosen, offset=offset)
                merged = cute.arch.fmax(top, other_max)
                mine = top - merged if top != -Float32.inf else Float32(0.0)
                theirs = other_max - merged if other_max != -Float32.inf else Float32(0.0)
                weight_mine = cute.math.exp2(mine, fastmath=True) if top != -Float32.inf else Float32(0.0)
                weight_theirs = cute.math.exp2(theirs, fastmath=True) if other_max != -Float32.inf else Float32(0.0)
                total_z = weight_mine * (total_z + total * mine) + weight_theirs * (other_sum_z + other_sum * theirs)
                total = weight_mine * total + weight_theirs * other_sum
                top = merged
            row = row0 + coords[_row_elements(r)[0]][0]
            if (lane % 4 == 0) & (row < num_tokens):
                parts[part, row, 0] = top * LN2
                parts[part, row, 1] = total
                parts[part, row, 2] = total_z * LN2
                parts[part, row, 3] = chosen * inverse[r]


TURN_BARRIER = 1  # named barriers 1 and 2: group g's turn to run its products (0 is __syncthreads)


@cute.jit
def _take_turn(group: Int32):
    """Wait until the other consumer group hands ``group`` the turn."""
    cute.arch.barrier(barrier_id=TURN_BARRIER + group, number_of_threads=256)


@cute.jit
def _give_turn(group: Int32):
    """Hand the turn to consumer group ``group`` (non-blocking)."""
    cute.arch.barrier_arrive(barrier_id=TURN_BARRIER + group, number_of_threads=256, aligned=False)


def _row_elements(r: int):
    """The flat accumulator indices of a thread's ``r``-th row: wgmma's C layout ``((2, 2, BLOCK_N /
    8), m64 atoms)`` holds columns in pairs, then the row halves (r % 2), then column groups of 8,
    then the atoms (r // 2)."""
    per_atom = 4 * (BLOCK_N // 8)
    return [c + 2 * (r % 2) + 4 * g + per_atom * (r // 2) for g in range(BLOCK_N // 8) for c in range(2)]


_compiled: dict = {}


def cute_split_statistics(
    hidden,
    weight,
    target_column,
    temperature,
    tiles_per_split: int,
    cluster_m: int = 2,
    group_m: int = 6,
    stages: int = 6,
):
    """Statistics ``[2 * num_splits, n, 4]`` (float32, ``softmax`` order) of the vocabulary splits of
    ``tiles_per_split`` column tiles of ``BLOCK_N``, each split's two consumer groups apart.

    ``hidden [n >= 1, H]`` and ``weight [V, H]``: bfloat16 or float16, one dtype, unit last stride,
    16-byte aligned rows (H a multiple of 8); ``target_column [n]`` int64 (negative: another
    shard's); ``temperature [n]`` float32 (stride 0: one for all rows). One compilation per
    configuration and dtype serves every shape (the shapes are dynamic), and later processes load it
    (``file_cache``); it is called through TVM-FFI on the current stream, with torch tensors (no
    DLPack wrappers built per call).
    """
    import torch

    num_tokens = hidden.shape[0]
    num_splits = _ceil_div(_ceil_div(weight.shape[0], BLOCK_N), tiles_per_split)
    parts = torch.empty(CONSUMER_GROUPS * num_splits, num_tokens, 4, dtype=torch.float32, device=hidden.device)
    uniform = temperature.stride(0) == 0
    temperature = temperature[:1] if uniform else temperature.contiguous()
    num_row_groups = _ceil_div(_ceil_div(num_tokens, BLOCK_M), cluster_m)
    num_clusters = min(num_row_groups * num_splits, _multiprocessors(hidden.device) // cluster_m)
    key = (hidden.dtype, cluster_m, group_m, stages, uniform)
    if key not in _compiled:
        kernel = StatisticsKernel(cluster_m, group_m, stages, uniform)
        configuration = (str(hidden.dtype), *key[1:])  # plain values, for the file cache's entry name
        _compiled[key] = cached_kernel(Path(__file__), configuration, lambda: _compile(kernel, hidden.dtype))
    _compiled[key](hidden, weight, target_column, temperature, parts, tiles_per_split, num_splits, num_clusters)
    return parts


def _compile(kernel: StatisticsKernel, dtype):
    """``kernel`` compiled for ``dtype`` operands of any shapes (symbolic sizes and row strides),
    called through TVM-FFI on the caller's current stream."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor
    from cutlass.cute.typing import sym_int64
    from cutlass.runtime import make_fake_stream

    operand = _DTYPES[str(dtype).split(".")[-1]]
    num_tokens, hidden_size, vocab, splits = (sym_int64() for _ in range(4))
    # Rows 16-byte aligned, as TMA needs; the caller checks it.
    hidden = make_fake_tensor(operand, (num_tokens, hidden_size), (sym_int64(divisibility=8), 1), assumed_align=16)
    weight = make_fake_tensor(operand, (vocab, hidden_size), (sym_int64(divisibility=8), 1), assumed_align=16)
    target_column = make_fake_compact_tensor(cutlass.Int64, (num_tokens,))
    temperature = make_fake_compact_tensor(Float32, (sym_int64(),))
    parts = make_fake_compact_tensor(Float32, (splits, num_tokens, 4), stride_order=(2, 1, 0))
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        kernel,
        hidden,
        weight,
        target_column,
        temperature,
        parts,
        Int32(1),
        Int32(1),
        Int32(1),
        stream,
        options="--enable-tvm-ffi",
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


_sms: dict = {}
_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


def _multiprocessors(device) -> int:
    if device not in _sms:
        import torch

        _sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sms[device]
