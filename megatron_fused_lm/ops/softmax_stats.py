"""The softmax math, split into named steps that every path shares.

A token's logits ``z`` are spread over the vocabulary shards of a tensor-parallel group (and, inside
one rank, over blocks of the shard). Each block is summarised by four float32 numbers, its
*statistics*:

- ``max``: ``m = max z``
- ``sumexp``: ``s = sum exp(z - m)``
- ``sumexp_z``: ``a = sum exp(z - m) * (z - m)``, the exp-weighted logits measured from ``m``
- ``target``: the target's logit if the block holds the target, else 0

Measuring ``a`` from the block's own maximum keeps the entropy ``log s - a / s`` free of the
cancellation that ``lse - mean`` suffers when the logits are large and the distribution peaky.
Statistics of disjoint blocks merge exactly (``merge_statistics``), so one collective over the
group finishes the job however many blocks the local work used.

Shapes: ``n`` tokens, ``v`` vocabulary rows in a block; all tensors float32 unless stated.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .contract import SavedStatistics, ShardTargets, UpstreamGrads
from .distributed import all_gather_stacked, group_size

# Column order of a statistics tensor [..., 4].
MAX, SUMEXP, SUMEXP_Z, TARGET = range(4)
NUM_STATISTICS = 4


class SoftmaxSummary(NamedTuple):
    """What the forward returns and the backward needs, per token (each ``[n]`` float32)."""

    logprob: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor  # log sum exp z
    mean_logit: torch.Tensor  # sum p z, the mean logit under the softmax

    @property
    def saved(self) -> SavedStatistics:
        """What the backward keeps."""
        return SavedStatistics(self.lse, self.mean_logit)


def block_statistics(logits: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """Statistics ``[n, 4]`` of one block of float32 logits ``[n, v]``.

    ``local_target [n]`` (int64) indexes the block's columns and must be valid for every row;
    ``owned [n]`` (bool) says which rows' target really lies in this block.
    """
    row_max = logits.amax(dim=-1, keepdim=True)
    shifted = logits - row_max
    weights = shifted.exp()
    stats = torch.empty(logits.shape[0], NUM_STATISTICS, dtype=torch.float32, device=logits.device)
    stats[:, MAX] = row_max.squeeze(-1)
    stats[:, SUMEXP] = weights.sum(dim=-1)
    stats[:, SUMEXP_Z] = torch.linalg.vecdot(weights, shifted)  # no fourth block for the product
    target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
    stats[:, TARGET] = torch.where(owned, target_logit, torch.zeros_like(target_logit))
    return stats


def merge_statistics(parts: torch.Tensor) -> torch.Tensor:
    """Merge the statistics ``[k, n, 4]`` of ``k`` disjoint blocks into ``[n, 4]``.

    A block with no columns carries ``max = -inf`` and ``sumexp = 0``; it contributes nothing.
    """
    block_max = parts[..., MAX]
    overall_max = block_max.amax(dim=0)
    empty = block_max == -torch.inf
    offset = torch.where(empty, 0.0, block_max - overall_max)
    scale = torch.where(empty, 0.0, offset.exp())
    sumexp = (parts[..., SUMEXP] * scale).sum(dim=0)
    # Re-measure each block's exp-weighted logits from the overall maximum.
    sumexp_z = (scale * (parts[..., SUMEXP_Z] + parts[..., SUMEXP] * offset)).sum(dim=0)
    merged = torch.empty_like(parts[0])
    merged[:, MAX] = overall_max
    merged[:, SUMEXP] = sumexp
    merged[:, SUMEXP_Z] = sumexp_z
    merged[:, TARGET] = parts[..., TARGET].sum(dim=0)
    return merged


def merge_across_group(stats: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Merge every rank's shard statistics ``[n, 4]`` into the whole vocabulary's, with one
    all-gather however many blocks each rank's own work used."""
    if group_size(group) == 1 or stats.shape[0] == 0:
        return stats
    return merge_statistics(all_gather_stacked(stats, group))


def summarize(stats: torch.Tensor) -> SoftmaxSummary:
    """Turn the merged statistics ``[n, 4]`` of the whole vocabulary into per-token results."""
    log_sumexp = stats[:, SUMEXP].log()
    spread = stats[:, SUMEXP_Z] / stats[:, SUMEXP]  # mean logit minus max, <= 0
    return SoftmaxSummary(
        logprob=(stats[:, TARGET] - stats[:, MAX]) - log_sumexp,
        entropy=log_sumexp - spread,
        lse=stats[:, MAX] + log_sumexp,
        mean_logit=stats[:, MAX] + spread,
    )


def logit_grad(
    logits: torch.Tensor, targets: ShardTargets, saved: SavedStatistics, upstream: UpstreamGrads
) -> torch.Tensor:
    """Gradient ``[n, v]`` (float32) with respect to one block of float32 logits ``[n, v]``.

    ``dz = g_lp * (1[v = y] - p) + g_H * p * (mean - z)``; a ``None`` upstream gradient contributes
    nothing. ``targets`` index the block's columns; the chosen-token term is added with a scatter,
    only on rows whose target the block owns, while every row keeps its ``-p`` term.
    """
    grad_logprob, grad_entropy = upstream
    if grad_entropy is not None:
        grad = torch.sub(saved.mean_logit.unsqueeze(-1), logits).mul_(grad_entropy.unsqueeze(-1))
        if grad_logprob is not None:
            grad.sub_(grad_logprob.unsqueeze(-1))
    elif grad_logprob is not None:
        grad = (-grad_logprob).unsqueeze(-1).expand_as(logits).clone()
    else:
        return torch.zeros_like(logits)
    grad.mul_(torch.sub(logits, saved.lse.unsqueeze(-1)).exp_())
    if grad_logprob is not None:
        chosen = torch.where(targets.owned, grad_logprob, torch.zeros_like(grad_logprob))
        grad.scatter_add_(-1, targets.local.unsqueeze(-1), chosen.unsqueeze(-1))
    return grad
