"""``vocab_size``: the true vocabulary, the padded rows of Megatron's head left out, against the
float64 oracle over the weight's first ``vocab_size`` rows (``devkit.oracle``): every op, its
gradients (the padded weight rows get none, and a ``weight_grad_into``'s padded rows are left as
they were), top-k, the labels path's ``max_logit`` rows, the logits ops, kept sets, the errors; and
two gloo ranks, the padding on the last one.

The padded rows here hold each row's largest logit (the peaked rows put most of the mass there),
so a padded column that leaks into a softmax, a top-k or a gradient costs O(1); a padded weight
row's gradient must be exactly 0. Tolerances are float32 accuracy (``FLOAT32_TOL``, as in
test_ops_kept_tokens.py), the three-GEMM loss bounded as there.
"""

import pytest
import torch
import torch.distributed as dist

from devkit.oracle import loss_reference, make_case, max_abs_error, reference, reference_from_logits, relative_error
from devkit.spawn import run_ranks
from megatron_fused_lm import (
    KeptTokens,
    fused_linear_cross_entropy,
    fused_linear_logprob,
    fused_linear_loss,
    fused_linear_topk,
    logits_logprob,
    logits_loss,
    logits_topk,
    losses,
)

H, VOCAB, PADDED = 24, 97, 104  # Megatron pads 97 ids to a multiple of 8 x TP=1 (of 52 per rank at TP=2)
LEAD = (3, 10)
FLOAT32_TOL = 2e-5
POLICY = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)


def padded_case(seed, lead=LEAD):
    """A peaked case over the true vocabulary, its head padded with rows that every row scores
    highest: a last hidden feature of 25 that only the padded rows read, giving them logits of 100
    (the peaked rows' own are of order 25), most of the stock softmax's mass."""
    hidden, weight, targets = make_case(lead, H, VOCAB, torch.float32, peaky=True, seed=seed)
    hidden[..., -1], weight[:, -1] = 25.0, 0.0
    padding = torch.zeros(PADDED - VOCAB, H)
    padding[:, -1] = 4.0
    return hidden, torch.cat([weight, padding]), targets


def leaves(*tensors):
    return [tensor.detach().clone().requires_grad_() for tensor in tensors]


@pytest.mark.parametrize("token_chunk", [None, 7])
def test_log_probs_entropy_and_gradients_over_the_true_vocabulary(token_chunk):
    hidden, weight, targets = padded_case(seed=1)
    temperature = torch.rand(LEAD, generator=torch.Generator().manual_seed(2)) + 0.5
    grad_logprob, grad_entropy = torch.randn(LEAD), torch.randn(LEAD)
    expected = reference(hidden, weight[:VOCAB], targets, temperature, grad_logprob, grad_entropy)
    padded = reference(hidden, weight, targets, temperature)
    assert max_abs_error(padded.logprob, expected.logprob) > 1.0  # the gap vocab_size closes
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    logprob, entropy = fused_linear_logprob(
        leaf_hidden,
        leaf_weight,
        targets,
        temperature=temperature,
        return_entropy=True,
        token_chunk=token_chunk,
        vocab_size=VOCAB,
    )
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    assert relative_error(logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(entropy, expected.entropy) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad[:VOCAB], expected.grad_weight) <= FLOAT32_TOL
    assert torch.count_nonzero(leaf_weight.grad[VOCAB:]) == 0
    # Without vocab_size, the stock head's numbers: the padded rows count.
    stock = fused_linear_logprob(hidden, weight, targets, temperature=temperature)
    assert relative_error(stock, padded.logprob) <= FLOAT32_TOL


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "policy"])
def test_three_gemm_losses_and_weight_grad_into(loss_fn):
    """The loss in the forward, its gradients by autograd and into a ``weight_grad_into`` whose
    padded rows keep what they held, over the true vocabulary; a trainer's calls: a forward under
    ``no_grad`` (the old log-probs), then the loss and its backward."""
    hidden, weight, targets = padded_case(seed=3)
    generator = torch.Generator().manual_seed(4)
    weights = (torch.rand(LEAD, generator=generator) > 0.2).float()
    if loss_fn == "cross_entropy":
        fn, inputs = losses.cross_entropy, {"weight": weights}
    else:
        with torch.no_grad():
            old = fused_linear_logprob(hidden, weight, targets, vocab_size=VOCAB)
        fn = POLICY
        inputs = {"weight": weights, "old_logprob": old + 0.1, "advantages": torch.randn(LEAD, generator=generator)}
    expected = loss_reference(hidden, weight[:VOCAB], targets, fn, loss_inputs=inputs)
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    result = fused_linear_loss(
        leaf_hidden, leaf_weight, targets, fn, loss_inputs=inputs, token_chunk=8, vocab_size=VOCAB
    )
    result.loss.backward()
    assert relative_error(result.loss, expected.loss) <= FLOAT32_TOL
    assert relative_error(result.logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad[:VOCAB], expected.grad_weight) <= FLOAT32_TOL
    assert torch.count_nonzero(leaf_weight.grad[VOCAB:]) == 0
    # Into a main_grad that already holds another micro-batch's gradient: its padded rows untouched.
    main_grad = torch.randn(PADDED, H, generator=generator)
    before = main_grad.clone()
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    fused_linear_loss(
        leaf_hidden, leaf_weight, targets, fn, loss_inputs=inputs, weight_grad_into=main_grad, vocab_size=VOCAB
    ).loss.backward()
    assert relative_error(main_grad[:VOCAB] - before[:VOCAB], expected.grad_weight) <= FLOAT32_TOL
    assert torch.equal(main_grad[VOCAB:], before[VOCAB:])
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL


