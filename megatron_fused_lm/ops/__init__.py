"""The ops: fused and unfused per-token log-probs, entropy and losses over a vocabulary-parallel
LM head. They know nothing about Megatron: a tensor-parallel group, if any, is a plain process
group. ``docs/DESIGN.md`` has the layout by execution path and the math."""

from . import losses
from .api import (
    FusedLoss,
    fused_linear_cross_entropy,
    fused_linear_logprob,
    fused_linear_loss,
    logits_logprob,
    logits_loss,
)
from .kept_tokens import KeptTokens
from .loss_pass.chunks import LossFn
from .loss_pass.weight_grad import name_weight_grad_into, outstanding_weight_grads, weight_grad_corrections
from .options import BACKENDS, resolved_backend
from .rank_check import RanksDisagree, check_ranks_agree
from .topk import fused_linear_topk, logits_topk

__all__ = [
    "BACKENDS",
    "FusedLoss",
    "KeptTokens",
    "LossFn",
    "RanksDisagree",
    "check_ranks_agree",
    "fused_linear_cross_entropy",
    "fused_linear_logprob",
    "fused_linear_loss",
    "fused_linear_topk",
    "logits_logprob",
    "logits_loss",
    "logits_topk",
    "losses",
    "name_weight_grad_into",
    "outstanding_weight_grads",
    "resolved_backend",
    "weight_grad_corrections",
]
