"""How the loss-in-forward pass keeps a chunk's logits from its statistics to its gradient, the
stored block (``docs/DESIGN.md``, "The stored block": why each form, and why these bounds):

- exponentials ``exp(z - r)`` against one reference ``r`` per row, chosen before the logits exist
  (``kernels/reference_kernel``), and the check that catches a reference that proved too low
  (``kernels/merge_kernel``); the products can read a block of
  the weight's dtype as it is when the loss has no entropy term;
- offsets ``z - m`` in float16 from each (row, column tile)'s exact maximum ``m`` (float32, stored
  beside the block), from which the ``dz`` kernel reads each logit back to within its offset's
  rounding: a row's largest logits, the ones an entropy term needs to float32 precision, exactly.

Shapes: ``n`` rows of the chunk; ``[n]`` tensors are float32 unless stated.
"""

from __future__ import annotations

import torch

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
