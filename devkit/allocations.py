"""An allocation recorder: what the ops allocate, for tests that no ``[tokens, vocab]`` tensor
is ever built."""

from __future__ import annotations

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode


class LargestAllocation(TorchDispatchMode):
    """Records ``(element count, op, dtype)`` of every tensor an op allocates (views excluded),
    inside the package's custom operators too."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "megatron_fused_lm":
            # A custom operator is one call at this level: run its implementation under the
            # recorder so that what it allocates is seen too.
            with self:
                return _maybe_get_opdef(func)._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        if not func.is_view:
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor):
                    self.sizes.append((tensor.numel(), str(func), tensor.dtype))
        return out

    def largest(self) -> int:
        """The largest element count recorded."""
        return max(size for size, _, _ in self.sizes)
