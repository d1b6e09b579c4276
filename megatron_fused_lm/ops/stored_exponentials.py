"""The block the Triton three-GEMM path stores per token chunk: each logit as ``e = exp(z - r)``
against one reference ``r`` per row, and what turns that block into the logits' gradient.

With ``p = e * exp(r - lse)``, a loss without an entropy term has

    dz = g * (1[v = y] - p) = f * e   for every column but the chosen token's,   f = -g * exp(r - lse),

so once the chosen token's element is zeroed, the two gradient products read the stored block as
it is: ``grad_hidden = f * (e @ W) + c * W_y`` and ``grad_weight = e.T @ (f * h)`` plus ``c * h`` in
row ``y``, with the chosen token's ``c = g * (1 - p_y)`` added in float32. No pass over
``[tokens, vocab]`` forms ``dz``. That term is each row's largest (most of both gradients' norm),
so it is kept out of the 16-bit operands (``stored_gradients.take_chosen``). With an entropy term
``dz`` is not a per-row multiple of ``e``, and ``stored_grad_kernel`` forms it.

The reference is chosen before the logits exist, from a sample of the shard's rows and the chosen
token's row: ``r = max(sampled logits) + REFERENCE_HEADROOM``. It must keep the row's maximum ``M``
from straying far from ``r`` either way:

- below: the sampled maximum is at most ``M``, so ``r <= M + REFERENCE_HEADROOM``: the top
  exponentials are at least ``exp(-REFERENCE_HEADROOM)``, normal numbers, and what underflows
  (``z < r - 87``) has ``p < exp(REFERENCE_HEADROOM - 87)``;
- above: a row whose maximum lies more than ``MAX_ABOVE_REFERENCE`` above ``r`` (the sample
  missed a far larger logit) is stored again against ``M`` (``refresh_stored_exp``), so no
  exponential exceeds ``exp(MAX_ABOVE_REFERENCE)`` and the products and the factor ``f`` stay far
  from float32's and bfloat16's limits (``exp(+-88)``).

Shapes: ``n`` rows of the chunk; ``[n]`` tensors are float32 unless stated.
"""

from __future__ import annotations

from typing import Optional

import torch

from .products import float32_product

REFERENCE_ROWS = 512  # weight rows sampled for the reference (plus the chosen token's)
REFERENCE_HEADROOM = 20.0
MAX_ABOVE_REFERENCE = 32.0


def stored_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The block's dtype: one with float32's exponent range. bfloat16 and float32 operands keep the
    block in their own dtype, so the products can read it; float16's exponent range is too narrow
    for a per-row reference, so its block is float32 and ``dz`` is formed into a float16 block."""
    return torch.float32 if weight_dtype == torch.float16 else weight_dtype


def row_references(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_column: torch.Tensor,
    inv_temperature: float,
    sample_rows: int = REFERENCE_ROWS,
) -> torch.Tensor:
    """``r [n]``: the largest logit among ``sample_rows`` evenly spaced rows of the shard and the
    row's chosen token (where ``target_column >= 0``), plus ``REFERENCE_HEADROOM``.

    ``hidden [n, H]``, ``weight [V, H]`` (one dtype), ``target_column [n]`` int64 (-1: another
    shard's). An estimate: ``stale_references`` checks it once the statistics are known.
    """
    sampled = weight[:: -(-weight.shape[0] // sample_rows)]
    estimate = float32_product(hidden, sampled.t()).amax(dim=1)
    chosen_logit = (hidden * weight[target_column.clamp(min=0)]).sum(dim=1, dtype=torch.float32)
    estimate = torch.where(target_column >= 0, torch.maximum(estimate, chosen_logit), estimate)
    return estimate.mul_(inv_temperature).add_(REFERENCE_HEADROOM)


def stale_references(reference: torch.Tensor, local_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(reference, refresh)``: the rows whose shard maximum ``local_max [n]`` lies more than
    ``MAX_ABOVE_REFERENCE`` above their reference get the maximum as their reference and
    ``refresh = 1`` (int8 ``[n]``); the others keep theirs."""
    stale = local_max > reference + MAX_ABOVE_REFERENCE
    return torch.where(stale, local_max, reference), stale.to(torch.int8)


def chosen_token_grad(
    target_column: torch.Tensor,
    target_logit: torch.Tensor,
    lse: torch.Tensor,
    grad_logprob: Optional[torch.Tensor],
    inv_temperature: float,
) -> torch.Tensor:
    """``dz_y / T = g * (1 - p_y) / T [n]`` on the rows whose target this shard owns, 0 elsewhere;
    ``target_logit [n]`` is ``z_y`` there. ``expm1`` keeps ``1 - p_y`` as accurate as the log-prob
    where ``p_y`` is near 1."""
    if grad_logprob is None:
        return torch.zeros_like(lse)
    chosen = torch.expm1(target_logit - lse).mul_(grad_logprob).mul_(-inv_temperature)
    return torch.where(target_column >= 0, chosen, 0.0)


def row_factor(
    grad_logprob: Optional[torch.Tensor], lse: torch.Tensor, reference: torch.Tensor, inv_temperature: float
) -> torch.Tensor:
    """``f / T [n]``: the per-row factor that turns the block into ``dz / T``, the chosen token
    aside (zero when the loss does not depend on the log-probs)."""
    if grad_logprob is None:
        return torch.zeros_like(lse)
    return torch.exp(reference - lse).mul_(grad_logprob).mul_(-inv_temperature)
