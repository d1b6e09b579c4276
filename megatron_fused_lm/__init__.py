"""megatron-fused-lm: per-token log-probs, entropy and losses straight from the LM head's hidden
states and weight shard, without the ``[tokens, vocab/TP]`` logits. The ops and packing helpers need
only torch; the Megatron-Core integration's names are imported on first use.
"""

# The ops' public names are the package's.
from .ops import *  # noqa: F403
from .ops import __all__ as _OPS_NAMES
from .packing import (
    context_parallel_gather,
    context_parallel_positions,
    context_parallel_sum,
    next_token_targets,
    response_mask,
    split_responses,
)

__version__ = "0.1.0"

# The integration's names (``integration.__all__``): the wrapper's and the output_processor hook's.
_INTEGRATION_NAMES = (
    "FusedLMConfig",
    "FusedLMHead",
    "FusedOutputProcessor",
    "LabelsRequest",
    "LogprobRequest",
    "LossRequest",
    "TopkRequest",
    "accepts_output_processor",
    "fused_head_of",
    "tie_to_forward",
    "unwrap_model",
    "wrap_model",
)

__all__ = [
    *_OPS_NAMES,
    "context_parallel_gather",
    "context_parallel_positions",
    "context_parallel_sum",
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
