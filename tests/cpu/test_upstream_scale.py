"""Every gradient follows the upstream scale exactly once: the loss times 0.37 (what Megatron's
schedule and a loss normalization put on it after the forward) gives each gradient times 0.37.

Per path (the recompute op, the loss-in-forward op, the declared cross-entropy) and per dtype
(float32 and bfloat16 operands; a 16-bit weight gradient is held in two float32 halves), each of
the hidden and the weight gradient is compared with 0.37 times the float64 oracle's. The bound is
twice the same gradient's error at scale 1 (rounding, which the scale does not change): a gradient
that skipped the scale, or took it twice, is off by 63 % or 170 % of its entries. The Triton
backend holds its gradients in the same objects; its scaling kernel is compared with the torch code
it replaces in test_triton_interpreter.py.
"""

import gc
import logging

import pytest
import torch

from devkit.oracle import loss_reference, make_case, policy_loss_inputs, reference, relative_error
from megatron_fused_lm import (
    fused_linear_cross_entropy,
    fused_linear_logprob,
    fused_linear_loss,
    losses,
    outstanding_weight_grads,
    weight_grad_corrections,
)

SCALE = 0.37
ROWS, HIDDEN, VOCAB = 23, 16, 97
POLICY = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.1, kl_coef=0.05)


def case(dtype):
    hidden, weight, targets = make_case((ROWS,), HIDDEN, VOCAB, dtype, peaky=False, seed=3)
    generator = torch.Generator().manual_seed(4)
    true_logprob = reference(hidden, weight, targets).logprob
    inputs = policy_loss_inputs(true_logprob, torch.rand(ROWS, generator=generator), generator)
    upstream = torch.randn(2, ROWS, generator=generator)
    return hidden, weight, targets, inputs, upstream


def recompute(hidden, weight, targets, inputs, upstream):
    logprob, entropy = fused_linear_logprob(hidden, weight, targets, return_entropy=True, token_chunk=7)
    expected = reference(hidden, weight, targets, 1.0, upstream[0], upstream[1])
    return (logprob * upstream[0]).sum() + (entropy * upstream[1]).sum(), expected


def loss_in_forward(hidden, weight, targets, inputs, upstream):
    result = fused_linear_loss(hidden, weight, targets, POLICY, loss_inputs=inputs, token_chunk=7)
    return result.loss, loss_reference(hidden, weight, targets, POLICY, inputs)


def declared_cross_entropy(hidden, weight, targets, inputs, upstream):
    declared = inputs["weight"]
    per_token = fused_linear_cross_entropy(hidden, weight, targets, declared, token_chunk=7)
    expected = loss_reference(hidden, weight, targets, losses.cross_entropy, {"weight": declared})
    return (per_token * declared).sum(), expected


