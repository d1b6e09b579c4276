"""What the benchmarks and the multi-GPU scripts share: the record of the device and versions,
timing, peak memory, and releasing memory between methods. On the CPU (a dry run of the scripts'
logic) times come from the host clock and there is no memory figure."""

from __future__ import annotations

import datetime
import gc
import importlib.metadata
import platform
import statistics
import time
from typing import Callable, Optional

import torch

import megatron_fused_lm


def release_memory() -> None:
    """Free what is no longer referenced, and return the CUDA caching allocator's free blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    """Wait for all the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed_ms(step: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one ``step()``: CUDA events around it on CUDA, else the host clock."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    step()
    return (time.perf_counter() - begin) * 1e3


def median_ms(step: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """The median of ``repeats`` timings of ``step()`` (``elapsed_ms``) after ``warmup`` untimed calls."""
    for _ in range(warmup):
        step()
    return statistics.median(elapsed_ms(step, device) for _ in range(repeats))


def reset_peak_memory(device: torch.device) -> Optional[int]:
    """Start a peak-memory measurement on ``device`` once its queued work is done; returns the
    bytes allocated then (subtract them from ``peak_memory_bytes`` for the extra), ``None`` on the
    CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_memory_bytes(device: torch.device) -> Optional[int]:
    """The most bytes allocated on ``device`` since ``reset_peak_memory`` once its queued work is
    done; ``None`` on the CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def package_version(name: str) -> Optional[str]:
    """The installed distribution's version, ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    """Device, date and versions for the JSON's ``meta``."""
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "dtype": str(dtype).removeprefix("torch."),
        "versions": {
            name: package_version(name)
            for name in (
                "torch",
                "triton",
                "megatron-core",
                "liger-kernel",
                "liger-cute-kernels",
                "apache-tvm-ffi",
                "cut-cross-entropy",
            )
        },
    }
    # Run from a checkout (PYTHONPATH), so the package's own version, not an installed one's.
    meta["versions"]["megatron-fused-lm"] = megatron_fused_lm.__version__
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        meta.update(
            device=properties.name,
            device_memory_bytes=properties.total_memory,
            multiprocessors=properties.multi_processor_count,
            cuda=torch.version.cuda,
        )
    else:
        meta["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return meta
