"""Ready-made per-token losses for ``fused_linear_loss`` (and ``FusedLMHead.loss``).

Each is a ``loss_fn(logprob, entropy, **inputs) -> [rows]``: one loss per token, computed from
that token's float32 log-prob ``logprob_t`` and entropy ``H_t`` and its per-token inputs. The
loss of a batch is their sum, so any normalization (a token mean, a per-sequence mean) is a
per-token weight ``w_t`` passed among the inputs (``token_mean_weights`` makes the usual one).
Each declares ``entropy_grad``, whether its value depends on the entropy, which saves
``fused_linear_loss`` a probe of the function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from .inputs import check_on_device

Tensor = torch.Tensor

# The log-ratio against the old policy is clamped to +-LOG_RATIO_LIMIT before exp, so that one
# far off-policy token cannot overflow the ratio (its gradient is then 0, as in common trainers).
LOG_RATIO_LIMIT = 20.0
KL_ESTIMATORS = ("k1", "k2", "k3")


def token_mean_weights(loss_mask: Tensor) -> Tensor:
    """Per-token weights ``w_t = mask_t / max(1, sum(mask))`` (float32, ``loss_mask``'s shape): the
    sum of ``w_t * loss_t`` is the mean over the masked tokens. No host synchronization."""
    mask = loss_mask.float()
    return mask / mask.sum().clamp(min=1.0)


def cross_entropy(logprob: Tensor, entropy: Tensor, *, weight: Tensor) -> Tensor:
    """SFT token cross-entropy: ``loss_t = -w_t * logprob_t``.

    ``weight [rows]``: per-token weights, e.g. ``token_mean_weights(loss_mask)`` for the mean
    cross-entropy over the masked tokens, or the loss mask itself for their sum. One target per
    row (``ValueError`` for several: their losses are the caller's to combine).
    """
    return _cross_entropy_terms(logprob, weight)[0]


def _cross_entropy_terms(logprob: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(losses, d losses / d logprob)`` of ``cross_entropy``."""
    if logprob.dim() != 1:
        raise ValueError(f"cross_entropy takes one target per row, got log-probs {tuple(logprob.shape)}")
    grad = -weight
    return grad * logprob, grad


cross_entropy.entropy_grad = False
# Its losses with their per-token gradients (d loss / d logprob, d loss / d entropy) in closed form,
# which the three-GEMM pass takes instead of autograd's (``loss_pass.chunks.ChunkLoss``): fewer launches.
cross_entropy.with_grads = lambda logprob, entropy, *, weight: (*_cross_entropy_terms(logprob, weight), None)


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of ``KL(policy || reference)`` from the sampled token, with
    ``d_t = ref_logprob_t - logprob_t``: ``k1 = -d``, ``k2 = d**2 / 2``, ``k3 = exp(d) - d - 1``."""
    log_ratio = ref_logprob - logprob
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def kl_penalty_grad(logprob: Tensor, ref_logprob: Tensor, estimator: str) -> Tensor:
    """``d kl_penalty / d logprob``: ``1``, ``-d`` and ``-expm1(d)`` for k1, k2 and k3."""
    log_ratio = ref_logprob - logprob
    if estimator == "k1":
        return torch.ones_like(log_ratio)
    if estimator == "k2":
        return -log_ratio
    return -torch.expm1(log_ratio)


@dataclass(frozen=True)
class ClippedPolicyLoss:
    """The PPO / GRPO / DAPO clipped policy loss with optional entropy bonus and KL penalty.

    Per token, with ``r_t = exp(logprob_t - old_logprob_t)`` and advantage ``A_t``::

        pg_t   = max(-A_t * r_t, -A_t * clip(r_t, 1 - clip_low, 1 + clip_high))
        pg_t   = min(pg_t, -A_t * dual_clip)            where A_t < 0, if dual_clip is set
        loss_t = w_t * (pg_t - entropy_coef * H_t + kl_coef * KL_t)

    ``KL_t`` is ``kl_penalty(logprob_t, ref_logprob_t, kl_estimator)``. DAPO's asymmetric clip is
    ``clip_high > clip_low``; its token-level mean is ``w_t = token_mean_weights(response_mask)``.

    Call it as ``loss_fn(logprob, entropy, old_logprob=..., advantages=..., weight=...,
    ref_logprob=...)``: every input ``[rows]``; ``ref_logprob`` is needed when ``kl_coef != 0``.
    Without ``old_logprob`` the step is on-policy: the old log-probs are the current ones, detached
    (``r_t = 1`` with ``d r_t / d logprob_t = 1``), as trainers take them when they skip the old
    log-prob pass for a single update per rollout (slime's reuse of the loss pass's log-probs).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"

    @property
    def entropy_grad(self) -> bool:
        """Whether the loss depends on the entropy: with an entropy bonus."""
        return self.entropy_coef != 0

    def __post_init__(self):
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")

    def with_grads(
        self,
        logprob: Tensor,
        entropy: Tensor,
        *,
        advantages: Tensor,
        weight: Tensor,
        old_logprob: Optional[Tensor] = None,
        ref_logprob: Optional[Tensor] = None,
    ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """``(losses, d losses / d logprob, d losses / d entropy or None)`` per token in closed form,
        what the three-GEMM pass takes instead of autograd's (fewer launches): the derivatives of
        ``__call__``'s values, whose ``torch.where`` picks the side whose derivative this takes."""
        inputs = dict(advantages=advantages, weight=weight, old_logprob=old_logprob, ref_logprob=ref_logprob)
        return self._terms(logprob, entropy, inputs, grads=True)

    def __call__(
        self,
        logprob: Tensor,
        entropy: Tensor,
        *,
        advantages: Tensor,
        weight: Tensor,
        old_logprob: Optional[Tensor] = None,
        ref_logprob: Optional[Tensor] = None,
    ) -> Tensor:
        inputs = dict(advantages=advantages, weight=weight, old_logprob=old_logprob, ref_logprob=ref_logprob)
        return self._terms(logprob, entropy, inputs, grads=False)[0]

    def _terms(self, logprob: Tensor, entropy: Tensor, inputs: dict, *, grads: bool):
        """The losses (differentiable by autograd) and, with ``grads``, their closed-form derivatives
        along ``logprob`` and ``entropy``; ``inputs`` the loss inputs by name."""
        advantages, weight, old_logprob, ref_logprob = (
            inputs[name] for name in ("advantages", "weight", "old_logprob", "ref_logprob")
        )
        # On-policy without old log-probs: a ratio of 1 whose derivative is 1.
        raw = logprob - (logprob.detach() if old_logprob is None else old_logprob)
        limited = raw.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        ratio = limited.exp()
        negated = -advantages  # once for both sides and the gradient
        unclipped, clipped = negated * ratio, negated * ratio.clamp(1 - self.clip_low, 1 + self.clip_high)
        # The clipped side wins only off the clip range (inside it the sides are equal), where its
        # derivative is 0; a tie or a NaN takes the unclipped side, as autograd of this value does.
        clipped_wins = unclipped < clipped
        loss = torch.where(clipped_wins, clipped, unclipped)
        capped = None
        if self.dual_clip is not None:
            bound = negated * self.dual_clip
            capped = (advantages < 0) & (loss > bound)
            loss = torch.where(capped, bound, loss)
        grad = grad_entropy = None
        if grads:
            # d unclipped / d logprob is unclipped itself, passed by the clamp inside its limits only.
            grad = torch.where(clipped_wins, 0.0, torch.where(limited == raw, unclipped, 0.0))
            grad = grad if capped is None else torch.where(capped, 0.0, grad)
        if self.entropy_coef:
            loss = torch.sub(loss, entropy, alpha=self.entropy_coef)
            grad_entropy = -self.entropy_coef * weight if grads else None
        if self.kl_coef:
            if ref_logprob is None:
                raise ValueError("ClippedPolicyLoss with kl_coef != 0 needs ref_logprob among the loss inputs")
            loss = loss + self.kl_coef * kl_penalty(logprob, ref_logprob, self.kl_estimator)
            if grads:
                grad = grad + self.kl_coef * kl_penalty_grad(logprob, ref_logprob, self.kl_estimator)
        return weight * loss, None if grad is None else weight * grad, grad_entropy


DIVERGENCES = ("forward", "reverse")
# How far a teacher's log-probs may lie above 0, and the log of their mass over the k ids above
# log 1: the bf16 rounding of log-probs near 0 and of a mass spread over the ids, with room to spare;
# raw logits and probabilities miss it by far.
TEACHER_TOLERANCE = 1e-2
REMAINDERS = ("renormalize", "tail")


@dataclass(frozen=True)
class TopkDistillation:
    """Top-k distillation: the student's log-probs at a teacher's top-k ids against the teacher's.

    Call ``fused_linear_loss(hidden, weight, teacher_ids, TopkDistillation(...), loss_inputs=
    {"teacher_logprob": ..., "weight": ...})`` with ``teacher_ids [..., k]`` (distinct ids per row,
    as ``head.topk`` / ``fused_linear_topk`` give them) and ``teacher_logprob [..., k]`` their
    log-probs under the teacher, normalized over its whole vocabulary (each at most 0, their
    exponentials summing to at most 1 per row, within ``TEACHER_TOLERANCE``). The ops check both
    and the ids' distinctness (``check_inputs``) on the device, without a host synchronization. Per token, with the
    student's ``p_j = exp(logprob_j)`` and the teacher's ``q_j`` on the ``k`` ids and the rest of
    each distribution ``P = 1 - sum_j p_j``, ``Q = 1 - sum_j q_j``::

        remainder="renormalize" (both distributions renormalized over the k ids):
            p^_j = p_j / sum_i p_i,   q^_j = q_j / sum_i q_i
            forward: KL_t = sum_j q^_j (log q^_j - log p^_j)       reverse: sum_j p^_j (log p^_j - log q^_j)
        remainder="tail" (the rest of each distribution as one outcome more):
            forward: KL_t = sum_j q_j (log q_j - log p_j) + Q (log Q - log P)
            reverse: KL_t = sum_j p_j (log p_j - log q_j) + P (log P - log Q)
        loss_t = w_t * KL_t

    ``"renormalize"`` matches the student to the teacher's shape on its top-k alone; ``"tail"``
    also matches the mass each puts outside them. Computed in float64 from the float32 log-probs
    (``P = -expm1(logsumexp(logprob))``), so the rest of the mass is as accurate as they are: about
    1e-7 absolute, which a student holding all but 1e-6 outside its top-k resolves to about 10 %.
    An id with log-prob -inf (probability 0) adds 0 where it weighs the sum (``0 log 0 = 0``); a
    row whose teacher log-probs are all -inf (padding) must be left out with ``mask``. The
    student's entropy is not used.
    """

    divergence: str = "forward"
    remainder: str = "renormalize"
    entropy_grad = False  # a class attribute: fused_linear_loss needs no probe

    def __post_init__(self):
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        if self.remainder not in REMAINDERS:
            raise ValueError(f"remainder must be one of {REMAINDERS}, got {self.remainder!r}")

    def check_inputs(self, targets: Tensor, inputs: Dict[str, Tensor], mask: Optional[Tensor]) -> None:
        """The ops' check of ``targets [rows, k]`` and ``inputs["teacher_logprob"] [rows, k]`` on the
        rows ``mask [rows]`` computes (every row without one), on the device."""
        teacher = inputs.get("teacher_logprob")
        if teacher is None or targets.dim() != 2 or teacher.shape != targets.shape:
            return  # __call__ names what is missing
        ordered = targets.sort(-1).values
        distinct = (ordered[:, 1:] != ordered[:, :-1]).all(-1)
        normalized = (teacher <= TEACHER_TOLERANCE).all(-1) & (teacher.float().logsumexp(-1) <= TEACHER_TOLERANCE)
        if mask is not None:  # rows left out are never read (padding)
            distinct, normalized = distinct | ~mask, normalized | ~mask
        check_on_device(
            normalized.all(),
            "TopkDistillation's teacher_logprob must be log-probabilities: each at most 0 and their exponentials summing "
            f"to at most 1 in each row (tolerance {TEACHER_TOLERANCE}); raw logits or probabilities give wrong losses",
        )
        check_on_device(
            distinct.all(),
            "TopkDistillation needs distinct teacher ids in each row (as head.topk gives them); one repeats",
        )

    def __call__(self, logprob: Tensor, entropy: Tensor, *, teacher_logprob: Tensor, weight: Tensor) -> Tensor:
        if logprob.dim() != 2 or teacher_logprob.shape != logprob.shape:
            raise ValueError(
                f"TopkDistillation takes the student's log-probs [rows, k] at the teacher's ids (targets [..., k]) and "
                f"teacher_logprob of that shape; got {tuple(logprob.shape)} and {tuple(teacher_logprob.shape)}"
            )
        # Float64: the rest of the mass 1 - sum p is a difference of numbers near 1.
        student, teacher = logprob.double(), teacher_logprob.double()

        if self.remainder == "renormalize":
            student = student - student.logsumexp(-1, keepdim=True)
            teacher = teacher - teacher.logsumexp(-1, keepdim=True)
        # KL(first || second): first = the teacher (forward) or the student (reverse).
        first, second = (teacher, student) if self.divergence == "forward" else (student, teacher)
        kl = torch.where(first == -torch.inf, 0.0, first.exp() * (first - second)).sum(-1)
        if self.remainder == "tail":
            # Rounding can leave a rest a hair below 0: it counts as the smallest positive mass.
            tiny = torch.finfo(torch.float64).tiny
            rest_first, rest_second = (
                (-torch.expm1(values.logsumexp(-1))).clamp(min=tiny) for values in (first, second)
            )
            kl = kl + rest_first * (rest_first.log() - rest_second.log())
        return weight * kl.to(logprob.dtype)
