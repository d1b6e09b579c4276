"""What the head needs under context parallelism, with Megatron-Core's own CP split
(``megatron.core.utils.get_batch_on_this_cp_rank``: each sequence cut into 2 x CP chunks, rank r
holding chunks r and 2 x CP - 1 - r), CP=2 over two processes.

A CP model hands each rank the final hidden states of its own positions; the head computes every
row from that row alone, over the tensor-parallel group only. So, with the hidden states, the
labels and the loss mask split by that same function:
1. each rank's log-probs and entropy equal the CP=1 results at the positions it holds;
2. a token-mean loss whose weights are normalized by the global token count, summed over the CP
   ranks by ``context_parallel_sum``, equals the CP=1 loss on every rank; with the gradient local,
   each rank's hidden-state gradient equals the CP=1 gradient at its positions, and the weight
   gradients summed over the CP ranks (what Megatron's gradient all-reduce over data x context
   parallelism does) equal the CP=1 weight gradient; with the gradient summed and rank r
   backpropagating ``c_r`` times the loss, both are ``sum(c)`` times those;
3. labels made by shifting each rank's own tokens, after the split, are wrong wherever a rank's
   two chunks are not adjacent: the labels must be shifted before the split (Megatron's
   ``get_batch`` does so);
4. ``context_parallel_gather`` of each rank's log-probs, at the positions Megatron's split gave it,
   is the CP=1 log-probs on every rank; rank r then backpropagating ``sum(u_r * logprob)`` (``u_r``
   its own), the gradient local gives each rank the CP=1 gradient of its own ``u_r`` at its
   positions, the gradient summed that of ``sum_r u_r``: hidden states at its positions, and its
   weight gradient that of those positions' terms.

The CP=1 results are a float64 oracle's. Tolerances: float32 inputs, so 2e-5 on values (measured
about 2e-6, as in test_integration_parity) and 5e-5 of the largest entry of each gradient.
"""

import torch

from devkit import megatron_gpt as harness
from devkit.oracle import logprob_entropy
from megatron_fused_lm import (
    context_parallel_gather,
    context_parallel_sum,
    fused_linear_logprob,
    fused_linear_loss,
    losses,
)

CP = 2
BATCH, SEQ, HIDDEN, VOCAB = 2, 16, 8, 37
VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5


def full_batch():
    """The whole batch, the same on every rank: tokens, labels shifted on the full sequence, a loss
    mask, positions and peaky hidden states and weight (some entropies near 0)."""
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": (torch.rand(BATCH, SEQ, generator=generator) > 0.3).float(),
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ),
        "hidden": torch.randn(BATCH, SEQ, HIDDEN, generator=generator) * 2.0,
    }, torch.randn(VOCAB, HIDDEN, generator=generator) * 1.5


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    error = (actual.double() - expected).abs().max().item()
    assert error <= GRAD_RTOL * expected.abs().max().item(), f"{label}: off by {error:.3g}"


