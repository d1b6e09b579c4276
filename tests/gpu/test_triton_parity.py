"""Triton and torch backends on CUDA against the float64 oracle, with the stock path (materialized
logits in the inputs' dtype, float32 softmax) measured on the same inputs.

Realistic vocabularies (151936, 129920, a prime), hidden sizes 4096 and 1000, bf16/fp16/fp32,
mild and peaky logits, targets owned by other (simulated) tensor-parallel ranks, float32 hidden
with a bf16 weight, ``entropy_grad=False``, non-contiguous inputs, the backward blocked over
several token and vocabulary chunks, and 0 tokens.

Bounds:
- log-prob and entropy: the logits are accumulated in float32 and never rounded to 16 bits, so
  the error scales with the largest logit ``|z|max``: at most ``VALUE_BOUND * |z|max``. Measured on
  an H100 (2026-11-22): up to 7.4e-6 x |z|max for the Triton kernel's tensor-core accumulation over
  the hidden dimension, 3e-6 for the torch backend's cuBLAS products. The stock path rounds the
  logits to 16 bits first: 3.6e-3 x |z|max for bf16, 4e-4 for fp16, so a method sliding toward it
  fails; for 16-bit inputs ours must also stay 10x under the stock error measured on the same inputs.
- gradients: both paths round ``dz`` and the products to the inputs' dtype, so ours may not be
  worse than ``GRAD_SLACK`` times the stock path's own error (measured 0.1-0.25 of it for bf16),
  plus float32 rounding for float32 inputs. A dropped or misplaced term is off by O(1).
"""

from __future__ import annotations

import pytest
import torch

from devkit.oracle import max_abs_error, reference, relative_error
from megatron_fused_lm import fused_linear_logprob, logits_logprob
from megatron_fused_lm.ops.backends.contract import NeededGrads, SavedStatistics, ShardProblem, UpstreamGrads
from megatron_fused_lm.ops.kept_tokens import every_column
from megatron_fused_lm.ops.softmax import merge_statistics, summarize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BACKENDS = ("triton", "torch")
VALUE_BOUND = 2e-5  # times the largest |logit|
GRAD_SLACK = 1.5
FLOAT32_GRAD_FLOOR = 1e-5


