"""Forward+backward time and peak extra memory of per-token log-prob + entropy, on one GPU.

Methods, on identical inputs in one process (bf16 by default, random upstream gradients):
- ``stock``: materialized logits ``hidden @ weight.T`` then ``logits_logprob`` (float32 softmax);
- ``torch``: ``fused_linear_logprob(backend="torch")``;
- ``triton``: ``fused_linear_logprob(backend="triton")``;
- ``floor``: the four cuBLAS GEMMs any exact recompute method needs (logits, recomputed logits,
  grad_hidden, grad_weight), each one full-size product.

Time: median of CUDA-event timings after warm-up. Memory: ``max_memory_allocated`` after
``reset_peak_memory_stats`` minus what was allocated before the step (the returned gradients
count). Accuracy: max |error| of log-prob and entropy against a float64 oracle on a subsample
of tokens. Prints a table and writes JSON.

    python benchmarks/bench_logprob.py --json bench.json [--shapes 4096x2048x151936,...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch
import triton

from megatron_fused_lm import fused_linear_logprob, logits_logprob

REFERENCE_SHAPES = (
    "4096x2048x151936,8192x4096x151936,16384x2048x151936,"
    "16384x5120x152064,16384x3072x262144,32768x4096x151936"
)
METHODS = ("floor", "stock", "torch", "triton")
MIB = 2**20


def parse_shape(text):
    tokens, hidden, vocab = (int(part) for part in text.lower().split("x"))
    return tokens, hidden, vocab


def make_inputs(tokens, hidden_size, vocab, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=gen).to(dtype).requires_grad_()
    # Logits with standard deviation about 4: a realistic, fairly peaky softmax.
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * (4.0 / hidden_size**0.5))
    weight = weight.to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    grad_logprob = torch.randn(tokens, device="cuda", generator=gen)
    grad_entropy = torch.randn(tokens, device="cuda", generator=gen)
    return hidden, weight, targets, grad_logprob, grad_entropy


def step_function(method, hidden, weight, targets, grad_logprob, grad_entropy):
    """A callable running one forward+backward; returns ``(logprob, entropy)`` or ``None``."""
    if method == "floor":
        logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
        products = (torch.empty_like(hidden), torch.empty_like(weight))

        def floor():
            with torch.no_grad():
                torch.mm(hidden, weight.t(), out=logits)
                torch.mm(hidden, weight.t(), out=logits)  # the recompute
                torch.mm(logits, weight, out=products[0])
                torch.mm(logits.t(), hidden, out=products[1])

        return floor

    def step():
        if method == "stock":
            logprob, entropy = logits_logprob(hidden @ weight.t(), targets, return_entropy=True)
        else:
            logprob, entropy = fused_linear_logprob(hidden, weight, targets, return_entropy=True, backend=method)
        torch.autograd.backward([logprob, entropy], [grad_logprob, grad_entropy])
        return logprob.detach(), entropy.detach()

    return step


def time_step(step, hidden, weight, warmup, repeats):
    """Median milliseconds of ``step`` and its peak extra memory in bytes."""
    for _ in range(warmup):
        hidden.grad = weight.grad = None
        step()
    times = []
    for _ in range(repeats):
        hidden.grad = weight.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outputs = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline
    return statistics.median(times), peak, outputs


def oracle(hidden, weight, targets, sample):
    """Float64 log-prob and entropy of the tokens ``sample``."""
    logits = hidden.detach()[sample].double() @ weight.detach().double().t()
    log_probs = logits.log_softmax(-1)
    logprob = log_probs.gather(1, targets[sample][:, None]).squeeze(1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprob, entropy


def bench_shape(shape, dtype, methods, warmup, repeats, sample_size):
    tokens, hidden_size, vocab = shape
    inputs = make_inputs(tokens, hidden_size, vocab, dtype)
    hidden, weight, targets = inputs[:3]
    sample = torch.randperm(tokens, device="cuda")[:sample_size]
    ref_logprob, ref_entropy = oracle(hidden, weight, targets, sample)
    gradient_bytes = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()
    rows = []
    for method in methods:
        torch.cuda.empty_cache()
        median_ms, peak, outputs = time_step(step_function(method, *inputs), hidden, weight, warmup, repeats)
        row = {"shape": "x".join(map(str, shape)), "method": method, "ms": median_ms, "peak_extra_bytes": peak}
        if outputs is not None:
            logprob, entropy = outputs
            row["logprob_max_error"] = (logprob[sample].double() - ref_logprob).abs().max().item()
            row["entropy_max_error"] = (entropy[sample].double() - ref_entropy).abs().max().item()
        rows.append(row)
        del outputs
    floor_ms = next((row["ms"] for row in rows if row["method"] == "floor"), None)
    memory_bound = 1.1 * gradient_bytes + 256 * MIB
    for row in rows:
        row["vs_floor"] = None if floor_ms is None else row["ms"] / floor_ms
        row["memory_bound_bytes"] = memory_bound
    return rows


def print_table(rows):
    print(f"{'shape':>22} {'method':>7} {'ms':>9} {'x floor':>8} {'peak GiB':>9} {'bound GiB':>9} "
          f"{'lp err':>9} {'ent err':>9}")
    for row in rows:
        ratio = "" if row["vs_floor"] is None else f"{row['vs_floor']:.3f}"
        lp_err = f"{row['logprob_max_error']:.2e}" if "logprob_max_error" in row else ""
        ent_err = f"{row['entropy_max_error']:.2e}" if "entropy_max_error" in row else ""
        print(f"{row['shape']:>22} {row['method']:>7} {row['ms']:9.2f} {ratio:>8} "
              f"{row['peak_extra_bytes'] / 2**30:9.3f} {row['memory_bound_bytes'] / 2**30:9.3f} {lp_err:>9} {ent_err:>9}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=REFERENCE_SHAPES, help="comma-separated TOKENSxHIDDENxVOCAB")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sample", type=int, default=256, help="tokens checked against the float64 oracle")
    parser.add_argument("--json", default="bench_logprob.json")
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    methods = args.methods.split(",")
    rows = []
    for text in args.shapes.split(","):
        rows += bench_shape(parse_shape(text), dtype, methods, args.warmup, args.repeats, args.sample)
        print_table(rows[-len(methods):])
    meta = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "warmup": args.warmup,
        "repeats": args.repeats,
    }
    with open(args.json, "w") as handle:
        json.dump({"meta": meta, "rows": rows}, handle, indent=1)
    print(json.dumps(meta))
    print_table(rows)


if __name__ == "__main__":
    main()
