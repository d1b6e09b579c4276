"""The loss-in-forward path's shared step: the contract of a per-token ``loss_fn``, and what every
rank does between a chunk's statistics and its gradients (``ChunkLoss``, the ``contract.ChunkStep``
of ``run_loss_pass``): merge the chunk's statistics across the group, record its log-probs and
entropy, and evaluate ``loss_fn`` and its per-token gradients."""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from .contract import UpstreamGrads
from .distributed import merge_across_group
from .softmax import SoftmaxSummary, summarize

Tensor = torch.Tensor
LossFn = Callable[..., Tensor]


def check_loss_inputs(
    loss_fn: LossFn, loss_inputs: Optional[Dict[str, Tensor]], lead_shape: torch.Size, device: torch.device
) -> Dict[str, Tensor]:
    """The per-token inputs flattened to ``[rows]``, after checking ``loss_fn`` is callable and each
    input is a tensor of ``lead_shape`` on ``device`` that needs no gradient."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if loss_inputs is None:
        return {}
    if not isinstance(loss_inputs, dict):
        raise TypeError(f"loss_inputs must be a dict of tensors, got {type(loss_inputs).__name__}")
    return {
        name: check_per_token(f"loss_inputs[{name!r}]", value, lead_shape, device)
        for name, value in loss_inputs.items()
    }


def check_per_token(name: str, value: Tensor, lead_shape: torch.Size, device: torch.device) -> Tensor:
    """``value`` flattened to ``[rows]``, after checking it is a tensor of ``lead_shape`` on ``device``
    that needs no gradient (errors name it ``name``)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if value.shape != lead_shape:
        raise ValueError(f"{name} has shape {tuple(value.shape)}; expected {tuple(lead_shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device}; expected {device}")
    if value.requires_grad:
        raise ValueError(f"{name} requires grad, but no gradient flows into loss inputs; detach it")
    return value.reshape(-1)


def per_token_losses(loss_fn: LossFn, logprob: Tensor, entropy: Tensor, inputs: Dict[str, Tensor]) -> Tensor:
    """``loss_fn(logprob [rows], entropy [rows], **inputs)`` as float32 ``[rows]``, or a clear error
    when it is not one loss per row."""
    losses = loss_fn(logprob, entropy, **inputs)
    if not isinstance(losses, Tensor) or not losses.dtype.is_floating_point:
        raise TypeError(f"loss_fn must return a float tensor of per-token losses, got {losses!r:.80}")
    if losses.shape != logprob.shape:
        raise ValueError(
            f"loss_fn must return one loss per token, shape {tuple(logprob.shape)}, got {tuple(losses.shape)}: "
            "it is called on chunks of rows and its results are summed, so it must not reduce across rows"
        )
    return losses.float()


class ChunkLoss:
    """The chunk step both backends' passes are driven with: merges a chunk's shard statistics
    across the group (one all-gather), records its log-probs and entropy and the running loss,
    and returns the loss's per-token gradients."""

    def __init__(
        self, loss_fn: LossFn, inputs: Dict[str, Tensor], num_rows: int, device, tp_group: Optional[dist.ProcessGroup]
    ):
        self.loss_fn, self.inputs, self.tp_group = loss_fn, inputs, tp_group
        self.logprob, self.entropy, self.lse, self.mean_logit = (
            torch.empty(num_rows, dtype=torch.float32, device=device) for _ in range(4)
        )
        self.total = torch.zeros((), dtype=torch.float32, device=device)

    def __call__(self, rows: slice, local_statistics: Tensor) -> tuple[SoftmaxSummary, UpstreamGrads]:
        summary = summarize(merge_across_group(local_statistics, self.tp_group))
        for name in ("logprob", "entropy", "lse", "mean_logit"):
            getattr(self, name)[rows] = getattr(summary, name)
        logprob = summary.logprob.detach().requires_grad_()
        entropy = summary.entropy.detach().requires_grad_()
        with torch.enable_grad():
            losses = per_token_losses(
                self.loss_fn, logprob, entropy, {name: value[rows] for name, value in self.inputs.items()}
            )
            total = losses.sum()
        self.total += total.detach()
        if not total.requires_grad:
            return summary, UpstreamGrads(None, None)
        grad_logprob, grad_entropy = torch.autograd.grad(total, (logprob, entropy), allow_unused=True)
        return summary, UpstreamGrads(grad_logprob, grad_entropy)


# How far an upstream gradient may stray from ``c * declared_weights`` (relative to its largest
# entry) and still count as that: float32 rounding of a mask times a scale, not a different loss.
PROPORTIONAL_TOLERANCE = 1e-5


def proportional_scale(upstream: Tensor, declared: Tensor) -> Optional[Tensor]:
    """``c`` (a 0-dim float32 tensor) such that ``upstream == c * declared`` up to
    ``PROPORTIONAL_TOLERANCE``, or ``None`` when there is none (one host synchronization)."""
    upstream, declared = upstream.float(), declared.float()
    norm = (declared * declared).sum()
    scale = torch.where(norm > 0, (upstream * declared).sum() / norm.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    deviation = (upstream - scale * declared).abs().max() if upstream.numel() else upstream.new_zeros(())
    bound = PROPORTIONAL_TOLERANCE * upstream.abs().max() if upstream.numel() else upstream.new_zeros(())
    return scale if bool(deviation <= bound) else None
