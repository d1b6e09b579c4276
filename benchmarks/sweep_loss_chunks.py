"""Time the Triton backend's loss-in-forward pass over token chunks and forward tiles, against the
three cuBLAS GEMMs.

Each variant is ``fused_linear_loss`` forward and backward through the public op, its launch shape
fixed by ``backend=TritonBackend(TritonTuning(forward_tiles=...))`` and ``token_chunk``. The loss is
the mean cross-entropy (the products read the stored block as it is), or with ``--entropy`` a
policy loss with an entropy bonus (the block goes through the ``dz`` kernel).

    PYTHONPATH=. python benchmarks/sweep_loss_chunks.py [--shapes 8192x4096x151936] [--json out.json] [--gaps] [--entropy]

``--gaps`` instead profiles one default pass per shape and prints the GPU's kernel time, its
idle time between kernels, the longest idle intervals with the kernels around them, and the time
by kernel (each phase of a chunk is a kernel or two of its own).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing
from harness import kernel_timeline, parse_shapes

from megatron_fused_lm import fused_linear_loss, losses
from megatron_fused_lm.ops.backends.triton import TritonBackend
from megatron_fused_lm.ops.backends.triton_tuning import TritonTuning
from megatron_fused_lm.ops.kernels.tiles import Tiles

TOKEN_CHUNKS = (None, 2048, 4096, 6656)
# None: the rule's choice. The others fit a 16-bit store within an H100's or H200's shared memory.
FORWARD_CANDIDATES = (
    None,
    Tiles(256, 128, 64, 8, 8, 2, "tf32"),
    Tiles(128, 256, 64, 8, 8, 3, "tf32"),
    Tiles(128, 128, 64, 8, 8, 3, "tf32"),
    Tiles(128, 128, 64, 8, 4, 4, "tf32"),
    Tiles(256, 64, 64, 8, 8, 3, "tf32"),
)
POLICY = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=2, rep=20, return_mode="median")


def make_inputs(tokens, hidden_size, vocab):
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * (4.0 / hidden_size**0.5)).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    weights = torch.full((tokens,), 1.0 / tokens, device="cuda")
    policy_inputs = {
        "old_logprob": torch.full((tokens,), -10.0, device="cuda"),
        "advantages": torch.randn(tokens, device="cuda", generator=gen),
        "weight": weights,
    }
    return hidden, weight, targets, weights, policy_inputs


def loss_step(inputs, entropy: bool, backend, token_chunk=None):
    """One forward and backward of the op on ``inputs`` (``make_inputs``)."""
    hidden, weight, targets, weights, policy_inputs = inputs
    loss_fn, loss_inputs = (POLICY, policy_inputs) if entropy else (losses.cross_entropy, {"weight": weights})

    def run():
        leaves = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        result = fused_linear_loss(
            *leaves, targets, loss_fn, loss_inputs=loss_inputs, backend=backend, token_chunk=token_chunk
        )
        result.loss.backward()

    return run


def three_gemms(inputs):
    hidden, weight = inputs[:2]
    logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.empty_like(weight)

    def run():
        torch.mm(hidden, weight.t(), out=logits)
        torch.mm(logits, weight, out=grad_hidden)
        torch.mm(logits.t(), hidden, out=grad_weight)

    return run


def idle_gaps(run, shown=12):
    """GPU busy and idle milliseconds of one ``run()`` (after a warm-up), its longest idle
    intervals as ``(ms, kernel before, kernel after)`` and ``(kernel, ms)`` longest first."""
    kernels = kernel_timeline(run)
    busy = sum(end - start for start, end, _ in kernels) / 1e3
    gaps = [
        ((after[0] - before[1]) / 1e3, before[2][:60], after[2][:60])
        for before, after in zip(kernels, kernels[1:], strict=False)
        if after[0] > before[1]
    ]
    idle = sum(gap for gap, _, _ in gaps)
    by_kernel = {}
    for start, end, name in kernels:
        by_kernel[name[:60]] = by_kernel.get(name[:60], 0.0) + (end - start) / 1e3
    return busy, idle, sorted(gaps, reverse=True)[:shown], sorted(by_kernel.items(), key=lambda item: -item[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default="8192x4096x151936,32768x4096x151936")
    parser.add_argument("--json", default="sweep_loss_chunks.json")
    parser.add_argument("--gaps", action="store_true", help="profile the idle time of one default pass instead")
    parser.add_argument("--entropy", action="store_true", help="a policy loss with an entropy bonus (the dz kernel)")
    args = parser.parse_args()
    results = []
    for shape in args.shapes:
        inputs = make_inputs(*shape)
        if args.gaps:
            busy, idle, longest, by_kernel = idle_gaps(loss_step(inputs, args.entropy, "triton"))
            print(f"{shape}: kernels {busy:.2f} ms, idle between them {idle:.2f} ms; longest idle intervals:")
            for gap, before, after in longest:
                print(f"  {gap:7.3f} ms after {before} before {after}")
            print("  kernel time by kernel:")
            for name, ms in by_kernel[:10]:
                print(f"  {ms:8.2f} ms {name}")
            continue
        floor_ms = median_ms(three_gemms(inputs))
        print(f"{shape}: three GEMMs {floor_ms:.2f} ms")
        for token_chunk in TOKEN_CHUNKS:
            for tiles in FORWARD_CANDIDATES:
                backend = TritonBackend(TritonTuning(forward_tiles=tiles))
                try:
                    ms = median_ms(loss_step(inputs, args.entropy, backend, token_chunk))
                except Exception as error:  # a tile shape that does not fit the shared memory
                    print(f"  chunk {token_chunk} tiles {tiles}: {type(error).__name__}: {str(error)[:120]}")
                    continue
                row = dict(shape=shape, entropy=args.entropy, token_chunk=token_chunk, tiles=tiles, ms=ms)
                results.append(dict(row, floor_ms=floor_ms))
                print(f"  chunk {token_chunk} tiles {tiles and tiles[:6]}: {ms:.2f} ms = {ms / floor_ms:.3f}x floor")
        del inputs
        torch.cuda.empty_cache()
    with open(args.json, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
