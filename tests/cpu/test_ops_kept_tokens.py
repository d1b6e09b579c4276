"""``kept_tokens``: each row's softmax renormalized over the ids its sampler kept, against the
float64 oracle over the same sets (``devkit.oracle``, which builds each row's dense mask with a
plain loop): the four-GEMM ``fused_linear_logprob``, the three-GEMM ``fused_linear_loss``, the
unfused ``logits_*`` ops; masks and ``max_rows``, odd sizes, peaked rows whose largest logit is
left out, sets with repeats, calls interleaved as a trainer makes them; the errors; and two gloo
ranks, each reading its own shard's ids, with the collectives of a call without sets. The Triton
kernels' handling is in test_triton_interpreter.py.

A column that leaks into a row's softmax, or a gradient that reaches one left out, costs O(0.1)
here (sets of a few ids of 97 or 251; peaked rows lose their largest logit); tolerances are float32
accuracy (``FLOAT32_TOL``, as in test_ops_temperature.py), the three-GEMM loss bounded by the
recompute path's own error as there.
"""

import itertools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from devkit.collectives import ALL_GATHER, counts, recorded_collectives
from devkit.oracle import (
    dense_kept,
    loss_reference,
    make_case,
    max_abs_error,
    reference,
    reference_from_logits,
    relative_error,
    within_recompute,
)
from devkit.spawn import run_ranks
from megatron_fused_lm import KeptTokens, fused_linear_logprob, fused_linear_loss, logits_logprob, logits_loss, losses
from megatron_fused_lm.ops.inputs import select_rows
from megatron_fused_lm.ops.kept_tokens import checked_sets

H, V = 24, 97
LEAD = (3, 10)
FLOAT32_TOL = 2e-5


def kept_sets(targets, rows, vocab, size, seed, leave_out=None):
    """Random sets of 1 to ``size`` ids (some repeated) for the flat ``rows`` of ``targets``, each
    holding its row's target; ``leave_out [*targets.shape]``: an id no set holds unless it is the
    target (the row's largest logit, say). Returns ``(offsets, token_ids)`` and the dense mask."""
    generator = torch.Generator().manual_seed(seed)
    flat_targets = targets.reshape(-1)
    flat_left_out = None if leave_out is None else leave_out.reshape(-1)
    offsets, ids = [0], []
    for row in rows.tolist():
        count = int(torch.randint(1, size + 1, (1,), generator=generator))
        chosen = torch.randperm(vocab, generator=generator)[:count]
        if flat_left_out is not None:
            chosen = chosen[chosen != flat_left_out[row]]
        chosen = torch.cat([chosen, flat_targets[row : row + 1], chosen[:2]])  # the target, and repeats
        ids += chosen[torch.randperm(chosen.shape[0], generator=generator)].tolist()
        offsets.append(len(ids))
    kept_tokens = torch.tensor(offsets), torch.tensor(ids, dtype=torch.long)
    return kept_tokens, dense_kept(*kept_tokens, rows, targets.shape, vocab)


def every_row(shape):
    return torch.arange(torch.Size(shape).numel())


def leaves(*tensors):
    return [tensor.detach().clone().requires_grad_() for tensor in tensors]


def largest(hidden, weight):
    return (hidden.double() @ weight.double().t()).argmax(-1)


@pytest.mark.parametrize("peaky", [False, True], ids=["flat", "peaky"])
@pytest.mark.parametrize("token_chunk", [None, 7])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])  # slime's sets come as int32
def test_fused_linear_logprob(peaky, token_chunk, dtype):
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=peaky, seed=1)
    # Peaked rows lose their largest logit: the kept set's softmax differs from the whole one by O(1).
    leave_out = largest(hidden, weight) if peaky else None
    kept_tokens, kept = kept_sets(targets, every_row(LEAD), V, 9, seed=2, leave_out=leave_out)
    kept_tokens = tuple(tensor.to(dtype) for tensor in kept_tokens)
    temperature = torch.rand(LEAD, generator=torch.Generator().manual_seed(3)) + 0.5
    grad_logprob, grad_entropy = torch.randn(LEAD), torch.randn(LEAD)
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    logprob, entropy = fused_linear_logprob(
        leaf_hidden, leaf_weight, targets, temperature=temperature, return_entropy=True, token_chunk=token_chunk,
        kept_tokens=kept_tokens,
    )  # fmt: skip
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    expected = reference(hidden, weight, targets, temperature, grad_logprob, grad_entropy, kept=kept)
    whole = reference(hidden, weight, targets, temperature)
    assert max_abs_error(logprob, whole.logprob) > 0.1  # the sets matter
    assert relative_error(logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(entropy, expected.entropy) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad, expected.grad_weight) <= FLOAT32_TOL
    assert torch.count_nonzero(leaf_weight.grad[~kept.reshape(-1, V).any(0)]) == 0  # ids no row keeps


