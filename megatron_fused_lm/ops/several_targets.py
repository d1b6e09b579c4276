"""Several targets per row (``target_column [n, k]``): their logits, read beside the statistics.

``logprob_j = z_{y_j} - lse``: the statistics run with no target (the target statistic 0), and
each row's ``k`` logits are read here, this shard's ids only (0 at another shard's; one all-reduce
sums them), for ``softmax.summarize`` to turn into log-probs (the recompute op's forward; on the
three-GEMM path each chunk's step, the ``target_logits`` operator). The backward needs nothing
from here: the backends' ``dz`` blocks take the ``k`` columns' ``+g_j`` and their row sum's shared
term (``softmax.block_logit_grad``, the Triton ``logit_grad_kernel``) in float32 before anything
is rounded, or on the three-GEMM path zero the ``k`` columns, whose terms
``softmax.chosen_logit_grad`` gives. These logits come from another product than the
statistics' maximum and sum; ``softmax.summarize`` takes a target holding over half a row's mass
as the maximum itself, so that its ``1 - p`` carries no rounding of theirs (``docs/DESIGN.md``,
"Contracts").
"""

from __future__ import annotations

from typing import Optional

import torch

from .softmax import softcapped

Tensor = torch.Tensor
# Gathered weight rows per chunk, float32 elements: bounds the [rows, k, H] working set (256 MiB).
GATHER_ELEMENTS = 2**26


def statistics_column(target_column: Tensor) -> Tensor:
    """The ``[n]`` target column the statistics run with: ``target_column`` itself, or for several
    targets ``[n, k]`` none (-1)."""
    if target_column.dim() == 1:
        return target_column
    return torch.full_like(target_column[:, 0], -1)


def gathered_logits(
    hidden: Tensor, weight: Tensor, target_column: Tensor, temperature: Tensor, softcap: Optional[float]
) -> Tensor:
    """``[n, k]`` float32: the logits ``hidden [n, H] . weight[target_column]`` (``softcapped``) over
    ``temperature [n]`` where this shard owns the id (``target_column >= 0``), else 0; products in
    float32, in chunks of rows."""
    logits = hidden.new_zeros(target_column.shape, dtype=torch.float32)
    chunk = max(1, GATHER_ELEMENTS // max(target_column.shape[1] * hidden.shape[1], 1))
    for start in range(0, target_column.shape[0], chunk):
        rows = slice(start, start + chunk)
        gathered = weight[target_column[rows].clamp(min=0)].float()  # [rows, k, H]
        # A reduction, not a matmul: float32 whatever TF32 setting the caller chose.
        logits[rows] = torch.linalg.vecdot(gathered, hidden[rows].float().unsqueeze(1))
    return torch.where(target_column >= 0, softcapped(logits, softcap).div_(temperature[:, None]), 0.0)


def taken_logits(logits: Tensor, target_column: Tensor, temperature: Tensor, softcap: Optional[float]) -> Tensor:
    """``gathered_logits`` from a materialized logits shard ``[n, vocab_shard]``."""
    taken = softcapped(logits.gather(-1, target_column.clamp(min=0)).float(), softcap).div_(temperature[:, None])
    return torch.where(target_column >= 0, taken, 0.0)
