"""The raw ops under tensor parallelism refuse ranks that disagree (two gloo ranks; four for shards
that change on some ranks): a whole weight on every rank, rows, targets, temperatures, a mask or
kept sets or options (chunking, max_rows, out_of_vocab, k) that differ between ranks, each named, on
the first call of a signature, with one all-gather that later calls of the signature do not repeat
(``check_ranks_agree("always")`` checks every call); ``check_ranks_agree(False)`` turns it off.
Without the check each of these mistakes gives numbers (the whole weight: every log-prob off by log
2) or aborts inside a collective."""

import math

import pytest
import torch
import torch.distributed as dist

from devkit.collectives import recorded_collectives
from devkit.oracle import make_case
from devkit.spawn import run_ranks
from megatron_fused_lm import (
    check_ranks_agree,
    fused_linear_cross_entropy,
    fused_linear_logprob,
    fused_linear_loss,
    fused_linear_topk,
    logits_logprob,
    logits_loss,
    losses,
)

H, V, TOKENS = 16, 41, 12


def case(vocab_shard, seed=0):
    """Hidden states, the whole weight of two shards and targets, the same on both ranks."""
    return make_case((TOKENS,), H, 2 * vocab_shard, torch.float32, peaky=False, seed=seed)


def shard_of(weight, rank):
    half = weight.shape[0] // 2
    return weight[rank * half : (rank + 1) * half]


def check_refusals(rank, world_size):
    group = dist.new_group([0, 1])
    hidden, weight, targets = case(V)
    shard = shard_of(weight, rank)
    # Agreeing ranks: one all-gather of the digest on the first call, none on a later call of the
    # signature (fewer rows, another temperature).
    with recorded_collectives(rank_check=True) as calls:
        fused_linear_logprob(hidden, shard, targets, tp_group=group)
        fused_linear_logprob(hidden[:5], shard, targets[:5], tp_group=group, temperature=0.5)
    assert [name for name, _ in calls].count("rank_check") == 1, calls

    # A loss without per-token inputs digests as none (it crashed the check's first call).
    def no_inputs(logprob, entropy):
        return -logprob

    fused_linear_loss(hidden, shard, targets, no_inputs, tp_group=group)
    logits_loss(hidden @ shard.t(), targets, no_inputs, tp_group=group)

    # Each mistake on a signature of its own (a shard size of its own).
    def refused(vocab_shard, words, call):
        hidden, weight, targets = case(vocab_shard, seed=vocab_shard)
        with pytest.raises(ValueError, match=words):
            call(hidden, shard_of(weight, rank), weight, targets)

    refused(V + 1, "every rank of tp_group holds the same weight rows", lambda h, s, w, t: fused_linear_logprob(
        h, w, t % (V + 1), tp_group=group))  # fmt: skip
    refused(V + 2, "disagree on targets", lambda h, s, w, t: fused_linear_logprob(h, s, (t + rank) % V, tp_group=group))
    refused(V + 3, "disagree on temperature", lambda h, s, w, t: fused_linear_logprob(
        h, s, t, tp_group=group, temperature=torch.full((TOKENS,), 0.7 + 0.1 * rank)))  # fmt: skip
    refused(V + 4, "disagree on mask", lambda h, s, w, t: fused_linear_logprob(
        h, s, t, tp_group=group, mask=torch.arange(TOKENS) % 2 == rank))  # fmt: skip
    refused(V + 5, "disagree on the rows' shape", lambda h, s, w, t: fused_linear_logprob(
        h[: TOKENS - rank], s, t[: TOKENS - rank], tp_group=group))  # fmt: skip

    def kept_sets(targets, extra):  # each row keeps its target and `extra`
        ids = torch.stack([targets, torch.full_like(targets, extra)], -1)
        ids[ids[:, 0] == extra, 1] = (extra + 1) % (2 * (V + 6))
        return torch.arange(TOKENS + 1) * 2, ids.reshape(-1)

    refused(V + 6, "disagree on kept_tokens", lambda h, s, w, t: fused_linear_logprob(
        h, s, t, tp_group=group, kept_tokens=kept_sets(t, 3 + rank)))  # fmt: skip
    refused(V + 7, "disagree on targets", lambda h, s, w, t: fused_linear_loss(
        h, s, (t + rank) % V, losses.cross_entropy, loss_inputs={"weight": torch.ones(TOKENS)}, tp_group=group))  # fmt: skip
    refused(V + 8, "every rank of tp_group holds the same weight rows", lambda h, s, w, t: logits_logprob(
        h @ w[: V + 8].t(), t % (V + 8), tp_group=group))  # fmt: skip
    # A loss's per-token inputs and the declared weights: each rank's own gives another gradient.
    weights = torch.linspace(0.5, 1.5, TOKENS)
    refused(V + 10, "disagree on loss_inputs", lambda h, s, w, t: fused_linear_loss(
        h, s, t, losses.cross_entropy, loss_inputs={"weight": weights + rank}, tp_group=group))  # fmt: skip
    refused(V + 11, "disagree on loss_inputs", lambda h, s, w, t: logits_loss(
        h @ s.t(), t, losses.cross_entropy, loss_inputs={"weight": weights * (1 + rank)}, tp_group=group))  # fmt: skip
    refused(V + 12, "disagree on loss_inputs", lambda h, s, w, t: fused_linear_cross_entropy(
        h, s, t, weights.roll(rank), tp_group=group))  # fmt: skip
    refused(V + 13, "every rank of tp_group holds the same weight rows", lambda h, s, w, t: fused_linear_topk(
        h, w, 3, tp_group=group))  # fmt: skip
    # Options that set the chunks, the rows' count or the collectives' sizes: the op would abort or hang.
    refused(V + 15, "disagree on the options", lambda h, s, w, t: fused_linear_logprob(
        h, s, t, tp_group=group, token_chunk=4 + rank))  # fmt: skip
    refused(V + 16, "disagree on the options", lambda h, s, w, t: fused_linear_loss(
        h, s, t, losses.cross_entropy, loss_inputs={"weight": torch.ones(TOKENS)}, tp_group=group,
        mask=torch.ones(TOKENS, dtype=torch.bool), max_rows=TOKENS + rank))  # fmt: skip
    refused(V + 17, "disagree on the options", lambda h, s, w, t: fused_linear_cross_entropy(
        h, s, t, weights, tp_group=group, out_of_vocab=("error", "max_logit")[rank]))  # fmt: skip
    refused(V + 18, "disagree on the options", lambda h, s, w, t: fused_linear_topk(h, s, 2 + rank, tp_group=group))
    refused(V + 19, "disagree on the options", lambda h, s, w, t: logits_logprob(
        h @ s.t(), t % (V + 19), tp_group=group, token_chunk=4 + rank))  # fmt: skip
    # One target per row on one rank, one of several ([n, 1]) on the other: other collectives.
    refused(V + 20, "disagree on targets", lambda h, s, w, t: fused_linear_logprob(
        h, s, t[:, None] if rank == 0 else t, tp_group=group))  # fmt: skip
    # One temperature per sequence, [b] on one rank and [b, 1] on the other: the same values, agreed.
    hidden_c, weight_c, targets_c = case(V + 22, seed=22)
    per_sequence = torch.full((3,), 0.7) if rank == 0 else torch.full((3, 1), 0.7)
    fused_linear_logprob(
        hidden_c.view(3, 4, H), shard_of(weight_c, rank), targets_c.view(3, 4), tp_group=group, temperature=per_sequence
    )
    # A list where the mask belongs: the op's own TypeError on every rank, not a crash in the digest.
    hidden_d, weight_d, targets_d = case(V + 23, seed=23)
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        fused_linear_logprob(hidden_d, shard_of(weight_d, rank), targets_d, tp_group=group, mask=[True] * TOKENS)
    # Options equal once checked agree, whatever their types.
    hidden_b, weight_b, targets_b = case(V + 21, seed=21)
    fused_linear_logprob(hidden_b, shard_of(weight_b, rank), targets_b, tp_group=group, entropy_grad=(True, 1)[rank])
    # A refused call is refused again when repeated: the check stays on until the ranks agree.
    for _ in range(2):
        refused(V + 14, "disagree on targets", lambda h, s, w, t: fused_linear_logprob(
            h, s, (t + rank) % V, tp_group=group))  # fmt: skip

    # A later call of a checked signature is not checked by default: "always" checks every call, so
    # a mask that selects other rows on one rank in a later micro-batch is a ValueError on every
    # rank, not a failed collective.
    check_ranks_agree("always")
    try:
        with recorded_collectives(rank_check=True) as calls:
            fused_linear_logprob(hidden, shard, targets, tp_group=group)
            fused_linear_logprob(hidden[:5], shard, targets[:5], tp_group=group)
        assert [name for name, _ in calls].count("rank_check") == 2, calls
        with pytest.raises(ValueError, match="disagree on mask"):
            fused_linear_logprob(hidden, shard, targets, tp_group=group, mask=torch.arange(TOKENS) < 6 + rank)
    finally:
        check_ranks_agree(True)
    with pytest.raises(ValueError, match="True, False or 'always'"):
        check_ranks_agree("sometimes")

    # Turned off: the whole weight on both ranks gives numbers, each log-prob off by log 2.
    check_ranks_agree(False)
    try:
        hidden, weight, targets = case(V + 9, seed=9)
        doubled = fused_linear_logprob(hidden, weight, targets, tp_group=group)
        alone = fused_linear_logprob(hidden, weight, targets)
        torch.testing.assert_close(alone - doubled, torch.full_like(alone, math.log(2)), rtol=0, atol=1e-5)
    finally:
        check_ranks_agree(True)