def test_a_set_of_the_whole_vocabulary_is_no_set():
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=False, seed=4)
    rows = LEAD[0] * LEAD[1]
    kept_tokens = torch.arange(rows + 1) * V, torch.arange(V).repeat(rows)
    with_sets = fused_linear_logprob(hidden, weight, targets, return_entropy=True, kept_tokens=kept_tokens)
    without = fused_linear_logprob(hidden, weight, targets, return_entropy=True)
    for actual, expected in zip(with_sets, without, strict=True):
        assert max_abs_error(actual, expected) <= 1e-6


@pytest.mark.parametrize("max_rows", [None, 20])
def test_masked_rows(max_rows):
    # The sets belong to the selected rows, in order; max_rows pads the selection with rows whose
    # sets are the package's own.
    hidden, weight, targets = make_case((29,), H, V, torch.float32, peaky=True, seed=5)
    mask = torch.rand(29, generator=torch.Generator().manual_seed(6)) < 0.5
    selected = mask.nonzero().squeeze(-1)
    kept_tokens, kept = kept_sets(targets, selected, V, 6, seed=7, leave_out=largest(hidden, weight))
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    logprob = fused_linear_logprob(
        leaf_hidden, leaf_weight, targets, mask=mask, max_rows=max_rows, kept_tokens=kept_tokens
    )
    logprob.sum().backward()
    expected = reference(hidden, weight, targets, grad_logprob=mask.double(), kept=kept)
    assert relative_error(logprob[mask], expected.logprob[mask]) <= FLOAT32_TOL
    assert torch.count_nonzero(logprob[~mask]) == 0
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad, expected.grad_weight) <= FLOAT32_TOL


@pytest.mark.parametrize("mask_rows", [False, True], ids=["all_rows", "masked"])
@pytest.mark.parametrize("token_chunk", [None, 7])
def test_fused_linear_loss(mask_rows, token_chunk):
    # A clipped policy loss with entropy and KL terms on the three-GEMM path over the kept sets,
    # within 1.2 times the recompute path's own error on the same inputs (or float32 accuracy).
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=True, seed=8)
    mask = torch.rand(LEAD, generator=torch.Generator().manual_seed(9)) < 0.6 if mask_rows else None
    rows = every_row(LEAD) if mask is None else mask.reshape(-1).nonzero().squeeze(-1)
    kept_tokens, kept = kept_sets(targets, rows, V, 9, seed=10, leave_out=largest(hidden, weight))
    generator = torch.Generator().manual_seed(11)
    true_logprob = reference(hidden, weight, targets, kept=kept).logprob.float()
    loss_inputs = {
        "old_logprob": true_logprob + 0.1 * torch.randn(LEAD, generator=generator),
        "ref_logprob": true_logprob,
        "advantages": torch.randn(LEAD, generator=generator),
        "weight": torch.rand(LEAD, generator=generator),
    }
    loss_fn = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01, kl_coef=0.05)
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    result = fused_linear_loss(
        leaf_hidden, leaf_weight, targets, loss_fn, loss_inputs=loss_inputs, mask=mask, token_chunk=token_chunk,
        kept_tokens=kept_tokens,
    )  # fmt: skip
    result.loss.backward()
    expected = loss_reference(hidden, weight, targets, loss_fn, loss_inputs, mask=mask, kept=kept)
    recompute_hidden, recompute_weight = leaves(hidden, weight)
    logprob, entropy = fused_linear_logprob(
        recompute_hidden, recompute_weight, targets, return_entropy=True, mask=mask, kept_tokens=kept_tokens
    )
    selected = torch.ones(LEAD, dtype=torch.bool) if mask is None else mask
    inputs = {name: value[selected] for name, value in loss_inputs.items()}
    recompute_loss = loss_fn(logprob[selected], entropy[selected], **inputs).sum()
    recompute_loss.backward()
    for actual, recompute, exact in (
        (result.loss, recompute_loss, expected.loss),
        (result.logprob, logprob, expected.logprob),
        (result.entropy, entropy, expected.entropy),
        (leaf_hidden.grad, recompute_hidden.grad, expected.grad_hidden),
        (leaf_weight.grad, recompute_weight.grad, expected.grad_weight),
    ):
        assert within_recompute(actual, recompute, exact, FLOAT32_TOL)