def make_inputs(num_tokens, hidden_size, vocab, dtype, logit_scale, seed=0):
    """Hidden and weight whose logits have standard deviation about ``logit_scale``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=gen)
    weight = torch.randn(vocab, hidden_size, device="cuda", generator=gen) * (logit_scale / hidden_size**0.5)
    targets = torch.randint(0, vocab, (num_tokens,), device="cuda", generator=gen)
    grad_logprob = torch.randn(num_tokens, device="cuda", generator=gen)
    grad_entropy = torch.randn(num_tokens, device="cuda", generator=gen)
    return hidden.to(dtype), weight.to(dtype), targets, grad_logprob, grad_entropy


def run(method, hidden, weight, targets, grad_logprob, grad_entropy, temperature=1.0, entropy_grad=True, **options):
    """``(logprob, entropy, grad_hidden, grad_weight)`` of ``stock`` or a backend of ours."""
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    if method == "stock":
        logprob, entropy = logits_logprob(hidden @ weight.t(), targets, temperature=temperature, return_entropy=True)
    else:
        logprob, entropy = fused_linear_logprob(
            hidden,
            weight,
            targets,
            temperature=temperature,
            return_entropy=True,
            entropy_grad=entropy_grad,
            backend=method,
            **options,
        )
    outputs, grads = [logprob], [grad_logprob]
    if entropy_grad:
        outputs.append(entropy)
        grads.append(grad_entropy)
    torch.autograd.backward(outputs, grads)
    return logprob.detach(), entropy.detach(), hidden.grad, weight.grad


def value_bound(hidden, weight, temperature=1.0):
    largest_logit = (hidden.double() @ weight.double().t()).abs().max().item() / temperature
    return VALUE_BOUND * largest_logit


def check_against(expected, results, bound, grad_bounds, label):
    logprob, entropy, grad_hidden, grad_weight = results
    errors = dict(
        logprob=max_abs_error(logprob, expected.logprob),
        entropy=max_abs_error(entropy, expected.entropy),
        grad_hidden=relative_error(grad_hidden, expected.grad_hidden),
        grad_weight=relative_error(grad_weight, expected.grad_weight),
    )
    print(f"{label}: {errors} value bound {bound:.2e} grad bounds {grad_bounds}")
    assert errors["logprob"] <= bound and errors["entropy"] <= bound, (label, errors, bound)
    assert errors["grad_hidden"] <= grad_bounds[0] and errors["grad_weight"] <= grad_bounds[1], (label, errors)
    return errors


def stock_grad_bounds(expected, stock, dtype):
    floor = FLOAT32_GRAD_FLOOR if dtype == torch.float32 else 0.0
    return tuple(
        GRAD_SLACK * relative_error(mine, ref) + floor
        for mine, ref in ((stock[2], expected.grad_hidden), (stock[3], expected.grad_weight))
    )


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
    inputs = make_inputs(num_tokens, hidden_size, vocab, dtype, logit_scale)
    hidden, weight, targets, grad_logprob, grad_entropy = inputs
    temperature = 0.8
    expected = reference(hidden, weight, targets, temperature, grad_logprob, grad_entropy)
    stock = run("stock", *inputs, temperature=temperature)
    stock_error = max_abs_error(stock[0], expected.logprob)
    bound = value_bound(hidden, weight, temperature)
    grad_bounds = stock_grad_bounds(expected, stock, dtype)
    for backend in BACKENDS:
        results = run(backend, *inputs, temperature=temperature)
        assert results[2].dtype == dtype and results[3].dtype == dtype
        errors = check_against(
            expected, results, bound, grad_bounds, f"{backend} (stock log-prob error {stock_error:.2e})"
        )
        if dtype != torch.float32:
            assert errors["logprob"] <= stock_error / 10, (backend, errors, stock_error)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_parity_with_a_temperature_per_row(dtype):
    # Each row its own temperature (0.5 to 2), on peaked logits: the kernels read each row's.
    num_tokens, hidden_size, vocab = 384, 1000, 129920
    inputs = make_inputs(num_tokens, hidden_size, vocab, dtype, 30.0)
    hidden, weight, targets, grad_logprob, grad_entropy = inputs
    temperature = torch.rand(num_tokens, device="cuda", generator=torch.Generator("cuda").manual_seed(5)) * 1.5 + 0.5
    expected = reference(hidden, weight, targets, temperature, grad_logprob, grad_entropy)
    stock = run("stock", *inputs, temperature=temperature)
    stock_error = max_abs_error(stock[0], expected.logprob)
    bound = value_bound(hidden, weight, float(temperature.min()))
    grad_bounds = stock_grad_bounds(expected, stock, dtype)
    for backend in BACKENDS:
        errors = check_against(expected, run(backend, *inputs, temperature=temperature), bound, grad_bounds, backend)
        assert errors["logprob"] <= stock_error / 10, (backend, errors, stock_error)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_several_targets_per_row(dtype):
    # k = 8 ids per row (a teacher's top-k, a repeat among them): log-probs [n, k] and both
    # gradients against the float64 oracle, within the one-target path's bounds on the same inputs.
    num_tokens, hidden_size, vocab, k = 384, 1000, 129920, 8
    inputs = make_inputs(num_tokens, hidden_size, vocab, dtype, 30.0)
    hidden, weight, targets, grad_logprob, grad_entropy = inputs
    gen = torch.Generator("cuda").manual_seed(6)
    ids = torch.randint(0, vocab, (num_tokens, k), device="cuda", generator=gen)
    ids[:, 0], ids[:, 1] = targets, targets
    grad_several = torch.randn(num_tokens, k, device="cuda", generator=gen)
    leaves = [tensor.detach().double().requires_grad_() for tensor in (hidden, weight)]
    log_probs = torch.log_softmax(leaves[0] @ leaves[1].t() / 0.8, dim=-1)
    exact, entropy = log_probs.gather(-1, ids), -(log_probs.exp() * log_probs).sum(-1)
    ((exact * grad_several).sum() + (entropy * grad_entropy).sum()).backward()
    one_target = reference(hidden, weight, targets, 0.8, grad_logprob, grad_entropy)
    stock = run("stock", *inputs, temperature=0.8)
    bound = value_bound(hidden, weight, 0.8)
    grad_bounds = stock_grad_bounds(one_target, stock, dtype)
    for backend in BACKENDS:
        leaf_hidden, leaf_weight = (tensor.detach().requires_grad_() for tensor in (hidden, weight))
        logprob, got_entropy = fused_linear_logprob(
            leaf_hidden, leaf_weight, ids, temperature=0.8, return_entropy=True, backend=backend
        )
        ((logprob * grad_several).sum() + (got_entropy * grad_entropy).sum()).backward()
        assert max_abs_error(logprob, exact) <= bound and max_abs_error(got_entropy, entropy) <= bound, backend
        assert relative_error(leaf_hidden.grad, leaves[0].grad) <= grad_bounds[0], backend
        assert relative_error(leaf_weight.grad, leaves[1].grad) <= grad_bounds[1], backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_targets_on_other_ranks(backend):
    """Simulated TP=3: each shard's statistics from the backend, merged as the collective would,
    and each shard's partial hidden gradient summed as the all-reduce would."""
    from megatron_fused_lm.ops.backends.registry import by_name
    from megatron_fused_lm.ops.options import HeadOptions

    num_tokens, hidden_size, vocab, ranks = 300, 1000, 3 * 43307, 3
    inputs = make_inputs(num_tokens, hidden_size, vocab, torch.bfloat16, 20.0, seed=1)
    hidden, weight, targets, grad_logprob, grad_entropy = inputs
    implementation, options = by_name(backend), HeadOptions(backend=backend)
    shard = vocab // ranks
    stats, shards = [], []
    for rank in range(ranks):
        local = targets - rank * shard
        target_column = torch.where((local >= 0) & (local < shard), local, -1)
        shards.append(
            ShardProblem(
                hidden,
                weight[rank * shard : (rank + 1) * shard],
                target_column,
                torch.ones(num_tokens, device="cuda"),
                every_column(hidden.device),
            )
        )
        stats.append(implementation.local_statistics(shards[-1], options))
    summary = summarize(merge_statistics(torch.stack(stats)))
    saved = SavedStatistics(summary.lse, summary.mean_logit)
    expected = reference(hidden, weight, targets, 1.0, grad_logprob, grad_entropy)
    stock = run("stock", *inputs)
    grad_hidden = torch.zeros(num_tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
    grad_weight = []
    for problem in shards:
        grads = implementation.local_gradients(
            problem, saved, UpstreamGrads(grad_logprob, grad_entropy), NeededGrads(hidden=True, weight=True), options
        )
        assert grads.hidden.dtype == torch.bfloat16  # the contract: partials in hidden's dtype
        grad_hidden += grads.hidden
        grad_weight.append(grads.weight)
    results = (summary.logprob, summary.entropy, grad_hidden, torch.cat(grad_weight))
    # The three partials are summed in bf16 as a bf16 all-reduce sums them: one more rounding.
    grad_bounds = tuple(2 * bound for bound in stock_grad_bounds(expected, stock, torch.bfloat16))
    check_against(expected, results, value_bound(hidden, weight), grad_bounds, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_hidden_with_bfloat16_weight(backend):
    hidden, weight, targets, grad_logprob, grad_entropy = make_inputs(256, 1000, 129920, torch.float32, 5.0, seed=2)
    weight = weight.bfloat16()
    hidden_rounded = hidden.bfloat16()  # the product runs in the weight's dtype
    expected = reference(hidden_rounded, weight, targets, 1.0, grad_logprob, grad_entropy)
    stock = run("stock", hidden_rounded, weight, targets, grad_logprob, grad_entropy)
    results = run(backend, hidden, weight, targets, grad_logprob, grad_entropy)
    assert results[2].dtype == torch.float32 and results[3].dtype == torch.bfloat16
    check_against(
        expected,
        results,
        value_bound(hidden_rounded, weight),
        stock_grad_bounds(expected, stock, torch.bfloat16),
        backend,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_as_metric_only(backend):
    inputs = make_inputs(256, 4096, 151936, torch.bfloat16, 5.0, seed=3)
    hidden, weight, targets, grad_logprob, _ = inputs
    expected = reference(hidden, weight, targets, 1.0, grad_logprob)
    stock = run("stock", *inputs, entropy_grad=False)
    results = run(backend, *inputs, entropy_grad=False)
    assert not results[1].requires_grad
    check_against(
        expected, results, value_bound(hidden, weight), stock_grad_bounds(expected, stock, torch.bfloat16), backend
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    hidden, weight, targets, _, grad_entropy = make_inputs(300, 1000, 32003, torch.bfloat16, 5.0, seed=4)
    grad_logprob = torch.randn(600, device="cuda")[::2]  # strided upstream grad
    expected = reference(hidden, weight, targets, 1.0, grad_logprob, grad_entropy)
    stock = run("stock", hidden, weight, targets, grad_logprob, grad_entropy)
    wide_hidden = torch.stack([hidden, torch.randn_like(hidden)], dim=-1)[..., 0]  # stride 2 along H
    weight_t = weight.t().contiguous().t()  # column-major storage
    results = run(backend, wide_hidden, weight_t, targets, grad_logprob, grad_entropy)
    check_against(
        expected, results, value_bound(hidden, weight), stock_grad_bounds(expected, stock, torch.bfloat16), backend
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_tokens(backend):
    hidden, weight, targets, grad_logprob, grad_entropy = make_inputs(0, 1000, 32003, torch.bfloat16, 5.0)
    logprob, entropy, grad_hidden, grad_weight = run(backend, hidden, weight, targets, grad_logprob, grad_entropy)
    assert logprob.shape == (0,) and entropy.shape == (0,)
    assert grad_hidden.shape == (0, 1000)
    assert grad_weight.shape == weight.shape and not grad_weight.any()


def test_backward_blocked_over_token_and_vocabulary_chunks():
    """Partial token chunks and partial vocabulary chunks of the Triton backward (the backend
    itself, as the ops call it, with a small dz block)."""
    from megatron_fused_lm.ops.backends.triton import TritonBackend
    from megatron_fused_lm.ops.backends.triton_tuning import TritonTuning
    from megatron_fused_lm.ops.options import HeadOptions

    inputs = make_inputs(2500, 1000, 129920, torch.bfloat16, 5.0, seed=5)
    hidden, weight, targets, grad_logprob, grad_entropy = inputs
    expected = reference(hidden, weight, targets, 1.0, grad_logprob, grad_entropy)
    stock = run("stock", *inputs)
    blocked = TritonBackend(TritonTuning(dz_block_bytes=1000 * 20000 * 2))  # 3 x 7 blocks of 1000 rows
    options = HeadOptions(backend=blocked.name, token_chunk=1000)
    problem = ShardProblem(
        hidden, weight, targets, torch.ones(hidden.shape[0], device="cuda"), every_column(hidden.device)
    )
    summary = summarize(blocked.local_statistics(problem, options))
    grads = blocked.local_gradients(
        problem,
        SavedStatistics(summary.lse, summary.mean_logit),
        UpstreamGrads(grad_logprob, grad_entropy),
        NeededGrads(hidden=True, weight=True),
        options,
    )
    results = (summary.logprob, summary.entropy, grads.hidden, grads.weight)
    check_against(
        expected, results, value_bound(hidden, weight), stock_grad_bounds(expected, stock, torch.bfloat16), "blocked"
    )