def test_ranks_that_disagree_are_refused_by_name():
    run_ranks(check_refusals, 2)


def check_shards_that_change_on_some_ranks(rank, world_size):
    """The case the default cannot catch: a first call with equal shards (40 rows, 10 each), then one
    whose shards differ (42 rows as 11, 11, 10, 10). Each rank decides from its own signature, which
    holds its shard size, so by default ranks 2 and 3 would skip the check that ranks 0 and 1 run,
    and the group would fail in a collective. ``"always"`` checks every call on every rank: the same
    ``ValueError`` everywhere, naming the shard."""
    group = dist.new_group(list(range(world_size)))
    check_ranks_agree("always")
    try:
        for sizes, refused in (([10, 10, 10, 10], False), ([11, 11, 10, 10], True)):
            hidden, weight, targets = make_case((TOKENS,), H, sum(sizes), torch.float32, peaky=False, seed=1)
            shard = weight.split(sizes)[rank]
            if not refused:
                fused_linear_logprob(hidden, shard, targets, tp_group=group)
                continue
            with pytest.raises(ValueError, match="disagree on the shard's vocabulary rows"):
                fused_linear_logprob(hidden, shard, targets, tp_group=group)
    finally:
        check_ranks_agree(True)


def test_always_refuses_shards_that_change_on_some_ranks_on_every_rank():
    run_ranks(check_shards_that_change_on_some_ranks, 4)
