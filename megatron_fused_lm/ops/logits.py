"""The unfused path: log-probs and entropy from a materialized logits shard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from .chunking import BlockLogits, chunk_logit_grads, chunk_statistics
from .contract import ShardTargets
from .inputs import check_float, check_options, select_rows
from .plumbing import finish_forward, open_backward


@dataclass(frozen=True)
class LogitsOptions:
    """Everything ``LogitsLogprob`` needs besides its tensors."""

    temperature: float
    tp_group: Optional[dist.ProcessGroup]
    token_chunk: Optional[int]  # rows per chunk of the float32 softmax; None: one pass
    entropy_grad: bool


class LogitsLogprob(torch.autograd.Function):
    """Autograd function behind ``logits_logprob``: ``forward(logits [n, vocab_shard], local_target
    [n] int64, owned [n] bool, options: LogitsOptions) -> (logprob [n], entropy [n])`` float32.

    Saves the logits as given (never modified) and O(n) statistics; the backward recomputes the
    float32 softmax one chunk at a time and writes the gradient in the logits' dtype.
    """

    @staticmethod
    def forward(ctx, logits, local_target, owned, options: LogitsOptions):
        targets = ShardTargets(local_target, owned)
        stats = chunk_statistics(_scaled(logits, options.temperature), targets, _chunk_rows(logits, options))
        return finish_forward(ctx, stats, options, logits, local_target, owned)

    @staticmethod
    def backward(ctx, grad_logprob: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]):
        opened = open_backward(ctx, grad_logprob, grad_entropy)
        if opened is None:
            return None, None, None, None
        (logits, local_target, owned), saved, upstream = opened
        options: LogitsOptions = ctx.options
        grad_logits = torch.empty_like(logits)
        logit_grads = chunk_logit_grads(
            _scaled(logits, options.temperature),
            ShardTargets(local_target, owned),
            saved,
            upstream,
            options.temperature,
            _chunk_rows(logits, options),
        )
        for chunk, grad in logit_grads:
            grad_logits[chunk] = grad
        return grad_logits, None, None, None


def _chunk_rows(logits: torch.Tensor, options: LogitsOptions) -> int:
    return options.token_chunk or max(logits.shape[0], 1)


def _scaled(logits: torch.Tensor, temperature: float) -> BlockLogits:
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
        chunk_size: rows per chunk of the float32 softmax; ``None`` (or a size of at least the
            number of rows) runs one pass over all rows.
        mask: optional bool ``[...]``: only rows where it is True are computed; the others are 0
            with zero gradient and their targets are not read (as for ``fused_linear_logprob``).

    Returns:
        ``logprob [...]`` float32, or ``(logprob, entropy)``. The gradient goes to ``logits`` in
        their dtype (this rank's shard only; nothing is reduced across ranks).
    """
    check_float("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., vocab_shard >= 1], got shape {tuple(logits.shape)}")
    check_options(temperature, chunk_size)
    selection = select_rows(targets, logits.shape[:-1], mask, logits.shape[-1], tp_group)
    options = LogitsOptions(float(temperature), tp_group, chunk_size, entropy_grad)
    logprob, entropy = LogitsLogprob.apply(selection.take(logits), *selection.targets, options)
    logprob = selection.place(logprob)
    return (logprob, selection.place(entropy)) if return_entropy else logprob
