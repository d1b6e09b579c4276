"""A temperature per token on every op, against the float64 oracle (``devkit.oracle``, which
divides each row's logits by its own temperature): the four-GEMM ``fused_linear_logprob``, the
three-GEMM ``fused_linear_loss`` and ``fused_linear_cross_entropy`` (whose second pass, for an
upstream gradient it did not hold for, reads the temperatures again), the unfused ``logits_*`` ops
and ``fused_linear_topk``; with masks, ``max_rows``, peaked rows and several chunks; the errors for
temperatures that cannot be right. The Triton kernels' handling is in test_triton_interpreter.py,
tensor parallelism in test_ops_tensor_parallel.py and test_ops_loss_tensor_parallel.py.

Temperatures range from 0.25 to 4, so a row read with another row's temperature is off by O(1).
Tolerances: float32 inputs within ``FLOAT32_TOL`` of the oracle, as in test_ops_loss.py.
"""

import pytest
import torch

from devkit.oracle import loss_reference, make_case, reference, reference_from_logits, relative_error, within_recompute
from megatron_fused_lm import (
    fused_linear_cross_entropy,
    fused_linear_logprob,
    fused_linear_loss,
    fused_linear_topk,
    logits_logprob,
    logits_loss,
    losses,
)

H, V = 24, 97
LEAD = (3, 10)
FLOAT32_TOL = 2e-5


def per_row(seed=5, shape=LEAD):
    """Temperatures from 0.25 to 4, log-uniform: ``[*shape]`` float32."""
    return torch.exp2(torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 4 - 2)


def leaves(*tensors):
    return [tensor.detach().clone().requires_grad_() for tensor in tensors]


@pytest.mark.parametrize("peaky", [False, True], ids=["flat", "peaky"])
@pytest.mark.parametrize("token_chunk", [None, 7])
def test_fused_linear_logprob_per_row(peaky, token_chunk):
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=peaky, seed=1)
    temperature = per_row()
    grad_logprob, grad_entropy = torch.randn(LEAD), torch.randn(LEAD)
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    logprob, entropy = fused_linear_logprob(
        leaf_hidden, leaf_weight, targets, temperature=temperature, return_entropy=True, token_chunk=token_chunk
    )
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    expected = reference(hidden, weight, targets, temperature, grad_logprob, grad_entropy)
    assert relative_error(logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(entropy, expected.entropy) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad, expected.grad_weight) <= FLOAT32_TOL


@pytest.mark.parametrize("max_rows", [None, 20])
def test_masked_rows_take_their_own_temperature(max_rows):
    # The selected rows are gathered: each must keep its own temperature, not the one of the
    # row that lands in its slot.
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=False, seed=2)
    temperature = per_row(seed=6)
    mask = torch.rand(LEAD, generator=torch.Generator().manual_seed(3)) < 0.5
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    logprob = fused_linear_logprob(
        leaf_hidden, leaf_weight, targets, temperature=temperature, mask=mask, max_rows=max_rows
    )
    logprob.sum().backward()
    expected = reference(hidden, weight, targets, temperature, grad_logprob=mask.double())
    assert relative_error(logprob[mask], expected.logprob[mask]) <= FLOAT32_TOL
    assert torch.count_nonzero(logprob[~mask]) == 0
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad, expected.grad_weight) <= FLOAT32_TOL


def test_a_0_dim_tensor_is_the_same_temperature_for_every_row():
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=False, seed=3)
    as_number = fused_linear_logprob(hidden, weight, targets, temperature=0.7, return_entropy=True)
    as_tensor = fused_linear_logprob(hidden, weight, targets, temperature=torch.tensor(0.7), return_entropy=True)
    for number, tensor in zip(as_number, as_tensor, strict=True):
        torch.testing.assert_close(tensor, number, rtol=0, atol=0)


