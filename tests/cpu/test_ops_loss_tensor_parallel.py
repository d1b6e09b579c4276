"""The three-GEMM loss ops with the vocabulary split over two gloo ranks, against the float64
oracle of the whole vocabulary (``devkit.oracle.loss_reference``); and the collectives each call
runs.

Each rank holds half the vocabulary rows of the weight and the same hidden states, targets, mask
and loss inputs. Checked: the loss, the metrics, this rank's weight-gradient shard and the hidden
gradient of ``fused_linear_loss`` (SFT, clipped policy and custom losses; chunks of 1, 7 and the
default; targets on both ranks or all on rank 1; a mask; float32 and bfloat16), the partial hidden
gradient of ``reduce_hidden_grad=False``, ``no_grad``, ``logits_loss`` on logits shards, and
``fused_linear_cross_entropy`` for an upstream gradient that matches its declared weights or not;
one temperature for all tokens, and one per token.

Collectives (``recorded_collectives``), as the README documents them. ``fused_linear_loss``
finishes its gradients in the forward: one all-gather of each chunk's shard statistics
``[chunk rows, 4]`` (merged before the chunk's gradient can be formed); its backward scales and
rounds them and runs one all-reduce of the hidden gradient ``[rows, H]``.
``fused_linear_cross_entropy`` runs the same forward; a matching upstream gives the same backward,
a mismatching one recomputes from the merged statistics it saved: again one all-reduce of the
hidden gradient, no all-gather.

Tolerances as in test_ops_loss.py: ``FLOAT32_TOL`` for float32 and for the float32 loss and
metrics; bfloat16 gradients at most ``STOCK_RATIO`` times the stock path's error (bfloat16 logits
shards through ``logits_loss``) plus a quarter of bfloat16's machine epsilon.
"""

import torch
import torch.distributed as dist

from devkit.collectives import ALL_GATHER, recorded_collectives
from devkit.oracle import logprob_entropy, loss_reference, make_case, policy_loss_inputs, relative_error
from devkit.spawn import run_ranks
from megatron_fused_lm import fused_linear_cross_entropy, fused_linear_loss, logits_loss, losses

H, V_LOCAL, LEAD = 24, 53, (4, 8)
TOKENS = LEAD[0] * LEAD[1]
TEMPERATURE = 0.8
# One temperature per token, from 0.5 to 2, the same on both ranks.
PER_ROW_TEMPERATURE = torch.rand(LEAD, generator=torch.Generator().manual_seed(21)) * 1.5 + 0.5
FLOAT32_TOL = 1e-5
STOCK_RATIO = 1.2


def forward_collectives(rows: int, token_chunk):
    """The collectives of one three-GEMM forward over ``rows`` rows: a statistics all-gather per chunk."""
    chunk = token_chunk or rows
    return [(ALL_GATHER, (min(chunk, rows - start), 4)) for start in range(0, rows, chunk)]


def custom_loss(logprob, entropy, *, w):
    """A per-token loss of both log-prob and entropy, nonlinear in the log-prob."""
    return w * (logprob**2 + 0.3 * entropy)


def problem(dtype, targets_on_rank_1_only=False, masked=False, seed=7):
    """Full ``hidden [4, 8, H]``, ``weight [2 * V_LOCAL, H]``, ``targets``, ``mask``: the same on
    both ranks. Targets alternate between the two shards (or all lie in rank 1's); with a mask,
    unselected targets are out of range (never read)."""
    hidden, weight, targets = make_case(LEAD, H, 2 * V_LOCAL, dtype, peaky=False, seed=seed)
    targets = targets % V_LOCAL
    targets = targets + V_LOCAL * (1 if targets_on_rank_1_only else torch.arange(TOKENS).view(LEAD) % 2)
    if not masked:
        return hidden, weight, targets, None
    mask = torch.rand(LEAD, generator=torch.Generator().manual_seed(seed + 1)) < 0.6
    return hidden, weight, torch.where(mask, targets, -100), mask


def loss_case(name, hidden, weight, targets, mask, temperature=TEMPERATURE):
    """``(loss_fn, loss_inputs)``, the same on both ranks; the policy case's old and reference
    log-probs lie near the true ones (the k3 KL estimator is exponential in their difference)."""
    gen = torch.Generator().manual_seed(11)
    weights = losses.token_mean_weights(torch.ones(LEAD, dtype=torch.bool) if mask is None else mask)
    if name == "sft":
        return losses.cross_entropy, {"weight": weights}
    if name == "custom":
        return custom_loss, {"w": torch.rand(LEAD, generator=gen)}
    logprob, _ = logprob_entropy(hidden.double() @ weight.double().t(), targets.clamp_min(0), temperature)
    loss_fn = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, dual_clip=3.0, entropy_coef=0.01, kl_coef=0.05)
    return loss_fn, policy_loss_inputs(logprob, weights, gen)


