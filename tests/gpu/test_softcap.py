"""``softcap`` on CUDA (bf16): the Triton and torch backends' recompute op, the Triton three-GEMM
losses (SFT, whose direct path reads each exponential stored times the cap's slope, and RL with an
entropy term), the labels path and the Triton top-k kernel, against the float64 oracle of the capped head
(``devkit.oracle.capped``), with the stock path (bf16 logits, then ``logits_logprob`` with the same
cap) measured on the same inputs.

Logits of spread about 20 under Gemma-2's cap of 30 (peaked rows reach 100): tanh bends on every
row's largest columns. Bounds as test_triton_parity.py: values within ``VALUE_BOUND`` times the
largest capped logit and 10x under the stock path's error; gradients within ``GRAD_SLACK`` times
the stock path's own error (``dz`` and the products are rounded to bf16 on both). A cap left out or
a slope missing costs O(1).
"""

from __future__ import annotations

import pytest
import torch

from devkit.oracle import capped, loss_reference, max_abs_error, reference, relative_error
from megatron_fused_lm import (
    fused_linear_cross_entropy,
    fused_linear_logprob,
    fused_linear_loss,
    fused_linear_topk,
    logits_logprob,
    losses,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CAP = 30.0
VALUE_BOUND = 2e-5
GRAD_SLACK = 1.5
TOKENS, HIDDEN, VOCAB = 1024, 2048, 151936


def make_case(seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen) * (20.0 / HIDDEN**0.5)
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=gen)
    return hidden.bfloat16(), weight.bfloat16(), targets


def grads_of(step, hidden, weight):
    leaves = [tensor.detach().clone().requires_grad_() for tensor in (hidden, weight)]
    values = step(*leaves)
    return values, leaves[0].grad, leaves[1].grad


def errors(values, grads, expected):
    logprob, entropy = values
    return dict(
        logprob=max_abs_error(logprob, expected.logprob),
        entropy=max_abs_error(entropy, expected.entropy),
        grad_hidden=relative_error(grads[0], expected.grad_hidden),
        grad_weight=relative_error(grads[1], expected.grad_weight),
    )


@pytest.mark.parametrize("path", ["triton", "torch", "three_gemm_sft", "three_gemm_rl"])
def test_against_the_oracle_and_stock(path):
    hidden, weight, targets = make_case()
    gen = torch.Generator(device="cuda").manual_seed(1)
    grad_logprob = torch.randn(TOKENS, device="cuda", generator=gen)
    grad_entropy = None if path == "three_gemm_sft" else torch.randn(TOKENS, device="cuda", generator=gen) * 0.01
    if path.startswith("three_gemm"):
        weights = torch.full_like(grad_logprob, 1.0 / TOKENS)
        if path == "three_gemm_sft":
            loss_fn, inputs = losses.cross_entropy, {"weight": weights}
        else:
            loss_fn = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)
            inputs = {"weight": weights, "advantages": grad_logprob}
        expected = loss_reference(hidden, weight, targets, loss_fn, loss_inputs=inputs, softcap=CAP)

        def fused(leaf_hidden, leaf_weight):
            result = fused_linear_loss(
                leaf_hidden, leaf_weight, targets, loss_fn, loss_inputs=inputs, backend="triton", softcap=CAP
            )
            result.loss.backward()
            return result.logprob, result.entropy

        def stock(leaf_hidden, leaf_weight):
            logprob, entropy = logits_logprob(leaf_hidden @ leaf_weight.t(), targets, return_entropy=True, softcap=CAP)
            loss_fn(logprob, entropy, **inputs).sum().backward()
            return logprob, entropy
    else:
        expected = reference(hidden, weight, targets, 0.8, grad_logprob, grad_entropy, softcap=CAP)

        def fused(leaf_hidden, leaf_weight):
            logprob, entropy = fused_linear_logprob(
                leaf_hidden, leaf_weight, targets, temperature=0.8, return_entropy=True, backend=path, softcap=CAP
            )
            torch.autograd.backward([logprob, entropy], [grad_logprob, grad_entropy])
            return logprob, entropy

        def stock(leaf_hidden, leaf_weight):
            logprob, entropy = logits_logprob(
                leaf_hidden @ leaf_weight.t(), targets, temperature=0.8, return_entropy=True, softcap=CAP
            )
            torch.autograd.backward([logprob, entropy], [grad_logprob, grad_entropy])
            return logprob, entropy

    values, *grads = grads_of(fused, hidden, weight)
    stock_values, *stock_grads = grads_of(stock, hidden, weight)
    ours, theirs = errors(values, grads, expected), errors(stock_values, stock_grads, expected)
    print(path, "ours", ours, "stock", theirs)
    value_bound = VALUE_BOUND * CAP / (0.8 if path in ("triton", "torch") else 1.0)
    assert ours["logprob"] <= min(value_bound, theirs["logprob"] / 10), (ours, theirs)
    assert ours["entropy"] <= value_bound, (ours, theirs)
    assert ours["grad_hidden"] <= GRAD_SLACK * theirs["grad_hidden"], (ours, theirs)
    assert ours["grad_weight"] <= GRAD_SLACK * theirs["grad_weight"], (ours, theirs)


def test_the_labels_path_and_top_k():
    hidden, weight, targets = make_case(seed=2)
    labels = targets.clone()
    labels[:9] = -100
    bound = VALUE_BOUND * CAP
    oracle = reference(hidden, weight, labels, out_of_vocab="max_logit", softcap=CAP).logprob
    per_token = fused_linear_cross_entropy(
        hidden, weight, labels, torch.ones(TOKENS, device="cuda"), out_of_vocab="max_logit", backend="triton",
        softcap=CAP,
    )  # fmt: skip
    assert max_abs_error(per_token, -oracle) <= bound
    # The Triton kernel's top-k (k = 8 of 1187 column tiles), its values the capped head's.
    log_softmax = torch.log_softmax(capped(hidden.double() @ weight.double().t(), CAP), -1)
    got_logprobs, got_ids = fused_linear_topk(hidden, weight, 8, backend="triton", softcap=CAP)
    assert max_abs_error(got_logprobs, log_softmax.topk(8, dim=-1).values) <= bound
    assert max_abs_error(got_logprobs, log_softmax.gather(-1, got_ids)) <= bound
