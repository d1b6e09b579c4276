"""Time the Triton backend's loss-in-forward pass over token chunks and forward tiles, against the
three cuBLAS GEMMs, and split one chunk's time into the pass's own phases.

Each variant runs the package's pass (``contract.run_loss_pass`` over ``TritonLoss``) with a fixed
upstream gradient per chunk and no autograd, so the figures isolate the pass from the op around
it; ``--entropy`` gives the upstream an entropy term (the block then goes through the ``dz``
kernel), otherwise the products read the stored block as it is. The phases of one chunk are the
pass's methods: its statistics (the forward kernel storing the block), the direct operand or the
``dz`` operand, the two products, and the chosen tokens' term.

    python benchmarks/sweep_loss_chunks.py [--shapes 8192x4096x151936] [--json out.json] [--gaps] [--entropy]

``--gaps`` instead profiles one default pass per shape and prints the GPU's kernel time, its
idle time between kernels, the longest idle intervals with the kernels around them, and the time
by kernel.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing
from harness import kernel_timeline, parse_shapes

from megatron_fused_lm.ops.backends.triton_loss import TritonLoss
from megatron_fused_lm.ops.backends.triton_tuning import TritonTuning
from megatron_fused_lm.ops.contract import NeededGrads, ShardProblem, UpstreamGrads, run_loss_pass
from megatron_fused_lm.ops.kernels.tiles import Tiles
from megatron_fused_lm.ops.softmax import chosen_logit_grad, summarize

TOKEN_CHUNKS = (None, 2048, 4096, 6656)
# None: the rule's choice. The others fit a bf16 store; those marked fit a float32 store too
# (the entropy term's block) within an H100's or H200's shared memory.
FORWARD_CANDIDATES = (
    None,
    Tiles(256, 128, 64, 8, 8, 2, "tf32"),
    Tiles(128, 256, 64, 8, 8, 3, "tf32"),
    Tiles(128, 128, 64, 8, 8, 3, "tf32"),  # float32 store
    Tiles(128, 128, 64, 8, 4, 4, "tf32"),  # float32 store
    Tiles(256, 64, 64, 8, 8, 3, "tf32"),  # float32 store
)


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=2, rep=20, return_mode="median")


def make_problem(tokens, hidden_size, vocab):
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * (4.0 / hidden_size**0.5)).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    upstream = torch.randn(tokens, device="cuda", generator=gen), torch.randn(tokens, device="cuda", generator=gen)
    return ShardProblem(hidden, weight, targets, torch.ones(tokens, device="cuda")), upstream


def three_gemms(problem):
    hidden, weight = problem.hidden, problem.weight
    logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.empty_like(weight)

    def run():
        torch.mm(hidden, weight.t(), out=logits)
        torch.mm(logits, weight, out=grad_hidden)
        torch.mm(logits.t(), hidden, out=grad_weight)

    return run


def chunk_step(upstream):
    """A chunk step with a fixed upstream gradient (one rank, no loss function)."""
    grad_logprob, grad_entropy = upstream
    return lambda rows, local: (
        summarize(local),
        UpstreamGrads(grad_logprob[rows], None if grad_entropy is None else grad_entropy[rows]),
    )


def backend_pass(backend, problem, upstream):
    """The package's pass over the whole problem."""
    return lambda: run_loss_pass(backend, problem, chunk_step(upstream), NeededGrads(True, True))


def chunk_phases(problem, upstream, token_chunk, entropy_grad):
    """Milliseconds of each phase of one chunk of ``token_chunk`` rows (default tuning), each the
    pass's own method on the chunk: without an entropy term the direct operand, with one the
    ``dz`` operand, written over the block. Only times are read: the repeated calls reuse a block
    that earlier calls overwrote."""
    rows = slice(0, token_chunk)
    chunk = ShardProblem(problem.hidden[rows], problem.weight, problem.target_column[rows], problem.temperature[rows])
    backend = TritonLoss(token_chunk=token_chunk, entropy_grad=entropy_grad)
    state = backend.allocate(chunk, NeededGrads(True, True))
    summary = summarize(backend.chunk_statistics(chunk, state, rows))
    chunk_upstream = UpstreamGrads(
        upstream[0][rows].contiguous(), upstream[1][rows].contiguous() if entropy_grad else None
    )
    if entropy_grad:
        operand, factor = backend.dz_operand(chunk, state, rows, summary, chunk_upstream), None
    else:
        operand, factor = backend.direct_operand(chunk, state, rows, summary, chunk_upstream)
    chosen = chosen_logit_grad(chunk.target_column, summary, *chunk_upstream)
    phases = {
        "statistics_storing": median_ms(lambda: backend.chunk_statistics(chunk, state, rows)),
        "operand": median_ms(
            lambda: (
                backend.dz_operand(chunk, state, rows, summary, chunk_upstream)
                if entropy_grad
                else backend.direct_operand(chunk, state, rows, summary, chunk_upstream)
            )
        ),
        "products": median_ms(lambda: backend.products(chunk, state, rows, operand, factor, False)),
        "chosen_term": median_ms(
            lambda: backend.add_chosen(state, rows, chunk.target_column, chosen, chunk.hidden, chunk.weight, factor)
        ),
    }
    return phases


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
    parser.add_argument("--entropy", action="store_true", help="an upstream entropy term (the dz kernel runs)")
    args = parser.parse_args()
    results = []
    for shape in args.shapes:
        problem, upstream = make_problem(*shape)
        if not args.entropy:
            upstream = (upstream[0], None)
        if args.gaps:
            busy, idle, longest, by_kernel = idle_gaps(
                backend_pass(TritonLoss(entropy_grad=args.entropy), problem, upstream)
            )
            print(f"{shape}: kernels {busy:.2f} ms, idle between them {idle:.2f} ms; longest idle intervals:")
            for gap, before, after in longest:
                print(f"  {gap:7.3f} ms after {before} before {after}")
            print("  kernel time by kernel:")
            for name, ms in by_kernel[:10]:
                print(f"  {ms:8.2f} ms {name}")
            continue
        floor_ms = median_ms(three_gemms(problem))
        print(f"{shape}: three GEMMs {floor_ms:.2f} ms")
        for token_chunk in TOKEN_CHUNKS:
            for tiles in FORWARD_CANDIDATES:
                backend = TritonLoss(
                    token_chunk=token_chunk, entropy_grad=args.entropy, tuning=TritonTuning(forward_tiles=tiles)
                )
                try:
                    ms = median_ms(backend_pass(backend, problem, upstream))
                except Exception as error:  # a tile shape that does not fit the shared memory
                    print(f"  chunk {token_chunk} tiles {tiles}: {type(error).__name__}: {str(error)[:120]}")
                    continue
                results.append(
                    dict(
                        shape=shape,
                        entropy=args.entropy,
                        token_chunk=token_chunk,
                        tiles=tiles,
                        ms=ms,
                        floor_ms=floor_ms,
                    )
                )
                print(f"  chunk {token_chunk} tiles {tiles and tiles[:6]}: {ms:.2f} ms = {ms / floor_ms:.3f}x floor")
        phases = chunk_phases(problem, upstream, 2048, args.entropy)
        print("  one 2048-row chunk:", {name: round(ms, 3) for name, ms in phases.items()})
        results.append(dict(shape=shape, phases_2048=phases))
        del problem, upstream
        torch.cuda.empty_cache()
    with open(args.json, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
