"""The float64 oracle: log-probs, entropy, per-token losses and their gradients by plain
``log_softmax`` and autograd, written independently of the package's own formulas; and the error
measures that compare with it."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class Reference(NamedTuple):
    """Float64 results; the gradients are ``None`` when no upstream gradient was given."""

    logprob: torch.Tensor  # [...] ([..., k] for several targets per row)
    entropy: torch.Tensor  # [...]
    grad_hidden: Optional[torch.Tensor] = None  # [..., H] (or the logits' gradient [..., V])
    grad_weight: Optional[torch.Tensor] = None  # [V, H] (None for a logits reference)

    @property
    def grad_logits(self) -> Optional[torch.Tensor]:
        """The gradient with respect to the logits, for a ``reference_from_logits``."""
        return self.grad_hidden


def logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature=1.0, kept=None, out_of_vocab="error"):
    """Float64 ``(logprob, entropy [...])`` of ``targets`` under ``softmax(logits [..., V] / T)``:
    ``targets [...]`` one per row (``logprob [...]``) or ``[..., k]`` several (``logprob [..., k]``);
    ``temperature`` a number or a tensor ``[...]`` (one per row); ``kept [..., V]`` bool: the
    softmax over each row's kept columns alone. ``out_of_vocab="max_logit"``: a target outside
    ``[0, V)`` scores as its row's largest scaled logit, a constant to autograd (Megatron's
    vocabulary-parallel cross-entropy, where no rank owns it); ``"error"``: it fails the gather."""
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.double().unsqueeze(-1)
    scaled = logits.double() / temperature
    if kept is not None:  # a finite stand-in for -inf: p = 0 exactly, and no 0 * inf in autograd
        scaled = torch.where(kept, scaled, -1e300)
    log_probs = torch.log_softmax(scaled, dim=-1)
    several = targets.dim() == logits.dim()
    index = targets.long() if several else targets.long().unsqueeze(-1)
    if out_of_vocab == "max_logit":
        vocab = logits.shape[-1]
        largest = scaled.detach().amax(-1, keepdim=True) - torch.logsumexp(scaled, -1, keepdim=True)
        logprob = torch.where((index < 0) | (index >= vocab), largest, log_probs.gather(-1, index.clamp(0, vocab - 1)))
    else:
        logprob = log_probs.gather(-1, index)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprob if several else logprob.squeeze(-1), entropy


def capped(logits: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """Gemma-2's logit softcapping, ``softcap * tanh(logits / softcap)`` (``None``: the logits)."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def _reference(
    logits_of, inputs, targets, temperature, grad_logprob, grad_entropy, kept=None, out_of_vocab="error"
) -> Reference:
    """``logits_of(*leaves)`` on float64 leaves made from ``inputs``; the gradients of the upstream
    loss with respect to those leaves, given any upstream gradient."""
    leaves = [tensor.detach().double().requires_grad_() for tensor in inputs]
    logprob, entropy = logprob_entropy(logits_of(*leaves), targets, temperature, kept, out_of_vocab)
    upstream = [(value, grad) for value, grad in ((logprob, grad_logprob), (entropy, grad_entropy)) if grad is not None]
    if not upstream:
        return Reference(logprob.detach(), entropy.detach())
    loss = sum((value * grad.double()).sum() for value, grad in upstream)
    return Reference(logprob.detach(), entropy.detach(), *torch.autograd.grad(loss, leaves))


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature=1.0,
    grad_logprob: Optional[torch.Tensor] = None,
    grad_entropy: Optional[torch.Tensor] = None,
    kept: Optional[torch.Tensor] = None,
    out_of_vocab: str = "error",
    softcap: Optional[float] = None,
) -> Reference:
    """Log-probs and entropy of ``targets [...]`` (or ``[..., k]``, as ``logprob_entropy``) under
    ``softmax(capped(hidden [..., H] @ weight.T, softcap) / T)`` (``T`` a number or a tensor ``[...]``)
    over the whole vocabulary ``weight [V, H]`` (``kept [..., V]`` bool: each row's kept columns;
    ``out_of_vocab`` as ``logprob_entropy``'s); given upstream gradients (of the log-probs' and the
    entropy's shapes), the gradients of ``sum(logprob * grad_logprob + entropy * grad_entropy)``
    with respect to hidden and weight."""
    return _reference(
        lambda h, w: capped(h @ w.t(), softcap),
        (hidden, weight),
        targets,
        temperature,
        grad_logprob,
        grad_entropy,
        kept,
        out_of_vocab,
    )


