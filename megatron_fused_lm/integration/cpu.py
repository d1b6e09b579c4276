"""Megatron-Core on the CPU, for trying the fused head without a GPU.

    from megatron_fused_lm.integration.cpu import megatron_on_cpu

    with megatron_on_cpu() as device:          # gloo, Megatron's process groups, TP=1
        model = GPTModel(...).to(device)       # the local layer spec, dropout 0
        head = wrap_model(model, FusedLMConfig(enabled=True, backend="torch"))

Under ``torchrun --nproc-per-node N`` the same context joins the N ranks, and
``megatron_on_cpu(tensor_parallel_size=N)`` splits the vocabulary over them.

Megatron-Core assumes a GPU in a few places a GPTModel's forward, backward and pipeline schedule,
and its DistributedDataParallel's gradient reduction, reach; ``patch_megatron_for_cpu`` redirects
them, process-wide and for good, on every release the integration supports (0.13 to 0.20). Inside
the context Megatron's advice on GPU features that a CPU has no use for is not shown. It is for
trying the head and for tests: a training run belongs on GPUs.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from typing import Iterator

import torch
import torch.distributed as dist

_patched = False


def patch_megatron_for_cpu() -> None:
    """Let a GPTModel of Megatron's local layer spec, and Megatron's DistributedDataParallel around
    it, run on the CPU (megatron-core 0.13 to 0.20). What each redirect is for:

    - ``torch.cuda.current_device()`` returns ``"cpu"``: the device of the attention scratch
      buffer (``GlobalMemoryBuffer``) and of DDP's gradient buffers.
    - ``torch.cuda.current_stream()`` returns a stand-in whose ``wait_event`` and ``wait_stream``
      do nothing (work on the CPU is synchronous): DDP's ``start_grad_sync``, which
      ``finish_grad_sync`` and the backward's hooks call, asks for the current stream
      unconditionally from megatron-core 0.19 (earlier releases only with several distributed
      optimizer instances, which this does not cover).
    - ``CudaRNGStatesTracker.fork`` does nothing: the CUDA RNG tracker has no states on the CPU
      (so dropout must be 0).
    - ``torch.tensor``, ``zeros``, ``ones``, ``empty`` and ``full`` create on the CPU what is asked
      for with ``device="cuda"``: the pipeline schedule's token count, among others.
    - torch norms run under sequence parallelism (``allow_torch_norm_under_sequence_parallel``).
    - megatron-core 0.20 asks of a multi-token-prediction layer's projection whether it is one of
      the inference linear layers, subclasses of TransformerEngine's that are no classes without it
      (``isinstance`` then raises): a class nothing is an instance of stands in for each.

    Idempotent; never undone."""
    global _patched
    if _patched:
        return
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda device=None: _HostStream()
    CudaRNGStatesTracker.fork = lambda self, *args, **kwargs: contextlib.nullcontext()

    def on_cpu(factory):
        def make(*args, device=None, **kwargs):
            return factory(*args, device="cpu" if device == "cuda" else device, **kwargs)

        return make

    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    allow_torch_norm_under_sequence_parallel()
    _stand_in_for_absent_inference_layers()
    _patched = True


def _stand_in_for_absent_inference_layers() -> None:
    try:
        from megatron.core.tensor_parallel import inference_layers
    except ImportError:  # before 0.20: MTP asks nothing of them
        return
    for name in ("InferenceColumnParallelLinear", "InferenceLayerNormColumnParallelLinear"):
        if not isinstance(getattr(inference_layers, name, object), type):
            setattr(inference_layers, name, type(f"Absent{name}", (), {}))


class _HostStream:
    """The CPU's stand-in for the current CUDA stream: work is synchronous, nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def allow_torch_norm_under_sequence_parallel() -> None:
    """Let Megatron's torch norms (the local spec's norms, without Apex or TransformerEngine, on any
    device) run under sequence parallelism, which they refuse. They are per-token, so exact there;
    as Megatron's own norms are, their parameters are marked ``sequence_parallel``, so that
    ``finalize_model_grads`` sums their gradients over the tensor-parallel group."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if getattr(WrappedTorchNorm.__new__, "_allows_sequence_parallel", False):
        return
    build_norm = WrappedTorchNorm.__new__

    def build_norm_ignoring_sequence_parallel(cls, config, *args, **kwargs):
        local_config = copy.copy(config)
        local_config.sequence_parallel = False
        norm = build_norm(cls, local_config, *args, **kwargs)
        for parameter in norm.parameters():
            parameter.sequence_parallel = config.sequence_parallel
        return norm

    build_norm_ignoring_sequence_parallel._allows_sequence_parallel = True
    WrappedTorchNorm.__new__ = build_norm_ignoring_sequence_parallel


# Megatron's warnings, by message, that concern only GPU features:
# - "full scope is deprecated": megatron-core 0.16 on warns of its own default for the CUDA-graph
#   capture scope (``cuda_graph_scope``, ``cuda_graph_modules`` from 0.18) each time a
#   TransformerConfig is built without one;
# - the advice to set CUDA_DEVICE_MAX_CONNECTIONS (CUDA's work queues), which the first linear layer
#   under tensor parallelism gives where it is unset.
GPU_ADVICE = (
    r"full scope is deprecated",
    r"When using (async grad allreduce|sequence parallelism) it is recommended to set the environment variable "
    r"CUDA_DEVICE_MAX_CONNECTIONS",
)


@contextlib.contextmanager
def _gpu_advice_hidden() -> Iterator[None]:
    """``GPU_ADVICE`` from Megatron's modules filtered out until exit; the filters are then taken
    out again (those alone: filters set meanwhile stay)."""
    added = []
    for message in GPU_ADVICE:
        before = list(warnings.filters)
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=r"megatron\.core\.")
        if warnings.filters[0] not in before:  # else the same filter was already there: it stays
            added.append(warnings.filters[0])
    try:
        yield
    finally:
        for entry in added:
            with contextlib.suppress(ValueError):  # taken out meanwhile
                warnings.filters.remove(entry)


@contextlib.contextmanager
def megatron_on_cpu(tensor_parallel_size: int = 1) -> Iterator[torch.device]:
    """Megatron-Core's process groups over gloo on the CPU; yields ``torch.device("cpu")`` and takes
    them down on exit.

    One process, on an in-process store, unless ``torchrun`` started this one (``RANK`` set: its
    ``WORLD_SIZE`` ranks join). ``tensor_parallel_size`` (Megatron's
    ``tensor_model_parallel_size``) must divide the number of processes. Patches Megatron for the
    CPU first (``patch_megatron_for_cpu``: process-wide, so not for a process that also uses a GPU).
    A process group that already exists is an error, as ``torch.distributed`` makes it.

    Inside the context Megatron's warnings of ``GPU_ADVICE`` are not shown: advice on GPU features,
    which the CPU has no use for. Every other warning shows, and these again after the context."""
    from megatron.core import parallel_state

    patch_megatron_for_cpu()
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:  # a group of one on an in-process store: no port to pick, none another process can take
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        if dist.get_world_size() % tensor_parallel_size:
            raise ValueError(
                f"megatron_on_cpu: tensor_parallel_size {tensor_parallel_size} does not divide "
                f"the {dist.get_world_size()} processes"
            )
        parallel_state.initialize_model_parallel(tensor_parallel_size, 1)
        with _gpu_advice_hidden():
            yield torch.device("cpu")
    finally:
        parallel_state.destroy_model_parallel()  # also after a partial initialization
        dist.destroy_process_group()
