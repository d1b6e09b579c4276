"""Float64 references written independently of the code under test (plain log_softmax + autograd)."""

import torch


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference, relative to the largest magnitude of ``expected``."""
    scale = expected.double().abs().max().clamp_min(1e-30)
    return float((actual.detach().double() - expected.double()).abs().max() / scale)


def logprob_entropy_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Float64 ``(logprob, entropy)`` of ``targets`` under ``softmax(logits / temperature)``."""
    log_probs = torch.log_softmax(logits.double() / temperature, dim=-1)
    logprob = log_probs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprob, entropy


def fused_reference(hidden, weight, targets, temperature, grad_logprob=None, grad_entropy=None):
    """Float64 log-probs, entropy and, given upstream gradients, the gradients of
    ``sum(logprob * grad_logprob + entropy * grad_entropy)`` w.r.t. hidden and the full weight."""
    hidden64 = hidden.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    logprob, entropy = logprob_entropy_from_logits(hidden64 @ weight64.t(), targets, temperature)
    result = {"logprob": logprob.detach(), "entropy": entropy.detach()}
    if grad_logprob is not None or grad_entropy is not None:
        loss = 0
        if grad_logprob is not None:
            loss = loss + (logprob * grad_logprob.double()).sum()
        if grad_entropy is not None:
            loss = loss + (entropy * grad_entropy.double()).sum()
        loss.backward()
        result["grad_hidden"] = hidden64.grad
        result["grad_weight"] = weight64.grad
    return result


def logits_reference(logits, targets, temperature, grad_logprob, grad_entropy):
    """Float64 log-probs, entropy and the gradient w.r.t. the logits."""
    logits64 = logits.detach().double().requires_grad_()
    logprob, entropy = logprob_entropy_from_logits(logits64, targets, temperature)
    ((logprob * grad_logprob.double()).sum() + (entropy * grad_entropy.double()).sum()).backward()
    return {"logprob": logprob.detach(), "entropy": entropy.detach(), "grad_logits": logits64.grad}


def make_case(lead_shape, hidden_size, vocab, dtype, peaky, seed=0):
    """Random ``hidden [*lead_shape, H]``, ``weight [vocab, H]``, ``targets [*lead_shape]``.

    Flat cases have logits of standard deviation about 1; peaky ones about 25, so that one token
    takes almost all the probability mass and log-probs reach the hundreds.
    """
    generator = torch.Generator().manual_seed(seed)
    scale = 25.0 if peaky else 1.0
    hidden = (torch.randn(*lead_shape, hidden_size, generator=generator) * scale).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5).to(dtype)
    targets = torch.randint(0, vocab, lead_shape, generator=generator)
    return hidden, weight, targets
