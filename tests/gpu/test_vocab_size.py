"""``vocab_size`` on CUDA (Triton backend, bf16): a Qwen-sized head of 151936 rows whose tokenizer
has 151665 ids, the padded rows scoring highest. The recompute op, the three-GEMM loss and top-k
with ``vocab_size`` give bitwise what the same op gives on the weight's first ``vocab_size`` rows
(the ops compute on that view), the padded rows get no gradient, and the values are those of the
float64 oracle over the true vocabulary within ``VALUE_BOUND`` times the largest |logit| (as
test_kept_tokens.py). A padded column in a softmax moves the log-probs by O(1).
"""

from __future__ import annotations

import pytest
import torch

from devkit.oracle import logprob_entropy, max_abs_error, relative_error
from megatron_fused_lm import fused_linear_logprob, fused_linear_loss, fused_linear_topk, losses
from megatron_fused_lm.ops import products

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VALUE_BOUND = 2e-5
TOKENS, HIDDEN, PADDED, VOCAB = 2048, 2048, 151936, 151665


def padded_case(seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen)
    weight = torch.randn(PADDED, HIDDEN, device="cuda", generator=gen) * (4.0 / HIDDEN**0.5)
    weight[VOCAB:] *= 4  # the padded rows score highest
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=gen)
    return hidden.bfloat16(), weight.bfloat16(), targets


def grads_of(step, hidden, weight):
    leaves = [tensor.detach().clone().requires_grad_() for tensor in (hidden, weight)]
    values = step(*leaves)
    return values, leaves[0].grad, leaves[1].grad


@pytest.mark.parametrize("path", ["recompute", "three-gemm"])
def test_the_padded_rows_are_left_out(path):
    hidden, weight, targets = padded_case()
    grad_logprob = torch.randn(TOKENS, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))

    def step(vocab_size):
        def run(leaf_hidden, leaf_weight):
            if path == "three-gemm":
                result = fused_linear_loss(
                    leaf_hidden,
                    leaf_weight,
                    targets,
                    losses.ClippedPolicyLoss(clip_high=0.28, entropy_coef=0.01),
                    loss_inputs={"advantages": grad_logprob, "weight": torch.full_like(grad_logprob, 1 / TOKENS)},
                    backend="triton",
                    vocab_size=vocab_size,
                )
                result.loss.backward()
                return result.logprob, result.entropy
            logprob, entropy = fused_linear_logprob(
                leaf_hidden, leaf_weight, targets, return_entropy=True, backend="triton", vocab_size=vocab_size
            )
            ((logprob * grad_logprob).sum() + entropy.sum()).backward()
            return logprob, entropy

        return run

    (logprob, entropy), grad_hidden, grad_weight = grads_of(step(VOCAB), hidden, weight)
    (want_logprob, want_entropy), want_hidden, want_weight = grads_of(step(None), hidden, weight[:VOCAB])
    assert torch.equal(logprob, want_logprob) and torch.equal(entropy, want_entropy)
    assert torch.equal(grad_hidden, want_hidden) and torch.equal(grad_weight[:VOCAB], want_weight)
    assert torch.count_nonzero(grad_weight[VOCAB:]) == 0
    logits = hidden.double() @ weight[:VOCAB].double().t()
    oracle_logprob, oracle_entropy = logprob_entropy(logits, targets)
    bound = VALUE_BOUND * float(logits.abs().max())
    assert max_abs_error(logprob, oracle_logprob) <= bound and max_abs_error(entropy, oracle_entropy) <= bound
    padded_logprob, _ = logprob_entropy(hidden.double() @ weight.double().t(), targets)
    assert max_abs_error(padded_logprob, oracle_logprob) > 1.0  # the padding matters here


def test_top_k_never_names_a_padded_id():
    hidden, weight, _ = padded_case(seed=2)
    logprobs, ids = fused_linear_topk(hidden, weight, 8, backend="triton", vocab_size=VOCAB)
    want_logprobs, want_ids = fused_linear_topk(hidden, weight[:VOCAB], 8, backend="triton")
    assert torch.equal(ids, want_ids) and torch.equal(logprobs, want_logprobs)
    assert int(ids.max()) < VOCAB and int(fused_linear_topk(hidden, weight, 8, backend="triton")[1].max()) >= VOCAB


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("depth", [VOCAB, 32003, 13])
def test_products_of_an_odd_depth_or_row_count(depth, accumulate, out_dtype):
    # products.add_product splits a contiguous dimension that is no whole number of 16-byte steps
    # (dz @ W over an odd vocabulary, dz.T @ h's rows) into an aligned bulk and a tail: the split
    # product is as close to float64 as cuBLAS's at the aligned shape (the block's zero padding
    # included: an even vocabulary's product), within another summation order; a bf16 result is
    # rounded once (after the bulk and again after the tail it reaches 1.4x that, on the CPU).
    gen = torch.Generator(device="cuda").manual_seed(depth)
    padded = -(-depth // 8) * 8
    stored = torch.randn(512, padded, device="cuda", generator=gen).bfloat16()
    stored[:, depth:] = 0
    logit_grads = stored[:, :depth]  # the block's layout: rows padded to 16 bytes
    weight = torch.zeros(padded, 256, device="cuda", dtype=torch.bfloat16)
    weight[:depth] = torch.randn(depth, 256, device="cuda", generator=gen).bfloat16()
    hidden = torch.randn(512, 256, device="cuda", generator=gen).bfloat16()
    mixed = {} if out_dtype == torch.bfloat16 else {"out_dtype": out_dtype}
    for left, right, aligned_left, aligned_right in (
        (logit_grads, weight[:depth], stored, weight),
        (logit_grads.t(), hidden, stored.t(), hidden),
    ):
        start = torch.randn(aligned_left.shape[0], right.shape[1], device="cuda", generator=gen).to(out_dtype)
        rows = left.shape[0]
        split = products.add_product(start[:rows].clone(), left, right, accumulate)
        aligned = torch.addmm(start.clone(), aligned_left, aligned_right, beta=int(accumulate), **mixed)[:rows]
        exact = left.double() @ right.double() + (start[:rows].double() if accumulate else 0)
        factor = 1.5 if out_dtype == torch.float32 else 1.15
        error, floor = relative_error(split, exact), relative_error(aligned, exact)
        assert error <= factor * floor + 1e-7, (left.shape, out_dtype, error, floor)