def test_logits_ops():
    hidden, weight, targets = make_case(LEAD, H, V, torch.float64, peaky=True, seed=12)
    logits = (hidden @ weight.t()).float()
    kept_tokens, kept = kept_sets(targets, every_row(LEAD), V, 9, seed=13, leave_out=largest(hidden, weight))
    grad_logprob, grad_entropy = torch.randn(LEAD), torch.randn(LEAD)
    (leaf,) = leaves(logits)
    logprob, entropy = logits_logprob(
        leaf, targets, temperature=1.3, return_entropy=True, token_chunk=4, kept_tokens=kept_tokens
    )
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    expected = reference_from_logits(logits, targets, 1.3, grad_logprob, grad_entropy, kept=kept)
    assert relative_error(logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(entropy, expected.entropy) <= FLOAT32_TOL
    assert relative_error(leaf.grad, expected.grad_logits) <= FLOAT32_TOL
    assert torch.count_nonzero(leaf.grad[~kept]) == 0
    result = logits_loss(
        logits, targets, losses.cross_entropy, loss_inputs={"weight": grad_logprob}, temperature=1.3,
        kept_tokens=kept_tokens,
    )  # fmt: skip
    expected_loss = -(expected.logprob * grad_logprob.double()).sum()
    assert relative_error(result.loss, expected_loss) <= FLOAT32_TOL


def test_calls_as_a_trainer_makes_them():
    # A no_grad pass with other sets, then two micro-batches whose backwards run in reverse order:
    # each backward must read its own call's sets (saved with it), not the latest call's.
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=True, seed=14)
    leave_out = largest(hidden, weight)
    first, first_kept = kept_sets(targets, every_row(LEAD), V, 5, seed=15, leave_out=leave_out)
    second, second_kept = kept_sets(targets, every_row(LEAD), V, 30, seed=16)
    with torch.no_grad():
        fused_linear_logprob(hidden, weight, targets, kept_tokens=second)
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    one = fused_linear_logprob(leaf_hidden, leaf_weight, targets, kept_tokens=first, return_entropy=True)
    two = fused_linear_loss(
        leaf_hidden, leaf_weight, targets, losses.cross_entropy, loss_inputs={"weight": torch.ones(LEAD)},
        kept_tokens=second,
    )  # fmt: skip
    two.loss.backward()
    (one[0].sum() + one[1].sum()).backward()
    expected_one = reference(hidden, weight, targets, 1.0, torch.ones(LEAD), torch.ones(LEAD), kept=first_kept)
    expected_two = reference(hidden, weight, targets, 1.0, -torch.ones(LEAD), kept=second_kept)
    assert relative_error(one[0], expected_one.logprob) <= FLOAT32_TOL
    assert relative_error(two.logprob, expected_two.logprob) <= FLOAT32_TOL
    for actual, name in ((leaf_hidden.grad, "grad_hidden"), (leaf_weight.grad, "grad_weight")):
        expected = getattr(expected_one, name) + getattr(expected_two, name)
        assert relative_error(actual, expected) <= FLOAT32_TOL


@dataclass
class SamplingMask:
    """vLLM's per-completion sampling mask: its fields in its order, ids first."""

    token_ids: object
    offsets: object


