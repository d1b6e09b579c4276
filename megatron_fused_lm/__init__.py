"""megatron-fused-lm: per-token log-probs, entropy and cross-entropy straight from the LM head's
hidden states and weight shard, without materializing the ``[tokens, vocab/TP]`` logits."""

from .ops import BACKENDS, FusedLinearLogprob, fused_linear_logprob, logits_logprob
from .packing import next_token_targets, response_mask, split_responses

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "FusedLinearLogprob",
    "fused_linear_logprob",
    "logits_logprob",
    "next_token_targets",
    "response_mask",
    "split_responses",
]
