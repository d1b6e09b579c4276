"""The unfused path: log-probs, entropy and per-token losses from a materialized logits shard."""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .distributed import group_name
from .inputs import check_float, check_options, select_rows
from .library import logits_forward
from .loss import FusedLoss, LossFn, check_loss_inputs, per_token_losses


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
    max_rows: Optional[int] = None,
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
        mask, max_rows: only rows where ``mask`` is True are computed; the others are 0 with zero
            gradient and their targets are not read (as for ``fused_linear_logprob``).

    Returns:
        ``logprob [...]`` float32, or ``(logprob, entropy)``. The gradient goes to ``logits`` in
        their dtype (this rank's shard only; nothing is reduced across ranks).
    """
    check_float("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., vocab_shard >= 1], got shape {tuple(logits.shape)}")
    check_options(temperature, chunk_size)
    selection = select_rows(targets, logits.shape[:-1], mask, max_rows, logits.shape[-1], tp_group)
    logprob, entropy, _, _ = logits_forward(
        selection.take(logits), *selection.targets, float(temperature), chunk_size, group_name(tp_group), entropy_grad
    )
    logprob = selection.place(logprob)
    return (logprob, selection.place(entropy)) if return_entropy else logprob


def logits_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: LossFn,
    *,
    loss_inputs: Optional[Dict[str, torch.Tensor]] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    mask: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
) -> FusedLoss:
    """``fused_linear_loss`` on a materialized logits shard: the same loss, the same contract for
    ``loss_fn`` and ``loss_inputs``, the gradient (to ``logits``) by the usual backward."""
    logprob, entropy = logits_logprob(
        logits, targets, tp_group=tp_group, temperature=temperature, return_entropy=True,
        chunk_size=chunk_size, mask=mask,
    )  # fmt: skip
    inputs = check_loss_inputs(loss_fn, loss_inputs, logits.shape[:-1], logits.device)
    logprob_rows, entropy_rows = logprob.reshape(-1), entropy.reshape(-1)
    if mask is not None:
        rows = mask.reshape(-1).nonzero().squeeze(-1)
        logprob_rows, entropy_rows = logprob_rows[rows], entropy_rows[rows]
        inputs = {name: value[rows] for name, value in inputs.items()}
    loss = per_token_losses(loss_fn, logprob_rows, entropy_rows, inputs).sum()
    return FusedLoss(loss, logprob.detach(), entropy.detach())
