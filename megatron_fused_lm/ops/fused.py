"""Per-token log-probs and entropy straight from hidden states and a vocabulary shard of the
LM-head weight, without building the ``[tokens, vocab_shard]`` logits."""

from __future__ import annotations

from types import ModuleType
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from .backends import resolve_backend
from .inputs import check_float, check_options, flatten_targets, scatter_rows, shard_targets
from .softmax_stats import group_size, merge_across_group, summarize


class FusedLinearLogprob(torch.autograd.Function):
    """Autograd function behind ``fused_linear_logprob`` (flat inputs, checks already done).

    ``forward(hidden [n, H], weight [vocab_shard, H] (same dtype as hidden), local_target [n]
    int64, owned [n] bool, temperature, tp_group, backend module, chunk_size, entropy_grad,
    reduce_hidden_grad) -> (logprob [n], entropy [n])``, both float32. Saves only O(n) statistics
    besides its inputs; the backward recomputes the logits.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        local_target: torch.Tensor,
        owned: torch.Tensor,
        temperature: float,
        tp_group: Optional[dist.ProcessGroup],
        backend: ModuleType,
        chunk_size: Optional[int],
        entropy_grad: bool,
        reduce_hidden_grad: bool,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        stats = backend.local_statistics(hidden, weight, local_target, owned, temperature, chunk_size)
        summary = summarize(merge_across_group(stats, tp_group))
        ctx.save_for_backward(hidden, weight, local_target, owned, summary.lse, summary.mean_logit)
        ctx.options = (temperature, tp_group, backend, chunk_size, entropy_grad, reduce_hidden_grad)
        ctx.set_materialize_grads(False)
        if not entropy_grad:
            ctx.mark_non_differentiable(summary.entropy)
        return summary.logprob, summary.entropy

    @staticmethod
    def backward(ctx, grad_logprob: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]):
        hidden, weight, local_target, owned, lse, mean_logit = ctx.saved_tensors
        temperature, tp_group, backend, chunk_size, entropy_grad, reduce_hidden_grad = ctx.options
        if not entropy_grad:
            grad_entropy = None
        need_hidden_grad, need_weight_grad = ctx.needs_input_grad[:2]
        if grad_logprob is None and grad_entropy is None:
            return (None,) * 10
        grad_hidden, grad_weight = backend.local_gradients(
            hidden, weight, local_target, owned, lse, mean_logit,
            None if grad_logprob is None else grad_logprob.float(),
            None if grad_entropy is None else grad_entropy.float(),
            temperature, chunk_size, need_hidden_grad, need_weight_grad,
        )
        if grad_hidden is not None:
            if reduce_hidden_grad and group_size(tp_group) > 1:
                dist.all_reduce(grad_hidden, group=tp_group)
            grad_hidden = grad_hidden.to(hidden.dtype)
        return (grad_hidden, grad_weight) + (None,) * 8


def fused_linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    entropy_grad: bool = True,
    backend: str = "torch",
    chunk_size: Optional[int] = None,
    reduce_hidden_grad: bool = True,
    mask: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Log-probs (and entropy) of ``targets`` under ``softmax(hidden @ weight.T / temperature)``,
    the vocabulary spread over ``tp_group``, without materializing the logits.

    Args:
        hidden: ``[..., H]`` float32, bfloat16 or float16; the same on every rank of ``tp_group``.
            It is cast to ``weight``'s dtype for the product; its gradient comes back in its own.
        weight: ``[vocab_shard, H]``, this rank's vocabulary rows (padded rows included): rank
            ``r`` owns global ids ``[r * vocab_shard, (r + 1) * vocab_shard)``.
        targets: ``[...]`` (``hidden.shape[:-1]``) integer global vocabulary ids.
        tp_group: the tensor-parallel group the vocabulary is split over; ``None`` for no split.
        temperature: divides the logits.
        return_entropy: also return the entropy of the distribution.
        entropy_grad: with ``False`` the entropy is a metric: no graph, no backward term.
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (Triton on CUDA when available; otherwise
            the torch backend, with one logged warning).
        chunk_size: tokens per chunk (torch backend); ``None`` picks one that bounds the float32
            working set (see ``torch_backend``).
        reduce_hidden_grad: ``True`` (default) gives the full gradient w.r.t. ``hidden`` on every
            rank (one all-reduce). ``False`` gives this rank's partial, for a caller whose own
            backward sums partials across ranks (a sequence-parallel gather's reduce-scatter).
        mask: optional bool ``[...]`` (``targets``' shape): only rows where it is True are
            computed (their hidden rows are gathered before the product, so time and memory follow
            the number selected); the others are 0 with zero gradient, and their targets are not
            read. Under tensor parallelism every rank must pass the same mask.

    Returns:
        ``logprob [...]`` float32, or ``(logprob, entropy)`` with ``return_entropy=True``.
    """
    check_float("hidden", hidden)
    check_float("weight", weight)
    if weight.dim() != 2 or weight.shape[0] == 0:
        raise ValueError(f"weight must be 2-D [vocab_shard >= 1, H], got shape {tuple(weight.shape)}")
    if hidden.dim() == 0 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size {tuple(hidden.shape)[-1:]} does not match weight's {weight.shape[1]}")
    check_options(temperature, chunk_size)
    lead_shape = hidden.shape[:-1]
    selected_targets, rows = flatten_targets(targets, lead_shape, mask)
    local_target, owned = shard_targets(selected_targets, weight.shape[0], tp_group)
    implementation = resolve_backend(backend, hidden.device)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if rows is not None:
        hidden = hidden.index_select(0, rows)
    logprob, entropy = FusedLinearLogprob.apply(
        hidden.to(weight.dtype), weight, local_target, owned,
        float(temperature), tp_group, implementation, chunk_size, entropy_grad, reduce_hidden_grad,
    )
    logprob = scatter_rows(logprob, rows, lead_shape)
    return (logprob, scatter_rows(entropy, rows, lead_shape)) if return_entropy else logprob
