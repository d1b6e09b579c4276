"""The tensor-parallel group as the ops see it (a plain process group, or ``None`` for no split), and
the ops' collectives."""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from .softmax import merge_statistics


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Number of ranks in ``group``; 1 for ``None``."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank in ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


def all_gather_stacked(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``tensor [m, ...]`` stacked in rank order: ``[group size, m, ...]``, one collective."""
    size = group_size(group)
    # Concatenated along the first dimension: the shape every backend (gloo too) accepts.
    gathered = tensor.new_empty((size * tensor.shape[0], *tensor.shape[1:]))
    # torch 2.13 renamed all_gather_into_tensor (and deprecated the old name).
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(gathered, tensor.contiguous(), group=group)
    return gathered.view(size, *tensor.shape)


def all_reduce_sum(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Sum ``tensor`` over ``group`` in place (nothing to do for a group of one)."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, group=group)


# The groups the ops were called with, by name: a custom operator carries a group's name, and the
# operator's body looks the group up here.
_groups_by_name: Dict[str, dist.ProcessGroup] = {}


def group_name(group: Optional[dist.ProcessGroup]) -> Optional[str]:
    """The name ``group`` is registered under, which ``group_by_name`` gives back."""
    if group is None:
        return None
    _groups_by_name[group.group_name] = group
    return group.group_name


def group_by_name(name: Optional[str]) -> Optional[dist.ProcessGroup]:
    """The process group ``group_name`` gave ``name``; ``None`` for ``None``. A compiled graph runs
    its operators before Dynamo replays the registration it traced, so a name not registered yet is
    resolved by torch's own (private) lookup, and registered."""
    if name is None:
        return None
    if name not in _groups_by_name:
        resolve = getattr(dist.distributed_c10d, "_resolve_process_group", None)
        if resolve is None:
            raise RuntimeError(
                f"the process group {name!r} was not named to the ops before this compiled call, and torch "
                f"{torch.__version__} has no _resolve_process_group to find it: call the op once uncompiled first"
            )
        _groups_by_name[name] = resolve(name)
    return _groups_by_name[name]


def merge_across_group(stats: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Merge every rank's shard statistics ``[n, 4]`` into the whole vocabulary's, with one
    all-gather however many blocks each rank's own work used."""
    if group_size(group) == 1 or stats.shape[0] == 0:
        return stats
    return merge_statistics(all_gather_stacked(stats, group))
