"""The ops: fused and unfused per-token log-probs and entropy over a vocabulary-parallel LM head.

They know nothing about Megatron: a tensor-parallel group, if any, is a plain process group.
Both run as PyTorch custom operators (``torch.ops.megatron_fused_lm``, see ``library``).
"""

from .backends import BACKENDS
from .fused import fused_linear_logprob
from .logits import logits_logprob

__all__ = ["BACKENDS", "fused_linear_logprob", "logits_logprob"]
