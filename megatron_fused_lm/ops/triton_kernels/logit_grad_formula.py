"""The logit gradient both gradient kernels write, as one Triton function they inline.

For the per-token upstream gradients ``g_lp`` (of the log-prob) and ``g_H`` (of the entropy), a
tile of probabilities ``p`` and of ``mean - z`` gives

    dz = g_lp * (1[v = y] - p) + g_H * p * (mean - z)

(with respect to ``z``, the logits after the temperature), the same formula as
``softmax_stats.logit_grad`` of the torch backend.
"""

import triton
import triton.language as tl


@triton.jit
def logit_grad_tile(
    prob,
    mean_minus_logit,
    is_target,
    grad_logprob,
    grad_entropy,
    HAS_GRAD_LOGPROB: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
):
    """``dz [BLOCK_M, BLOCK_N]`` float32 from ``prob`` and ``mean_minus_logit`` (both
    ``[BLOCK_M, BLOCK_N]``), ``is_target`` (bool, same shape) and the rows' ``grad_logprob`` and
    ``grad_entropy`` (``[BLOCK_M]``; ignored where their flag is off)."""
    grad = prob * 0.0
    if HAS_GRAD_ENTROPY:
        grad = prob * mean_minus_logit * grad_entropy[:, None]
    if HAS_GRAD_LOGPROB:
        grad += grad_logprob[:, None] * (tl.where(is_target, 1.0, 0.0) - prob)
    return grad
