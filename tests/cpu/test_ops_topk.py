"""``fused_linear_topk`` and ``logits_topk`` against a float64 oracle of the whole vocabulary's log-probs: on one rank
(flat and confident rows, odd sizes, a temperature, leading dimensions, k from 1 to the whole
vocabulary), with exact ties, and with the vocabulary split over two gloo ranks."""

import pytest
import torch
import torch.distributed as dist

from devkit.oracle import make_case
from devkit.spawn import run_ranks
from megatron_fused_lm import fused_linear_topk, logits_topk

F64 = torch.float64


def oracle_logprobs(hidden, weight, temperature):
    """float64 log-probs ``[n, V]`` of the rounded operands (the products' inputs)."""
    rows = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype).to(F64)
    return torch.log_softmax(rows @ weight.to(F64).t() / temperature, dim=-1)


def check_against_oracle(logprobs, ids, expected, k, tolerance):
    """Our ``k`` ids are distinct, score what the oracle gives them, come in descending order, and
    miss no token the oracle ranks clearly above our last one."""
    logprobs, ids = logprobs.reshape(-1, k), ids.reshape(-1, k)
    assert logprobs.dtype == torch.float32 and ids.dtype == torch.int64
    assert all(len(set(row.tolist())) == k for row in ids)
    assert (logprobs.double() - expected.gather(1, ids)).abs().max() <= tolerance
    assert bool((logprobs[:, :-1] >= logprobs[:, 1:]).all())
    kth_expected = expected.topk(k, dim=1).values[:, -1]
    assert bool((logprobs[:, -1].double() >= kth_expected - tolerance).all())


@pytest.mark.parametrize("k", [1, 5, 97])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("peaky", [False, True], ids=["flat", "confident"])
def test_against_float64(peaky, dtype, k):
    hidden, weight, _ = make_case((3, 7), 33, 97, dtype, peaky=peaky, seed=1)
    logprobs, ids = fused_linear_topk(hidden, weight, k, temperature=0.7, token_chunk=4)
    assert logprobs.shape == ids.shape == (3, 7, k)
    expected = oracle_logprobs(hidden, weight, 0.7)
    # float32 logits of magnitude up to a few hundred (confident rows) round by ~1e-5 each.
    tolerance = 1e-4 if peaky else 2e-6
    check_against_oracle(logprobs, ids, expected, k, tolerance)
    if k == 97:  # the whole vocabulary: every id once, the probabilities summing to 1
        assert torch.allclose(logprobs.double().exp().sum(-1), torch.ones(3, 7, dtype=F64), atol=1e-5)
    # The same from the logits, in the weight's dtype as the stock head makes them.
    logits = (hidden.to(weight.dtype).float() @ weight.float().t()).to(dtype)
    logprobs, ids = logits_topk(logits, k, temperature=0.7, token_chunk=5)
    from_logits = torch.log_softmax(logits.double() / 0.7, dim=-1).reshape(-1, 97)
    check_against_oracle(logprobs, ids, from_logits, k, tolerance)


def tied_case(vocab=12, hidden_size=4):
    """Integer-valued operands, so every logit is exact whatever the product's order: rows 2, 5
    and 9 of the weight are equal, and each row's largest logit is theirs."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randint(-2, 3, (vocab, hidden_size), generator=generator).float()
    weight[[2, 5, 9]] = torch.tensor([4.0, 4.0, 4.0, 4.0])
    hidden = torch.randint(1, 3, (6, hidden_size), generator=generator).float()
    return hidden, weight


def test_ties_go_to_the_lower_id():
    hidden, weight = tied_case()
    logprobs, ids = fused_linear_topk(hidden, weight, 4)
    assert ids[:, :3].tolist() == [[2, 5, 9]] * 6
    assert bool((logprobs[:, 0] == logprobs[:, 1]).all() and (logprobs[:, 1] == logprobs[:, 2]).all())


@pytest.mark.parametrize("tied", [5, 40], ids=["within the margin", "past the margin"])
def test_ties_at_the_boundary_go_to_the_lower_ids(tied):
    # `tied` equal largest logits at ids spread over a 64-token vocabulary; k = 3 keeps the three
    # lowest of them, whether the candidates past the k-th settle it or the whole shard must.
    hidden, weight = tied_case(vocab=64)
    weight[[2, 5, 9]] = 0.0
    tied_ids = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:tied]
    weight[tied_ids] = 4.0
    _, ids = fused_linear_topk(hidden, weight, 3)
    assert ids.tolist() == [sorted(tied_ids.tolist())[:3]] * 6


def test_rows_with_and_without_the_fallback_in_one_chunk_and_signed_zeros():
    # Row 0 has distinct logits; row 1 ties 24 logits at its boundary (past the margin), so only
    # row 1 takes the whole shard's keys.
    logits = torch.zeros(2, 64)
    logits[0] = torch.arange(64.0)
    logits[1, 40:] = 1.0
    assert logits_topk(logits, 3)[1].tolist() == [[63, 62, 61], [40, 41, 42]]
    # -0.0 equals +0.0: the lower id first.
    assert logits_topk(torch.tensor([[-0.0, 0.0, -1.0]]), 2)[1].tolist() == [[0, 1]]
    assert logits_topk(torch.tensor([[0.0, -0.0, -1.0]]), 2)[1].tolist() == [[0, 1]]


def test_forward_only_and_checked_arguments():
    hidden, weight, _ = make_case((5,), 8, 11, torch.float32, peaky=False)
    logprobs, _ = fused_linear_topk(hidden.requires_grad_(), weight.requires_grad_(), 3)
    assert not logprobs.requires_grad
    for k, error in ((0, ValueError), (12, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="k must be"):
            fused_linear_topk(hidden, weight, k)
        with pytest.raises(error, match="k must be"):
            logits_topk(hidden @ weight.t(), k)
    with pytest.raises(TypeError, match="logits must be"):
        logits_topk(torch.zeros(3, 4, dtype=torch.long), 1)
    empty, empty_ids = fused_linear_topk(hidden[:0], weight, 3)
    assert empty.shape == empty_ids.shape == (0, 3)


def two_rank_cases(rank, world):
    group = dist.new_group(list(range(world)))
    hidden, weight, _ = make_case((9,), 16, 2 * 23, torch.float32, peaky=True, seed=4)
    shard = weight[rank * 23 : (rank + 1) * 23]
    expected = oracle_logprobs(hidden, weight, 1.0)
    logits = hidden @ weight.t()
    for k in (1, 7, 30):  # 30: more than one shard holds
        logprobs, ids = fused_linear_topk(hidden, shard, k, tp_group=group, token_chunk=4)
        check_against_oracle(logprobs, ids, expected, k, 1e-4)
        logprobs, ids = logits_topk(logits[:, rank * 23 : (rank + 1) * 23], k, tp_group=group)
        check_against_oracle(logprobs, ids, torch.log_softmax(logits.double(), dim=-1), k, 1e-4)
        gathered = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(gathered, ids, group=group)
        assert all(torch.equal(other, ids) for other in gathered)  # the same result on every rank
    # A tie across the shards: rows 5 (rank 0) and 18 (rank 1) equal, the largest logit of every row.
    hidden, weight = tied_case(vocab=24)
    weight[2], weight[9], weight[18] = 0.0, 0.0, 4.0
    _, ids = fused_linear_topk(hidden, weight[rank * 12 : (rank + 1) * 12], 2, tp_group=group)
    assert ids.tolist() == [[5, 18]] * 6


def test_two_ranks():
    run_ranks(two_rank_cases, 2)
