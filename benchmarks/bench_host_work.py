"""Host work of the head per forward and backward on one GPU: CUDA kernels launched, launch calls,
copies between host and device, synchronizations, and the host (CPU) time of each path against the
stock one, on random bf16 inputs.

Paths: ``stock`` (bf16 logits, float32 log-softmax, gather: Megatron's labels path without its
all-reduce), ``labels`` (``fused_linear_cross_entropy`` with declared weights, the upstream as
declared), ``labels_main_grad`` (the same into a float32 accumulator), ``sft`` and ``rl``
(``fused_linear_loss`` with ``losses.cross_entropy`` and ``losses.ClippedPolicyLoss`` with an entropy
bonus) and ``recompute`` (``fused_linear_logprob`` and a loss of both outputs). Each is warmed up,
profiled once (``torch.profiler``: the kernels and the runtime calls), then timed ``--repeats``
times: host time is the thread's CPU time (``time.thread_time``) per step, wall time the step's
until the GPU is done. ``--vocab`` takes several sizes (a TP=2 shard of 151936 is 75968).
``--cuda-graph`` also captures each path's forward and backward in one CUDA graph and times its
replay, what a trainer that captures the head for fixed shapes gains.

    PYTHONPATH=. python benchmarks/bench_host_work.py --json host_work.json

Prints a JSON line per row; ``--json`` writes them all with the device and versions.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

import megatron_fused_lm as mfl
from devkit.measure import environment
from megatron_fused_lm import losses

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
RL_LOSS = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)


def paths(tokens: int, vocab: int, device: str) -> dict:
    """Each path as ``step(hidden, weight) -> loss``, on inputs shared by all."""
    generator = torch.Generator(device=device).manual_seed(1)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    mask = torch.rand(tokens, device=device, generator=generator) < 0.9
    weights = losses.token_mean_weights(mask)
    rl_inputs = {
        "old_logprob": torch.full((tokens,), -8.0, device=device),
        "advantages": torch.randn(tokens, device=device, generator=generator),
        "weight": weights,
    }
    accumulators = {}  # the main_grad route's float32 accumulator, made at its first call

    def stock(hidden, weight):
        logprob = torch.log_softmax((hidden @ weight.t()).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
        return -(logprob * weights).sum()

    def labels(hidden, weight):
        return (mfl.fused_linear_cross_entropy(hidden, weight, targets, weights, backend="triton") * weights).sum()

    def labels_main_grad(hidden, weight):
        if "main_grad" not in accumulators:
            accumulators["main_grad"] = torch.zeros_like(weight, dtype=torch.float32)
        accumulator = accumulators["main_grad"]
        per_token = mfl.fused_linear_cross_entropy(
            hidden, weight, targets, weights, backend="triton", weight_grad_into=accumulator
        )
        return (per_token * weights).sum()

    def sft(hidden, weight):
        loss_inputs = {"weight": weights}
        return mfl.fused_linear_loss(
            hidden, weight, targets, losses.cross_entropy, loss_inputs=loss_inputs, backend="triton"
        ).loss

    def rl(hidden, weight):
        return mfl.fused_linear_loss(hidden, weight, targets, RL_LOSS, loss_inputs=rl_inputs, backend="triton").loss

    def recompute(hidden, weight):
        logprob, entropy = mfl.fused_linear_logprob(hidden, weight, targets, return_entropy=True, backend="triton")
        return -(logprob * weights).sum() - 0.01 * (entropy * weights).sum()

    return dict(stock=stock, labels=labels, labels_main_grad=labels_main_grad, sft=sft, rl=rl, recompute=recompute)


def measure(step, hidden: torch.Tensor, weight: torch.Tensor, repeats: int, python_profile=None) -> dict:
    """The profiled counts and the host and wall time of ``step``'s forward and backward; with
    ``python_profile`` (a path), the Python profile of ``repeats`` steps written there (``pstats``)."""

    def forward_backward():
        step(hidden.detach().requires_grad_(), weight.detach().requires_grad_()).backward()

    for _ in range(3):
        forward_backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
        forward_backward()
        torch.cuda.synchronize()
    events = list(profiled.events())
    on_device = [event.name for event in events if event.device_type == torch.autograd.DeviceType.CUDA]
    counts = {
        "gpu_kernels": sum(not name.startswith("Memcpy") and not name.startswith("Memset") for name in on_device),
        "launch_calls": sum(event.name in LAUNCHES for event in events),
        "host_device_copies": sum(name.startswith(("Memcpy HtoD", "Memcpy DtoH")) for name in on_device),
        "device_copies": sum(name.startswith(("Memcpy DtoD", "Memset")) for name in on_device),
        "sync_calls": sum(event.name in SYNCS for event in events),
        "kernels": dict(collections.Counter(name[:60] for name in on_device).most_common()),
        "host_ops_ms": {
            average.key: round(average.self_cpu_time_total / 1e3, 3)
            for average in sorted(profiled.key_averages(), key=lambda average: -average.self_cpu_time_total)[:25]
        },
    }
    host, wall = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        thread, clock = time.thread_time(), time.perf_counter()
        forward_backward()
        host.append((time.thread_time() - thread) * 1e3)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - clock) * 1e3)
    if python_profile:
        cProfile.runctx("for _ in range(repeats): forward_backward()", globals(), locals(), python_profile)
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    return dict(counts, host_cpu_ms=round(median(host), 3), wall_ms=round(median(wall), 3))


def graph_replay(step, hidden: torch.Tensor, weight: torch.Tensor, repeats: int) -> dict:
    """``step``'s forward and backward captured once in a CUDA graph (static inputs, warmed up on a
    side stream as PyTorch's capture asks) and replayed: the replay's host and wall time."""
    static_hidden, static_weight = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(static_hidden, static_weight).backward()
    torch.cuda.current_stream().wait_stream(side)
    static_hidden.grad = static_weight.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(static_hidden, static_weight).backward()
    host, wall = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        thread, clock = time.thread_time(), time.perf_counter()
        graph.replay()
        host.append((time.thread_time() - thread) * 1e3)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - clock) * 1e3)
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    return dict(graph_host_cpu_ms=round(median(host), 3), graph_wall_ms=round(median(wall), 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 75968])
    parser.add_argument("--paths", default="stock,labels,labels_main_grad,sft,rl,recompute")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", help="write every row, with the device and versions, here")
    parser.add_argument("--python-profiles", help="a folder for each row's Python profile (pstats files)")
    parser.add_argument("--cuda-graph", action="store_true", help="also time each path replayed from a CUDA graph")
    args = parser.parse_args()
    rows = []
    for vocab in args.vocab:
        generator = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(args.tokens, args.hidden, device="cuda", generator=generator).bfloat16()
        weight = (torch.randn(vocab, args.hidden, device="cuda", generator=generator) * 2 / args.hidden**0.5).bfloat16()
        available = paths(args.tokens, vocab, "cuda")
        for name in args.paths.split(","):
            row = dict(tokens=args.tokens, hidden=args.hidden, vocab=vocab, path=name)
            profile_path = None
            if args.python_profiles:
                os.makedirs(args.python_profiles, exist_ok=True)
                profile_path = os.path.join(args.python_profiles, f"{name}_{vocab}.pstats")
            row.update(measure(available[name], hidden, weight, args.repeats, profile_path))
            if args.cuda_graph:
                row.update(graph_replay(available[name], hidden, weight, args.repeats))
            print(json.dumps({key: value for key, value in row.items() if key not in ("kernels", "host_ops_ms")}))
            rows.append(row)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"meta": environment(torch.device("cuda"), torch.bfloat16), "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
