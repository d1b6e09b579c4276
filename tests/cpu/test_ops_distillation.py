"""Several targets per row on the three-GEMM path, and the top-k distillation loss on it: against
devkit's float64 oracle (``loss_reference``, with ``topk_distillation_loss`` for the formulas of
``losses.TopkDistillation``'s docstring) on the student's full ``log_softmax``; the three-GEMM loss
beside the recompute path's own error on the same inputs; ``logits_loss`` (the unfused path) and
two gloo ranks; the errors. The Triton pass is in test_triton_interpreter.py
(``test_several_targets_per_row_three_gemm``).

Teachers put 60 to 99 % of their mass on their top 5 of 97 ids and the students are peaked (logits
of about 25): a renormalization or a rest-of-mass term that is off, or a target's term counted
twice, moves the loss by O(0.1).
"""

import pytest
import torch
import torch.distributed as dist

from devkit.oracle import loss_reference, make_case, relative_error, topk_distillation_loss, within_recompute
from devkit.spawn import run_ranks
from megatron_fused_lm import fused_linear_logprob, fused_linear_loss, logits_loss, losses

H, V, K = 24, 97, 5
LEAD = (3, 10)
FLOAT32_TOL = 2e-5
FLOAT32_GRAD_FLOOR = 1e-6  # float32 gradients of these sizes, whatever the path


