"""Time the Triton backend's two kernels over candidate tile shapes, against cuBLAS.

For each shape: the forward kernel (``split_statistics`` + ``merge_statistics``) over all tokens
and the whole vocabulary next to the cuBLAS product of the same size (8 column tiles per split and
the rule's choice), and the backward kernel (``logit_grad_block``: recomputed product + ``dz``
epilogue; one program per tile or persistent) on one backward block next to the bare bf16 cuBLAS
product of that block. Prints achieved TFLOP/s; the chosen rule lives in
``ops/backends/triton_tuning.py`` and is explained in ``docs/benchmarks/constants.md``.

    python benchmarks/sweep_tiles.py [--shapes 8192x4096x151936,4096x2048x151936]
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from megatron_fused_lm.ops.backends.contract import SavedStatistics, UpstreamGrads
from megatron_fused_lm.ops.backends.triton_tuning import TOKEN_CHUNK, TritonTuning
from megatron_fused_lm.ops.kernels.logit_grad_kernel import logit_grad_block
from megatron_fused_lm.ops.kernels.softmax_stats_kernel import split_statistics
from megatron_fused_lm.ops.kernels.tiles import Tiles
from megatron_fused_lm.ops.softmax import merge_statistics

FORWARD_CANDIDATES = [
    Tiles(256, 128, 64, 8, 8, 3, "tf32"),
    Tiles(256, 128, 64, 8, 8, 4, "tf32"),
    Tiles(128, 256, 64, 8, 8, 3, "tf32"),
    Tiles(128, 128, 64, 8, 4, 3, "tf32"),
]
BACKWARD_CANDIDATES = [
    Tiles(128, 256, 64, 8, 8, 3, "tf32"),
    Tiles(256, 128, 64, 8, 8, 3, "tf32"),
    Tiles(128, 128, 64, 8, 4, 2, "tf32"),
]


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def tflops(tokens, hidden_size, vocab, ms):
    return 2 * tokens * hidden_size * vocab / ms / 1e9


def report(name, label, shape, fn):
    try:
        ms = median_ms(fn)
        print(f"{name} {label:42s} {ms:8.3f} ms {tflops(*shape, ms):6.0f} TFLOP/s")
    except Exception as error:  # out of shared memory or registers: report, go on
        print(f"{name} {label:42s} failed: {type(error).__name__}")


def sweep(shape):
    tokens, hidden_size, vocab = shape
    hidden = torch.randn(tokens, hidden_size, device="cuda").bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda") * (4 / hidden_size**0.5)).bfloat16()
    target_column = torch.randint(0, vocab, (tokens,), device="cuda")
    lse = torch.randn(tokens, device="cuda") + 12
    mean_logit = torch.randn(tokens, device="cuda")
    grad_logprob, grad_entropy = torch.randn(tokens, device="cuda"), torch.randn(tokens, device="cuda")
    name = "x".join(map(str, shape))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rules = TritonTuning()

    logits = torch.empty(tokens, vocab, device="cuda", dtype=torch.bfloat16)
    report(name, "cublas logits", shape, lambda out=logits: torch.mm(hidden, weight.t(), out=out))
    del logits  # freed before the kernels run
    for tiles in FORWARD_CANDIDATES:
        best_split = rules.tiles_per_split_for(vocab, tiles, weight.device)
        for per_split in sorted({8, best_split}):
            report(
                name,
                f"forward {tuple(tiles[:6])} split {per_split}",
                shape,
                lambda tiles=tiles, per_split=per_split: merge_statistics(
                    split_statistics(hidden, weight, target_column, 1.0, tiles, per_split)
                ),
            )

    rows = min(tokens, TOKEN_CHUNK)
    block_bytes = rules.dz_block_bytes_for(2 * (tokens + vocab) * hidden_size, rows * hidden_size * 4)
    cols = min(vocab, block_bytes // 2 // rows // 256 * 256)
    block_shape = (rows, hidden_size, cols)
    out = torch.empty(rows, -(-cols // 256) * 256, device="cuda", dtype=torch.bfloat16)[:, :cols]
    h, w = hidden[:rows], weight[:cols]
    report(name, f"cublas bf16 block {rows}x{cols}", block_shape, lambda: torch.mm(h, w.t(), out=out))
    for tiles in BACKWARD_CANDIDATES:
        for programs, grid in ((rows * cols, "one program per tile"), (sms, "persistent")):
            report(
                name,
                f"backward {tuple(tiles[:6])} {grid}",
                block_shape,
                lambda tiles=tiles, programs=programs: logit_grad_block(
                    out,
                    h,
                    w,
                    target_column[:rows],
                    0,
                    SavedStatistics(lse[:rows], mean_logit[:rows]),
                    UpstreamGrads(grad_logprob[:rows], grad_entropy[:rows]),
                    1.0,
                    tiles,
                    programs,
                ),
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8192x4096x151936,4096x2048x151936")
    args = parser.parse_args()
    for text in args.shapes.split(","):
        sweep(tuple(int(part) for part in text.split("x")))


if __name__ == "__main__":
    main()