def leaves(*tensors):
    """Fresh leaves requiring grad, with the given tensors' values."""
    return [tensor.detach().clone().requires_grad_() for tensor in tensors]


def shard_of(rank, weight):
    """This rank's vocabulary rows of a full ``[2 * V_LOCAL, ...]`` tensor."""
    return weight[rank * V_LOCAL : (rank + 1) * V_LOCAL]


def run_stock(hidden, shard, targets, loss_fn, loss_inputs, group, **options):
    """The unfused path on this rank's logits shard (in the inputs' dtype): the result, the full
    hidden gradient (the partials summed here: ``logits_loss`` reduces nothing) and the shard's."""
    hidden, shard = leaves(hidden, shard)
    result = logits_loss(hidden @ shard.t(), targets, loss_fn, loss_inputs=loss_inputs, tp_group=group, **options)
    result.loss.backward()
    grad_hidden = hidden.grad.float()
    dist.all_reduce(grad_hidden, group=group)
    return result, grad_hidden, shard.grad


def assert_values_match(result, expected, mask):
    """The loss and the metrics within ``FLOAT32_TOL``; unselected rows exactly 0."""
    assert relative_error(result.loss, expected.loss) <= FLOAT32_TOL
    assert relative_error(result.logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(result.entropy, expected.entropy) <= FLOAT32_TOL
    if mask is not None:
        assert torch.count_nonzero(result.logprob[~mask]) == torch.count_nonzero(result.entropy[~mask]) == 0


def check_loss(
    rank, group, case, dtype, token_chunk, targets_on_rank_1_only=False, masked=False, temperature=TEMPERATURE
):
    hidden, weight, targets, mask = problem(dtype, targets_on_rank_1_only, masked)
    loss_fn, loss_inputs = loss_case(case, hidden, weight, targets, mask, temperature)
    options = dict(temperature=temperature, mask=mask)
    leaf_hidden, leaf_shard = leaves(hidden, shard_of(rank, weight))
    with recorded_collectives() as calls:
        result = fused_linear_loss(
            leaf_hidden, leaf_shard, targets, loss_fn, loss_inputs=loss_inputs, tp_group=group,
            token_chunk=token_chunk, **options,
        )  # fmt: skip
        forward_calls = list(calls)
        result.loss.backward()
    rows = TOKENS if mask is None else int(mask.sum())
    assert forward_calls == forward_collectives(rows, token_chunk), forward_calls
    assert calls == forward_calls + [("all_reduce", (rows, H))], calls
    expected = loss_reference(hidden, weight, targets, loss_fn, loss_inputs, **options)
    assert_values_match(result, expected, mask)
    hidden_error = relative_error(leaf_hidden.grad, expected.grad_hidden)
    shard_error = relative_error(leaf_shard.grad, shard_of(rank, expected.grad_weight))
    if dtype == torch.float32:
        assert hidden_error <= FLOAT32_TOL and shard_error <= FLOAT32_TOL, (hidden_error, shard_error)
    else:
        _, stock_hidden, stock_shard = run_stock(
            hidden, shard_of(rank, weight), targets, loss_fn, loss_inputs, group, **options
        )
        floor = torch.finfo(dtype).eps / 4
        assert hidden_error <= STOCK_RATIO * relative_error(stock_hidden, expected.grad_hidden) + floor
        assert shard_error <= STOCK_RATIO * relative_error(stock_shard, shard_of(rank, expected.grad_weight)) + floor


def check_partial_hidden_grad(rank, group):
    hidden, weight, targets, _ = problem(torch.float32, seed=3)
    loss_fn, loss_inputs = loss_case("policy", hidden, weight, targets, None)
    leaf_hidden, leaf_shard = leaves(hidden, shard_of(rank, weight))
    with recorded_collectives() as calls:
        fused_linear_loss(
            leaf_hidden, leaf_shard, targets, loss_fn, loss_inputs=loss_inputs, tp_group=group,
            temperature=TEMPERATURE, token_chunk=7, reduce_hidden_grad=False,
        ).loss.backward()  # fmt: skip
    assert calls == forward_collectives(TOKENS, 7), calls
    full = loss_reference(hidden, weight, targets, loss_fn, loss_inputs, TEMPERATURE).grad_hidden
    partial = leaf_hidden.grad.clone()
    assert relative_error(partial, full) > 1e-2  # really only this rank's share
    dist.all_reduce(partial, group=group)
    assert relative_error(partial, full) <= FLOAT32_TOL


def check_no_grad(rank, group):
    hidden, weight, targets, _ = problem(torch.float32, seed=4)
    loss_fn, loss_inputs = loss_case("custom", hidden, weight, targets, None)
    leaf_hidden, leaf_shard = leaves(hidden, shard_of(rank, weight))
    with recorded_collectives() as calls, torch.no_grad():
        result = fused_linear_loss(
            leaf_hidden, leaf_shard, targets, loss_fn, loss_inputs=loss_inputs, tp_group=group,
            temperature=TEMPERATURE, token_chunk=7,
        )  # fmt: skip
    assert calls == forward_collectives(TOKENS, 7), calls  # no gradient to reduce
    assert result.loss.grad_fn is None
    expected = loss_reference(hidden, weight, targets, loss_fn, loss_inputs, TEMPERATURE)
    assert_values_match(result, expected, None)


def check_logits_loss(rank, group, temperature=TEMPERATURE):
    hidden, weight, targets, mask = problem(torch.float32, masked=True, seed=5)
    loss_fn, loss_inputs = loss_case("policy", hidden, weight, targets, mask, temperature)
    options = dict(temperature=temperature, mask=mask)
    result, grad_hidden, grad_shard = run_stock(
        hidden, shard_of(rank, weight), targets, loss_fn, loss_inputs, group, token_chunk=4, **options
    )
    expected = loss_reference(hidden, weight, targets, loss_fn, loss_inputs, **options)
    assert_values_match(result, expected, mask)
    assert relative_error(grad_hidden, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(grad_shard, shard_of(rank, expected.grad_weight)) <= FLOAT32_TOL


def check_declared_cross_entropy(rank, group, matching, temperature=TEMPERATURE):
    hidden, weight, targets, _ = problem(torch.float32, seed=6)
    declared = torch.rand(LEAD, generator=torch.Generator().manual_seed(12)) < 0.7
    # The loss per token taken on the returned losses: its upstream gradient is 0.37 * declared, or not.
    per_token = (lambda out, d: out * d * 0.37) if matching else (lambda out, d: out**2)
    leaf_hidden, leaf_shard = leaves(hidden, shard_of(rank, weight))
    with recorded_collectives() as calls:
        out = fused_linear_cross_entropy(
            leaf_hidden, leaf_shard, targets, declared, tp_group=group, temperature=temperature, token_chunk=7
        )
        forward_calls = list(calls)
        per_token(out, declared.float()).sum().backward()
    assert forward_calls == forward_collectives(TOKENS, 7), forward_calls
    assert calls == forward_calls + [("all_reduce", (TOKENS, H))], calls
    expected = loss_reference(
        hidden, weight, targets, lambda logprob, entropy, *, d: per_token(-logprob, d), {"d": declared.double()},
        temperature,
    )  # fmt: skip
    assert relative_error(out, -expected.logprob) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_shard.grad, shard_of(rank, expected.grad_weight)) <= FLOAT32_TOL


def tensor_parallel_cases(rank, world_size):
    group = dist.new_group(list(range(world_size)))
    for case in ("sft", "policy", "custom"):
        for token_chunk in (1, 7, None):
            check_loss(rank, group, case, torch.float32, token_chunk)
    check_loss(rank, group, "policy", torch.float32, 5, targets_on_rank_1_only=True)
    check_loss(rank, group, "custom", torch.float32, 3, masked=True)
    for case in ("policy", "custom"):
        check_loss(rank, group, case, torch.bfloat16, 7, masked=case == "policy")
    check_partial_hidden_grad(rank, group)
    check_no_grad(rank, group)
    check_logits_loss(rank, group)
    for matching in (True, False):
        check_declared_cross_entropy(rank, group, matching)
    # A temperature per token: the recompute pass of a mismatched upstream reads them again.
    check_loss(rank, group, "policy", torch.float32, 7, masked=True, temperature=PER_ROW_TEMPERATURE)
    check_loss(rank, group, "custom", torch.bfloat16, 7, temperature=PER_ROW_TEMPERATURE)
    check_logits_loss(rank, group, temperature=PER_ROW_TEMPERATURE)
    check_declared_cross_entropy(rank, group, False, temperature=PER_ROW_TEMPERATURE)


def test_two_ranks():
    run_ranks(tensor_parallel_cases, 2)
