"""The softmax math every path and backend shares, as named steps: a block's statistics, their merge,
the per-token results, the logits' gradient ``dz`` and the chosen token's term of it.

A leaf: it imports torch only, and ``logit_grad`` is plain arithmetic, so the Triton kernels compile
the same function (``triton.jit(logit_grad)``). ``docs/DESIGN.md`` ("The math") derives each step.

Encoding of the target: ``target_column [n]`` int64, the target's column in this block or shard,
-1 where another shard owns it, ``OUTSIDE_VOCAB`` (-2) where no shard does and the row's largest
logit stands in for the target's (``summarize``). Shapes: ``n`` tokens, ``v`` columns in a block;
float32 unless stated.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

# Column order of a statistics tensor [..., 4]: the block's maximum m, sum exp(z - m),
# sum exp(z - m) * (z - m), and the target's logit (0 where the block does not hold it).
MAX, SUMEXP, SUMEXP_Z, TARGET = range(4)
NUM_STATISTICS = 4
# The target column of an id outside the vocabulary that scores as Megatron's vocabulary-parallel
# cross-entropy scores it: its logit counts as the row's largest, and it takes no gradient.
OUTSIDE_VOCAB = -2


class TargetIndex(NamedTuple):
    """What the steps read of ``target_column [n]`` besides its values, alike in each: made once per
    call (``of``) where a caller keeps it, and sliced per chunk (``rows``)."""

    column: torch.Tensor  # [n] int64: the target column clamped at 0, a column every row may read
    elsewhere: torch.Tensor  # [n] bool: the block or shard does not hold the target (column < 0)

    @classmethod
    def of(cls, target_column: torch.Tensor) -> TargetIndex:
        return cls(target_column.clamp(min=0), target_column < 0)

    def rows(self, rows: slice) -> TargetIndex:
        return TargetIndex(self.column[rows], self.elsewhere[rows])


class SoftmaxSummary(NamedTuple):
    """Per-token results of the merged statistics (each ``[n]`` float32)."""

    logprob: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor  # log sum exp z
    mean_logit: torch.Tensor  # sum p z, the mean logit under the softmax
    mean_minus_target: torch.Tensor  # mean - z_y, free of the cancellation of mean_logit - z_y


def block_statistics(
    logits: torch.Tensor,
    target_column: torch.Tensor,
    kept: Optional[torch.Tensor] = None,
    index: Optional[TargetIndex] = None,
) -> torch.Tensor:
    """Statistics ``[n, 4]`` of one block of float32 logits ``[n, v]``; with ``kept [n, v]`` bool,
    of the kept columns alone (a row keeping none: ``merge_statistics``' empty block). ``index``:
    ``TargetIndex.of(target_column)``, where the caller keeps it."""
    index = index or TargetIndex.of(target_column)
    if kept is not None:
        logits = logits.masked_fill(~kept, -torch.inf)
    row_max = logits.amax(dim=-1, keepdim=True)
    # A row keeping no column has max -inf: its shifted logits stay -inf, not NaN.
    shifted = logits - (row_max if kept is None else row_max.clamp(min=torch.finfo(torch.float32).min))
    weights = shifted.exp()
    # No fourth block for the product; a column left out adds 0, not 0 * -inf.
    sumexp_z = torch.linalg.vecdot(weights, shifted if kept is None else shifted.masked_fill(~kept, 0.0))
    target = logits.gather(-1, index.column.unsqueeze(-1)).squeeze(-1).masked_fill_(index.elsewhere, 0.0)
    return torch.stack([row_max.squeeze(-1), weights.sum(dim=-1), sumexp_z, target], dim=1)  # MAX ... TARGET


def merge_statistics(parts: torch.Tensor) -> torch.Tensor:
    """Merge the statistics ``[k, n, 4]`` of ``k`` disjoint blocks into ``[n, 4]``. A block with no
    columns carries ``max = -inf`` and ``sumexp = 0`` and contributes nothing."""
    block_max = parts[..., MAX]
    overall_max = block_max.amax(dim=0)
    empty = block_max == -torch.inf
    offset = torch.where(empty, 0.0, block_max - overall_max)
    scale = torch.where(empty, 0.0, offset.exp())
    merged = torch.empty_like(parts[0])
    merged[:, MAX] = overall_max
    merged[:, SUMEXP] = (parts[..., SUMEXP] * scale).sum(dim=0)
    # Each block's exp-weighted logits re-measured from the overall maximum.
    merged[:, SUMEXP_Z] = (scale * (parts[..., SUMEXP_Z] + parts[..., SUMEXP] * offset)).sum(dim=0)
    merged[:, TARGET] = parts[..., TARGET].sum(dim=0)
    return merged


def summarize(
    stats: torch.Tensor,
    target_column: Optional[torch.Tensor] = None,
    target_logits: Optional[torch.Tensor] = None,
    out: Optional[SoftmaxSummary] = None,
) -> SoftmaxSummary:
    """The per-token results of the whole vocabulary's merged statistics ``[n, 4]``; with the rows'
    ``target_column``, a row whose target is ``OUTSIDE_VOCAB`` takes the largest logit as its target
    logit (its log-prob is ``max - lse``). ``target_logits [n, k]``: several targets' logits read
    apart from the statistics (``several_targets``), whose log-probs ``[n, k]`` the summary gives;
    ``z - max`` is capped at 0, where such a logit rounds an ulp above the maximum. ``out``: tensors
    each result is written into (and returned), by its last operation."""
    out = out or SoftmaxSummary(None, None, None, None, None)
    log_sumexp = stats[:, SUMEXP].log()
    spread = stats[:, SUMEXP_Z] / stats[:, SUMEXP]  # mean logit minus max, <= 0
    target = stats[:, TARGET]
    if target_column is not None:
        target = torch.where(target_column == OUTSIDE_VOCAB, stats[:, MAX], target)
    target_offset = target - stats[:, MAX]
    if target_logits is None:
        logprob = torch.sub(target_offset, log_sumexp, out=out.logprob)
    else:
        offset = (target_logits - stats[:, MAX, None]).clamp(max=0.0)
        # A target holding over half the mass is the largest logit: the maximum is its value from
        # the statistics' own product, so that its 1 - p is as exact as one target's.
        offset = torch.where(offset - log_sumexp[:, None] > -math.log(2.0), 0.0, offset)
        logprob = torch.sub(offset, log_sumexp[:, None], out=out.logprob)
    return SoftmaxSummary(
        logprob=logprob,
        entropy=torch.sub(log_sumexp, spread, out=out.entropy),
        lse=torch.add(stats[:, MAX], log_sumexp, out=out.lse),
        mean_logit=torch.add(stats[:, MAX], spread, out=out.mean_logit),
        mean_minus_target=torch.sub(spread, target_offset, out=out.mean_minus_target),
    )


def softcapped(products: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """``softcap * tanh(products / softcap)`` in place (``softcap`` ``None``: ``products`` as they
    are): the logits of a softcapped head (Gemma-2's ``final_logit_softcapping``), before the
    temperature divides them. Returns ``products``."""
    if softcap is not None:
        products.div_(softcap).tanh_().mul_(softcap)
    return products


def product_grad(
    grad: torch.Tensor, logits: Optional[torch.Tensor], temperature: torch.Tensor, softcap: Optional[float]
) -> torch.Tensor:
    """The gradient with respect to the products ``h . w`` from ``grad``, that with respect to the
    logits ``z = softcap tanh(h . w / softcap) / T``, in place: ``grad (1 - tanh^2) / T``, the tanh
    read back from ``z`` itself (``z T / softcap``, as autograd's tanh backward reads its output).
    ``logits`` as ``grad`` (a block, or the targets' logits; read with a ``softcap`` only, and then
    consumed: the slope is formed in its memory, no block more), ``temperature`` broadcast against
    both; a column left out (``-inf``) gets slope 0. Returns ``grad``."""
    if softcap is not None:
        slope = logits.mul_(temperature).div_(softcap).clamp_(-1.0, 1.0).square_().neg_().add_(1.0)
        grad.mul_(slope)
    return grad.div_(temperature)


def logit_grad(prob, mean_minus_logit, grad_logprob, grad_entropy, HAS_GRAD_LOGPROB, HAS_GRAD_ENTROPY):
    """``dz = p * (g_H * (mean - z) - g_lp)``: the gradient with respect to every logit but the
    chosen token's, which adds ``g_lp`` (``chosen_logit_grad`` gives its whole term).

    ``prob`` and ``mean_minus_logit`` are blocks, ``grad_logprob`` and ``grad_entropy`` per row and
    broadcast against them (read only where their flag is on; at least one flag is on). The same
    source runs as torch code and as a Triton function: the augmented assignments update the
    caller's blocks in place in torch (``prob``, and ``mean_minus_logit`` when the entropy term is
    on, are consumed) and rebind values in Triton.
    """
    if HAS_GRAD_ENTROPY:
        grad = mean_minus_logit
        grad *= grad_entropy
        if HAS_GRAD_LOGPROB:
            grad -= grad_logprob
        grad *= prob
    else:
        grad = prob
        grad *= -grad_logprob
    return grad


def block_logit_grad(
    logits: torch.Tensor,
    target_column: torch.Tensor,
    lse: torch.Tensor,
    mean_logit: torch.Tensor,
    grad_logprob: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    kept: Optional[torch.Tensor] = None,
    with_chosen: bool = True,
) -> torch.Tensor:
    """``dz [n, v]`` for one block of float32 logits ``[n, v]`` (``lse``, ``mean_logit`` and the
    upstream gradients ``[n]``, ``None``: no term), the chosen token's ``+g_lp`` added with a scatter
    where the block owns the target (``with_chosen``; otherwise its element is left for the caller,
    which zeroes it, ``zero_chosen``). Several targets per row: ``target_column`` and
    ``grad_logprob`` ``[n, k]``, the shared term taking their row sum and each target its own
    ``+g_lp``, in float32 before anything is rounded. ``kept [n, v]`` bool: 0 on the columns left
    out (their logits, finite or not, are never read into the result)."""
    if grad_logprob is None and grad_entropy is None:
        return torch.zeros_like(logits)
    if target_column.dim() == 1:
        target_column = target_column.unsqueeze(-1)
        grad_logprob = None if grad_logprob is None else grad_logprob.unsqueeze(-1)
    prob = torch.sub(logits, lse.unsqueeze(-1)).exp_()
    mean_minus_logit = torch.sub(mean_logit.unsqueeze(-1), logits) if grad_entropy is not None else None
    grad = logit_grad(
        prob,
        mean_minus_logit,
        grad_logprob if grad_logprob is None or grad_logprob.shape[-1] == 1 else grad_logprob.sum(-1, keepdim=True),
        None if grad_entropy is None else grad_entropy.unsqueeze(-1),
        grad_logprob is not None,
        grad_entropy is not None,
    )
    if kept is not None:
        grad.masked_fill_(~kept, 0.0)
    if grad_logprob is not None and with_chosen:
        owned = target_column >= 0
        grad.scatter_add_(-1, target_column.clamp(min=0), torch.where(owned, grad_logprob, 0.0))
    return grad


def chosen_logit_grad(
    target_column: torch.Tensor,
    summary: SoftmaxSummary,
    grad_logprob: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    index: Optional[TargetIndex] = None,
) -> torch.Tensor:
    """``dz_y [n]``, the chosen token's whole gradient term, from the merged statistics:
    ``g_lp * (1 - p_y) + g_H * p_y * (mean - z_y)`` where this shard owns the target, else 0.
    ``-expm1(logprob)`` keeps ``1 - p_y`` as accurate as the log-prob where ``p_y`` is near 1, and
    ``mean - z_y`` comes from the statistics measured from the maximum, not from a rounded block.

    Several targets per row (``target_column``, ``summary.logprob`` and ``grad_logprob`` ``[n, k]``):
    ``[n, k]``, each distinct column's whole term ``G_y (1 - p_y) - (G - G_y) p_y + g_H p_y (mean
    - z_y)`` on its first entry and 0 on its repeats, with ``G_y`` the upstream gradients of the
    entries naming it and ``G`` their row sum; ``mean - z_y = -H - logprob_y``. ``index`` (one
    target): ``TargetIndex.of(target_column)``, where the caller keeps it."""
    if target_column.dim() == 1:
        grad = None if grad_logprob is None else torch.expm1(summary.logprob).mul_(grad_logprob).neg_()
        if grad_entropy is not None:
            entropy_term = grad_entropy * summary.logprob.exp() * summary.mean_minus_target
            grad = entropy_term if grad is None else grad.add_(entropy_term)
        if grad is None:
            return torch.zeros_like(summary.logprob)
        return grad.masked_fill_((index or TargetIndex.of(target_column)).elsewhere, 0.0)
    logprob, prob = summary.logprob, summary.logprob.exp()
    same = target_column.unsqueeze(2) == target_column.unsqueeze(1)  # [n, k, k]: entries naming one column
    order = torch.arange(target_column.shape[1], device=target_column.device)
    first = ~(same & (order[None, None, :] < order[None, :, None])).any(2)
    grad = torch.zeros_like(logprob)
    if grad_logprob is not None:
        column_total = (same * grad_logprob.unsqueeze(1)).sum(2)
        grad = grad - column_total * torch.expm1(logprob) - (grad_logprob.sum(1, keepdim=True) - column_total) * prob
    if grad_entropy is not None:
        grad = grad - grad_entropy.unsqueeze(1) * prob * (summary.entropy.unsqueeze(1) + logprob)
    return torch.where(first & (target_column >= 0), grad, 0.0)


def chosen_product_grad(
    target_column: torch.Tensor,
    summary: SoftmaxSummary,
    grad_logprob: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    temperature: torch.Tensor,
    softcap: Optional[float],
    index: Optional[TargetIndex] = None,
) -> torch.Tensor:
    """``chosen_logit_grad`` taken back to the products (``product_grad``): over ``temperature``
    (``[n]`` as a column against several targets' ``[n, k]``), and with a ``softcap`` times its
    slope at each target's own logit, ``logprob + lse``."""
    grad = chosen_logit_grad(target_column, summary, grad_logprob, grad_entropy, index)
    per_row = temperature.view(-1, *[1] * (target_column.dim() - 1))
    logits = None
    if softcap is not None:
        logits = summary.logprob + (summary.lse if summary.logprob.dim() == 1 else summary.lse.unsqueeze(1))
    return product_grad(grad, logits, per_row, softcap)


def zero_chosen(block: torch.Tensor, target_column: torch.Tensor, index: Optional[TargetIndex] = None) -> None:
    """Zero the chosen token's element of each row of ``block [n, v]`` that holds its target (every
    target's, for ``target_column [n, k]``): the loss-in-forward path adds that term in float32
    instead (``chosen_logit_grad``). ``index`` (one target): ``TargetIndex.of(target_column)``,
    where the caller keeps it."""
    if target_column.dim() == 1:
        column, elsewhere = index or TargetIndex.of(target_column)
        column, elsewhere = column.unsqueeze(1), elsewhere.unsqueeze(1)
    else:
        elsewhere = target_column < 0
        # An entry of another shard (-1) names its row's largest column, one of the zeroed targets, or
        # where the row has none here column 0, written back as it is: no two writes of one element differ.
        column = torch.where(elsewhere, target_column.amax(1, keepdim=True), target_column).clamp(min=0)
        elsewhere = elsewhere.all(1, keepdim=True)
    # One target: a row without one here writes its column 0 back as it is.
    block.scatter_(1, column, torch.where(elsewhere, block.gather(1, column), 0))
