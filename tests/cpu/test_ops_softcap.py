"""``softcap``: Gemma-2's logit softcapping, ``z = softcap * tanh(h . w / softcap) / T``, on every op
against the float64 oracle (``devkit.oracle.capped``): log-probs, entropy and both gradients of the
four-GEMM op (one temperature and one per row, kept sets, several targets), the three-GEMM losses
into autograd and into a ``weight_grad_into`` (a trainer's old log-probs under ``no_grad``, then the
loss), the labels path, top-k, the logits ops, two gloo ranks, and the errors.

The peaked rows here reach logits of about 100 against a cap of 30, so tanh saturates on their
largest columns (slope near 5e-3) while the rest sit on its linear part: a cap left out, applied
after the temperature, or missing from a gradient costs O(1). Tolerance: float32 accuracy
(``FLOAT32_TOL``, as test_ops_vocab_size.py).
"""

import pytest
import torch
import torch.distributed as dist

from devkit.oracle import (
    capped,
    loss_reference,
    make_case,
    max_abs_error,
    reference,
    reference_from_logits,
    relative_error,
)
from devkit.spawn import run_ranks
from megatron_fused_lm import (
    fused_linear_cross_entropy,
    fused_linear_logprob,
    fused_linear_loss,
    fused_linear_topk,
    logits_logprob,
    logits_loss,
    logits_topk,
    losses,
)

H, V = 24, 104
LEAD = (3, 10)
CAP = 30.0
FLOAT32_TOL = 2e-5
POLICY = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)


def capped_case(seed, lead=LEAD):
    """A peaked case whose largest logits are about 100, where ``tanh(z / 30)`` saturates."""
    hidden, weight, targets = make_case(lead, H, V, torch.float32, peaky=True, seed=seed)
    hidden = hidden * (100 / float((hidden @ weight.t()).abs().max()))
    return hidden, weight, targets


def leaves(*tensors):
    return [tensor.detach().clone().requires_grad_() for tensor in tensors]


def test_the_case_saturates_and_the_cap_matters():
    hidden, weight, targets = capped_case(seed=0)
    logits = hidden.double() @ weight.double().t()
    slope = 1 - torch.tanh(logits / CAP) ** 2
    assert float(slope.min()) < 1e-2 and float(slope.max()) > 0.99
    uncapped = reference(hidden, weight, targets).logprob
    assert max_abs_error(uncapped, reference(hidden, weight, targets, softcap=CAP).logprob) > 1.0


@pytest.mark.parametrize("temperature", ["one", "per_row"])
@pytest.mark.parametrize("token_chunk", [None, 7])
def test_log_probs_entropy_and_gradients(temperature, token_chunk):
    hidden, weight, targets = capped_case(seed=1)
    temperature = 0.8 if temperature == "one" else torch.rand(LEAD, generator=torch.Generator().manual_seed(2)) + 0.5
    grad_logprob, grad_entropy = torch.randn(LEAD), torch.randn(LEAD)
    expected = reference(hidden, weight, targets, temperature, grad_logprob, grad_entropy, softcap=CAP)
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    logprob, entropy = fused_linear_logprob(
        leaf_hidden,
        leaf_weight,
        targets,
        temperature=temperature,
        return_entropy=True,
        token_chunk=token_chunk,
        softcap=CAP,
    )
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    assert relative_error(logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(entropy, expected.entropy) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad, expected.grad_weight) <= FLOAT32_TOL


