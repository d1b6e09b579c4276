"""The autograd steps that the fused and the unfused autograd functions share, so that the two
cannot drift apart: finishing the forward from this shard's statistics, and opening the backward."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from .contract import SavedStatistics, UpstreamGrads
from .softmax_stats import merge_across_group, summarize


def finish_forward(
    ctx: Any, stats: torch.Tensor, options: Any, *inputs: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge this shard's statistics ``[n, 4]`` over ``options.tp_group``, save ``inputs`` and the
    O(n) statistics for the backward, and return ``(logprob [n], entropy [n])`` float32.
    ``options`` is the autograd function's options dataclass (``tp_group``, ``entropy_grad``)."""
    summary = summarize(merge_across_group(stats, options.tp_group))
    ctx.save_for_backward(*inputs, *summary.saved)
    ctx.options = options
    ctx.set_materialize_grads(False)
    if not options.entropy_grad:
        ctx.mark_non_differentiable(summary.entropy)
    return summary.logprob, summary.entropy


def open_backward(
    ctx: Any, grad_logprob: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]
) -> Optional[Tuple[Tuple[torch.Tensor, ...], SavedStatistics, UpstreamGrads]]:
    """``(inputs saved by finish_forward, saved statistics, float32 upstream gradients)``, or
    ``None`` when no gradient flows back (an entropy without gradient contributes none)."""
    upstream = UpstreamGrads.from_autograd(grad_logprob, grad_entropy if ctx.options.entropy_grad else None)
    if upstream is None:
        return None
    *inputs, lse, mean_logit = ctx.saved_tensors
    return tuple(inputs), SavedStatistics(lse, mean_logit), upstream