def reference_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature=1.0,
    grad_logprob: Optional[torch.Tensor] = None,
    grad_entropy: Optional[torch.Tensor] = None,
    kept: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> Reference:
    """As ``reference`` from materialized logits ``[..., V]``; ``grad_logits`` (``grad_hidden``)
    holds the gradient with respect to the logits."""
    return _reference(
        lambda logits: capped(logits, softcap), (logits,), targets, temperature, grad_logprob, grad_entropy, kept
    )


class LossReference(NamedTuple):
    """Float64 results of a per-token loss: the summed loss, the metrics (0 on unselected rows)
    and the loss's gradients."""

    loss: torch.Tensor  # []
    logprob: torch.Tensor  # [...] ([..., k] for several targets per row)
    entropy: torch.Tensor  # [...]
    grad_hidden: torch.Tensor  # [..., H]
    grad_weight: torch.Tensor  # [V, H]


def loss_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    loss_fn,
    loss_inputs: Optional[dict] = None,
    temperature=1.0,
    mask: Optional[torch.Tensor] = None,
    kept: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> LossReference:
    """``sum_t loss_fn(logprob_t, entropy_t, **inputs_t)`` over the rows ``mask [...]`` selects
    (every row without one) under ``softmax(hidden [..., H] @ weight.T / T)`` over the whole
    vocabulary ``weight [V, H]``, in float64 (float inputs upcast), and its gradients by autograd.
    ``targets [...]``, or ``[..., k]`` for several per row. ``loss_fn`` receives the selected rows
    flattened: ``logprob [rows]`` (``[rows, k]``), ``entropy [rows]`` and each input ``[..., *]`` as
    ``[rows, *]``; unselected targets are not read. ``kept [..., V]`` bool: each row's softmax over
    its kept columns; ``softcap`` as ``reference``'s."""
    leaves = [tensor.detach().double().requires_grad_() for tensor in (hidden, weight)]
    lead = hidden.shape[:-1]
    selected = torch.ones(lead, dtype=torch.bool, device=hidden.device) if mask is None else mask.to(torch.bool)
    per_target = selected if targets.dim() == len(lead) else selected.unsqueeze(-1)
    readable_targets = torch.where(per_target, targets, torch.zeros_like(targets))
    logprob, entropy = logprob_entropy(capped(leaves[0] @ leaves[1].t(), softcap), readable_targets, temperature, kept)
    rows = selected.reshape(-1)

    def flat(value):  # [..., *] -> the selected rows [rows, *]
        return value.reshape(rows.numel(), *value.shape[len(lead) :])[rows]

    inputs = {
        name: flat(value.double() if value.is_floating_point() else value)
        for name, value in (loss_inputs or {}).items()
    }
    loss = loss_fn(flat(logprob), flat(entropy), **inputs).sum()
    grad_hidden, grad_weight = torch.autograd.grad(loss, leaves)
    zero = logprob.new_zeros(())
    return LossReference(
        loss.detach(),
        torch.where(per_target, logprob.detach(), zero),
        torch.where(selected, entropy.detach(), zero),
        grad_hidden,
        grad_weight,
    )


def topk_distillation_loss(divergence: str = "forward", remainder: str = "renormalize"):
    """A float64 ``loss_fn`` for ``loss_reference``: ``(logprob [rows, k], entropy, *,
    teacher_logprob [rows, k], weight [rows]) -> weight * KL [rows]`` between a student's and a
    teacher's distributions on the teacher's top-k ids (log-probs each over its whole vocabulary),
    from probabilities ``p`` (student) and ``q`` (teacher). ``remainder="renormalize"``: both
    renormalized over the k ids; ``"tail"``: each one's rest of mass, ``1 - sum``, as one outcome
    more. ``divergence="forward"``: KL(q || p); ``"reverse"``: KL(p || q). The entropy is not used."""

    def loss_fn(logprob, entropy, *, teacher_logprob, weight):
        p, q = logprob.double().exp(), teacher_logprob.double().exp()
        if remainder == "renormalize":
            p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
            first, second = (q, p) if divergence == "forward" else (p, q)
            return weight.double() * torch.xlogy(first, first / second).sum(-1)
        rest_p, rest_q = 1 - p.sum(-1), 1 - q.sum(-1)
        first, second, rest_first, rest_second = (
            (q, p, rest_q, rest_p) if divergence == "forward" else (p, q, rest_p, rest_q)
        )
        kl = torch.xlogy(first, first / second).sum(-1) + torch.xlogy(rest_first, rest_first / rest_second)
        return weight.double() * kl

    return loss_fn


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference (0 for empty tensors)."""
    if expected.numel() == 0:
        return 0.0
    return float((actual.detach().double() - expected.double()).abs().max())


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest magnitude of ``expected``: an
    elementwise relative error is meaningless for entries near zero, a norm hides one bad entry."""
    if expected.numel() == 0:
        return 0.0
    scale = expected.double().abs().max().clamp_min(1e-30)
    return float((actual.detach().double() - expected.double()).abs().max() / scale)


