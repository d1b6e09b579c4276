"""The named softmax steps every path shares, each against the float64 oracle."""

import pytest
import torch

from devkit.oracle import max_abs_error, reference_from_logits, relative_error
from megatron_fused_lm.ops.softmax import (
    MAX,
    NUM_STATISTICS,
    SUMEXP,
    block_logit_grad,
    block_statistics,
    chosen_logit_grad,
    merge_statistics,
    summarize,
    zero_chosen,
)

ROWS, VOCAB = 9, 60


def make_logits(scale: float, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=generator, dtype=torch.float64) * scale
    targets = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    return logits, targets


def block_columns(targets, start, stop):
    """The targets' columns in the block ``[start, stop)``, -1 where another block holds them."""
    return torch.where((targets >= start) & (targets < stop), targets - start, -1)


def blocks_statistics(logits, targets, edges):
    """Statistics ``[k, n, 4]`` of the column blocks ``[edges[i], edges[i + 1])``."""
    parts = []
    for start, stop in zip(edges[:-1], edges[1:], strict=True):
        parts.append(block_statistics(logits[:, start:stop].float(), block_columns(targets, start, stop)))
    return torch.stack(parts)


@pytest.mark.parametrize("scale", [1.0, 30.0], ids=["flat", "peaky"])
def test_merged_blocks_give_the_whole_vocabulary(scale):
    logits, targets = make_logits(scale)
    summary = summarize(merge_statistics(blocks_statistics(logits, targets, [0, 7, 31, 32, 60])))
    expected = reference_from_logits(logits, targets)
    # float32 logits of magnitude ~scale * 3: rounding ~1e-7 of that.
    assert max_abs_error(summary.logprob, expected.logprob) <= 1e-6 * scale
    assert max_abs_error(summary.entropy, expected.entropy) <= 1e-6 * scale
    lse = torch.logsumexp(logits, -1)
    assert max_abs_error(summary.lse, lse) <= 1e-6 * scale
    assert max_abs_error(summary.mean_logit, lse - expected.entropy) <= 2e-6 * scale


def test_merge_does_not_depend_on_block_order():
    logits, targets = make_logits(10.0, seed=1)
    parts = blocks_statistics(logits, targets, [0, 13, 40, 60])
    forward = merge_statistics(parts)
    for order in ([2, 1, 0], [1, 2, 0]):
        # Same sums in another order: equal up to float32 rounding.
        assert torch.allclose(merge_statistics(parts[order]), forward, rtol=1e-6, atol=1e-6)


def test_an_empty_block_contributes_nothing():
    logits, targets = make_logits(5.0, seed=2)
    parts = blocks_statistics(logits, targets, [0, 25, 60])
    empty = torch.zeros(1, ROWS, NUM_STATISTICS)
    empty[..., MAX] = -torch.inf  # what a block without columns carries
    merged = merge_statistics(torch.cat([parts[:1], empty, parts[1:]]))
    assert torch.equal(merged, merge_statistics(parts))
    assert torch.isfinite(merged).all()


def test_peaky_entropy_keeps_its_relative_precision():
    # Logits in the hundreds with entropies far below 1e-6: lse - mean would cancel to errors
    # of the logits' float32 spacing (~3e-5 here); measuring from the maximum keeps them at
    # ~1e-12 (the tiny log(sumexp) term below float32's resolution of 1 is what remains).
    logits, targets = make_logits(200.0, seed=3)
    logits = logits.float().double()  # the oracle sees the float32 logits the blocks see
    summary = summarize(merge_statistics(blocks_statistics(logits, targets, [0, 30, 60])))
    expected = reference_from_logits(logits, targets).entropy
    assert expected.min() < 1e-6  # several rows are that peaky
    assert torch.allclose(summary.entropy.double(), expected, rtol=1e-3, atol=1e-9)


