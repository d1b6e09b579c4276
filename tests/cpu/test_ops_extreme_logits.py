"""Every logit negative, every logit positive, and logits of huge magnitude, on every path of the
torch backend (the four-GEMM op, the three-GEMM loss, the labels path, the logits ops and top-k),
against the float64 oracle. Peers shipped kernels whose running maximum started at 0 (an entropy
wrong when every logit is negative) or that overflowed to NaN; a shift of the logits changes no
log-prob, entropy or gradient, so each case must give the unshifted oracle's numbers.

The shift enters through a constant hidden feature that every weight row reads, so the products
themselves carry it, as a model's would. Tolerance: float32 rounding of the logits, 8 ulps of the
largest magnitude, plus float32 accuracy (2e-5, as test_ops_kept_tokens.py); a running maximum
that starts at 0 or an overflow costs O(1) or NaN.
"""

import pytest
import torch

from devkit.oracle import loss_reference, make_case, max_abs_error, reference, relative_error
from megatron_fused_lm import (
    fused_linear_cross_entropy,
    fused_linear_logprob,
    fused_linear_loss,
    fused_linear_topk,
    logits_logprob,
    logits_topk,
    losses,
)

H, V = 24, 97
LEAD = (4, 6)
SHIFTS = {"all negative": -3000.0, "all positive": 3000.0, "huge spread": 0.0}


def shifted_case(name, seed):
    """Hidden states and weight whose logits are the peaked case's moved by ``SHIFTS[name]``, or,
    for ``"huge spread"``, scaled to a spread of about 1e4 (the peaked case's, times 400)."""
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=True, seed=seed)
    if name == "huge spread":
        hidden = hidden * 400
    hidden[..., -1], weight[:, -1] = SHIFTS[name] / 10, 10.0  # z + shift, exactly representable
    return hidden, weight, targets


def tolerance(hidden, weight):
    return 8 * torch.finfo(torch.float32).eps * float((hidden.double() @ weight.double().t()).abs().max()) + 2e-5


@pytest.mark.parametrize("name", list(SHIFTS))
def test_log_probs_entropy_and_gradients(name):
    hidden, weight, targets = shifted_case(name, seed=1)
    logits = hidden.double() @ weight.double().t()
    if name == "all negative":
        assert logits.max() < -2000
    elif name == "all positive":
        assert logits.min() > 2000
    else:
        assert (logits.max(-1).values - logits.min(-1).values).min() > 1000
    atol = tolerance(hidden, weight)
    grad_logprob, grad_entropy = torch.randn(LEAD), torch.randn(LEAD)
    expected = reference(hidden, weight, targets, 1.0, grad_logprob, grad_entropy)
    assert torch.isfinite(expected.entropy).all()
    leaf_hidden, leaf_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logprob, entropy = fused_linear_logprob(leaf_hidden, leaf_weight, targets, return_entropy=True, token_chunk=5)
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    assert max_abs_error(logprob, expected.logprob) <= atol, name
    assert max_abs_error(entropy, expected.entropy) <= atol, name
    # The gradients' scale is the hidden states' (the logits' gradient is at most a probability).
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= atol, name
    assert relative_error(leaf_weight.grad, expected.grad_weight) <= atol, name
    # The logits ops on the float32 logits themselves.
    from_logits = logits_logprob((hidden @ weight.t()).requires_grad_(), targets, return_entropy=True)
    assert max_abs_error(from_logits[0], expected.logprob) <= atol, name
    assert max_abs_error(from_logits[1], expected.entropy) <= atol, name


@pytest.mark.parametrize("name", list(SHIFTS))
def test_three_gemm_losses_the_labels_path_and_top_k(name):
    hidden, weight, targets = shifted_case(name, seed=2)
    atol = tolerance(hidden, weight)
    weights = torch.rand(LEAD, generator=torch.Generator().manual_seed(3))
    policy = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)
    inputs = {"weight": weights, "advantages": torch.randn(LEAD, generator=torch.Generator().manual_seed(4))}
    expected = loss_reference(hidden, weight, targets, policy, loss_inputs=inputs)
    leaf_hidden, leaf_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    result = fused_linear_loss(leaf_hidden, leaf_weight, targets, policy, loss_inputs=inputs, token_chunk=5)
    result.loss.backward()
    assert max_abs_error(result.entropy, expected.entropy) <= atol, name
    assert relative_error(result.loss, expected.loss) <= atol, name
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= atol, name
    assert relative_error(leaf_weight.grad, expected.grad_weight) <= atol, name
    # The labels path, an ignored label (-100) among them, scored as Megatron scores it.
    labels = targets.clone()
    labels[0, :2] = -100
    oracle = reference(hidden, weight, labels, out_of_vocab="max_logit").logprob
    per_token = fused_linear_cross_entropy(hidden, weight, labels, weights, out_of_vocab="max_logit")
    assert max_abs_error(per_token, -oracle) <= atol, name
    # Top-k: the largest, scored by the oracle.
    want = torch.log_softmax(hidden.double() @ weight.double().t(), -1).topk(3, dim=-1)
    for got_logprobs, got_ids in (fused_linear_topk(hidden, weight, 3), logits_topk(hidden @ weight.t(), 3)):
        assert torch.equal(got_ids, want.indices), name
        assert max_abs_error(got_logprobs, want.values) <= atol, name
