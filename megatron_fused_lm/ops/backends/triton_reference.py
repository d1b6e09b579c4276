"""How the loss-in-forward pass keeps a chunk's logits from its statistics to its gradient, the
stored block (``docs/DESIGN.md``, "The stored block": why each form, and why these bounds):

- exponentials ``exp(z - r)`` against one reference ``r`` per row, chosen before the logits exist,
  and the check that catches a reference that proved too low; the products can read a block of
  the weight's dtype as it is when the loss has no entropy term;
- offsets ``z - m`` in float16 from each (row, column tile)'s exact maximum ``m`` (float32, stored
  beside the block), from which the ``dz`` kernel reads each logit back to within its offset's
  rounding: a row's largest logits, the ones an entropy term needs to float32 precision, exactly.

Shapes: ``n`` rows of the chunk; ``[n]`` tensors are float32 unless stated.
"""

from __future__ import annotations

import torch

from ..products import float32_product

REFERENCE_HEADROOM = 20.0
MAX_ABOVE_REFERENCE = 32.0
# Without kept sets a shard's maximum is at least the estimate, REFERENCE_HEADROOM below the
# reference; this bound leaves that margin twice, and the row's largest exponentials far from
# bfloat16's smallest normal (exp(-87)).
MAX_BELOW_REFERENCE = 2 * REFERENCE_HEADROOM
# The reference of a row this shard keeps no column of: exp(reference - lse) is 0 for any lse a
# model's logits give, and mean - reference stays finite.
EMPTY_REFERENCE = -1e4


def stored_dtype(weight_dtype: torch.dtype, entropy_grad: bool) -> torch.dtype:
    """The block's dtype, which names its form (``softmax_stats_kernel.stores_offsets``): float32 exponentials for float32
    operands; the weight's dtype, exponentials the products read as they are, for a bfloat16 weight
    and no entropy term; float16 offsets otherwise (an entropy term reads each logit back, and
    float16's exponent range is too narrow for exponentials against a per-row reference)."""
    if weight_dtype == torch.float32:
        return torch.float32
    if entropy_grad or weight_dtype == torch.float16:
        return torch.float16
    return weight_dtype


def row_references(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_column: torch.Tensor,
    temperature: torch.Tensor,
    sample_rows: int,
) -> torch.Tensor:
    """``r [n]``: the largest logit among ``sample_rows`` evenly spaced rows of the shard and the
    row's chosen token (where ``target_column >= 0``), divided by the row's temperature, plus
    ``REFERENCE_HEADROOM``.

    ``hidden [n, H]``, ``weight [V, H]`` (one dtype), ``target_column [n]`` int64 (-1: another
    shard's), ``temperature [n]``. An estimate: ``stale_references`` checks it once the statistics are known.
    """
    sampled = weight[:: -(-weight.shape[0] // sample_rows)]
    estimate = float32_product(hidden, sampled.t()).amax(dim=1)
    chosen_logit = (hidden * weight[target_column.clamp(min=0)]).sum(dim=1, dtype=torch.float32)
    estimate = torch.where(target_column >= 0, torch.maximum(estimate, chosen_logit), estimate)
    return estimate.div_(temperature).add_(REFERENCE_HEADROOM)


def stale_references(reference: torch.Tensor, local_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(reference, refresh)``: the rows whose shard maximum ``local_max [n]`` lies more than
    ``MAX_ABOVE_REFERENCE`` above their reference, or more than ``MAX_BELOW_REFERENCE`` below it
    (a kept set that leaves the sampled rows' largest logits out), get the maximum as their
    reference and ``refresh = 1`` (int8 ``[n]``); the others keep theirs. A shard keeping none of
    a row's columns (maximum -inf) stored zeros, which stay right, and gets ``EMPTY_REFERENCE``: the
    sampled one may lie far above the row's ``lse``, where ``exp(reference - lse)`` would overflow
    and meet the zeros as NaN."""
    empty = local_max == -torch.inf
    too_low = (local_max < reference - MAX_BELOW_REFERENCE) & ~empty
    stale = (local_max > reference + MAX_ABOVE_REFERENCE) | too_low
    reference = torch.where(stale, local_max, reference)
    return torch.where(empty, EMPTY_REFERENCE, reference), stale.to(torch.int8)