@pytest.mark.parametrize("token_chunk", [None, 4])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
def test_fused_linear_loss_per_row(token_chunk, masked):
    # The clipped policy loss with an entropy bonus and a KL term, three GEMMs, against the oracle.
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=True, seed=4)
    temperature = per_row(seed=7)
    mask = torch.rand(LEAD, generator=torch.Generator().manual_seed(8)) < 0.6 if masked else None
    weights = losses.token_mean_weights(torch.ones(LEAD, dtype=torch.bool) if mask is None else mask)
    generator = torch.Generator().manual_seed(9)
    loss_inputs = {
        "old_logprob": reference(hidden, weight, targets, temperature).logprob.float() + 0.1 * torch.randn(LEAD, generator=generator),
        "ref_logprob": reference(hidden, weight, targets, temperature).logprob.float(),
        "advantages": torch.randn(LEAD, generator=generator),
        "weight": weights,
    }  # fmt: skip
    loss_fn = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01, kl_coef=0.05)
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    result = fused_linear_loss(
        leaf_hidden, leaf_weight, targets, loss_fn, loss_inputs=loss_inputs, temperature=temperature, mask=mask,
        token_chunk=token_chunk,
    )  # fmt: skip
    result.loss.backward()
    expected = loss_reference(hidden, weight, targets, loss_fn, loss_inputs, temperature, mask)
    # Logits reach about 100 here (peaked rows at temperature 0.25) and the loss sums terms of both
    # signs, so float32 rounding alone comes near the tolerance: the bound is 1.2 times the
    # recompute path's own error on the same inputs (the loss on fused_linear_logprob), or it.
    recompute_hidden, recompute_weight = leaves(hidden, weight)
    logprob, entropy = fused_linear_logprob(
        recompute_hidden, recompute_weight, targets, temperature=temperature, return_entropy=True, mask=mask
    )
    rows = torch.ones(LEAD, dtype=torch.bool) if mask is None else mask
    inputs = {name: value[rows] for name, value in loss_inputs.items()}
    recompute_loss = loss_fn(logprob[rows], entropy[rows], **inputs).sum()
    recompute_loss.backward()
    for actual, recompute, exact in (
        (result.loss, recompute_loss, expected.loss),
        (result.logprob, logprob, expected.logprob),
        (result.entropy, entropy, expected.entropy),
        (leaf_hidden.grad, recompute_hidden.grad, expected.grad_hidden),
        (leaf_weight.grad, recompute_weight.grad, expected.grad_weight),
    ):
        assert within_recompute(actual, recompute, exact, FLOAT32_TOL)
    # The unfused path on the materialized logits gives the same loss.
    logits = leaves(hidden @ weight.t())[0]
    stock = logits_loss(logits, targets, loss_fn, loss_inputs=loss_inputs, temperature=temperature, mask=mask)
    assert relative_error(stock.loss, expected.loss) <= max(
        FLOAT32_TOL, 1.2 * relative_error(recompute_loss, expected.loss)
    )


@pytest.mark.parametrize("matching", [True, False], ids=["declared", "second_pass"])
def test_fused_linear_cross_entropy_per_row(matching):
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=True, seed=5)
    temperature = per_row(seed=10)
    declared = (torch.rand(LEAD, generator=torch.Generator().manual_seed(11)) < 0.7).float()
    per_token = (lambda out: out * declared * 0.37) if matching else (lambda out: out**2)
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    out = fused_linear_cross_entropy(
        leaf_hidden, leaf_weight, targets, declared, temperature=temperature, token_chunk=7
    )
    per_token(out).sum().backward()
    expected = loss_reference(
        hidden, weight, targets, lambda logprob, entropy: per_token(-logprob.view(LEAD)).reshape(-1), None, temperature
    )
    assert relative_error(out, -expected.logprob) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad, expected.grad_weight) <= FLOAT32_TOL


def test_logits_logprob_per_row():
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=True, seed=6)
    temperature = per_row(seed=12)
    logits = leaves(hidden @ weight.t())[0]
    grad_logprob, grad_entropy = torch.randn(LEAD), torch.randn(LEAD)
    logprob, entropy = logits_logprob(logits, targets, temperature=temperature, return_entropy=True, token_chunk=4)
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    expected = reference_from_logits(logits.detach(), targets, temperature, grad_logprob, grad_entropy)
    assert relative_error(logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(entropy, expected.entropy) <= FLOAT32_TOL
    assert relative_error(logits.grad, expected.grad_logits) <= FLOAT32_TOL


def test_topk_per_row():
    hidden, weight, _ = make_case(LEAD, H, V, torch.float32, peaky=False, seed=7)
    temperature = per_row(seed=13)
    logprobs, ids = fused_linear_topk(hidden, weight, 5, temperature=temperature, token_chunk=7)
    expected = torch.log_softmax(hidden.double() @ weight.double().t() / temperature.double()[..., None], -1)
    top = expected.topk(5, dim=-1)
    assert torch.equal(ids, top.indices)
    assert relative_error(logprobs, top.values) <= FLOAT32_TOL


def test_interleaved_calls_keep_their_own_temperatures():
    # A trainer's sequence: old log-probs under no_grad at one set of temperatures, then two
    # micro-batches' forwards at others, backwards in reverse order.
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=True, seed=8)
    first, second = per_row(seed=14), per_row(seed=15)
    with torch.no_grad():
        old = fused_linear_logprob(hidden, weight, targets, temperature=first)
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    out_first = fused_linear_logprob(leaf_hidden, leaf_weight, targets, temperature=first)
    out_second = fused_linear_logprob(leaf_hidden, leaf_weight, targets, temperature=second)
    out_second.sum().backward(retain_graph=True)
    out_first.sum().backward()
    expected_first = reference(hidden, weight, targets, first, grad_logprob=torch.ones(LEAD))
    expected_second = reference(hidden, weight, targets, second, grad_logprob=torch.ones(LEAD))
    assert relative_error(old, expected_first.logprob) <= FLOAT32_TOL
    assert relative_error(out_second, expected_second.logprob) <= FLOAT32_TOL
    summed = expected_first.grad_hidden + expected_second.grad_hidden
    assert relative_error(leaf_hidden.grad, summed) <= FLOAT32_TOL


