"""A float32 head on CUDA (float32 hidden states and weight, Triton backend): log-probs, entropy and
both gradients as close to float64 as stock's float32 head (cuBLAS's float32 product, TF32 off,
then float32 log-softmax) on the same inputs, on the recompute op and the three-GEMM SFT and RL
losses, in one chunk and in several (``weight_grad_into`` too). The Triton backend multiplies
float32 by 3xTF32 ("tf32x3") in its own kernels; one TF32 product (10-bit mantissa) errs about 1e3
times more, so a bound of twice stock's error tells the two apart while leaving room for another
summation order. The fused ops run with PyTorch's TF32 switch on: a product left to cuBLAS would
then round to TF32 and fail.
"""

from __future__ import annotations

import pytest
import torch

from devkit.oracle import loss_reference, max_abs_error, reference
from megatron_fused_lm import fused_linear_logprob, fused_linear_loss, losses

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOKENS, HIDDEN, VOCAB = 1024, 2048, 32003
FACTOR = 2.0


def tf32(allowed: bool):
    torch.backends.cuda.matmul.allow_tf32 = allowed


@pytest.fixture(autouse=True)
def restore_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    yield
    tf32(before)


def make_case(seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen) * (6.0 / HIDDEN**0.5)  # peaked rows
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=gen)
    grad_logprob = torch.randn(TOKENS, device="cuda", generator=gen)
    return hidden, weight, targets, grad_logprob


def norm_error(actual, expected):
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def errors(logprob, entropy, grad_hidden, grad_weight, expected):
    return dict(
        logprob=max_abs_error(logprob, expected.logprob),
        entropy=max_abs_error(entropy, expected.entropy),
        grad_hidden=norm_error(grad_hidden, expected.grad_hidden),
        grad_weight=norm_error(grad_weight, expected.grad_weight),
    )


def stock_values(hidden, weight, targets):
    log_softmax = torch.log_softmax(hidden @ weight.t(), dim=-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_softmax.gather(-1, targets[:, None]).squeeze(-1), entropy


def compare(hidden, weight, expected, run):
    """Stock's float32 head (TF32 off) and ours (TF32 on) on the same leaves: ``run(name,
    leaf_hidden, leaf_weight)`` gives ``(logprob, entropy, weight gradient)`` after its backward;
    ours must err at most ``FACTOR`` times stock's against ``expected``."""
    results = {}
    for name in ("stock", "triton"):
        leaf_hidden, leaf_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        tf32(name != "stock")
        logprob, entropy, grad_weight = run(name, leaf_hidden, leaf_weight)
        results[name] = errors(logprob, entropy, leaf_hidden.grad, grad_weight, expected)
    print(results)
    assert all(results["triton"][key] <= FACTOR * results["stock"][key] for key in results["stock"]), results


@pytest.mark.parametrize("token_chunk", [None, 256])
def test_the_recompute_op(token_chunk):
    hidden, weight, targets, grad_logprob = make_case()
    grad_entropy = torch.rand(TOKENS, device="cuda")

    def run(name, leaf_hidden, leaf_weight):
        if name == "stock":
            logprob, entropy = stock_values(leaf_hidden, leaf_weight, targets)
        else:
            logprob, entropy = fused_linear_logprob(
                leaf_hidden, leaf_weight, targets, return_entropy=True, backend=name, token_chunk=token_chunk
            )
        torch.autograd.backward([logprob, entropy], [grad_logprob, grad_entropy])
        return logprob, entropy, leaf_weight.grad

    compare(hidden, weight, reference(hidden, weight, targets, 1.0, grad_logprob, grad_entropy), run)


@pytest.mark.parametrize("into", [False, True], ids=["returned", "weight_grad_into"])
@pytest.mark.parametrize("token_chunk", [None, 256])
@pytest.mark.parametrize("loss", ["sft", "rl"])
def test_the_three_gemm_losses(loss, token_chunk, into):
    hidden, weight, targets, advantages = make_case(seed=1)
    weights = torch.full_like(advantages, 1.0 / TOKENS)
    if loss == "sft":
        loss_fn, inputs = losses.cross_entropy, {"weight": weights}
    else:
        loss_fn = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)
        inputs = {"weight": weights, "advantages": advantages}

    def run(name, leaf_hidden, leaf_weight):
        if name == "stock":
            logprob, entropy = stock_values(leaf_hidden, leaf_weight, targets)
            loss_fn(logprob, entropy, **inputs).sum().backward()  # the oracle's loss, on stock's values
            return logprob, entropy, leaf_weight.grad
        into_weight = torch.zeros_like(weight) if into else None
        result = fused_linear_loss(
            leaf_hidden,
            leaf_weight,
            targets,
            loss_fn,
            loss_inputs=inputs,
            backend=name,
            token_chunk=token_chunk,
            weight_grad_into=into_weight,
        )
        result.loss.backward()
        return result.logprob, result.entropy, into_weight if into else leaf_weight.grad

    compare(hidden, weight, loss_reference(hidden, weight, targets, loss_fn, loss_inputs=inputs), run)
