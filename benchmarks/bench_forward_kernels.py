"""The forward kernel alone, the package's Triton kernel against the Gluon ping-pong candidate
(``pingpong_forward.py``), on single chunks: each against
the cuBLAS logits product of the same size, with and without a stored block, and each checked
against the other (merged statistics; the stored block element by element).

    PYTHONPATH=.:benchmarks python benchmarks/bench_forward_kernels.py --json forward_kernels.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import pingpong_forward as hopper
import torch
from harness import make_inputs, parse_shapes

from devkit.measure import median_ms
from megatron_fused_lm.ops.backends.triton_tuning import TritonTuning
from megatron_fused_lm.ops.kernels.softmax_stats_kernel import split_statistics
from megatron_fused_lm.ops.kernels.tiles import Tiles
from megatron_fused_lm.ops.softmax import MAX, merge_statistics

HOPPER_TILES = Tiles(hopper.BLOCK_M, hopper.BLOCK_N, hopper.BLOCK_K, hopper.GROUP_M, 12, hopper.STAGES, "tf32")


def clone(tensor):
    return None if tensor is None else tensor.clone()


def run_shape(shape, stores, warmup, repeats):
    tokens, hidden_size, vocab = shape
    inputs = make_inputs(tokens, hidden_size, vocab, torch.bfloat16, "cuda")
    hidden, weight = inputs.hidden.detach(), inputs.weight.detach()
    columns = inputs.targets.contiguous()
    device = hidden.device
    tuning = TritonTuning()
    rows = []
    floor = median_ms(lambda: hidden @ weight.t(), device, warmup, repeats)
    rows.append(dict(shape=shape, kernel="cublas", store="none", ms=floor))
    for store in stores:
        block_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[store]
        triton_tiles = tuning.forward_tiles_for(weight.dtype, block_dtype, device)
        results = {}
        for kernel, tiles in (("triton", triton_tiles), ("gluon", HOPPER_TILES)):
            per_split = tuning.tiles_per_split_for(vocab, tiles, device)
            block = reference = None
            if block_dtype is not None:
                block = torch.empty(tokens, vocab, dtype=block_dtype, device=device)
                if store == "fp16":
                    reference = torch.empty(tokens, -(-vocab // 128), dtype=torch.float32, device=device)
                else:
                    exact = merge_statistics(split_statistics(hidden, weight, columns, 1.0, triton_tiles, per_split))
                    reference = exact[:, MAX].contiguous()
            run = (
                partial(split_statistics, hidden, weight, columns, 1.0, tiles, per_split, block, reference)
                if kernel == "triton"
                else partial(hopper.split_statistics_hopper, hidden, weight, columns, 1.0, per_split, block, reference)
            )
            merged = merge_statistics(run())
            results[kernel] = (merged, clone(block), clone(reference))
            ms = median_ms(run, device, warmup, repeats)
            rows.append(
                dict(shape=shape, kernel=kernel, store=store, ms=ms, x_floor=ms / floor, tiles_per_split=per_split)
            )
            run = block = None
        (a, block_a, ref_a), (b, block_b, ref_b) = results["triton"], results["gluon"]
        # Each statistic's largest difference relative to its size, then the stored blocks (offsets:
        # both kernels keep 128-column tile maxima, so the blocks and maxima compare directly).
        check = dict(shape=shape, kernel="check", store=store)
        for column, name in enumerate(("max", "sumexp", "sumexp_z", "target")):
            scale = a[:, column].abs().max().clamp(min=1e-30)
            check[f"{name}_rel"] = ((a[:, column] - b[:, column]).abs().max() / scale).item()
        if block_a is not None:
            check["block_max_abs"] = (block_a.float() - block_b.float()).abs().max().item()
        if store == "fp16":
            check["reference_max_abs"] = (ref_a - ref_b).abs().max().item()
        rows.append(check)
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        default="4096x2048x151936,8192x4096x151936,3328x4096x151936,3328x2048x151936,3328x5120x152064,2048x3072x262144",
    )
    parser.add_argument("--stores", default="none,bf16,fp16")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for shape in parse_shapes(args.shapes):
        for row in run_shape(shape, args.stores.split(","), args.warmup, args.repeats):
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            rows.append(row)
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
