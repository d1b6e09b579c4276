"""The reference against which the loss-in-forward pass stores each row's logits as
``exp(z - reference)``, and the check that catches a reference that proved too low
(``docs/DESIGN.md``, "The stored block": why one reference per row, and why these bounds).

Shapes: ``n`` rows of the chunk; ``[n]`` tensors are float32 unless stated.
"""

from __future__ import annotations

import torch

from ..products import float32_product

REFERENCE_HEADROOM = 20.0
MAX_ABOVE_REFERENCE = 32.0


def stored_dtype(weight_dtype: torch.dtype, entropy_grad: bool) -> torch.dtype:
    """The block's dtype (``docs/DESIGN.md``, "The stored block"): the weight's where the products
    read the block itself (bfloat16 or float32 operands, no entropy term); float32 where the entropy
    term reads each logit back from it (``log e`` must keep float32's precision) or where the
    weight is float16, whose exponent range is too narrow for a per-row reference. A float32 block
    of 16-bit operands gets ``dz`` formed into a block of the weight's dtype."""
    return torch.float32 if entropy_grad or weight_dtype == torch.float16 else weight_dtype


def row_references(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_column: torch.Tensor,
    inv_temperature: float,
    sample_rows: int,
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
