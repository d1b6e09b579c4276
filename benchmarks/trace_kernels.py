"""GPU time per kernel in profiler traces (``bench_model_step.py --diagnose``'s chrome traces), side
by side: where two steps of the same work differ. NCCL kernels are grouped by collective: their
time includes waiting for the slowest rank, so a rank held up elsewhere shows here as a longer
all-gather or reduce-scatter on the others. ``--host-ops`` adds the host time of the ops whose
names start with the given prefixes (outermost calls only) and the count of kernel launches. Times
are of the profiled step, which the profiler slows (its span is up to twice the timed step's):
compare them between traces, not with timed steps.

    python benchmarks/trace_kernels.py fast=diag/8192_tp2/three-gemm_sft_rank0.json slow=OTHER.json \
        --host-ops megatron_fused_lm::,_VocabParallelCrossEntropy
"""

from __future__ import annotations

import argparse
import collections
import json
from typing import Dict, List, Tuple

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
SPAN, BUSY = "(profiled span)", "(GPU busy: union of all GPU work)"


def busy_ms(intervals: List[Tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals (microseconds in), in ms: overlapping
    streams (NCCL beside compute) counted once."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1e3


def timed_events(path: str) -> List[dict]:
    """A chrome trace's events that have a duration."""
    with open(path) as handle:
        return [event for event in json.load(handle)["traceEvents"] if "dur" in event]


def kernel_times(events: List[dict]) -> Dict[str, float]:
    """Milliseconds of GPU time per kernel (NCCL kernels per collective) in one trace's ``events``,
    with the step's span and its busy time under ``SPAN`` and ``BUSY``."""
    events = [event for event in events if event.get("cat") in GPU_CATEGORIES]
    times: Dict[str, float] = collections.defaultdict(float)
    for event in events:
        name = event["name"]
        key = "nccl " + name.split("(")[0].removeprefix("ncclDevKernel_") if name.startswith("nccl") else name
        times[key] += event["dur"] / 1e3
    intervals = [(event["ts"], event["ts"] + event["dur"]) for event in events]
    if intervals:
        times[SPAN] = (max(end for _, end in intervals) - min(start for start, _ in intervals)) / 1e3
        times[BUSY] = busy_ms(intervals)
    return times


def host_times(events: List[dict], prefixes: List[str]) -> Dict[str, float]:
    """Milliseconds of host time per op name starting with one of ``prefixes`` (nested calls of the
    same prefix counted once), and the number of kernel launches under ``"(launches)"``."""
    times: Dict[str, float] = collections.defaultdict(float)
    for prefix in prefixes:
        ops = sorted(
            (e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith(prefix)), key=lambda e: e["ts"]
        )
        end = float("-inf")
        for op in ops:
            if op["ts"] >= end:  # outermost: not inside the previous call
                times[op["name"]] += op["dur"] / 1e3
                end = op["ts"] + op["dur"]
    times["(launches)"] = sum(1 for e in events if e.get("cat") == "cuda_runtime" and "Launch" in e["name"])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", metavar="LABEL=TRACE")
    parser.add_argument("--top", type=int, default=15, help="kernels shown, by their largest time")
    parser.add_argument("--host-ops", default=None, help="comma-separated op name prefixes: their host time")
    args = parser.parse_args()
    columns = dict(item.split("=", 1) for item in args.traces)
    events = {label: timed_events(path) for label, path in columns.items()}
    times = {label: kernel_times(trace) for label, trace in events.items()}
    names = sorted({name for table in times.values() for name in table} - {SPAN, BUSY})
    names.sort(key=lambda name: -max(table.get(name, 0.0) for table in times.values()))
    print_table("ms in the profiled step", times, [SPAN, BUSY, *names[: args.top]])
    if args.host_ops:
        host = {label: host_times(trace, args.host_ops.split(",")) for label, trace in events.items()}
        print()
        print_table("host ms in the profiled step", host, sorted({name for table in host.values() for name in table}))


def print_table(title: str, tables: Dict[str, Dict[str, float]], rows: List[str]) -> None:
    """One row per name in ``rows``, one column per table (0 where a table lacks the name)."""
    print(f"{title:72}" + "".join(f" {label:>11}" for label in tables))
    for name in rows:
        print(f"{name[:72]:72}" + "".join(f" {table.get(name, 0.0):11.2f}" for table in tables.values()))


if __name__ == "__main__":
    main()