def gradient_errors(path, dtype, scale):
    hidden, weight, targets, inputs, upstream = case(dtype)
    hidden.requires_grad_()
    weight.requires_grad_()
    loss, expected = path(hidden, weight, targets, inputs, upstream)
    (loss * scale).backward()
    return [
        relative_error(grad, scale * expected_grad)
        for grad, expected_grad in ((hidden.grad, expected.grad_hidden), (weight.grad, expected.grad_weight))
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("path", [recompute, loss_in_forward, declared_cross_entropy], ids=lambda path: path.__name__)
def test_each_gradient_takes_the_upstream_scale_once(path, dtype):
    unscaled = gradient_errors(path, dtype, 1.0)
    scaled = gradient_errors(path, dtype, SCALE)
    for name, at_one, at_scale in zip(("hidden", "weight"), unscaled, scaled, strict=True):
        assert at_one <= (1e-5 if dtype == torch.float32 else 2e-2), (name, at_one)
        assert at_scale <= 2 * at_one + 1e-6, (name, at_scale, at_one)


@pytest.mark.parametrize("narrow_in_place", [True, False], ids=["in-place", "new-memory"])
def test_the_held_weight_gradient_is_narrowed_once_scaled_in_every_step(monkeypatch, narrow_in_place):
    # A first step of 3 rows makes the in-place narrowing take six steps over the first half (3, 3,
    # 6, 12, 24 and 1 rows), each writing over float32 rows an earlier step read: a step that wrote
    # over rows not yet read would leave entries far from the oracle's.
    from megatron_fused_lm.ops.backends import contract
    from megatron_fused_lm.ops.backends.torch_loss import TorchLoss

    monkeypatch.setattr(contract, "NARROWING_SHARE", 17)  # a first step of ceil(49 / 17) = 3 rows
    generator = torch.Generator().manual_seed(5)
    held = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
    parts = [held[:49].float().clone(), held[49:].float().clone()]
    first_address = parts[0].data_ptr()
    grad_weight = contract.finish_weight(
        parts, torch.tensor(SCALE), torch.bfloat16, narrow_in_place, TorchLoss.scaled_copy
    )
    assert [step.stop for step in contract.narrowing_steps(49)] == [3, 6, 12, 24, 48, 49]
    expected = (held.float().double() * SCALE).to(torch.bfloat16)
    assert grad_weight.dtype == torch.bfloat16 and grad_weight.shape == (VOCAB, HIDDEN)
    # One rounding of the float32 product: within one bfloat16 step of the float64 oracle's.
    torch.testing.assert_close(grad_weight.double(), expected.double(), rtol=2**-8, atol=0)
    assert (grad_weight.data_ptr() == first_address) == narrow_in_place


@pytest.mark.parametrize("peaky", [False, True], ids=["flat", "peaked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("declared", [SCALE, 1.0], ids=["declared-scale", "other-scale"])
def test_weight_grad_into_receives_the_scaled_weight_gradient_once(declared, dtype, peaky):
    # The forward adds `declared` times the weight gradient into the accumulator; the loss then
    # receives SCALE. Declared right, nothing more happens; declared wrong, the backward adds the
    # difference. Either way the accumulator gains SCALE times the float64 oracle's gradient,
    # never rounded (float32 products), and the weight gets no autograd gradient.
    hidden, weight, targets = make_case((ROWS,), HIDDEN, VOCAB, dtype, peaky=peaky, seed=3)
    generator = torch.Generator().manual_seed(4)
    inputs = policy_loss_inputs(
        reference(hidden, weight, targets).logprob, torch.rand(ROWS, generator=generator), generator
    )
    expected = loss_reference(hidden, weight, targets, POLICY, inputs)
    before = 1e-2 * torch.randn(VOCAB, HIDDEN, generator=generator)  # about the gradient's size
    accumulator = before.clone()
    hidden.requires_grad_()
    weight.requires_grad_()
    weight_grad_corrections()  # what earlier tests left
    result = fused_linear_loss(
        hidden, weight, targets, POLICY, loss_inputs=inputs, token_chunk=7, weight_grad_into=accumulator,
        weight_grad_scale=declared,
    )  # fmt: skip
    (result.loss * SCALE).backward()
    assert weight.grad is None
    assert weight_grad_corrections() == (0 if declared == SCALE else 1)  # the second pass, counted once
    assert weight_grad_corrections() == 0
    added = (accumulator.double() - before.double()) / SCALE
    # float32 products over float32 or bf16 operands, then one float32 sum with `before`.
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    assert relative_error(added, expected.grad_weight) <= bound
    assert relative_error(hidden.grad, SCALE * expected.grad_hidden) <= 2 * bound


def test_weight_grad_into_is_checked_and_left_alone_without_a_weight_gradient():
    hidden, weight, targets, inputs, _ = case(torch.float32)
    call = dict(loss_inputs=inputs, token_chunk=7)
    with pytest.raises(TypeError, match="weight_grad_into must be float32"):
        fused_linear_loss(
            hidden, weight.requires_grad_(), targets, POLICY, weight_grad_into=weight.detach().double(), **call
        )
    with pytest.raises(ValueError, match="the weight's shape"):
        fused_linear_loss(hidden, weight, targets, POLICY, weight_grad_into=torch.zeros(VOCAB, HIDDEN + 1), **call)
    with pytest.raises(ValueError, match="weight_grad_scale must be a finite nonzero"):
        fused_linear_loss(
            hidden, weight, targets, POLICY, weight_grad_into=torch.zeros(VOCAB, HIDDEN), weight_grad_scale=0.0, **call
        )
    accumulator = torch.zeros(VOCAB, HIDDEN)
    with torch.no_grad():
        fused_linear_loss(hidden, weight, targets, POLICY, weight_grad_into=accumulator, **call)
    assert not accumulator.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("upstream", ["declared", "other-scale", "not-proportional"])
def test_declared_cross_entropy_into_weight_grad_into_is_exact_for_any_upstream(upstream, dtype):
    # Declared: SCALE times the weights. What arrives: that; the weights times 1.0; or random
    # per-token values. Each time the accumulator gains the weight gradient of what arrived and the
    # hidden gradient is that of what arrived, against the float64 oracle.
    hidden, weight, targets = make_case((ROWS,), HIDDEN, VOCAB, dtype, peaky=True, seed=5)
    generator = torch.Generator().manual_seed(6)
    declared = torch.rand(ROWS, generator=generator)
    arriving = {
        "declared": SCALE * declared,
        "other-scale": declared,
        "not-proportional": torch.randn(ROWS, generator=generator),
    }[upstream]
    expected = loss_reference(hidden, weight, targets, losses.cross_entropy, {"weight": arriving})
    before = 1e-2 * torch.randn(VOCAB, HIDDEN, generator=generator)
    accumulator = before.clone()
    hidden.requires_grad_()
    weight.requires_grad_()
    per_token = fused_linear_cross_entropy(
        hidden, weight, targets, declared, token_chunk=7, weight_grad_into=accumulator, weight_grad_scale=SCALE
    )
    (per_token * arriving).sum().backward()
    assert weight.grad is None
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    assert relative_error(accumulator.double() - before.double(), expected.grad_weight) <= bound
    assert relative_error(hidden.grad, expected.grad_hidden) <= 2 * bound


def test_weight_grad_into_refuses_a_fullgraph_compile_by_name():
    # The correction may need a host synchronization and a second pass: eager only, said plainly.
    hidden, weight, targets, inputs, _ = case(torch.float32)
    accumulator = torch.zeros(VOCAB, HIDDEN)

    def step(hidden, weight):
        return fused_linear_loss(hidden, weight, targets, POLICY, loss_inputs=inputs, weight_grad_into=accumulator).loss

    with pytest.raises(Exception, match="weight_grad_into runs eagerly only"):
        torch.compile(step, fullgraph=True)(hidden.requires_grad_(), weight.requires_grad_())


def test_a_backward_without_the_weight_grad_into_its_forward_added_into_is_refused():
    # The compiled backward's operator has no accumulator: a held pass that added into one must not
    # put its correction into parts that nobody reads.
    from megatron_fused_lm.ops.loss_pass.held import Held, HeldSpec, finish
    from megatron_fused_lm.ops.options import HeadOptions

    spec = HeldSpec(
        per_token=False, has_weight_grad_into=True, weight_grad_scale=0.5, parts=0, correctable=True,
        dtype=torch.float32,
    )  # fmt: skip
    held = Held(torch.zeros(4, HIDDEN), [], None, None, None, None)
    with pytest.raises(RuntimeError, match="weight_grad_into runs eagerly only"):
        finish(spec, HeadOptions(), held, torch.tensor(1.0), None, narrow=False)


def test_a_loss_released_without_its_backward_is_reported_at_once_and_listed(caplog, monkeypatch):
    # The forward adds into the accumulator. Then the loss gets its backward (nothing to report,
    # nothing read back from the device when its graph goes), waits for it (listed as waiting), is
    # dropped (logged at once, with its value, and listed until forgotten), or the forward fails
    # part way (logged and listed). Another accumulator's list stays empty.
    from megatron_fused_lm.ops.loss_pass import weight_grad

    described = []
    sentence = weight_grad.PendingWeightGrad._sentence
    monkeypatch.setattr(
        weight_grad.PendingWeightGrad,
        "_sentence",
        lambda self, state: described.append(state) or sentence(self, state),
    )
    hidden, weight, targets, inputs, _ = case(torch.float32)
    hidden.requires_grad_()
    weight.requires_grad_()
    accumulator, other = torch.zeros(VOCAB, HIDDEN), torch.zeros(VOCAB, HIDDEN)
    row = torch.arange(ROWS, dtype=torch.float32)

    def loss(loss_fn=POLICY, **extra):
        return fused_linear_loss(
            hidden, weight, targets, loss_fn, loss_inputs={**inputs, **extra}, token_chunk=7,
            weight_grad_into=accumulator, weight_grad_scale=SCALE,
        ).loss  # fmt: skip

    def fails_on_the_second_chunk(logprob, entropy, *, row, **policy_inputs):
        if row.min() >= 7:
            raise RuntimeError("a NaN check, say")
        return POLICY(logprob, entropy, **policy_inputs)

    with caplog.at_level(logging.WARNING, logger="megatron_fused_lm"):
        kept = loss()
        (waiting,) = outstanding_weight_grads(accumulator)
        assert "waits for its backward" in waiting and f"{ROWS} rows" in waiting, waiting
        described.clear()
        (kept * SCALE).backward()
        del kept
        gc.collect()
        assert outstanding_weight_grads(accumulator) == [] and not caplog.records
        assert described == [], "a loss whose backward ran was described (its value read back)"

        dropped = loss()
        value = f"{dropped.item():.6g}"
        del dropped
        (warning,) = [record.getMessage() for record in caplog.records]
        assert "released without its backward" in warning and value in warning, warning
        assert f"weight_grad_into {[VOCAB, HIDDEN]}" in warning, warning
        assert outstanding_weight_grads(other) == []
        (listed,) = outstanding_weight_grads(accumulator)
        assert "released without its backward" in listed and value in listed, listed
        assert outstanding_weight_grads(accumulator) == [listed], "a released loss stays listed until forgotten"
        assert outstanding_weight_grads(accumulator, forget_released=True) == [listed]
        assert outstanding_weight_grads(accumulator) == []

        per_token = fused_linear_cross_entropy(
            hidden, weight, targets, torch.ones(ROWS), weight_grad_into=accumulator, weight_grad_scale=SCALE
        )
        del per_token
        with pytest.raises(RuntimeError, match="a NaN check"):
            loss(fails_on_the_second_chunk, row=row)
        messages = [record.getMessage() for record in caplog.records[1:]]
        assert len(messages) == 2 and "released without its backward" in messages[0], messages
        assert "stopped with an exception part way" in messages[1], messages
        assert len(outstanding_weight_grads(forget_released=True)) == 2 and outstanding_weight_grads() == []
