"""GPU time per kernel in profiler traces (``bench_model_step.py --diagnose``'s chrome traces), side
by side: where two steps of the same work differ. NCCL kernels are grouped by collective: their
time includes waiting for the slowest rank, so a rank held up elsewhere shows here as a longer
all-gather or reduce-scatter on the others.

    python benchmarks/trace_kernels.py fast=diag/8192_tp2/three-gemm_sft_rank0.json slow=OTHER.json
"""

from __future__ import annotations

import argparse
import collections
import json
from typing import Dict

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def kernel_times(path: str) -> Dict[str, float]:
    """Milliseconds of GPU time per kernel name (NCCL kernels per collective) in one trace, and the
    step's GPU span under ``"(span)"``."""
    with open(path) as handle:
        events = [event for event in json.load(handle)["traceEvents"] if event.get("cat") in GPU_CATEGORIES]
    times: Dict[str, float] = collections.defaultdict(float)
    for event in events:
        name = event["name"]
        key = "nccl " + name.split("(")[0].removeprefix("ncclDevKernel_") if name.startswith("nccl") else name[:70]
        times[key] += event.get("dur", 0) / 1e3
    if events:
        times["(span)"] = (max(e["ts"] + e.get("dur", 0) for e in events) - min(e["ts"] for e in events)) / 1e3
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", metavar="LABEL=TRACE")
    parser.add_argument("--top", type=int, default=15, help="kernels shown, by their largest time")
    args = parser.parse_args()
    columns = dict(item.split("=", 1) for item in args.traces)
    times = {label: kernel_times(path) for label, path in columns.items()}
    names = sorted({name for table in times.values() for name in table} - {"(span)"})
    names.sort(key=lambda name: -max(table.get(name, 0.0) for table in times.values()))
    print(f"{'ms per step':72}" + "".join(f" {label:>11}" for label in columns))
    for name in ["(span)", "(all kernels)", *names[: args.top]]:
        cells = [
            sum(value for key, value in table.items() if key != "(span)")
            if name == "(all kernels)"
            else table.get(name, 0.0)
            for table in times.values()
        ]
        print(f"{name:72}" + "".join(f" {cell:11.2f}" for cell in cells))


if __name__ == "__main__":
    main()