def teacher_case(lead, vocab, seed):
    """``(teacher_ids [*lead, K] distinct, teacher_logprob [*lead, K] float32)``: a teacher's top-K
    ids and log-probs over its whole vocabulary, holding 60 to 99 % of its mass."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.Size(lead).numel()
    ids = torch.stack([torch.randperm(vocab, generator=generator)[:K] for _ in range(rows)])
    shares = torch.softmax(torch.randn(rows, K, generator=generator) * 2, -1)
    mass = 0.6 + 0.39 * torch.rand(rows, 1, generator=generator)
    return ids.view(*lead, K), (shares * mass).log().float().view(*lead, K)


def leaves(*tensors):
    return [tensor.detach().clone().requires_grad_() for tensor in tensors]


@pytest.mark.parametrize("remainder", losses.REMAINDERS)
@pytest.mark.parametrize("divergence", losses.DIVERGENCES)
@pytest.mark.parametrize("token_chunk", [None, 7])
def test_distillation_against_float64(divergence, remainder, token_chunk):
    hidden, weight, _ = make_case(LEAD, H, V, torch.float32, peaky=True, seed=1)
    ids, teacher = teacher_case(LEAD, V, seed=2)
    weights = torch.rand(LEAD, generator=torch.Generator().manual_seed(3))
    loss_fn = losses.TopkDistillation(divergence, remainder)
    inputs = {"teacher_logprob": teacher, "weight": weights}
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    result = fused_linear_loss(leaf_hidden, leaf_weight, ids, loss_fn, loss_inputs=inputs, token_chunk=token_chunk)
    result.loss.backward()
    expected = loss_reference(hidden, weight, ids, topk_distillation_loss(divergence, remainder), inputs)
    # The same loss on the recompute path's log-probs: the bound is 1.2 times its own error, or float32's.
    recompute_hidden, recompute_weight = leaves(hidden, weight)
    logprob = fused_linear_logprob(recompute_hidden, recompute_weight, ids)
    recompute_loss = loss_fn(
        logprob.view(-1, K), None, teacher_logprob=teacher.view(-1, K), weight=weights.view(-1)
    ).sum()
    recompute_loss.backward()
    assert result.logprob.shape == (*LEAD, K) and result.entropy.shape == LEAD
    for actual, recompute, exact in (
        (result.loss, recompute_loss, expected.loss),
        (leaf_hidden.grad, recompute_hidden.grad, expected.grad_hidden),
        (leaf_weight.grad, recompute_weight.grad, expected.grad_weight),
    ):
        # Beside the recompute bound (which a wrong formula would loosen with its own error): the
        # float32 accuracy of the log-probs themselves.
        assert within_recompute(actual, recompute, exact, FLOAT32_TOL) and relative_error(actual, exact) <= 1e-4


@pytest.mark.parametrize("remainder", losses.REMAINDERS)
@pytest.mark.parametrize("divergence", losses.DIVERGENCES)
def test_the_formulas(divergence, remainder):
    # The loss itself on float64 log-probs against the oracle's probabilities: rows holding 60 to
    # 99 % of each mass, a row whose student holds all but 1e-9 (its rest computed without
    # cancellation) and a teacher id of probability 0 (0 log 0 = 0).
    _, teacher = teacher_case(LEAD, V, seed=12)
    generator = torch.Generator().manual_seed(13)
    student = torch.log_softmax(torch.randn(LEAD[0] * LEAD[1], K, generator=generator, dtype=torch.float64), -1) - 0.4
    teacher = teacher.view(-1, K).double()
    student[0] = torch.tensor([1 - 1e-9 - 4e-12, 1e-12, 1e-12, 1e-12, 1e-12], dtype=torch.float64).log()
    teacher[1, 2] = -torch.inf
    weights = torch.rand(student.shape[0], dtype=torch.float64, generator=generator)
    loss = losses.TopkDistillation(divergence, remainder)(student, None, teacher_logprob=teacher, weight=weights)
    exact = topk_distillation_loss(divergence, remainder)(student, None, teacher_logprob=teacher, weight=weights)
    finite = exact.isfinite()  # reverse: a student id the teacher gives 0 costs infinity, as it should
    assert bool(finite[0]) and torch.equal(loss.isfinite(), finite)
    assert relative_error(loss[finite], exact[finite]) <= 1e-6


def test_the_remainder_and_direction_matter():
    # The four choices give different losses on these inputs: each formula is its own.
    hidden, weight, _ = make_case(LEAD, H, V, torch.float32, peaky=True, seed=1)
    ids, teacher = teacher_case(LEAD, V, seed=2)
    inputs = {"teacher_logprob": teacher, "weight": torch.ones(LEAD)}
    values = [
        fused_linear_loss(hidden, weight, ids, losses.TopkDistillation(divergence, remainder), loss_inputs=inputs).loss
        for divergence in losses.DIVERGENCES
        for remainder in losses.REMAINDERS
    ]
    assert min(abs(a - b) for i, a in enumerate(values) for b in values[i + 1 :]) > 0.1


def test_masked_rows_and_a_general_loss():
    # Any per-row loss of [rows, k] log-probs (here with the entropy too, and a repeated id), over
    # the rows a mask selects; the unfused logits_loss gives the same.
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=False, seed=4)
    ids = torch.stack([targets, (targets + 3) % V, targets], -1)
    mask = torch.rand(LEAD, generator=torch.Generator().manual_seed(5)) < 0.6
    goal = torch.randn(*LEAD, 3, generator=torch.Generator().manual_seed(6))

    def loss_fn(logprob, entropy, *, goal):
        return ((logprob - goal) ** 2).sum(-1) - 0.1 * entropy

    leaf_hidden, leaf_weight = leaves(hidden, weight)
    result = fused_linear_loss(leaf_hidden, leaf_weight, ids, loss_fn, loss_inputs={"goal": goal}, mask=mask)
    result.loss.backward()
    expected = loss_reference(hidden, weight, ids, loss_fn, {"goal": goal}, mask=mask)
    assert relative_error(result.loss, expected.loss) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad, expected.grad_weight) <= FLOAT32_TOL
    assert torch.count_nonzero(result.logprob[~mask]) == 0
    (logits,) = leaves(hidden @ weight.t())
    unfused = logits_loss(logits, ids, loss_fn, loss_inputs={"goal": goal}, mask=mask)
    assert relative_error(unfused.loss, expected.loss) <= FLOAT32_TOL


@pytest.mark.parametrize("prob", [0.5, 0.99, 1 - 1e-6])
def test_a_dominant_target_among_several(prob):
    # The first of k ids holds probability prob: near 1 its gradient's 1 - p needs its logit to be
    # the very value the statistics' maximum came from. Read from a second product, the three-GEMM
    # gradients here were 2.6 times the recompute path's error at p = 1 - 1e-6 (and 0.99 failed
    # too); at p = 0.5, where another logit may round above it, taking the maximum must cost nothing.
    generator = torch.Generator().manual_seed(8)
    rows, vocab, hidden_size = 64, 301, 64
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64) / hidden_size**0.5
    hidden = torch.randn(rows, hidden_size, generator=generator, dtype=torch.float64)
    ids = torch.stack([torch.randperm(vocab, generator=generator)[:K] for _ in range(rows)])
    top, every_row = ids[:, 0], torch.arange(rows)
    for _ in range(4):  # moving the row along the top id's weight moves the other logits too: settle
        logits = hidden @ weight.t()
        rest = torch.logsumexp(logits.index_put((every_row, top), torch.tensor(-torch.inf, dtype=torch.float64)), 1)
        gap = rest + torch.log(torch.tensor(prob / (1 - prob), dtype=torch.float64)) - logits[every_row, top]
        hidden = hidden + gap[:, None] * weight[top] / (weight[top] ** 2).sum(1, keepdim=True)
    hidden, weight = hidden.float(), weight.float()
    coef = torch.rand(rows, K, generator=generator)

    def loss_fn(logprob, entropy, *, coef):
        return -(coef * logprob).sum(-1)

    expected = loss_reference(hidden, weight, ids, loss_fn, {"coef": coef})
    three_gemm, recompute = leaves(hidden, weight), leaves(hidden, weight)
    result = fused_linear_loss(*three_gemm, ids, loss_fn, loss_inputs={"coef": coef})
    result.loss.backward()
    loss_fn(fused_linear_logprob(*recompute, ids), None, coef=coef).sum().backward()
    assert relative_error(result.logprob, expected.logprob) <= FLOAT32_TOL
    exact_grads = (expected.grad_hidden, expected.grad_weight)
    for actual, reference, exact in zip(three_gemm, recompute, exact_grads, strict=True):
        assert within_recompute(actual.grad, reference.grad, exact, FLOAT32_GRAD_FLOOR)


def test_errors():
    hidden, weight, _ = make_case(LEAD, H, V, torch.float32, peaky=False, seed=7)
    ids, teacher = teacher_case(LEAD, V, seed=8)
    with pytest.raises(ValueError, match="divergence"):
        losses.TopkDistillation("sideways")
    with pytest.raises(ValueError, match="remainder"):
        losses.TopkDistillation(remainder="drop")
    with pytest.raises(ValueError, match="teacher_logprob of that shape"):
        fused_linear_loss(
            hidden,
            weight,
            ids,
            losses.TopkDistillation(),
            loss_inputs={"teacher_logprob": teacher[..., :2], "weight": torch.ones(LEAD)},
        )
    with pytest.raises(ValueError, match="one target per row"):
        fused_linear_loss(hidden, weight, ids, losses.cross_entropy, loss_inputs={"weight": torch.ones(LEAD)})
    with pytest.raises(ValueError, match="one value per target: with several targets per row it must combine"):
        fused_linear_loss(hidden, weight, ids, lambda logprob, entropy: -logprob)


@pytest.mark.parametrize("op", ["fused_linear_loss", "logits_loss"])
def test_the_teacher_is_checked_on_the_rows_computed(op):
    """Raw logits, probabilities and repeated ids are refused (on the CPU at once; a device-side
    assertion on a GPU); a teacher sure of one id (a log-prob a rounding above 0) and padding rows
    the mask leaves out, with or without max_rows (whose padding reads some row's inputs), are not."""
    hidden, weight, _ = make_case(LEAD, H, V, torch.float32, peaky=False, seed=30)
    ids, teacher = teacher_case(LEAD, V, seed=31)
    weights = torch.ones(LEAD)
    loss_fn = losses.TopkDistillation()

    def run(ids, teacher, **kwargs):
        inputs = {"teacher_logprob": teacher, "weight": weights}
        if op == "fused_linear_loss":
            return fused_linear_loss(hidden, weight, ids, loss_fn, loss_inputs=inputs, **kwargs)
        return logits_loss(hidden @ weight.t(), ids, loss_fn, loss_inputs=inputs, **kwargs)

    logits = torch.randn(*LEAD, V, generator=torch.Generator().manual_seed(32)) * 3
    for wrong in (logits.gather(-1, ids), teacher.exp()):  # raw logits, probabilities
        with pytest.raises(ValueError, match="teacher_logprob must be log-probabilities"):
            run(ids, wrong)
    repeated = ids.clone()
    repeated[1, 4, 3] = repeated[1, 4, 0]
    with pytest.raises(ValueError, match="distinct teacher ids"):
        run(repeated, teacher)
    sure = teacher.clone()
    sure[0, 0] = torch.tensor([1e-7, -30.0, -31.0, -32.0, -33.0])  # float32 rounding of a certain teacher
    assert torch.isfinite(run(ids, sure).loss)
    mask = torch.ones(LEAD, dtype=torch.bool)
    mask[:, -3:] = False
    padded, padded_ids = teacher.masked_fill(~mask[..., None], 0.0), ids.masked_fill(~mask[..., None], 0)
    assert torch.isfinite(run(padded_ids, padded, mask=mask).loss)
    assert torch.isfinite(run(padded_ids, padded, mask=mask, max_rows=LEAD[0] * LEAD[1]).loss)


# Two ranks.

TOKENS, V_LOCAL = 31, 53


def check_two_ranks(rank, group):
    hidden, weight, _ = make_case((TOKENS,), H, 2 * V_LOCAL, torch.float32, peaky=True, seed=9)
    ids, teacher = teacher_case((TOKENS,), 2 * V_LOCAL, seed=10)  # each row's ids on both shards
    weights = torch.rand(TOKENS, generator=torch.Generator().manual_seed(11))
    loss_fn = losses.TopkDistillation("reverse", "tail")
    shard = weight[rank * V_LOCAL : (rank + 1) * V_LOCAL].clone().requires_grad_()
    hidden_leaf = hidden.clone().requires_grad_()
    result = fused_linear_loss(
        hidden_leaf, shard, ids, loss_fn, loss_inputs={"teacher_logprob": teacher, "weight": weights}, tp_group=group,
        token_chunk=8,
    )  # fmt: skip
    result.loss.backward()
    inputs = {"teacher_logprob": teacher, "weight": weights}
    expected = loss_reference(hidden, weight, ids, topk_distillation_loss("reverse", "tail"), inputs)
    assert relative_error(result.loss, expected.loss) <= FLOAT32_TOL
    assert relative_error(hidden_leaf.grad, expected.grad_hidden) <= 1e-4
    assert relative_error(shard.grad, expected.grad_weight[rank * V_LOCAL : (rank + 1) * V_LOCAL]) <= 1e-4


def two_rank_cases(rank, world_size):
    check_two_ranks(rank, dist.new_group(list(range(world_size))))


def test_two_ranks():
    run_ranks(two_rank_cases, 2)


def test_compiled_as_k_changes():
    # torch.compile(fullgraph=True) of a loss that lets the entropy probe run, called with k = 4
    # then 5 (the second call traces k as a symbolic size): each equals the eager loss.
    hidden, weight, targets = make_case((12,), H, V, torch.float32, peaky=False, seed=15)

    def loss_fn(logprob, entropy, *, goal):
        return ((logprob - goal) ** 2).sum(-1) - 0.3 * entropy

    def loss(hidden, weight, ids, goal):
        return fused_linear_loss(hidden, weight, ids, loss_fn, loss_inputs={"goal": goal}, token_chunk=5).loss

    compiled = torch.compile(loss, fullgraph=True)
    for k in (4, 5):
        ids = torch.randint(0, V, (12, k), generator=torch.Generator().manual_seed(k))
        goal = -torch.rand(12, k, generator=torch.Generator().manual_seed(k))
        assert relative_error(compiled(hidden, weight, ids, goal), loss(hidden, weight, ids, goal)) <= 1e-6