def test_block_statistics_of_one_block():
    logits, targets = make_logits(3.0, seed=4)
    owned = targets % 2 == 0  # the other rows' targets live elsewhere
    logits = logits.float().double()  # what the block sees
    stats = block_statistics(logits.float(), torch.where(owned, targets, -1))
    row_max = logits.max(-1).values
    assert max_abs_error(stats[:, MAX], row_max) == 0
    assert relative_error(stats[:, SUMEXP], (logits - row_max[:, None]).exp().sum(-1)) <= 1e-6
    target_logit = logits.gather(1, targets[:, None]).squeeze(1)
    assert max_abs_error(stats[:, -1], torch.where(owned, target_logit, 0.0)) <= 1e-6


@pytest.mark.parametrize("with_logprob,with_entropy", [(True, True), (True, False), (False, True)])
def test_logit_grad_matches_autograd(with_logprob, with_entropy):
    logits, targets = make_logits(4.0, seed=5)
    generator = torch.Generator().manual_seed(6)
    grad_logprob = torch.randn(ROWS, generator=generator) if with_logprob else None
    grad_entropy = torch.randn(ROWS, generator=generator) if with_entropy else None
    expected = reference_from_logits(logits, targets, 1.0, grad_logprob, grad_entropy)
    lse = torch.logsumexp(logits, -1).float()
    mean_logit = (torch.logsumexp(logits, -1) - expected.entropy).float()
    # Two column blocks, as a rank's shard or a chunk of it sees them; targets outside a block
    # keep only the -p term there.
    grads = []
    for start, stop in ((0, 22), (22, VOCAB)):
        grads.append(
            block_logit_grad(
                logits[:, start:stop].float(),
                block_columns(targets, start, stop),
                lse,
                mean_logit,
                grad_logprob,
                grad_entropy,
            )
        )
    assert relative_error(torch.cat(grads, 1), expected.grad_hidden) <= 1e-5


def test_logit_grad_without_upstream_is_zero():
    logits, targets = make_logits(1.0)
    grad = block_logit_grad(logits.float(), targets, torch.zeros(ROWS), torch.zeros(ROWS), None, None)
    assert torch.count_nonzero(grad) == 0


@pytest.mark.parametrize("with_logprob,with_entropy", [(True, True), (True, False), (False, True)])
def test_chosen_term_completes_the_zeroed_block(with_logprob, with_entropy):
    # A confident chosen token (p_y about 1 - 1e-6), a dominant other token, and random rows: the
    # block with the chosen elements zeroed plus the chosen term from the statistics is dz.
    logits, targets = make_logits(2.0, seed=7)
    logits[0, targets[0]] = 20.0
    logits[1, (targets[1] + 1) % VOCAB] = 20.0
    generator = torch.Generator().manual_seed(8)
    grad_logprob = torch.randn(ROWS, generator=generator) if with_logprob else None
    grad_entropy = torch.randn(ROWS, generator=generator) if with_entropy else None
    expected = reference_from_logits(logits, targets, 1.0, grad_logprob, grad_entropy).grad_hidden
    columns = torch.where(targets % 3 == 0, -1, targets)  # a third of the targets in another shard
    summary = summarize(block_statistics(logits.float(), columns))
    block = block_logit_grad(logits.float(), columns, summary.lse, summary.mean_logit, grad_logprob, grad_entropy)
    zero_chosen(block, columns)
    owned = columns >= 0
    assert (block[owned, columns[owned]] == 0).all() and (block[~owned] != 0).any()
    chosen = chosen_logit_grad(columns, summary, grad_logprob, grad_entropy)
    assert (chosen[~owned] == 0).all()
    block[torch.arange(ROWS)[owned], columns[owned]] = chosen[owned]
    if grad_logprob is not None:  # what the shard that owns those rows' targets adds
        block[torch.arange(ROWS)[~owned], targets[~owned]] += grad_logprob[~owned]
    assert relative_error(block, expected) <= 1e-5
    # The confident row's chosen term (1 - p_y about 8e-7): float32 statistics give 1 - p_y to
    # about 1e-7 (log of a sum near 1); 1 - exp(z_y - lse) from logits near 20 would err by 2e-6.
    scale = sum(grad[0].abs().item() for grad in (grad_logprob, grad_entropy) if grad is not None)
    assert abs(chosen[0].item() - expected[0, targets[0]].item()) <= 3e-7 * scale
