"""Triton and torch backends on CUDA against a float64 oracle written here.

Realistic vocabularies (151936, 129920, a prime), hidden sizes 4096 and 1000, bf16/fp16/fp32,
peaky logits, targets owned by other (simulated) tensor-parallel ranks, float32 hidden with a bf16
weight, ``entropy_grad=False``, non-contiguous inputs and 0 tokens.
"""

from __future__ import annotations

import pytest
import torch

from megatron_fused_lm import fused_linear_logprob
from megatron_fused_lm.ops import torch_backend
from megatron_fused_lm.ops.softmax_stats import merge_statistics, summarize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BACKENDS = ("triton", "torch")
GRAD_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}


def backend_module(name):
    if name == "torch":
        return torch_backend
    from megatron_fused_lm.ops import triton_backend

    return triton_backend


def make_inputs(num_tokens, hidden_size, vocab, dtype, logit_scale, seed=0):
    """Hidden and weight whose logits have standard deviation about ``logit_scale``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=gen)
    weight = torch.randn(vocab, hidden_size, device="cuda", generator=gen) * (logit_scale / hidden_size**0.5)
    targets = torch.randint(0, vocab, (num_tokens,), device="cuda", generator=gen)
    grad_logprob = torch.randn(num_tokens, device="cuda", generator=gen)
    grad_entropy = torch.randn(num_tokens, device="cuda", generator=gen)
    return hidden.to(dtype), weight.to(dtype), targets, grad_logprob, grad_entropy


def oracle(hidden, weight, targets, temperature, grad_logprob, grad_entropy):
    """Float64 log-probs, entropy and gradients (``grad_entropy`` may be ``None``)."""
    h, w = hidden.double(), weight.double()
    logits = h @ w.t() / temperature
    log_probs = logits.log_softmax(dim=-1)
    probs = log_probs.exp()
    logprob = log_probs.gather(1, targets[:, None]).squeeze(1)
    mean_logit = (probs * logits).sum(-1)
    entropy = torch.logsumexp(logits, -1) - mean_logit
    dz = -grad_logprob.double()[:, None] * probs
    dz.scatter_add_(1, targets[:, None], grad_logprob.double()[:, None])
    if grad_entropy is not None:
        dz += grad_entropy.double()[:, None] * probs * (mean_logit[:, None] - logits)
    dz /= temperature
    return logprob, entropy, dz @ w, dz.t() @ h


def relative_error(value, reference):
    return ((value.double() - reference).norm() / reference.norm()).item()


def max_error(value, reference):
    return (value.double() - reference).abs().max().item()


def run_public(hidden, weight, targets, grad_logprob, grad_entropy, backend, temperature=1.0, entropy_grad=True):
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    logprob, entropy = fused_linear_logprob(
        hidden, weight, targets, temperature=temperature, return_entropy=True,
        entropy_grad=entropy_grad, backend=backend,
    )
    outputs, grads = [logprob], [grad_logprob]
    if entropy_grad:
        outputs.append(entropy)
        grads.append(grad_entropy)
    torch.autograd.backward(outputs, grads)
    return logprob, entropy, hidden.grad, weight.grad


SHAPES = [
    (512, 4096, 151936),
    (384, 1000, 129920),
    (200, 1000, 32003),  # prime vocabulary
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("logit_scale", [3.0, 30.0], ids=["mild", "peaky"])
def test_parity_with_float64_oracle(shape, dtype, logit_scale):
    num_tokens, hidden_size, vocab = shape
    hidden, weight, targets, grad_logprob, grad_entropy = make_inputs(num_tokens, hidden_size, vocab, dtype, logit_scale)
    temperature = 0.8
    ref_logprob, ref_entropy, ref_grad_hidden, ref_grad_weight = oracle(
        hidden, weight, targets, temperature, grad_logprob, grad_entropy
    )
    errors = {}
    for backend in BACKENDS:
        logprob, entropy, grad_hidden, grad_weight = run_public(
            hidden, weight, targets, grad_logprob, grad_entropy, backend, temperature
        )
        assert grad_hidden.dtype == dtype and grad_weight.dtype == dtype
        errors[backend] = (max_error(logprob, ref_logprob), max_error(entropy, ref_entropy))
        assert relative_error(grad_hidden, ref_grad_hidden) < GRAD_TOLERANCE[dtype], backend
        assert relative_error(grad_weight, ref_grad_weight) < GRAD_TOLERANCE[dtype], backend
    for triton_error, torch_error in zip(errors["triton"], errors["torch"]):
        # Both accumulate the same products in float32; only the summation order differs.
        assert triton_error <= 1.5 * torch_error + 2e-5 * logit_scale, errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_targets_on_other_ranks(backend):
    """Simulated TP=3: each shard's statistics from the backend, merged as the collective would."""
    num_tokens, hidden_size, vocab, ranks = 300, 1000, 3 * 43307, 3
    hidden, weight, targets, grad_logprob, grad_entropy = make_inputs(
        num_tokens, hidden_size, vocab, torch.bfloat16, 20.0, seed=1
    )
    module = backend_module(backend)
    shard = vocab // ranks
    stats, shards = [], []
    for rank in range(ranks):
        local = targets - rank * shard
        owned = (local >= 0) & (local < shard)
        shards.append((weight[rank * shard:(rank + 1) * shard], local.clamp(0, shard - 1), owned))
        stats.append(module.local_statistics(hidden, shards[-1][0], shards[-1][1], owned, 1.0, None))
    summary = summarize(merge_statistics(torch.stack(stats)))
    ref_logprob, ref_entropy, ref_grad_hidden, ref_grad_weight = oracle(
        hidden, weight, targets, 1.0, grad_logprob, grad_entropy
    )
    assert max_error(summary.logprob, ref_logprob) < 0.05
    assert max_error(summary.entropy, ref_entropy) < 0.05
    grad_hidden = torch.zeros(num_tokens, hidden_size, device="cuda", dtype=torch.float32)
    grad_weight = []
    for shard_weight, local_target, owned in shards:
        partial, weight_grad = module.local_gradients(
            hidden, shard_weight, local_target, owned, summary.lse, summary.mean_logit,
            grad_logprob, grad_entropy, 1.0, None, True, True,
        )
        grad_hidden += partial.float()
        grad_weight.append(weight_grad)
    assert relative_error(grad_hidden, ref_grad_hidden) < 1e-2
    assert relative_error(torch.cat(grad_weight), ref_grad_weight) < 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_hidden_with_bfloat16_weight(backend):
    hidden, weight, targets, grad_logprob, grad_entropy = make_inputs(256, 1000, 129920, torch.float32, 5.0, seed=2)
    weight = weight.bfloat16()
    hidden_rounded = hidden.bfloat16()  # the product runs in the weight's dtype
    ref_logprob, _, ref_grad_hidden, _ = oracle(hidden_rounded, weight, targets, 1.0, grad_logprob, grad_entropy)
    logprob, _, grad_hidden, grad_weight = run_public(hidden, weight, targets, grad_logprob, grad_entropy, backend)
    assert grad_hidden.dtype == torch.float32 and grad_weight.dtype == torch.bfloat16
    assert max_error(logprob, ref_logprob) < 1e-2
    assert relative_error(grad_hidden, ref_grad_hidden) < 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_as_metric_only(backend):
    hidden, weight, targets, grad_logprob, grad_entropy = make_inputs(256, 4096, 151936, torch.bfloat16, 5.0, seed=3)
    _, ref_entropy, ref_grad_hidden, ref_grad_weight = oracle(hidden, weight, targets, 1.0, grad_logprob, None)
    _, entropy, grad_hidden, grad_weight = run_public(
        hidden, weight, targets, grad_logprob, grad_entropy, backend, entropy_grad=False
    )
    assert not entropy.requires_grad
    assert max_error(entropy, ref_entropy) < 1e-2
    assert relative_error(grad_hidden, ref_grad_hidden) < 1e-2
    assert relative_error(grad_weight, ref_grad_weight) < 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    hidden, weight, targets, _, grad_entropy = make_inputs(300, 1000, 32003, torch.bfloat16, 5.0, seed=4)
    grad_logprob = torch.randn(600, device="cuda")[::2]  # strided upstream grad
    ref = oracle(hidden, weight, targets, 1.0, grad_logprob, grad_entropy)
    wide_hidden = torch.stack([hidden, torch.randn_like(hidden)], dim=-1)[..., 0]  # stride 2 along H
    weight_t = weight.t().contiguous().t()  # column-major storage
    logprob, entropy, grad_hidden, grad_weight = run_public(
        wide_hidden, weight_t, targets, grad_logprob, grad_entropy, backend
    )
    assert max_error(logprob, ref[0]) < 1e-2 and max_error(entropy, ref[1]) < 1e-2
    assert relative_error(grad_hidden, ref[2]) < 1e-2
    assert relative_error(grad_weight, ref[3]) < 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_tokens(backend):
    hidden, weight, targets, grad_logprob, grad_entropy = make_inputs(0, 1000, 32003, torch.bfloat16, 5.0)
    logprob, entropy, grad_hidden, grad_weight = run_public(hidden, weight, targets, grad_logprob, grad_entropy, backend)
    assert logprob.shape == (0,) and entropy.shape == (0,)
    assert grad_hidden.shape == (0, 1000)
    assert grad_weight.shape == weight.shape and not grad_weight.any()


def test_several_token_and_vocabulary_chunks(monkeypatch):
    """The backward's 2-D blocking: partial token chunks, partial vocabulary chunks."""
    from megatron_fused_lm.ops import triton_backend

    monkeypatch.setattr(triton_backend, "BLOCK_BYTES", 1000 * 20000 * 2)  # 7 vocabulary chunks
    hidden, weight, targets, grad_logprob, grad_entropy = make_inputs(2500, 1000, 129920, torch.bfloat16, 5.0, seed=5)
    ref = oracle(hidden, weight, targets, 1.0, grad_logprob, grad_entropy)
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    logprob, entropy = fused_linear_logprob(
        hidden, weight, targets, return_entropy=True, backend="triton", chunk_size=1000
    )
    torch.autograd.backward([logprob, entropy], [grad_logprob, grad_entropy])
    assert relative_error(hidden.grad, ref[2]) < 1e-2
    assert relative_error(weight.grad, ref[3]) < 1e-2