def test_the_labels_path_scores_ignored_labels_by_the_true_vocabulary():
    """``fused_linear_cross_entropy`` with ``out_of_vocab="max_logit"`` (the labels path): a label
    outside the true vocabulary (``-100``, or a padded id) scores as the largest logit below
    ``vocab_size``, with no gradient, as the stock loss scores it over its columns."""
    hidden, weight, targets = padded_case(seed=5)
    targets = targets.clone()
    targets[0, :3] = -100
    targets[1, 0] = VOCAB + 2  # a padded id: outside the true vocabulary
    declared = torch.ones(LEAD)
    expected = reference(hidden, weight[:VOCAB], targets, grad_logprob=-declared, out_of_vocab="max_logit")
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    per_token = fused_linear_cross_entropy(
        leaf_hidden, leaf_weight, targets, declared, out_of_vocab="max_logit", vocab_size=VOCAB
    )
    per_token.sum().backward()
    assert relative_error(per_token, -expected.logprob) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad[:VOCAB], expected.grad_weight) <= FLOAT32_TOL
    assert torch.count_nonzero(leaf_weight.grad[VOCAB:]) == 0


def test_logits_ops_and_top_k():
    hidden, weight, targets = padded_case(seed=6)
    logits = hidden @ weight.t()
    grad_logprob, grad_entropy = torch.randn(LEAD), torch.randn(LEAD)
    expected = reference_from_logits(logits[..., :VOCAB], targets, 1.3, grad_logprob, grad_entropy)
    leaf = logits.detach().clone().requires_grad_()
    logprob, entropy = logits_logprob(leaf, targets, temperature=1.3, return_entropy=True, vocab_size=VOCAB)
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    assert relative_error(logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(entropy, expected.entropy) <= FLOAT32_TOL
    assert relative_error(leaf.grad[..., :VOCAB], expected.grad_logits) <= FLOAT32_TOL
    assert torch.count_nonzero(leaf.grad[..., VOCAB:]) == 0
    loss = logits_loss(
        logits, targets, losses.cross_entropy, loss_inputs={"weight": torch.ones(LEAD)}, vocab_size=VOCAB
    )
    at_one = reference_from_logits(logits[..., :VOCAB], targets).logprob  # the loss at temperature 1
    assert relative_error(loss.loss, -at_one.sum()) <= FLOAT32_TOL
    # Top-k: the true vocabulary's largest, never a padded id, from the weight and from the logits.
    want = torch.log_softmax(logits[..., :VOCAB].double(), -1).topk(5, dim=-1)
    for got_logprobs, got_ids in (
        fused_linear_topk(hidden, weight, 5, vocab_size=VOCAB),
        logits_topk(logits, 5, vocab_size=VOCAB),
    ):
        assert torch.equal(got_ids, want.indices)
        assert relative_error(got_logprobs, want.values) <= FLOAT32_TOL
    assert int(fused_linear_topk(hidden, weight, 5)[1].max()) >= VOCAB  # stock: the padded ids win


def test_kept_sets_and_the_errors():
    hidden, weight, targets = padded_case(seed=7, lead=(4,))
    offsets, ids = torch.tensor([0, 2, 4, 6, 8]), torch.stack([targets, (targets + 1) % VOCAB], 1).reshape(-1)
    kept = torch.zeros(4, VOCAB, dtype=torch.bool)
    kept[torch.arange(4).repeat_interleave(2), ids] = True
    got = fused_linear_logprob(hidden, weight, targets, kept_tokens=KeptTokens(offsets, ids), vocab_size=VOCAB)
    assert relative_error(got, reference(hidden, weight[:VOCAB], targets, kept=kept).logprob) <= FLOAT32_TOL
    with pytest.raises(ValueError, match="kept token id is outside the vocabulary \\[0, 97\\)"):
        padded_ids = torch.where(ids == ids[1], VOCAB + 1, ids)
        fused_linear_logprob(hidden, weight, targets, kept_tokens=(offsets, padded_ids), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="outside the vocabulary \\[0, 97\\) \\(vocab_size\\)"):
        fused_linear_logprob(hidden, weight, torch.full_like(targets, VOCAB), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="vocab_size=105 must lie in \\(0, 104\\]"):
        fused_linear_logprob(hidden, weight, targets, vocab_size=PADDED + 1)
    with pytest.raises(ValueError, match="positive int"):
        fused_linear_logprob(hidden, weight, targets, vocab_size=0)
    with pytest.raises(TypeError, match="vocab_size must be an integer"):
        fused_linear_logprob(hidden, weight, targets, vocab_size=97.0)
    with pytest.raises(ValueError, match="between 1 and the vocabulary size 97"):
        fused_linear_topk(hidden, weight, VOCAB + 1, vocab_size=VOCAB)


def _two_ranks(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    hidden, weight, targets = padded_case(seed=8)
    shard = PADDED // world_size
    rows = slice(rank * shard, (rank + 1) * shard)
    grad_logprob, grad_entropy = torch.randn(LEAD, generator=torch.Generator().manual_seed(9)), torch.ones(LEAD)
    expected = reference(hidden, weight[:VOCAB], targets, 0.8, grad_logprob, grad_entropy)
    leaf_hidden, leaf_weight = leaves(hidden, weight[rows])
    logprob, entropy = fused_linear_logprob(
        leaf_hidden, leaf_weight, targets, tp_group=group, temperature=0.8, return_entropy=True, vocab_size=VOCAB
    )
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    assert relative_error(logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(entropy, expected.entropy) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    live = min(shard, VOCAB - rank * shard)  # rank 1 holds 45 ids and 7 padded rows
    assert relative_error(leaf_weight.grad[:live], expected.grad_weight[rows][:live]) <= FLOAT32_TOL
    assert torch.count_nonzero(leaf_weight.grad[live:]) == 0
    result = fused_linear_loss(
        hidden,
        weight[rows],
        targets,
        POLICY,
        loss_inputs={"weight": torch.ones(LEAD), "advantages": torch.ones(LEAD)},
        tp_group=group,
        vocab_size=VOCAB,
    )
    assert relative_error(result.logprob, reference(hidden, weight[:VOCAB], targets).logprob) <= FLOAT32_TOL
    _, ids = fused_linear_topk(hidden, weight[rows], 4, tp_group=group, vocab_size=VOCAB)
    assert torch.equal(ids, (hidden.double() @ weight[:VOCAB].double().t()).topk(4, dim=-1).indices)
    # A vocabulary that leaves the last rank no id: refused alike on both ranks, before any collective.
    with pytest.raises(ValueError, match="every rank holding at least one id"):
        fused_linear_logprob(hidden, weight[rows], targets, tp_group=group, vocab_size=shard)


def test_two_ranks():
    run_ranks(_two_ranks, 2)
