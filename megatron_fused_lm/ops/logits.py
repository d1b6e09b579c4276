"""The unfused path: log-probs and entropy from a materialized logits shard."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from .inputs import check_float, check_options, flatten_targets, scatter_rows, shard_targets
from .softmax_stats import merge_across_group, summarize
from .torch_backend import chunk_logit_grads, chunk_statistics


class LogitsLogprob(torch.autograd.Function):
    """Autograd function behind ``logits_logprob``: ``forward(logits [n, vocab_shard], local_target,
    owned, temperature, tp_group, chunk_size, entropy_grad) -> (logprob [n], entropy [n])``.

    Saves the logits as given (never modified) and O(n) statistics; the backward recomputes the
    float32 softmax one chunk at a time and writes the gradient in the logits' dtype.
    """

    @staticmethod
    def forward(ctx, logits, local_target, owned, temperature, tp_group, chunk_size, entropy_grad):
        num_tokens = logits.shape[0]
        chunk_size = chunk_size or max(num_tokens, 1)
        stats = chunk_statistics(_scaled(logits, temperature), num_tokens, chunk_size, local_target, owned)
        summary = summarize(merge_across_group(stats, tp_group))
        ctx.save_for_backward(logits, local_target, owned, summary.lse, summary.mean_logit)
        ctx.options = (temperature, chunk_size, entropy_grad)
        ctx.set_materialize_grads(False)
        if not entropy_grad:
            ctx.mark_non_differentiable(summary.entropy)
        return summary.logprob, summary.entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, local_target, owned, lse, mean_logit = ctx.saved_tensors
        temperature, chunk_size, entropy_grad = ctx.options
        if not entropy_grad:
            grad_entropy = None
        if grad_logprob is None and grad_entropy is None:
            return (None,) * 7
        grad_logits = torch.empty_like(logits)
        grads = chunk_logit_grads(
            _scaled(logits, temperature), logits.shape[0], chunk_size, local_target, owned, lse, mean_logit,
            None if grad_logprob is None else grad_logprob.float(),
            None if grad_entropy is None else grad_entropy.float(),
            temperature,
        )
        for chunk, grad in grads:
            grad_logits[chunk] = grad
        return (grad_logits,) + (None,) * 6


def _scaled(logits: torch.Tensor, temperature: float):
    # Out of place: logits.float() is logits itself when it is float32 already.
    return lambda chunk: logits[chunk].float() / temperature


def logits_logprob(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_size: Optional[int] = None,
    mask: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Log-probs (and entropy) of ``targets`` under ``softmax(logits / temperature)``, the
    vocabulary spread over ``tp_group``: the stock (unfused) path.

    Args:
        logits: ``[..., vocab_shard]`` float32, bfloat16 or float16, this rank's vocabulary
            columns: rank ``r`` owns global ids ``[r * vocab_shard, (r + 1) * vocab_shard)``.
        targets: ``[...]`` (``logits.shape[:-1]``) integer global vocabulary ids.
        tp_group, temperature, return_entropy, entropy_grad: as for ``fused_linear_logprob``.
        chunk_size: tokens per chunk of the float32 softmax; ``None`` (or a size of at least the
            number of tokens) runs one pass over all tokens.
        mask: optional bool ``[...]``: only rows where it is True are computed; the others are 0
            with zero gradient (as for ``fused_linear_logprob``).

    Returns:
        ``logprob [...]`` float32, or ``(logprob, entropy)``. The gradient goes to ``logits``
        (this rank's shard only; nothing is reduced across ranks).
    """
    check_float("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., vocab_shard >= 1], got shape {tuple(logits.shape)}")
    check_options(temperature, chunk_size)
    lead_shape = logits.shape[:-1]
    selected_targets, rows = flatten_targets(targets, lead_shape, mask)
    local_target, owned = shard_targets(selected_targets, logits.shape[-1], tp_group)
    logits = logits.reshape(-1, logits.shape[-1])
    if rows is not None:
        logits = logits.index_select(0, rows)
    logprob, entropy = LogitsLogprob.apply(logits, local_target, owned, float(temperature), tp_group, chunk_size, entropy_grad)
    logprob = scatter_rows(logprob, rows, lead_shape)
    return (logprob, scatter_rows(entropy, rows, lead_shape)) if return_entropy else logprob
