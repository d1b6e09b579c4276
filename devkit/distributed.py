"""Shared setup of the multi-GPU tests and benchmarks, which torchrun starts with one process per GPU.

On CUDA: NCCL, one GPU per process, NVLink multicast off in NCCL, PyTorch and NVSHMEM (on shared
hosts multicast can take the GPUs out of service). Without CUDA the same scripts run on gloo CPU
ranks at tiny sizes: a dry run of their logic, with ``megatron_gpt``'s CPU patches.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict
from typing import Optional

# Megatron warns about every missing GPU extension (Apex, TransformerEngine); they are absent on purpose.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

import torch
import torch.distributed as dist

from devkit import megatron_gpt
from devkit.measure import environment as measurement_environment
from devkit.megatron_gpt import GPTShape, padded_vocab_size

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Initial weights of a ``peaky`` model: the embedding / output weights are scaled so that the
# logits' standard deviation is about LOGIT_STD (the final norm's output has unit scale), giving
# peaky next-token distributions, where log-prob and entropy errors show; the layers' weights have
# standard deviation PEAKY_INIT_STD so that the layers' outputs, not the input token's embedding,
# dominate the residual stream (else a tied model predicts its input token with certainty).
LOGIT_STD = 6.0
PEAKY_INIT_STD = 0.2


def init_distributed(tensor_parallel: int, pipeline_parallel: int = 1) -> torch.device:
    """Join the torchrun job (NCCL on this process's GPU, else gloo on the CPU) and build Megatron's
    process groups; returns this process's device."""
    os.environ.update(MULTICAST_OFF)  # before NCCL reads its environment, whatever the launcher set
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        megatron_gpt.allow_torch_norm_under_sequence_parallel()
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        megatron_gpt.patch_megatron_for_cpu()
        run_cuda_placements_on_cpu()
        dist.init_process_group("gloo")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel)
    return device


def run_cuda_placements_on_cpu() -> None:
    """For the CPU dry run: Megatron's pipeline schedule, setup and optimizers place a few tensors
    on the GPU by name (``.cuda()``, ``device="cuda"``); keep them on the CPU."""

    def on_cpu(factory):
        def make(*args, device=None, **kwargs):
            return factory(*args, device="cpu" if device == "cuda" else device, **kwargs)

        return make

    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
    torch.cuda.current_stream = lambda *args, **kwargs: _HostStream()


class _HostStream:
    """The CPU's stand-in for a CUDA stream: work is synchronous, so there is nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def shutdown() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def build_bf16_gpt(
    shape: GPTShape,
    device: torch.device,
    *,
    tied: bool,
    sequence_parallel: bool,
    seed: int,
    peaky: bool = False,
    pre_process: bool = True,
    post_process: bool = True,
):
    """The multi-GPU scripts' model: ``megatron_gpt.build_gpt`` in bf16 on ``device``, the
    vocabulary padded as Megatron-LM pads it, Megatron's default initialization or, with
    ``peaky``, one that gives peaky next-token distributions."""
    from megatron.core import parallel_state

    return megatron_gpt.build_gpt(
        shape,
        vocab_size=padded_vocab_size(shape.vocab, parallel_state.get_tensor_model_parallel_world_size()),
        dtype=torch.bfloat16,
        device=device,
        tied=tied,
        sequence_parallel=sequence_parallel,
        seed=seed,
        init_method_std=PEAKY_INIT_STD if peaky else 0.02,
        logit_std=LOGIT_STD if peaky else None,
        pre_process=pre_process,
        post_process=post_process,
    )


def causal_batch(shape: GPTShape, vocab: int, seed: int, device: torch.device):
    """``(input_ids, position_ids, attention_mask, targets)``, the same on every rank: ids and
    targets ``[micro_batch, seq]`` int64 over ``vocab``, a causal mask ``[1, 1, seq, seq]``
    (True = masked)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (shape.micro_batch, shape.seq), generator=generator)
    targets = torch.randint(0, vocab, (shape.micro_batch, shape.seq), generator=generator)
    position_ids = torch.arange(shape.seq).unsqueeze(0).expand(shape.micro_batch, shape.seq)
    mask = torch.triu(torch.ones(1, 1, shape.seq, shape.seq, dtype=torch.bool), diagonal=1)
    return tuple(tensor.to(device) for tensor in (input_ids, position_ids, mask, targets))


def peak_memory_bytes(device: torch.device) -> Optional[int]:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def gather_to_rank0(record: dict) -> Optional[list]:
    """Every rank's ``record`` (a JSON-able dict) as a list on global rank 0; ``None`` elsewhere."""
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
