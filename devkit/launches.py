"""Host work of a call, counted without a GPU: the ATen ops that launch a kernel (views, allocations
and metadata changes launch none), the Triton kernels launched, the host reads of tensor data (each
a synchronization on a GPU) and the copies between host and device.

``CountedLaunches`` is a dispatch mode, so it sees every ATen op below autograd, the backward's
included. With ``stub_triton=True`` the Triton kernels are counted and not run: on meta tensors
a pass then runs exactly the launches it would on a GPU (its results are meaningless), and a host
read raises, as meta tensors have no data, so none can hide."""

from __future__ import annotations

import collections
from typing import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that launch no kernel: allocation, views and metadata.
NO_LAUNCH = {
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "set_", "resize_", "detach",
    "alias", "lift_fresh", "_unsafe_view", "record_stream",
    "scalar_tensor",  # a Python number wrapped on the host
}  # fmt: skip
HOST_READS = {"_local_scalar_dense", "nonzero", "is_nonzero", "item", "equal"}


class CountedLaunches(TorchDispatchMode):
    """``with CountedLaunches() as counted:`` ... then ``counted.aten`` (launching ATen ops by name),
    ``counted.triton`` (Triton kernels by name), ``counted.host_reads`` and ``counted.copies``
    (between devices); ``counted.launches`` is the sum of the first two."""

    def __init__(self, stub_triton: bool = True):
        super().__init__()
        self.stub_triton = stub_triton
        self.aten: Counter[str] = collections.Counter()
        self.triton: Counter[str] = collections.Counter()
        self.host_reads: Counter[str] = collections.Counter()
        self.copies = 0

    @property
    def launches(self) -> int:
        return sum(self.aten.values()) + sum(self.triton.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.host_reads[name] += 1
        elif name in ("copy_", "_to_copy") and _crosses_devices(func, args, kwargs):
            self.copies += 1
        elif name not in NO_LAUNCH and not func.is_view:
            self.aten[name] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        from triton.runtime.jit import JITFunction

        counted, original = self, JITFunction.run

        def run(function, *args, **kwargs):
            counted.triton[function.fn.__name__] += 1
            return None if counted.stub_triton else original(function, *args, **kwargs)

        self._restore = lambda: setattr(JITFunction, "run", original)
        JITFunction.run = run
        return super().__enter__()

    def __exit__(self, *exc):
        self._restore()
        return super().__exit__(*exc)


def _crosses_devices(func, args, kwargs) -> bool:
    tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
    if func.overloadpacket.__name__ == "_to_copy":
        device = kwargs.get("device")
        return device is not None and torch.device(device) != tensors[0].device
    return len(tensors) >= 2 and tensors[0].device != tensors[1].device
