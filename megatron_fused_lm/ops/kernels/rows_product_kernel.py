"""``out (+)= left @ right`` accumulated in float32 with tiles fixed by the dtype alone: each output
row is summed over the inner dimension in the same order whatever the number of rows, which
cuBLAS does not promise (it picks an algorithm, split-K included, from the shape). The hidden
gradient's product under ``batch_invariant=True`` (``docs/DESIGN.md``, "Batch invariance")."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .descriptors import addressable, descriptor
from .epilogue import grouped_tile
from .tiles import Tiles


@triton.jit
def rows_product_kernel(
    left_desc,
    right_desc,
    out_ptr,
    num_rows,
    inner,
    columns,
    stride_out,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    row_tile, col_tile = grouped_tile(tl.program_id(0), tl.cdiv(num_rows, BLOCK_M), tl.cdiv(columns, BLOCK_N), GROUP_M)
    row0, col0 = row_tile * BLOCK_M, col_tile * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    valid = (rows < num_rows)[:, None] & (cols < columns)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    if ACCUMULATE:
        acc = tl.load(out, mask=valid, other=0.0)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_step in range(0, tl.cdiv(inner, BLOCK_K)):
        # The descriptors read zeros past the edges: a partial step adds nothing there.
        left = left_desc.load([row0, k_step * BLOCK_K])
        right = right_desc.load([k_step * BLOCK_K, col0])
        acc = tl.dot(left, right, acc, input_precision=DOT_PRECISION)
    tl.store(out, acc, mask=valid)


def rows_product(out: torch.Tensor, left: torch.Tensor, right: torch.Tensor, accumulate: bool, tiles: Tiles) -> None:
    """``out = left @ right`` (``+ out`` when ``accumulate``): ``out [m, n]`` float32 with a unit
    last stride, ``left [m, k]`` and ``right [k, n]`` of one dtype (copied where a descriptor cannot
    address them); ``tiles`` as ``TritonTuning.backward_tiles_for`` gives them."""
    num_rows, inner = left.shape
    columns = right.shape[1]
    if num_rows == 0 or columns == 0:
        return
    grid = (triton.cdiv(num_rows, tiles.block_m) * triton.cdiv(columns, tiles.block_n),)
    rows_product_kernel[grid](
        descriptor(addressable(left), [tiles.block_m, tiles.block_k]),
        descriptor(addressable(right), [tiles.block_k, tiles.block_n]),
        out,
        num_rows,
        inner,
        columns,
        out.stride(0),
        ACCUMULATE=accumulate,
        **tiles.launch_options(),
    )