def test_kept_sets_and_several_targets():
    hidden, weight, targets = capped_case(seed=3, lead=(6,))
    grad_logprob = torch.randn(6)
    offsets = torch.arange(0, 6 * 5 + 1, 5)
    ids = torch.stack([(targets + shift) % V for shift in range(5)], 1).reshape(-1)
    kept = torch.zeros(6, V, dtype=torch.bool)
    kept[torch.arange(6).repeat_interleave(5), ids] = True
    expected = reference(hidden, weight, targets, 1.0, grad_logprob, torch.ones(6), kept=kept, softcap=CAP)
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    logprob, entropy = fused_linear_logprob(
        leaf_hidden, leaf_weight, targets, return_entropy=True, kept_tokens=(offsets, ids), softcap=CAP
    )
    ((logprob * grad_logprob).sum() + entropy.sum()).backward()
    assert relative_error(logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad, expected.grad_weight) <= FLOAT32_TOL
    # A teacher's 4 ids per row, one of them the row's largest logit (saturated), one repeated.
    teacher = torch.stack([targets, (hidden @ weight.t()).argmax(-1), (targets + 3) % V, targets], 1)
    grad_teacher = torch.randn(6, 4)
    expected = reference(hidden, weight, teacher, 1.0, grad_teacher, None, softcap=CAP)
    for op in ("recompute", "three_gemm"):
        leaf_hidden, leaf_weight = leaves(hidden, weight)
        if op == "recompute":
            got = fused_linear_logprob(leaf_hidden, leaf_weight, teacher, softcap=CAP)
            (got * grad_teacher).sum().backward()
        else:
            result = fused_linear_loss(
                leaf_hidden,
                leaf_weight,
                teacher,
                lambda logprob, entropy, g: (logprob * g).sum(-1),
                loss_inputs={"g": grad_teacher},
                softcap=CAP,
            )
            result.loss.backward()
            got = result.logprob
        assert relative_error(got, expected.logprob) <= FLOAT32_TOL, op
        assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL, op
        assert relative_error(leaf_weight.grad, expected.grad_weight) <= FLOAT32_TOL, op


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "policy"])
def test_three_gemm_losses_and_weight_grad_into(loss_fn):
    """A trainer's calls: the old log-probs under ``no_grad``, then the loss in the forward and its
    backward, into autograd and into a ``weight_grad_into`` holding another micro-batch's gradient."""
    hidden, weight, targets = capped_case(seed=4)
    generator = torch.Generator().manual_seed(5)
    weights = (torch.rand(LEAD, generator=generator) > 0.2).float()
    if loss_fn == "cross_entropy":
        fn, inputs = losses.cross_entropy, {"weight": weights}
    else:
        with torch.no_grad():
            old = fused_linear_logprob(hidden, weight, targets, temperature=0.9, softcap=CAP)
        fn = POLICY
        inputs = {"weight": weights, "old_logprob": old + 0.1, "advantages": torch.randn(LEAD, generator=generator)}
    expected = loss_reference(hidden, weight, targets, fn, loss_inputs=inputs, temperature=0.9, softcap=CAP)
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    result = fused_linear_loss(
        leaf_hidden, leaf_weight, targets, fn, loss_inputs=inputs, temperature=0.9, token_chunk=8, softcap=CAP
    )
    result.loss.backward()
    assert relative_error(result.loss, expected.loss) <= FLOAT32_TOL
    assert relative_error(result.logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(result.entropy, expected.entropy) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad, expected.grad_weight) <= FLOAT32_TOL
    main_grad = torch.randn(V, H, generator=generator)
    before = main_grad.clone()
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    fused_linear_loss(
        leaf_hidden,
        leaf_weight,
        targets,
        fn,
        loss_inputs=inputs,
        temperature=0.9,
        weight_grad_into=main_grad,
        softcap=CAP,
    ).loss.backward()
    assert relative_error(main_grad - before, expected.grad_weight) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL


def test_the_labels_path():
    """``fused_linear_cross_entropy`` with ``-100`` labels (``max_logit``: the capped row's largest
    logit, no gradient), as the stock loss on capped logits scores them."""
    hidden, weight, targets = capped_case(seed=6)
    targets = targets.clone()
    targets[0, :3] = -100
    declared = torch.ones(LEAD)
    expected = reference(hidden, weight, targets, grad_logprob=-declared, out_of_vocab="max_logit", softcap=CAP)
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    per_token = fused_linear_cross_entropy(
        leaf_hidden, leaf_weight, targets, declared, out_of_vocab="max_logit", softcap=CAP
    )
    per_token.sum().backward()
    assert relative_error(per_token, -expected.logprob) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad, expected.grad_weight) <= FLOAT32_TOL


