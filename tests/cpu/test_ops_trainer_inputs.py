"""Loss inputs as trainers hand them over: float64 tensors from a numpy rollout buffer, one GRPO
advantage or one sampling temperature per sequence (``[b]`` or ``[b, 1]`` for rows ``[b, s]``).
Each is computed as the float64 oracle computes the same values laid out per token, by the fused
op (both paths: three GEMMs, and log-probs then a loss) and by the unfused one.

Tolerances: 2e-5 on values (plus 8 float32 roundings of the value: a peaked row's log-prob reaches
-250) and 5e-5 relative on gradients, those of the ops' float32 parity tests (measured errors about
1e-6); a float64 input read as float32 moves nothing by more than 1e-7 of its
size, and a per-sequence input broadcast to the wrong positions moves a loss by O(1).
"""

import pytest
import torch

from devkit.oracle import loss_reference, make_case, max_abs_error, reference, relative_error
from megatron_fused_lm import fused_linear_logprob, fused_linear_loss, logits_logprob, logits_loss, losses

B, S, H, V = 3, 5, 16, 37
VALUE_ATOL, GRAD_RTOL = 2e-5, 5e-5
LOSS = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01, kl_coef=0.05)


def policy_case(seed: int, temperature=1.0):
    """A peaked case ``[B, S]`` and its per-token policy inputs, float32: old and reference
    log-probs near the current ones (the KL estimator is exp-sensitive), half the targets the
    rows' most likely tokens (a confident row)."""
    hidden, weight, targets = make_case((B, S), H, V, torch.float32, peaky=True, seed=seed)
    targets[:, ::2] = (hidden @ weight.t()).argmax(-1)[:, ::2]
    current = reference(hidden, weight, targets, temperature=temperature).logprob.float()
    generator = torch.Generator().manual_seed(seed)
    inputs = {
        "old_logprob": current + 0.3 * torch.randn(B, S, generator=generator),
        "ref_logprob": current + 0.3 * torch.randn(B, S, generator=generator),
        "advantages": torch.randn(B, 1, generator=generator).expand(B, S),  # GRPO: one per sequence
        "weight": torch.rand(B, S, generator=generator),
    }
    return hidden, weight, targets, inputs


def fused_and_unfused(hidden, weight, targets, loss_inputs, temperature):
    """``(loss, grad hidden, grad weight)`` of the fused op and of the unfused one on the logits."""
    results = []
    for fused in (True, False):
        leaves = [tensor.detach().clone().requires_grad_() for tensor in (hidden, weight)]
        if fused:
            result = fused_linear_loss(
                *leaves, targets, LOSS, loss_inputs=loss_inputs, temperature=temperature, backend="torch"
            )
        else:
            result = logits_loss(leaves[0] @ leaves[1].t(), targets, LOSS, loss_inputs=loss_inputs,
                                 temperature=temperature)  # fmt: skip
        result.loss.backward()
        results.append((result.loss.detach(), leaves[0].grad, leaves[1].grad))
    return results


def assert_close(actual, expected, label):
    """Within VALUE_ATOL plus 8 float32 roundings of the value (peaked rows' log-probs reach -250)."""
    error = (actual.double() - expected).abs() - 8 * torch.finfo(torch.float32).eps * expected.abs()
    assert float(error.max()) <= VALUE_ATOL, f"{label}: off by {max_abs_error(actual, expected):.3g}"


def assert_matches_oracle(results, expected, label):
    for loss, grad_hidden, grad_weight in results:
        assert_close(loss, expected.loss, f"{label}: loss")
        assert relative_error(grad_hidden, expected.grad_hidden) <= GRAD_RTOL, f"{label}: hidden gradient"
        assert relative_error(grad_weight, expected.grad_weight) <= GRAD_RTOL, f"{label}: weight gradient"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_float_loss_inputs_of_another_precision_are_read_as_float32(dtype):
    hidden, weight, targets, inputs = policy_case(seed=1)
    expected = loss_reference(hidden, weight, targets, LOSS, {name: value.to(dtype) for name, value in inputs.items()})
    given = {name: value.to(dtype) for name, value in inputs.items()}
    assert_matches_oracle(fused_and_unfused(hidden, weight, targets, given, 1.0), expected, str(dtype))


@pytest.mark.parametrize("shape", [(B,), (B, 1)], ids=["[b]", "[b, 1]"])
def test_one_advantage_per_sequence_is_broadcast_over_its_positions(shape):
    hidden, weight, targets, inputs = policy_case(seed=2)
    expected = loss_reference(hidden, weight, targets, LOSS, inputs)
    per_sequence = {**inputs, "advantages": inputs["advantages"][:, 0].reshape(shape)}
    assert_matches_oracle(fused_and_unfused(hidden, weight, targets, per_sequence, 1.0), expected, str(shape))


@pytest.mark.parametrize("shape", [(B,), (B, 1)], ids=["[b]", "[b, 1]"])
def test_one_temperature_per_sequence_is_broadcast_over_its_positions(shape):
    temperature = torch.tensor([0.7, 1.0, 1.3])
    per_token = temperature[:, None].expand(B, S)
    hidden, weight, targets, inputs = policy_case(seed=3, temperature=per_token.double())
    expected = loss_reference(hidden, weight, targets, LOSS, inputs, temperature=per_token.double())
    results = fused_and_unfused(hidden, weight, targets, inputs, temperature.reshape(shape))
    assert_matches_oracle(results, expected, f"temperature {shape}")
    oracle = reference(hidden, weight, targets, temperature=per_token.double())
    for logprob, entropy in (
        fused_linear_logprob(hidden, weight, targets, temperature=temperature.reshape(shape), return_entropy=True),
        logits_logprob(hidden @ weight.t(), targets, temperature=temperature.reshape(shape), return_entropy=True),
    ):
        assert_close(logprob, oracle.logprob, "log-probs at per-sequence temperatures")
        assert_close(entropy, oracle.entropy, "entropy at per-sequence temperatures")


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("advantages", torch.ones(B + 1), "loss_inputs['advantages'] has shape (4,)"),
        ("advantages", torch.ones(B, 2), "one value per sequence"),
        ("advantages", torch.ones(S), "loss_inputs['advantages'] has shape (5,)"),
    ],
)
def test_per_sequence_inputs_of_another_batch_are_refused_by_name(name, value, words):
    hidden, weight, targets, inputs = policy_case(seed=4)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        fused_linear_loss(hidden, weight, targets, LOSS, loss_inputs={**inputs, name: value})
    with pytest.raises(ValueError, match="temperature.shape"):
        fused_linear_logprob(hidden, weight, targets, temperature=torch.ones(S, 1))
