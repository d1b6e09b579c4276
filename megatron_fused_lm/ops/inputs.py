"""Checks shared by the public ops, and the mapping of global target ids onto a vocabulary shard."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .softmax_stats import group_rank, group_size

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float(name: str, tensor: torch.Tensor) -> None:
    """``TypeError`` unless ``tensor`` is float32, bfloat16 or float16."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {tensor.dtype}")


def check_options(temperature: float, chunk_size: Optional[int]) -> None:
    """``ValueError`` for a non-positive temperature or chunk size."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not temperature > 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise TypeError(f"chunk_size must be an int or None, got {type(chunk_size).__name__}")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive number of tokens or None, got {chunk_size}")


def flatten_targets(
    targets: torch.Tensor, lead_shape: torch.Size, mask: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Check ``targets`` (and ``mask``) against ``lead_shape``; return the flat targets of the
    selected rows and the selected row indices (``None`` without a mask: every row)."""
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer token ids, got {targets.dtype}")
    if targets.shape != lead_shape:
        raise ValueError(f"targets.shape {tuple(targets.shape)} must equal the leading shape {tuple(lead_shape)}")
    flat = targets.reshape(-1)
    if mask is None:
        return flat, None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
    if mask.shape != lead_shape:
        raise ValueError(f"mask.shape {tuple(mask.shape)} must equal targets.shape {tuple(lead_shape)}")
    rows = mask.reshape(-1).nonzero().squeeze(-1)
    return flat[rows], rows


def shard_targets(targets: torch.Tensor, vocab_shard: int, tp_group: Optional[dist.ProcessGroup]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Map flat global ``targets [n]`` onto this rank's vocabulary shard.

    Rank ``r`` owns global ids ``[r * vocab_shard, (r + 1) * vocab_shard)``. Returns
    ``local_target [n]`` (int64, clamped into the shard so that it can always index it) and
    ``owned [n]`` (bool, whether this rank holds the row's target).
    """
    vocab = vocab_shard * group_size(tp_group)
    targets = targets.long()
    if targets.numel() > 0:
        low, high = torch.stack([targets.min(), targets.max()]).tolist()  # one host sync
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(
                f"target id {bad} is outside the vocabulary [0, {vocab}) "
                f"({vocab_shard} rows per rank x {group_size(tp_group)} ranks)"
            )
    local = targets - group_rank(tp_group) * vocab_shard
    owned = (local >= 0) & (local < vocab_shard)
    return local.clamp(0, vocab_shard - 1), owned


def scatter_rows(values: torch.Tensor, rows: Optional[torch.Tensor], lead_shape: torch.Size) -> torch.Tensor:
    """Per-row results of the selected ``rows`` back in ``lead_shape``, 0 elsewhere (differentiable)."""
    if rows is None:
        return values.view(lead_shape)
    full = values.new_zeros(lead_shape.numel())
    return full.index_copy(0, rows, values).view(lead_shape)
