"""Time the Triton backend's two kernels over candidate tile shapes, against cuBLAS.

For each shape: the forward kernel (``split_statistics`` + ``merge_statistics``) over all tokens
and the whole vocabulary next to the cuBLAS product of the same size, and the backward's per-block
work (cuBLAS float32 product + ``logit_grad_block``) next to a bare bf16 cuBLAS product. Prints achieved
TFLOP/s; the chosen rule lives in ``triton_backend`` and is explained in ``docs/BENCHMARKS.md``.

    python benchmarks/sweep_tiles.py [--shapes 8192x4096x151936,4096x2048x151936]
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from megatron_fused_lm.ops import triton_backend
from megatron_fused_lm.ops.softmax_stats import merge_statistics
from megatron_fused_lm.ops.triton_kernels.logit_grad_kernel import logit_grad_block
from megatron_fused_lm.ops.triton_kernels.softmax_stats_kernel import split_statistics
from megatron_fused_lm.ops.triton_kernels.tiles import Tiles

CANDIDATES = [
    Tiles(128, 256, 64, 8, 8, 3, "tf32"),
    Tiles(128, 256, 64, 8, 8, 4, "tf32"),
    Tiles(256, 128, 64, 8, 8, 3, "tf32"),
    Tiles(256, 128, 64, 8, 8, 4, "tf32"),
    Tiles(128, 128, 64, 8, 8, 4, "tf32"),
]
TILES_PER_SPLIT = (8, 16)


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def tflops(tokens, hidden_size, vocab, ms):
    return 2 * tokens * hidden_size * vocab / ms / 1e9


def sweep(shape):
    tokens, hidden_size, vocab = shape
    hidden = torch.randn(tokens, hidden_size, device="cuda").bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda") * (4 / hidden_size**0.5)).bfloat16()
    target_column = torch.randint(0, vocab, (tokens,), device="cuda")
    lse = torch.randn(tokens, device="cuda") + 12
    mean_logit = torch.randn(tokens, device="cuda")
    grad_logprob, grad_entropy = torch.randn(tokens, device="cuda"), torch.randn(tokens, device="cuda")
    chunk = min(tokens, triton_backend.TOKEN_CHUNK)
    block_cols = min(vocab, triton_backend.BLOCK_BYTES // (chunk * 6) // 256 * 256)
    out = torch.empty(chunk, block_cols, device="cuda", dtype=torch.bfloat16)
    product = torch.empty(chunk, block_cols, device="cuda", dtype=torch.float32)
    name = "x".join(map(str, shape))

    logits = torch.empty(tokens, vocab, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: torch.mm(hidden, weight.t(), out=logits))
    print(f"{name} cublas logits          {ms:8.3f} ms {tflops(tokens, hidden_size, vocab, ms):6.0f} TFLOP/s")
    del logits
    for tiles in CANDIDATES:
        for per_split in TILES_PER_SPLIT:
            try:
                ms = median_ms(lambda: merge_statistics(
                    split_statistics(hidden, weight, target_column, 1.0, tiles, per_split)))
                print(f"{name} forward {tuple(tiles[:6])} split {per_split:2d} {ms:8.3f} ms "
                      f"{tflops(tokens, hidden_size, vocab, ms):6.0f} TFLOP/s")
            except Exception as error:  # out of shared memory or registers: report, go on
                print(f"{name} forward {tuple(tiles[:6])} split {per_split:2d} failed: {type(error).__name__}")

    rows = slice(0, chunk)
    ms = median_ms(lambda: torch.mm(hidden[rows], weight[:block_cols].t(), out=out))
    print(f"{name} cublas bf16 block      {ms:8.3f} ms {tflops(chunk, hidden_size, block_cols, ms):6.0f} TFLOP/s")
    ms = median_ms(lambda: torch.mm(hidden[rows], weight[:block_cols].t(), out_dtype=torch.float32, out=product))
    print(f"{name} cublas float32 block   {ms:8.3f} ms {tflops(chunk, hidden_size, block_cols, ms):6.0f} TFLOP/s")
    ms = median_ms(lambda: logit_grad_block(
        out, product, target_column[rows], lse[rows], mean_logit[rows], grad_logprob[rows], grad_entropy[rows], 1.0))
    print(f"{name} dz epilogue pass       {ms:8.3f} ms {chunk * block_cols * 6 / ms / 1e6:6.0f} GB/s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8192x4096x151936,4096x2048x151936")
    args = parser.parse_args()
    for text in args.shapes.split(","):
        sweep(tuple(int(part) for part in text.split("x")))


if __name__ == "__main__":
    main()
