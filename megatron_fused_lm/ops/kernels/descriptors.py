"""Tensor descriptors (TMA on Hopper) for the kernels' 2-D operands and outputs.

A descriptor needs a unit last stride and 16-byte aligned rows and base; it reads zeros past the
tensor's edges and clips stores there, so the kernels need no masks on their tiles.
"""

from __future__ import annotations

from typing import Sequence

import torch
from triton.tools.tensor_descriptor import TensorDescriptor


def addressable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor [rows, cols]`` if a descriptor can address it, else a copy (same values) that one
    can: row-major, each row padded to a multiple of 16 bytes. Production layouts (contiguous,
    hidden size a multiple of 8) never copy."""
    item = tensor.element_size()
    if tensor.stride(1) == 1 and tensor.stride(0) * item % 16 == 0 and tensor.data_ptr() % 16 == 0:
        return tensor
    return addressable_empty(tensor, *tensor.shape, tensor.dtype).copy_(tensor)


def addressable_empty(like: torch.Tensor, rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized ``[rows, columns]`` tensor of ``dtype`` on ``like``'s device that a
    descriptor can address: row-major, each row padded to a multiple of 16 bytes."""
    item = torch.finfo(dtype).bits // 8
    padded_columns = -(-columns * item // 16) * 16 // item
    return like.new_empty(rows, padded_columns, dtype=dtype)[:, :columns]


def descriptor(tensor: torch.Tensor, block_shape: Sequence[int]) -> TensorDescriptor:
    """Descriptor of an ``addressable`` 2-D tensor, moving ``block_shape`` tiles."""
    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), list(block_shape))