def worker() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=CP)
    group = parallel_state.get_context_parallel_group()
    batch, weight = full_batch()
    local = harness.split_for_this_cp_rank(batch)
    positions = local["position_ids"][0]
    assert positions.numel() == SEQ // CP and len(set(positions.tolist())) == SEQ // CP

    # 1. Per position: the CP=1 values at the positions this rank holds.
    want_logprob, want_entropy = logprob_entropy(batch["hidden"].double() @ weight.double().t(), batch["labels"], 1.0)
    logprob, entropy = fused_linear_logprob(local["hidden"], weight, local["labels"], return_entropy=True)
    harness.assert_max_error(logprob, want_logprob[:, positions], VALUE_ATOL, "CP logprob")
    harness.assert_max_error(entropy, want_entropy[:, positions], VALUE_ATOL, "CP entropy")
    assert want_entropy.min() < 0.2, "the distributions are not peaky enough to test"

    # 2. A token mean over the whole batch: weights from the global count, the loss summed over CP.
    hidden = batch["hidden"].double().requires_grad_()
    full_weight = weight.double().requires_grad_()
    full_logprob, _ = logprob_entropy(hidden @ full_weight.t(), batch["labels"], 1.0)
    want_loss = -(losses.token_mean_weights(batch["loss_mask"]).double() * full_logprob).sum()
    want_loss.backward()
    weights = harness.split_for_this_cp_rank({"weights": losses.token_mean_weights(batch["loss_mask"])})["weights"]
    rank = torch.distributed.get_rank(group)
    scales = [1.0 + k for k in range(CP)]  # c_r, what rank r backpropagates the loss with
    for gradient, upstream, factor in (("local", 1.0, 1.0), ("summed", scales[rank], sum(scales))):
        local_hidden = local["hidden"].clone().requires_grad_()
        local_weight = weight.clone().requires_grad_()
        result = fused_linear_loss(
            local_hidden, local_weight, local["labels"], losses.cross_entropy, loss_inputs={"weight": weights}
        )
        loss = context_parallel_sum(result.loss, group, gradient=gradient)
        assert abs(loss.item() - want_loss.item()) <= VALUE_ATOL, (gradient, loss.item(), want_loss.item())
        (upstream * loss).backward()
        assert_grad_close(local_hidden.grad, factor * hidden.grad[:, positions], f"{gradient} sum: hidden gradient")
        weight_grad = local_weight.grad.clone()
        torch.distributed.all_reduce(weight_grad, group=group)
        assert_grad_close(weight_grad, factor * full_weight.grad, f"{gradient} sum: weight gradient")

    # 3. Labels shifted after the split: wrong exactly where the next local position is not the
    # next position of the sequence (between a rank's two chunks, unless they are adjacent).
    shifted_late = torch.roll(local["tokens"], -1, dims=1)[:, :-1]  # the last column has no next token here
    wrong = (shifted_late != local["labels"][:, :-1]).any(dim=0)
    jumps = positions[1:] != positions[:-1] + 1
    assert not wrong[~jumps].any(), "a late shift should be right inside a chunk"
    assert wrong[jumps].all(), "a late shift should break the targets where the chunks are not adjacent"
    broken = torch.tensor(int(jumps.sum()))
    torch.distributed.all_reduce(broken, group=group)
    assert broken.item() > 0, "no rank holds two chunks that are not adjacent: the split is not Megatron's"

    # 4. Back to whole sequences, at the positions Megatron's split gave this rank.
    upstreams = [harness.random_weights(BATCH, SEQ, seed=40 + k).double() for k in range(CP)]
    held = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    held[:, positions] = True
    for gradient, upstream in (("local", upstreams[rank]), ("summed", sum(upstreams))):
        hidden = batch["hidden"].double().requires_grad_()
        full_weight = weight.double().requires_grad_()
        want_logprob, _ = logprob_entropy(hidden @ full_weight.t(), batch["labels"], 1.0)
        # This rank's hidden rows, and its weight gradient: that of its own positions' terms.
        (upstream * want_logprob * held).sum().backward()
        local_hidden = local["hidden"].clone().requires_grad_()
        local_weight = weight.clone().requires_grad_()
        logprob = fused_linear_logprob(local_hidden, local_weight, local["labels"])
        whole = context_parallel_gather(logprob, positions, SEQ, group, gradient=gradient)
        assert whole.shape == (BATCH, SEQ) and whole.dtype == logprob.dtype, (whole.shape, whole.dtype)
        harness.assert_max_error(whole, want_logprob, VALUE_ATOL, f"{gradient} gather: log-probs")
        (upstreams[rank] * whole).sum().backward()
        assert_grad_close(local_hidden.grad, hidden.grad[:, positions], f"{gradient} gather: hidden gradient")
        assert_grad_close(local_weight.grad, full_weight.grad, f"{gradient} gather: weight gradient")


def test_context_parallel_split_gives_the_cp1_results():
    harness.spawn(worker, CP)