# Leading shapes of 1 to 3 dimensions, each with a prime vocabulary (not a multiple of any tile).
LEAD_SHAPES = [((29,), 97), ((3, 11), 251), ((2, 3, 5), 97)]


def within_recompute(actual: torch.Tensor, recompute: torch.Tensor, exact: torch.Tensor, floor: float) -> bool:
    """Whether ``actual`` (a three-GEMM result) is as close to ``exact`` (float64) as 1.2 times the
    recompute path's own result ``recompute`` on the same inputs is, or within ``floor``."""
    return relative_error(actual, exact) <= max(floor, 1.2 * relative_error(recompute, exact))


def make_case(lead_shape, hidden_size: int, vocab: int, dtype: torch.dtype, peaky: bool, seed: int = 0, device=None):
    """Random ``hidden [*lead_shape, H]``, ``weight [vocab, H]``, ``targets [*lead_shape]``.

    Flat cases have logits of standard deviation about 1; peaky ones about 25, so that one token
    takes almost all the probability mass and log-probs reach the hundreds.
    """
    generator = torch.Generator().manual_seed(seed)
    scale = 25.0 if peaky else 1.0
    hidden = (torch.randn(*lead_shape, hidden_size, generator=generator) * scale).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5).to(dtype)
    targets = torch.randint(0, vocab, tuple(lead_shape), generator=generator)
    return hidden.to(device), weight.to(device), targets.to(device)


# Log-ratios logprob - old_logprob for a clipped policy loss with clip range (0.2, 0.28) and dual
# clip 3, each well inside one of its branches (kinks at log 0.8, log 1.28 and log 3): beyond the
# dual clip, above 1 + clip_high, inside the clip range, below 1 - clip_low. Far from the kinks no
# rounding can switch a token's branch.
POLICY_LOG_RATIOS = torch.tensor([1.4, 0.4, 0.05, -0.05, -0.4])


def policy_loss_inputs(
    true_logprob: torch.Tensor, weights: torch.Tensor, generator: torch.Generator, jitter: float = 0.0
) -> dict:
    """Loss inputs of ``losses.ClippedPolicyLoss`` for tokens whose float64 log-probs are
    ``true_logprob``: old log-probs a ``POLICY_LOG_RATIOS`` step (plus uniform ``jitter``) away,
    reference log-probs within about 0.1 (the k3 KL estimator is exponential in the difference),
    normal advantages and the given per-token ``weights``; float32, ``true_logprob``'s shape."""
    shape = true_logprob.shape
    log_ratio = POLICY_LOG_RATIOS[torch.randint(0, len(POLICY_LOG_RATIOS), shape, generator=generator)]
    if jitter:
        log_ratio = log_ratio + jitter * (torch.rand(shape, generator=generator) - 0.5)
    return {
        "old_logprob": (true_logprob - log_ratio).float(),
        "ref_logprob": (true_logprob + 0.1 * torch.randn(shape, generator=generator)).float(),
        "advantages": torch.randn(shape, generator=generator),
        "weight": weights,
    }


def dense_kept(offsets: torch.Tensor, token_ids: torch.Tensor, rows: torch.Tensor, shape, vocab: int) -> torch.Tensor:
    """``kept [*shape, vocab]`` bool from the compressed sets ``(offsets, token_ids)`` of the flat
    rows ``rows`` (in order), every column kept on the other rows: a plain loop, for tests."""
    kept = torch.ones(int(torch.tensor(shape).prod()), vocab, dtype=torch.bool)
    for index, row in enumerate(rows.tolist()):
        kept[row] = False
        kept[row, token_ids[offsets[index] : offsets[index + 1]].cpu()] = True
    return kept.view(*shape, vocab).to(offsets.device)
