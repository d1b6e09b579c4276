"""``out (+)= left @ right`` accumulated in float32 with tiles fixed by the dtype alone: each output
row is summed over the inner dimension in the same order whatever the number of rows, which
cuBLAS does not promise (it picks an algorithm, split-K included, from the shape). The hidden
gradient's product under ``batch_invariant=True`` (``docs/DESIGN.md``, "Batch invariance"); and,
behind a gate on the device, the weight gradient's product of a correction that may not run
(``left`` read transposed), which cuBLAS cannot skip without the host reading the gate; and every
product of float32 operands (``float32_by_kernel``)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .descriptors import addressable, descriptor
from .epilogue import grouped_tile
from .tiles import Tiles


def float32_by_kernel(dtype: torch.dtype) -> bool:
    """Whether the Triton backend runs the products of ``dtype`` operands with this kernel rather
    than cuBLAS: float32, which its tiles multiply by 3xTF32 on tensor cores (``tl.dot``'s
    "tf32x3": float32's accuracy, where cuBLAS runs float32 without tensor cores or rounds to
    TF32)."""
    return dtype == torch.float32


@triton.jit
def rows_product_kernel(
    left_desc,
    right_desc,
    out_ptr,
    num_rows,
    inner,
    columns,
    stride_out_row,
    stride_out_column,
    gate_ptr,
    ACCUMULATE: tl.constexpr,
    LEFT_TRANSPOSED: tl.constexpr,
    RIGHT_TRANSPOSED: tl.constexpr,
    GATED: tl.constexpr,
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
    k_steps = tl.cdiv(inner, BLOCK_K)
    if GATED:  # a closed gate: no steps, no reads or writes
        is_open = tl.load(gate_ptr) != 0
        valid = valid & is_open
        k_steps = tl.where(is_open, k_steps, 0)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_out_row + cols[None, :].to(tl.int64) * stride_out_column
    if ACCUMULATE:
        acc = tl.load(out, mask=valid, other=0.0)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_step in range(0, k_steps):
        # The descriptors read zeros past the edges: a partial step adds nothing there.
        if LEFT_TRANSPOSED:
            left = tl.trans(left_desc.load([k_step * BLOCK_K, row0]))
        else:
            left = left_desc.load([row0, k_step * BLOCK_K])
        if RIGHT_TRANSPOSED:
            right = tl.trans(right_desc.load([col0, k_step * BLOCK_K]))
        else:
            right = right_desc.load([k_step * BLOCK_K, col0])
        acc = tl.dot(left, right, acc, input_precision=DOT_PRECISION)
    tl.store(out, acc, mask=valid)


def rows_product(
    out: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    accumulate: bool,
    tiles: Tiles,
    gate: Optional[torch.Tensor] = None,
) -> None:
    """``out = left @ right`` (``+ out`` when ``accumulate``): ``out [m, n]`` float32 (a unit stride
    on either dimension), ``left [m, k]`` and ``right [k, n]`` of one dtype, row-major, the transpose
    of a row-major tensor (the production layouts) or strided otherwise (copied where a descriptor
    cannot address them); ``tiles`` as ``TritonTuning.backward_tiles_for`` gives them. With a
    ``gate`` (a 0-dim tensor on the device) nothing is read or written where it is 0.

    Float32 operands multiply on tensor cores only with ``right`` read along ``k`` (Hopper's wgmma
    takes 32-bit operands from shared memory ``k``-major; read row-major, the products took 1.3-1.4x
    as long, docs/benchmarks/features.md, "A float32 head"): where both operands are row-major the
    product runs transposed, ``out.T = right.T @ left.T`` (``tiles.block_m`` then tiles ``out``'s
    columns), and where only ``left`` is not, on ``k_major(right)``. Either way each element's sum
    runs over ``k`` in the same steps."""
    num_rows, inner = left.shape
    columns = right.shape[1]
    if num_rows == 0 or columns == 0:
        return
    if inner == 0:  # an empty sum: zeros written, nothing added
        if not accumulate and gate is None:
            out.zero_()
        elif not accumulate:
            out.masked_fill_(gate != 0, 0.0)
        return
    if left.element_size() == 4 and not _transposed(right):
        if _transposed(left.t()) and _transposed(right.t()):
            out, left, right = out.t(), right.t(), left.t()
            num_rows, columns = columns, num_rows
        else:
            right = k_major(right)
    left_transposed, right_transposed = _transposed(left), _transposed(right)
    stored_left = addressable(left.t() if left_transposed else left)
    stored_right = addressable(right.t() if right_transposed else right)
    grid = (triton.cdiv(num_rows, tiles.block_m) * triton.cdiv(columns, tiles.block_n),)
    rows_product_kernel[grid](
        descriptor(stored_left, [tiles.block_k, tiles.block_m] if left_transposed else [tiles.block_m, tiles.block_k]),
        descriptor(
            stored_right, [tiles.block_n, tiles.block_k] if right_transposed else [tiles.block_k, tiles.block_n]
        ),
        out,
        num_rows,
        inner,
        columns,
        out.stride(0),
        out.stride(1),
        gate,
        ACCUMULATE=accumulate,
        LEFT_TRANSPOSED=left_transposed,
        RIGHT_TRANSPOSED=right_transposed,
        GATED=gate is not None,
        **tiles.launch_options(),
    )


def k_major(right: torch.Tensor) -> torch.Tensor:
    """``right [k, n]`` as ``rows_product`` reads a float32 right operand on tensor cores: the
    transpose of a row-major ``[n, k]`` tensor (``right`` itself where it is one, else a copy); a
    caller that passes the same operand to several products makes it once."""
    return right if _transposed(right) else right.t().contiguous().t()


def _transposed(operand: torch.Tensor) -> bool:
    """Whether a 2-D operand is the transpose of a row-major tensor (its first dimension contiguous)."""
    return operand.stride(0) == 1 and operand.stride(1) != 1
