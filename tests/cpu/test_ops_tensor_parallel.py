"""Both ops with the vocabulary split over two gloo ranks, against a float64 oracle of the whole
vocabulary; and the number of collectives per call."""

import torch
import torch.distributed as dist

from devkit.collectives import ALL_GATHER, counts, recorded_collectives
from devkit.oracle import make_case, reference, reference_from_logits, relative_error
from devkit.spawn import run_ranks
from megatron_fused_lm import fused_linear_logprob, logits_logprob

H, V_LOCAL, TOKENS = 24, 53, 31


def check_fused(rank, group, dtype, token_chunk, targets_on_rank_1_only, temperature=0.7):
    world = dist.get_world_size(group)
    hidden, weight, targets = make_case((TOKENS,), H, V_LOCAL * world, dtype, peaky=True, seed=7)
    if targets_on_rank_1_only:  # rank 0 owns no target: its shard still gets the -p term
        targets = V_LOCAL + targets % V_LOCAL
    else:  # alternate rows' targets in alternate shards: each rank owns half of them
        targets = targets % V_LOCAL + V_LOCAL * (torch.arange(TOKENS) % world)
    shard = weight[rank * V_LOCAL : (rank + 1) * V_LOCAL].clone().requires_grad_()
    hidden_leaf = hidden.clone().requires_grad_()
    grad_logprob, grad_entropy = torch.randn(TOKENS), torch.randn(TOKENS)
    with recorded_collectives() as calls:
        logprob, entropy = fused_linear_logprob(
            hidden_leaf,
            shard,
            targets,
            tp_group=group,
            temperature=temperature,
            return_entropy=True,
            token_chunk=token_chunk,
        )
        forward_counts = counts(calls)
        ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    assert forward_counts == {ALL_GATHER: 1, "all_reduce": 0}, forward_counts
    assert counts(calls) == {ALL_GATHER: 1, "all_reduce": 1}, calls
    expected = reference(hidden, weight, targets, temperature, grad_logprob, grad_entropy)
    output_tol, grad_tol = (2e-5, 2e-5) if dtype == torch.float32 else (1e-4, 1e-2)
    assert relative_error(logprob, expected.logprob) <= output_tol
    assert relative_error(entropy, expected.entropy) <= output_tol
    assert relative_error(hidden_leaf.grad, expected.grad_hidden) <= grad_tol
    expected_shard_grad = expected.grad_weight[rank * V_LOCAL : (rank + 1) * V_LOCAL]
    assert relative_error(shard.grad, expected_shard_grad) <= grad_tol


def check_partial_hidden_grad(rank, group):
    hidden, weight, targets = make_case((TOKENS,), H, 2 * V_LOCAL, torch.float32, peaky=False, seed=3)
    shard = weight[rank * V_LOCAL : (rank + 1) * V_LOCAL]
    hidden_leaf = hidden.clone().requires_grad_()
    with recorded_collectives() as calls:
        fused_linear_logprob(hidden_leaf, shard, targets, tp_group=group, reduce_hidden_grad=False).sum().backward()
    assert counts(calls)["all_reduce"] == 0
    full = reference(hidden, weight, targets, 1.0, grad_logprob=torch.ones(TOKENS)).grad_hidden
    partial = hidden_leaf.grad.clone()
    assert relative_error(partial, full) > 1e-2  # really only this rank's share
    dist.all_reduce(partial, group=group)
    assert relative_error(partial, full) <= 2e-5


def check_logits(rank, group, token_chunk):
    hidden, weight, targets = make_case((TOKENS,), H, 2 * V_LOCAL, torch.float64, peaky=False, seed=5)
    logits = (hidden @ weight.t()).float()
    shard = logits[:, rank * V_LOCAL : (rank + 1) * V_LOCAL].clone().requires_grad_()
    grad_logprob, grad_entropy = torch.randn(TOKENS), torch.randn(TOKENS)
    with recorded_collectives() as calls:
        logprob, entropy = logits_logprob(
            shard, targets, tp_group=group, temperature=1.3, return_entropy=True, token_chunk=token_chunk
        )
        ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    assert counts(calls) == {ALL_GATHER: 1, "all_reduce": 0}, calls
    expected = reference_from_logits(logits, targets, 1.3, grad_logprob, grad_entropy)
    assert relative_error(logprob, expected.logprob) <= 2e-5
    assert relative_error(entropy, expected.entropy) <= 2e-5
    assert relative_error(shard.grad, expected.grad_logits[:, rank * V_LOCAL : (rank + 1) * V_LOCAL]) <= 2e-5


def check_masked(rank, group):
    hidden, weight, targets = make_case((TOKENS,), H, 2 * V_LOCAL, torch.float32, peaky=False, seed=9)
    mask = torch.arange(TOKENS) % 3 == 0
    shard = weight[rank * V_LOCAL : (rank + 1) * V_LOCAL].clone().requires_grad_()
    hidden_leaf = hidden.clone().requires_grad_()
    logprob = fused_linear_logprob(hidden_leaf, shard, targets, tp_group=group, mask=mask)
    logprob.sum().backward()
    expected = reference(hidden, weight, targets, 1.0, grad_logprob=mask.double())
    assert relative_error(logprob[mask], expected.logprob[mask]) <= 2e-5
    assert torch.count_nonzero(logprob[~mask]) == 0
    assert relative_error(hidden_leaf.grad, expected.grad_hidden) <= 2e-5
    assert relative_error(shard.grad, expected.grad_weight[rank * V_LOCAL : (rank + 1) * V_LOCAL]) <= 2e-5


def tensor_parallel_cases(rank, world_size):
    torch.manual_seed(1234)  # the same upstream gradients on every rank
    group = dist.new_group(list(range(world_size)))
    for dtype in (torch.float32, torch.bfloat16):
        for token_chunk in (1, 7, None):
            check_fused(rank, group, dtype, token_chunk, targets_on_rank_1_only=False)
    check_fused(rank, group, torch.float32, 5, targets_on_rank_1_only=True)
    per_row = torch.rand(TOKENS, generator=torch.Generator().manual_seed(9)) * 1.5 + 0.5  # the same on both ranks
    for dtype in (torch.float32, torch.bfloat16):
        check_fused(rank, group, dtype, 7, targets_on_rank_1_only=False, temperature=per_row)
    check_partial_hidden_grad(rank, group)
    check_masked(rank, group)
    for token_chunk in (4, None):
        check_logits(rank, group, token_chunk)


def test_two_ranks():
    run_ranks(tensor_parallel_cases, 2)