def test_the_engines_layouts_by_name():
    """The sets as engines hand them over give the oracle's log-probs: ``KeptTokens`` built by name
    in vLLM's order, a ``SamplingMask`` passed as it is, vLLM's per-completion masks joined, and
    SGLang's list of ids per token. A pair is read as ``(offsets, token_ids)``: vLLM's order in a
    plain pair is refused, not read swapped."""
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=True, seed=21)
    (offsets, ids), kept = kept_sets(targets, every_row(LEAD), V, 9, seed=22, leave_out=largest(hidden, weight))
    expected = reference(hidden, weight, targets, kept=kept).logprob
    per_row = [
        ids[start:stop].tolist() for start, stop in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
    ]
    # Three completions of ten tokens each, as vLLM returns them: lists, each one's offsets from 0.
    completions = [
        SamplingMask(sum(rows, []), [0, *itertools.accumulate(len(row) for row in rows)])
        for rows in (per_row[first : first + 10] for first in (0, 10, 20))
    ]
    layouts = {
        "by name": KeptTokens(token_ids=ids, offsets=offsets),
        "a SamplingMask": SamplingMask(token_ids=ids, offsets=offsets),
        "vLLM's masks joined": KeptTokens.from_sampling_masks(completions, device=hidden.device),
        "SGLang's lists": KeptTokens.from_id_lists(per_row, device=hidden.device),
    }
    pair = fused_linear_logprob(hidden, weight, targets, kept_tokens=(offsets, ids))
    assert relative_error(pair, expected) <= FLOAT32_TOL
    assert max_abs_error(pair, reference(hidden, weight, targets).logprob) > 0.1  # the sets matter
    for name, kept_tokens in layouts.items():
        assert torch.equal(fused_linear_logprob(hidden, weight, targets, kept_tokens=kept_tokens), pair), name
    with pytest.raises(ValueError, match="sets for the 30 rows"):
        fused_linear_logprob(hidden, weight, targets, kept_tokens=(ids, offsets))
    with pytest.raises(ValueError, match="sampling mask 1: its offsets must run from 0"):
        KeptTokens.from_sampling_masks([completions[0], SamplingMask([1, 2], [1, 2])], device=hidden.device)
    with pytest.raises(TypeError, match="vLLM's SamplingMask"):
        fused_linear_logprob(hidden, weight, targets, kept_tokens={"offsets": offsets, "token_ids": ids})


def test_errors():
    hidden, weight, targets = make_case((5,), H, V, torch.float32, peaky=False, seed=17)
    (offsets, ids), _ = kept_sets(targets, every_row((5,)), V, 4, seed=18)
    cases = [
        ((offsets, ids[ids != targets[2]]), ValueError, "offsets must start at 0"),  # fewer ids than offsets say
        ((offsets, torch.where(ids == targets[2], (ids + 1) % V, ids)), ValueError, "target is outside"),
        ((offsets[:-1], ids), ValueError, "4 sets for the 5 rows computed"),
        ((offsets.flip(0), ids), ValueError, "never decrease"),
        ((offsets, torch.where(ids == ids[0], V, ids)), ValueError, "outside the vocabulary"),
        ((offsets, ids.float()), TypeError, "integer tensor"),
        ((offsets, ids.view(1, -1)), ValueError, "1-D"),
        ([offsets], TypeError, "a pair"),
    ]
    for kept_tokens, error, message in cases:
        with pytest.raises(error, match=message):
            fused_linear_logprob(hidden, weight, targets, kept_tokens=kept_tokens)
    with pytest.raises(ValueError, match="one target per row"):
        fused_linear_logprob(hidden, weight, targets.unsqueeze(-1), kept_tokens=(offsets, ids))
    with pytest.raises(ValueError, match="inside the vocabulary"):
        fused_linear_logprob(hidden, weight, targets, out_of_vocab="max_logit", kept_tokens=(offsets, ids))
    with pytest.raises(ValueError, match="more than max_rows|at most max_rows"):
        mask = torch.tensor([True, True, False, False, False])
        fused_linear_logprob(hidden, weight, targets, mask=mask, max_rows=1, kept_tokens=(offsets[:3], ids))
    # With a mask alone, the count of sets against the rows it selects, without a word of max_rows.
    with pytest.raises(ValueError, match="hold 5 sets for the 2 rows mask= selects") as raised:
        fused_linear_logprob(hidden, weight, targets, mask=torch.arange(5) < 2, kept_tokens=(offsets, ids))
    assert "max_rows" not in str(raised.value)
    # More sets than the rows max_rows lets the mask select: named as such.
    with pytest.raises(ValueError, match="hold 5 sets, more than the 2 rows that mask= can select"):
        mask = torch.tensor([True, True, False, False, False])
        fused_linear_logprob(hidden, weight, targets, mask=mask, max_rows=2, kept_tokens=(offsets, ids))