@pytest.mark.parametrize(
    "temperature,error,match",
    [
        (torch.ones(3, 9), ValueError, "one per row"),
        (torch.ones(30), ValueError, "one per row"),
        (torch.ones(LEAD, dtype=torch.long), TypeError, "float tensor"),
        (torch.ones(LEAD).requires_grad_(), ValueError, "no gradient"),
        (torch.ones(LEAD).index_fill(1, torch.tensor([3]), 0.0), ValueError, "positive and finite"),
        (torch.ones(LEAD).index_fill(0, torch.tensor([1]), float("inf")), ValueError, "positive and finite"),
        (torch.ones(LEAD).index_fill(0, torch.tensor([2]), float("nan")), ValueError, "positive and finite"),
        (-1.0, ValueError, "positive finite number"),
        ("0.7", TypeError, "temperature"),
    ],
)
def test_temperatures_that_cannot_be_right_are_refused(temperature, error, match):
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=False, seed=9)
    calls = [
        lambda: fused_linear_logprob(hidden, weight, targets, temperature=temperature),
        lambda: fused_linear_loss(hidden, weight, targets, losses.cross_entropy, temperature=temperature),
        lambda: logits_logprob(hidden @ weight.t(), targets, temperature=temperature),
        lambda: fused_linear_topk(hidden, weight, 3, temperature=temperature),
    ]
    for call in calls:
        with pytest.raises(error, match=match):
            call()


@pytest.mark.parametrize("max_rows", [None, 25])
def test_a_masked_out_row_may_hold_any_temperature(max_rows):
    # Rows the mask leaves out are not read: a 0 there (a padding position) is no error, also where
    # max_rows pads the selection with the last row (masked out here).
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=False, seed=10)
    mask = torch.ones(LEAD, dtype=torch.bool)
    mask[0, :4] = False
    mask[-1, -1] = False
    temperature = per_row(seed=16).masked_fill(~mask, 0.0)
    logprob = fused_linear_logprob(hidden, weight, targets, temperature=temperature, mask=mask, max_rows=max_rows)
    expected = reference(hidden, weight, targets, temperature.masked_fill(~mask, 1.0))
    assert relative_error(logprob[mask], expected.logprob[mask]) <= FLOAT32_TOL


def test_a_temperature_made_under_inference_mode_trains():
    # Rollout code often makes its tensors under inference_mode; the ops keep their own copy.
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=False, seed=11)
    with torch.inference_mode():
        temperature = per_row(seed=17) + 0.0
    expected = reference(hidden, weight, targets, temperature, grad_logprob=-torch.ones(LEAD))
    for three_gemm in (False, True):
        leaf_hidden, leaf_weight = leaves(hidden, weight)
        if three_gemm:
            loss = fused_linear_loss(
                leaf_hidden, leaf_weight, targets, losses.cross_entropy, loss_inputs={"weight": torch.ones(LEAD)},
                temperature=temperature,
            ).loss  # fmt: skip
        else:
            loss = -fused_linear_logprob(leaf_hidden, leaf_weight, targets, temperature=temperature).sum()
        loss.backward()
        assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
        assert relative_error(leaf_weight.grad, expected.grad_weight) <= FLOAT32_TOL


def test_one_temperature_reaches_the_backends_as_one_value():
    # A number or a 0-dim tensor: a stride-0 view, which the Triton kernels read as one scalar.
    from megatron_fused_lm.ops.inputs import RowSelection, row_temperatures

    selection = RowSelection(torch.Size(LEAD), None, None, None)
    for temperature in (0.7, torch.tensor(0.7)):
        rows = row_temperatures(temperature, selection, torch.device("cpu"))
        assert rows.shape == (30,) and rows.stride() == (0,) and float(rows[0]) == pytest.approx(0.7)
