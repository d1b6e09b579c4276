"""Where a float32 head's products could go faster (issue 61, item 3): Triton's 3xTF32 (``tl.dot``'s
"tf32x3", which splits each float32 tile into its TF32 high and low parts at every k step) against
operands split once in memory (``tf32_parts``: the high parts, TF32-rounded or truncated, and the
remainders) and multiplied by three "tf32" dots, the left operand split in registers against the
right one's stored parts, and one "tf32" dot as the speed ceiling; ``out = a @ b.T`` with both
operands k-major, as the forward kernel reads them, on tile shapes of ``--tiles``. Each variant's
time (median of 7 calls) and its error norm against float64 over the float64 result's
norm, beside cuBLAS's float32 product with TF32 off. A diagnostic of the kernels' arithmetic, not
a benchmark of the package: the ops do not run here.

    PYTHONPATH=.:benchmarks python benchmarks/diag_float32_split.py --json split.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from devkit.measure import median_ms
from megatron_fused_lm.ops.kernels.epilogue import grouped_tile

# The kernel's variant for each name; "split_truncated" runs "split_once"'s kernel on the float32
# operands themselves and their remainders after truncation, which is exact if the tensor cores
# read a float32 operand as its truncated TF32 high part (then only the remainders need storing).
# "split_left" splits the left operand in registers (by truncation; wgmma may read it from there)
# and reads the right one's truncated parts from memory, as a package kernel would store only the
# weight's; "split_left_truncated" passes the right operand itself as its high part.
VARIANTS = {"tf32x3": 0, "tf32_once": 1, "split_once": 2, "split_truncated": 2, "split_left": 3}
VARIANTS["split_left_truncated"] = 3


@triton.jit
def split_product_kernel(
    a_desc,
    a_low_desc,
    b_desc,
    b_low_desc,
    out_ptr,
    rows,
    inner,
    columns,
    VARIANT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    row_tile, col_tile = grouped_tile(tl.program_id(0), tl.cdiv(rows, BLOCK_M), tl.cdiv(columns, BLOCK_N), GROUP_M)
    row0, col0 = row_tile * BLOCK_M, col_tile * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_step in range(0, tl.cdiv(inner, BLOCK_K)):
        a = a_desc.load([row0, k_step * BLOCK_K])
        b = tl.trans(b_desc.load([col0, k_step * BLOCK_K]))
        if VARIANT == 0:
            acc = tl.dot(a, b, acc, input_precision="tf32x3")
        elif VARIANT == 1:
            acc = tl.dot(a, b, acc, input_precision="tf32")
        elif VARIANT == 3:
            a_high = (a.to(tl.int32, bitcast=True) & -0x2000).to(tl.float32, bitcast=True)
            small = tl.dot(a - a_high, b, input_precision="tf32")
            small = tl.dot(a_high, tl.trans(b_low_desc.load([col0, k_step * BLOCK_K])), small, input_precision="tf32")
            acc = tl.dot(a_high, b, acc + small, input_precision="tf32")
        else:  # the small terms first, then the high parts' product
            small = tl.dot(a_low_desc.load([row0, k_step * BLOCK_K]), b, input_precision="tf32")
            small = tl.dot(a, tl.trans(b_low_desc.load([col0, k_step * BLOCK_K])), small, input_precision="tf32")
            acc = tl.dot(a, b, acc + small, input_precision="tf32")
    out_rows, out_cols = row0 + tl.arange(0, BLOCK_M), col0 + tl.arange(0, BLOCK_N)
    valid = (out_rows < rows)[:, None] & (out_cols < columns)[None, :]
    tl.store(out_ptr + out_rows[:, None].to(tl.int64) * columns + out_cols[None, :], acc, mask=valid)


def tf32_parts(values: torch.Tensor, rounded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(high, low)`` float32: ``values`` cut to TF32's 10 mantissa bits (rounded to nearest, ties
    away from zero; or truncated) and the exact remainder."""
    high = ((values.view(torch.int32) + (0x1000 if rounded else 0)) & -0x2000).view(torch.float32)
    return high, values - high


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192x4096x32768", help="tokens x hidden x vocabulary rows")
    parser.add_argument("--tiles", default="128,64,32,4,3;128,128,32,8,3;128,64,32,4,4;128,128,32,4,2")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, hidden_size, vocab = (int(part) for part in args.shape.split("x"))
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(tokens, hidden_size, device=device, generator=gen)
    b = torch.randn(vocab, hidden_size, device=device, generator=gen) * 0.02
    expected = a.double() @ b.double().t()
    (a_high, a_low), (b_high, b_low) = tf32_parts(a), tf32_parts(b)
    a_cut = tf32_parts(a, rounded=False)[1]
    b_truncated, b_cut = tf32_parts(b, rounded=False)
    out, rows = torch.empty(tokens, vocab, device=device), []
    for name, variant in VARIANTS.items():
        left, right = (a_high, b_high) if name == "split_once" else (a, b_truncated if name == "split_left" else b)
        a_rest, b_rest = (a_low, b_low) if name == "split_once" else (a_cut, b_cut)
        for tiles in args.tiles.split(";"):
            block_m, block_n, block_k, warps, stages = (int(part) for part in tiles.split(","))

            def desc(tensor, block):
                return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), block)

            operands = (desc(left, [block_m, block_k]), desc(a_rest, [block_m, block_k]))
            operands += (desc(right, [block_n, block_k]), desc(b_rest, [block_n, block_k]))
            grid = (triton.cdiv(tokens, block_m) * triton.cdiv(vocab, block_n),)

            def step():
                split_product_kernel[grid](
                    *operands,
                    out,
                    tokens,
                    hidden_size,
                    vocab,
                    VARIANT=variant,
                    BLOCK_M=block_m,
                    BLOCK_N=block_n,
                    BLOCK_K=block_k,
                    GROUP_M=8,
                    num_warps=warps,
                    num_stages=stages,
                )

            ms = median_ms(step, torch.device(device), warmup=1, repeats=7) if device == "cuda" else step()
            error = float((out.double() - expected).norm() / expected.norm())
            rows.append(dict(variant=name, tiles=tiles, ms=ms, error=error))
            print(rows[-1], flush=True)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        ms = median_ms(lambda: torch.mm(a, b.t(), out=out), torch.device(device), warmup=1, repeats=7)
        rows.append(
            dict(variant="cublas_float32", ms=ms, error=float((out.double() - expected).norm() / expected.norm()))
        )
        print(rows[-1])
    if args.json:
        with open(args.json, "w") as file:
            json.dump(
                dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", rows=rows), file, indent=1
            )


if __name__ == "__main__":
    main()