def test_strided_sets_reach_the_builders_contiguous():
    # The Triton builder reads its inputs at unit stride: strided views (and the targets of a
    # masked selection) are copied first.
    targets = torch.randint(0, V, (6, 2))[:, 0]
    (offsets, ids), _ = kept_sets(targets, every_row((6,)), V, 4, seed=21)
    strided = torch.stack([offsets, offsets], -1)[:, 0], torch.stack([ids, ids], -1)[:, 0]
    selection = select_rows(targets, targets.shape, None, None, V, None)
    sets = checked_sets(strided, selection, targets, V, None)
    assert all(tensor.is_contiguous() for tensor in (sets.offsets, sets.token_ids, sets.targets))
    assert (
        torch.equal(sets.offsets, offsets) and torch.equal(sets.token_ids, ids) and torch.equal(sets.targets, targets)
    )


# Two ranks.

TOKENS, V_LOCAL = 31, 53


def check_two_ranks(rank, group, three_gemm):
    hidden, weight, targets = make_case((TOKENS,), H, 2 * V_LOCAL, torch.float32, peaky=True, seed=19)
    # Half the rows keep ids on both shards, the others on the target's shard only: the other
    # rank keeps none of them (its statistics are an empty block).
    kept_tokens, kept = kept_sets(targets, every_row((TOKENS,)), 2 * V_LOCAL, 12, seed=20)
    offsets, ids = kept_tokens
    row_of = torch.repeat_interleave(torch.arange(TOKENS), offsets.diff())
    same_shard = (ids // V_LOCAL == targets[row_of] // V_LOCAL) | (row_of % 2 == 0)
    ids, row_of = ids[same_shard], row_of[same_shard]
    kept_tokens = torch.cat([torch.zeros(1, dtype=torch.long), torch.bincount(row_of, minlength=TOKENS).cumsum(0)]), ids
    kept = dense_kept(*kept_tokens, every_row((TOKENS,)), (TOKENS,), 2 * V_LOCAL)
    shard = weight[rank * V_LOCAL : (rank + 1) * V_LOCAL].clone().requires_grad_()
    hidden_leaf = hidden.clone().requires_grad_()
    grad_logprob, grad_entropy = torch.randn(TOKENS), torch.randn(TOKENS)
    with recorded_collectives() as calls:
        if three_gemm:
            loss_fn = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)
            loss_inputs = {"old_logprob": torch.zeros(TOKENS), "advantages": grad_logprob, "weight": torch.ones(TOKENS)}
            result = fused_linear_loss(
                hidden_leaf, shard, targets, loss_fn, loss_inputs=loss_inputs, tp_group=group, token_chunk=8,
                kept_tokens=kept_tokens,
            )  # fmt: skip
            logprob, entropy = result.logprob, result.entropy
            result.loss.backward()
        else:
            logprob, entropy = fused_linear_logprob(
                hidden_leaf, shard, targets, tp_group=group, return_entropy=True, token_chunk=7, kept_tokens=kept_tokens
            )
            ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    if three_gemm:
        expected = loss_reference(hidden, weight, targets, loss_fn, loss_inputs, kept=kept)
    else:
        assert counts(calls) == {ALL_GATHER: 1, "all_reduce": 1}, calls  # as without sets
        expected = reference(hidden, weight, targets, 1.0, grad_logprob, grad_entropy, kept=kept)
    assert relative_error(logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(entropy, expected.entropy) <= FLOAT32_TOL
    assert relative_error(hidden_leaf.grad, expected.grad_hidden) <= 1e-4
    assert relative_error(shard.grad, expected.grad_weight[rank * V_LOCAL : (rank + 1) * V_LOCAL]) <= 1e-4


def two_rank_cases(rank, world_size):
    torch.manual_seed(1234)  # the same upstream gradients on every rank
    group = dist.new_group(list(range(world_size)))
    for three_gemm in (False, True):
        check_two_ranks(rank, group, three_gemm)


def test_two_ranks():
    run_ranks(two_rank_cases, 2)
