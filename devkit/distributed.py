"""Shared setup of the multi-GPU tests and benchmarks, which torchrun starts with one process per GPU.

On CUDA: NCCL, one GPU per process, NVLink multicast off in NCCL, PyTorch and NVSHMEM (on shared
hosts multicast can take the GPUs out of service). Without CUDA the same scripts run on gloo CPU
ranks at tiny sizes: a dry run of their logic, with ``megatron_gpt``'s CPU patches.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import asdict
from typing import Optional

# Megatron warns about every missing GPU extension (Apex, TransformerEngine); they are absent on purpose.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

import torch
import torch.distributed as dist

from devkit.measure import environment as measurement_environment
from devkit.megatron_gpt import GPTShape
from megatron_fused_lm.integration.cpu import allow_torch_norm_under_sequence_parallel, patch_megatron_for_cpu

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def init_distributed(
    tensor_parallel: int, pipeline_parallel: int = 1, virtual_pipeline_parallel: Optional[int] = None
) -> torch.device:
    """Join the torchrun job (NCCL on this process's GPU, else gloo on the CPU) and build Megatron's
    process groups (``virtual_pipeline_parallel``: model chunks per pipeline stage, ``None`` for
    none); returns this process's device."""
    os.environ.update(MULTICAST_OFF)  # before NCCL reads its environment, whatever the launcher set
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        allow_torch_norm_under_sequence_parallel()
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        run_cuda_placements_on_cpu()
        dist.init_process_group("gloo")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_parallel, pipeline_parallel, virtual_pipeline_model_parallel_size=virtual_pipeline_parallel
    )
    return device


def run_cuda_placements_on_cpu() -> None:
    """For the CPU dry run: Megatron's pipeline schedule, setup and optimizers place a few tensors
    on the GPU by name (``.cuda()``, ``device="cuda"``); keep them on the CPU."""

    patch_megatron_for_cpu()  # the factories' device="cuda", among others
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
    torch.cuda.current_stream = lambda *args, **kwargs: _HostStream()


@contextlib.contextmanager
def cpu_tensors_named_cuda():
    """For the CPU dry run: Megatron's mixed-precision and distributed optimizers accept only
    parameters whose ``type()`` names a CUDA tensor, and check it while they are built; inside
    this context a CPU tensor's ``type()`` names the CUDA type of its dtype."""
    real_type = torch.Tensor.type

    def named_cuda(tensor, *args, **kwargs):
        name = real_type(tensor, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not (args or kwargs or tensor.is_cuda) else name

    torch.Tensor.type = named_cuda
    try:
        yield
    finally:
        torch.Tensor.type = real_type


class _HostStream:
    """The CPU's stand-in for a CUDA stream: work is synchronous, so there is nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def shutdown() -> None:
    """Destroy Megatron's process groups, then leave the job."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def gather_to_rank0(record: object) -> Optional[list]:
    """Every rank's ``record`` (picklable; JSON-able for ``write_json``) as a list in rank order on
    global rank 0; ``None`` elsewhere."""
    records = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(record, records, dst=0)
    return records


def write_json(path: Optional[str], payload: dict) -> None:
    """Write ``payload`` (rank 0 only) when a path was given."""
    if path and dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as handle:
            json.dump(payload, handle, indent=1)


def shape_record(shape: GPTShape) -> dict:
    """The model's and micro-batches' sizes for the JSON."""
    return asdict(shape)


def environment(device: torch.device) -> dict:
    """Device, date and versions (the benchmarks' record) plus megatron-core's, NCCL's and the
    number of processes."""
    import megatron.core

    meta = measurement_environment(device, torch.bfloat16)
    meta["versions"]["megatron-core"] = megatron.core.__version__  # the one imported, wherever it lies
    meta["world_size"] = dist.get_world_size()
    if device.type == "cuda":
        meta["versions"]["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    meta["multicast_env"] = {name: os.environ.get(name) for name in MULTICAST_OFF}
    return meta


def log(message: str) -> None:
    """Print with the global rank in front, flushed (torchrun interleaves the ranks' output)."""
    print(f"[rank {dist.get_rank()}] {message}", flush=True)
