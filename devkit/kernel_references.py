"""Torch forms of the Triton loss-in-forward pass's reference steps, which the kernels
``kernels/reference_kernel.row_references`` and ``kernels/merge_kernel.merge_parts`` (its stale check)
follow: the tests hold each kernel to its torch form, and the bounds to float64. The rule and its
bounds are ``megatron_fused_lm.ops.backends.triton_reference``'s."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_fused_lm.ops.backends.triton_reference import (
    EMPTY_REFERENCE,
    MAX_ABOVE_REFERENCE,
    MAX_BELOW_REFERENCE,
    REFERENCE_HEADROOM,
)
from megatron_fused_lm.ops.products import float32_product
from megatron_fused_lm.ops.softmax import softcapped


def torch_row_references(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_column: torch.Tensor,
    temperature: torch.Tensor,
    sample_rows: int,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """``r [n]``: the largest logit among ``sample_rows`` evenly spaced rows of the shard and the
    row's chosen token (where ``target_column >= 0``), softcapped (``softcap``; ``None``: none) and
    divided by the row's temperature, plus ``REFERENCE_HEADROOM``.

    ``hidden [n, H]``, ``weight [V, H]`` (one dtype), ``target_column [n]`` int64 (-1: another
    shard's), ``temperature [n]``. An estimate: ``torch_stale_references`` checks it once the statistics are known.
    """
    sampled = weight[:: -(-weight.shape[0] // sample_rows)]
    estimate = float32_product(hidden, sampled.t()).amax(dim=1)
    chosen_logit = (hidden * weight[target_column.clamp(min=0)]).sum(dim=1, dtype=torch.float32)
    estimate = torch.where(target_column >= 0, torch.maximum(estimate, chosen_logit), estimate)
    return softcapped(estimate, softcap).div_(temperature).add_(REFERENCE_HEADROOM)


def torch_stale_references(reference: torch.Tensor, local_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