def test_logits_ops_and_top_k():
    hidden, weight, targets = capped_case(seed=7)
    logits = hidden @ weight.t()
    grad_logprob, grad_entropy = torch.randn(LEAD), torch.randn(LEAD)
    expected = reference_from_logits(logits, targets, 1.3, grad_logprob, grad_entropy, softcap=CAP)
    leaf = logits.detach().clone().requires_grad_()
    logprob, entropy = logits_logprob(leaf, targets, temperature=1.3, return_entropy=True, softcap=CAP)
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    assert relative_error(logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(entropy, expected.entropy) <= FLOAT32_TOL
    assert relative_error(leaf.grad, expected.grad_logits) <= FLOAT32_TOL
    loss = logits_loss(logits, targets, losses.cross_entropy, loss_inputs={"weight": torch.ones(LEAD)}, softcap=CAP)
    assert relative_error(loss.loss, -reference_from_logits(logits, targets, softcap=CAP).logprob.sum()) <= FLOAT32_TOL
    # Top-k: the capped log-probs (the order is the logits', tanh being increasing).
    want = torch.log_softmax(capped(logits.double(), CAP), -1).topk(5, dim=-1)
    for got_logprobs, got_ids in (
        fused_linear_topk(hidden, weight, 5, softcap=CAP),
        logits_topk(logits, 5, softcap=CAP),
    ):
        assert torch.equal(got_ids, want.indices)
        assert relative_error(got_logprobs, want.values) <= FLOAT32_TOL


@pytest.mark.parametrize("softcap, error", [(0.0, ValueError), (-30.0, ValueError), (float("inf"), ValueError),
                                            ("30", TypeError), (True, TypeError)])  # fmt: skip
def test_the_errors(softcap, error):
    hidden, weight, targets = capped_case(seed=8, lead=(4,))
    with pytest.raises(error, match="softcap must be"):
        fused_linear_logprob(hidden, weight, targets, softcap=softcap)
    with pytest.raises(error, match="softcap must be"):
        logits_logprob(hidden @ weight.t(), targets, softcap=softcap)


def _two_ranks(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    hidden, weight, targets = capped_case(seed=9)
    shard = V // world_size
    rows = slice(rank * shard, (rank + 1) * shard)
    grad_logprob, grad_entropy = torch.randn(LEAD, generator=torch.Generator().manual_seed(10)), torch.ones(LEAD)
    expected = reference(hidden, weight, targets, 0.8, grad_logprob, grad_entropy, softcap=CAP)
    leaf_hidden, leaf_weight = leaves(hidden, weight[rows])
    logprob, entropy = fused_linear_logprob(
        leaf_hidden, leaf_weight, targets, tp_group=group, temperature=0.8, return_entropy=True, softcap=CAP
    )
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    assert relative_error(logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(entropy, expected.entropy) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad, expected.grad_weight[rows]) <= FLOAT32_TOL
    result = fused_linear_loss(
        hidden,
        weight[rows],
        targets,
        POLICY,
        loss_inputs={"weight": torch.ones(LEAD), "advantages": torch.ones(LEAD)},
        tp_group=group,
        softcap=CAP,
    )
    assert relative_error(result.logprob, reference(hidden, weight, targets, softcap=CAP).logprob) <= FLOAT32_TOL
    # Ranks passing different caps are refused alike, before the softmax's collectives (an op's
    # first call of its shapes: each is checked once).
    with pytest.raises(ValueError, match="disagree on softcap"):
        fused_linear_topk(hidden, weight[rows], 3, tp_group=group, softcap=CAP + rank)


def test_two_ranks():
    run_ranks(_two_ranks, 2)
