"""The ops: fused and unfused per-token log-probs, entropy and losses over a vocabulary-parallel
LM head.

They know nothing about Megatron: a tensor-parallel group, if any, is a plain process group.
The log-prob ops run as PyTorch custom operators (``torch.ops.megatron_fused_lm``, see
``library``); the loss ops (``loss``) take a Python ``loss_fn`` and run as autograd functions.
"""

from . import losses
from .backends import BACKENDS
from .fused import fused_linear_logprob
from .logits import logits_logprob, logits_loss
from .loss import FusedLoss, fused_linear_cross_entropy, fused_linear_loss

__all__ = [
    "BACKENDS",
    "FusedLoss",
    "fused_linear_cross_entropy",
    "fused_linear_logprob",
    "fused_linear_loss",
    "logits_logprob",
    "logits_loss",
    "losses",
]
