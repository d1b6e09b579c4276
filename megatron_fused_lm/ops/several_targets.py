"""Several targets per row on the four-GEMM path: log-probs ``[n, k]`` at ``k`` ids of each row.

``logprob_j = z_{y_j} - lse``. The row's ``-lse`` is what the fused op returns for a row whose
target no rank owns (target column -1 everywhere: the target statistic is 0), so its gradient,
``sum_j g_j`` times ``-softmax``, comes from the op's own backward; the ``k`` logits ``z_{y_j}`` are
gathered here from the weight rows of the ids, with their gradients ``g_j w_{y_j} / T`` into the
hidden row and ``g_j h / T`` into the weight rows. Under tensor parallelism each rank gathers the
ids of its shard (0 elsewhere), and one all-reduce sums the ``[n, k]`` logits; the backward
all-reduces this part's hidden gradient as the op does its own.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .distributed import all_reduce_sum

Tensor = torch.Tensor
# Gathered weight rows per chunk, float32 elements: bounds the [rows, k, H] working set (256 MiB).
GATHER_ELEMENTS = 2**26


def _chunks(num_rows: int, per_row: int):
    rows = max(1, GATHER_ELEMENTS // max(per_row, 1))
    return (slice(start, min(start + rows, num_rows)) for start in range(0, num_rows, rows))


class GatheredLogits(torch.autograd.Function):
    """``z [n, k]`` float32: ``hidden [n, H] . weight[column] / temperature`` where ``column [n, k]``
    (this shard's rows, -1: another shard's id, 0 here) and ``temperature [n]``, summed over
    ``tp_group``; the hidden gradient summed over it too when ``reduce_hidden_grad``."""

    @staticmethod
    def forward(ctx, hidden, weight, column, temperature, tp_group: Optional[dist.ProcessGroup], reduce_hidden_grad):
        owned = column >= 0
        logits = hidden.new_zeros(column.shape, dtype=torch.float32)
        for rows in _chunks(column.shape[0], column.shape[1] * hidden.shape[1]):
            gathered = weight[column[rows].clamp(min=0)].float()  # [rows, k, H]
            logits[rows] = torch.bmm(gathered, hidden[rows].float().unsqueeze(-1)).squeeze(-1)
        logits = torch.where(owned, logits / temperature[:, None], 0.0)
        all_reduce_sum(logits, tp_group)
        ctx.save_for_backward(hidden, weight, column, temperature)
        ctx.tp_group, ctx.reduce_hidden_grad = tp_group, reduce_hidden_grad
        return logits

    @staticmethod
    def backward(ctx, grad_logits):
        hidden, weight, column, temperature = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        # Each rank's ids only: another shard's z took no part in this rank's product.
        scaled = torch.where(column >= 0, grad_logits.float() / temperature[:, None], 0.0)
        safe = column.clamp(min=0)
        grad_hidden = torch.empty_like(hidden, dtype=torch.float32) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        for rows in _chunks(column.shape[0], column.shape[1] * hidden.shape[1]):
            if grad_hidden is not None:
                gathered = weight[safe[rows]].float()  # [rows, k, H]
                grad_hidden[rows] = torch.bmm(scaled[rows].unsqueeze(1), gathered).squeeze(1)
            if grad_weight is not None:
                contributions = scaled[rows].unsqueeze(-1) * hidden[rows].float().unsqueeze(1)  # [rows, k, H]
                grad_weight.index_add_(0, safe[rows].reshape(-1), contributions.reshape(-1, hidden.shape[1]))
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
            if ctx.reduce_hidden_grad:
                all_reduce_sum(grad_hidden, ctx.tp_group)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None,
            None,
            None,
            None,
        )


class SummedLogits(torch.autograd.Function):
    """A logits shard's ``[n, k]`` values at ``column`` (-1: another shard's, 0 here), divided by
    ``temperature [n]`` in float32, summed over ``tp_group``; the gradient goes to this shard's
    logits only, as ``logits_logprob``'s does."""

    @staticmethod
    def forward(ctx, logits, column, temperature, tp_group: Optional[dist.ProcessGroup]):
        taken = logits.gather(-1, column.clamp(min=0)).float() / temperature[:, None]
        taken = torch.where(column >= 0, taken, 0.0)
        all_reduce_sum(taken, tp_group)
        ctx.save_for_backward(column, temperature)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return taken

    @staticmethod
    def backward(ctx, grad_taken):
        column, temperature = ctx.saved_tensors
        scaled = torch.where(column >= 0, grad_taken.float() / temperature[:, None], 0.0)
        grad_logits = torch.zeros(ctx.shape, dtype=torch.float32, device=scaled.device)
        grad_logits.scatter_add_(-1, column.clamp(min=0), scaled)
        return grad_logits.to(ctx.dtype), None, None, None
