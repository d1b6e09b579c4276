"""What the benchmarks and the multi-GPU scripts share: the record of the device and versions,
and releasing memory between methods."""

from __future__ import annotations

import datetime
import gc
import importlib.metadata
import platform

import torch

import megatron_fused_lm


def release_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def package_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device, dtype):
    """Device, date and versions for the JSON's ``meta``."""
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "dtype": str(dtype).removeprefix("torch."),
        "versions": {name: package_version(name) for name in ("torch", "triton", "liger-kernel", "cut-cross-entropy")},
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
