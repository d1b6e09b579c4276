"""megatron-fused-lm: per-token log-probs, entropy and cross-entropy straight from the LM head's
hidden states and weight shard, without materializing the ``[tokens, vocab/TP]`` logits.

The ops (``fused_linear_logprob``, ``logits_logprob``) and the packed-sequence helpers need only
torch; the Megatron-Core integration (``FusedLMConfig``, ``wrap_model``, ...) is imported on first
use, so the ops do not pay for importing megatron-core.
"""

from .ops import BACKENDS, fused_linear_logprob, logits_logprob
from .packing import next_token_targets, response_mask, split_responses

__version__ = "0.1.0"

_INTEGRATION_NAMES = ("FusedLMConfig", "FusedLMHead", "unwrap_model", "wrap_model")

__all__ = [
    "BACKENDS",
    "fused_linear_logprob",
    "logits_logprob",
    "next_token_targets",
    "response_mask",
    "split_responses",
    *_INTEGRATION_NAMES,
]


def __getattr__(name):
    if name in _INTEGRATION_NAMES:
        from . import integration

        return getattr(integration, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
