"""The slime and NeMo-RL recipes under context parallelism (CP=2, TP=1, two processes), each fed its
trainer's CP layout of a micro-batch.

Megatron's attention has no CPU kernel under CP, so these tests start from the final hidden states:
random hidden states at every position of the whole micro-batch and a peaky head weight (some
entropies near 0). Each rank takes the rows its trainer gives it, cut by Megatron's own
``get_batch_on_this_cp_rank`` applied to each padded sequence (slime's ``slice_with_cp`` and
NeMo-RL's ``_get_tokens_on_this_cp_rank`` cut a sequence into the same 2 x CP chunks); the same
split of the positions says which positions a rank holds. The head is ``OpsHead`` over the weight.

The oracle: float64 log-probs and entropy of every whole sequence at CP=1 (devkit's oracle).
- slime keeps its results per rank: each rank's pieces of every sample equal the oracle's at the
  positions it holds, in slime's order, and the losses, each over the rank's own tokens with
  denominators from whole samples, sum over the ranks to the CP=1 loss. Each rank's hidden-state
  gradient equals the CP=1 gradient at its positions and the weight gradients summed over the ranks
  (Megatron's data x context-parallel reduction) equal the CP=1 weight gradient.
- NeMo-RL gathers its log-probs to every rank (``AllGatherCPTensor``, whose backward sums the
  ranks' upstream gradients before each takes its own rows): every rank's ``[B, S - 1]`` equals the
  oracle's, and with a different loss on each rank, each rank's hidden-state gradient is the
  gradient of the sum of all ranks' losses at its positions. Its SFT loss, whole on every rank,
  gives each rank CP times its rows' share of the gradient.

Tolerances as in test_recipes: 2e-5 on values, 5e-5 of the largest entry of each gradient.
"""

from typing import List
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from devkit import megatron_gpt as harness
from devkit.oracle import logprob_entropy, policy_loss_inputs
from devkit.rollouts import OpsHead, slime_args, slime_policy_oracle, slime_sample_mean
from megatron_fused_lm import context_parallel_positions
from megatron_fused_lm.recipes import nemo_rl, slime

CP = 2
HIDDEN, VOCAB = 8, 37
TEMPERATURE = 0.8
TOKEN_CHUNK = 5
VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    error = (actual.double() - expected).abs().max().item()
    assert error <= GRAD_RTOL * expected.abs().max().item(), f"{label}: off by {error:.3g}"


def summed_over_ranks(value: torch.Tensor) -> torch.Tensor:
    total = value.detach().clone()
    dist.all_reduce(total)
    return total


def padded_length(length: int) -> int:
    return -(-length // (2 * CP)) * (2 * CP)


def this_ranks_rows(per_position: torch.Tensor) -> torch.Tensor:
    """This rank's rows of one padded sequence's ``[P, ...]`` values, by Megatron's split."""
    return harness.split_for_this_cp_rank({"values": per_position.unsqueeze(0)})["values"][0]


def whole_sequences(lengths: List[int], seed: int):
    """Tokens of each sequence, float64 hidden states of each padded sequence (the padding rows
    random too: they must not matter) and a peaky weight ``[V, h]``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(1, VOCAB, (length,), generator=generator) for length in lengths]
    hidden = [torch.randn(padded_length(length), HIDDEN, generator=generator, dtype=torch.float64) * 2.0
              for length in lengths]  # fmt: skip
    return tokens, hidden, torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64) * 1.5


def oracle_rows(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor):
    """Float64 log-prob and entropy ``[n - 1]`` of one sequence's next tokens at CP=1."""
    logits = hidden[: tokens.numel() - 1] @ weight.t()
    return logprob_entropy(logits, tokens[1:], TEMPERATURE)


def rank_weights(shape, rank: int, seed: int) -> torch.Tensor:
    return harness.random_weights(*shape, seed=seed + 100 * rank).double()


# ---------------------------------------------------------------------------------------- slime

SLIME_TOTALS, SLIME_RESPONSES = [11, 16, 7, 9], [6, 3, 4, 1]
# Padded to 12, 16, 8, 12 positions: sample 0's response spans both ranks (one rank holding the
# position whose next token starts its other chunk), sample 1's lies on rank 0 and sample 2's on
# rank 1 only, sample 3's single token on rank 1. Rows: 24 per rank, padded at the end to 32.
# With --allgather-cp the 43 positions laid end to end, padded to 64, split in two halves of 32.
SLIME_ROWS = 32


def slime_worker(allgather_cp: bool) -> None:
    """slime's default CP layout, or with ``allgather_cp`` its contiguous one, whose per-sample
    results slime still expects in the default layout's per-rank pieces."""
    rank = parallel_state.get_context_parallel_rank()
    tokens, hidden, weight = whole_sequences(SLIME_TOTALS, seed=11)
    generator = torch.Generator().manual_seed(12)
    if allgather_cp:
        stream = torch.cat([sample[:total] for sample, total in zip(hidden, SLIME_TOTALS, strict=True)])
        tail = torch.randn(SLIME_ROWS * CP - stream.shape[0], HIDDEN, generator=generator, dtype=torch.float64)
        local_rows = torch.cat([stream, tail])[rank * SLIME_ROWS : (rank + 1) * SLIME_ROWS]
    else:
        local_rows = torch.cat([this_ranks_rows(sample) for sample in hidden])
        padding = torch.randn(SLIME_ROWS - local_rows.shape[0], HIDDEN, generator=generator, dtype=torch.float64)
        local_rows = torch.cat([local_rows, padding])
    # Per sample: the response entries this rank holds, in its row order (which is slime's order).
    held = []
    for total, response in zip(SLIME_TOTALS, SLIME_RESPONSES, strict=True):
        positions = this_ranks_rows(torch.arange(padded_length(total)))
        first = total - response - 1
        held.append(positions[(positions >= first) & (positions < total - 1)] - first)
    assert any(entries.numel() == 0 for entries in held), "no sample without a response on this rank"

    def leaves():
        return local_rows.float()[None].requires_grad_(), weight.float().requires_grad_()

    def oracle():
        """Whole-sample float64 ``(logprob, entropy)`` per sample, its leaves."""
        leaves64 = [sample.clone().requires_grad_() for sample in hidden], weight.clone().requires_grad_()
        rows = [oracle_rows(sample, leaves64[1], ids) for sample, ids in zip(leaves64[0], tokens, strict=True)]
        responses = [
            (logprob[-response:], entropy[-response:])
            for (logprob, entropy), response in zip(rows, SLIME_RESPONSES, strict=True)
        ]
        return responses, leaves64

    def check_grads(leaves32, leaves64, label):
        """This rank's hidden gradient at its rows, and the weight gradient summed over the ranks."""
        if allgather_cp:
            stream = torch.cat([sample.grad[:total] for sample, total in zip(leaves64[0], SLIME_TOTALS, strict=True)])
            expected_rows = torch.cat([stream, stream.new_zeros(SLIME_ROWS * CP - stream.shape[0], HIDDEN)])
            expected_rows = expected_rows[rank * SLIME_ROWS : (rank + 1) * SLIME_ROWS]
        else:
            expected_rows = torch.cat([this_ranks_rows(sample.grad) for sample in leaves64[0]])
        actual = leaves32[0].grad[0]
        assert_grad_close(actual[: expected_rows.shape[0]], expected_rows, f"{label} hidden gradient")
        assert not actual[expected_rows.shape[0] :].any(), f"{label}: gradient on the end padding"
        assert_grad_close(summed_over_ranks(leaves32[1].grad), leaves64[1].grad, f"{label} weight gradient")

    args = slime_args(TEMPERATURE, "--fused-linear-logprob", "--fused-linear-logprob-token-chunk", str(TOKEN_CHUNK))
    args.allgather_cp = allgather_cp
    layout = "--allgather-cp" if allgather_cp else "zigzag"
    common = dict(unconcat_tokens=tokens, total_lengths=SLIME_TOTALS, response_lengths=SLIME_RESPONSES)

    # log_probs_and_entropy: this rank's pieces; a weighted sum of them over the ranks.
    responses, leaves64 = oracle()
    assert min(entropy.min().item() for _, entropy in responses) < 0.2, "not peaky enough to test"
    upstream = [rank_weights((2, response), 0, seed=20 + i) for i, response in enumerate(SLIME_RESPONSES)]
    sum(((u[0] * lp) + (u[1] * ent)).sum() for u, (lp, ent) in zip(upstream, responses, strict=True)).backward()
    leaves32 = leaves()
    with mock.patch.object(slime, "_head", OpsHead(leaves32[1], TOKEN_CHUNK)):
        empty, found = slime.log_probs_and_entropy(leaves32[0], args=args, with_entropy=True, **common)
    assert empty.numel() == 0
    local_sum = 0
    for i, entries in enumerate(held):
        for name, index in (("log_probs", 0), ("entropy", 1)):
            piece = found[name][i]
            assert piece.shape == entries.shape, (name, i, piece.shape, entries.shape)
            harness.assert_max_error(
                piece, responses[i][index][entries], VALUE_ATOL, f"slime CP {layout} {name} sample {i}"
            )
            local_sum = local_sum + (upstream[i][index][entries] * piece).sum()
    local_sum.backward()
    check_grads(leaves32, leaves64, f"slime CP {layout} log_probs_and_entropy")

    # The losses: each rank's over its own tokens, denominators from whole samples.
    loss_masks = [(torch.rand(response, generator=generator) > 0.2).float() for response in SLIME_RESPONSES]
    loss_masks[0][0] = 0.0
    mask_sums = [mask.sum() for mask in loss_masks]
    local_reduce = slime_sample_mean([mask[entries] for mask, entries in zip(loss_masks, held, strict=True)], mask_sums)
    whole_reduce = slime_sample_mean(loss_masks, mask_sums)
    batch = {**common, "loss_masks": loss_masks}

    responses, leaves64 = oracle()
    expected = -whole_reduce(torch.cat([lp for lp, _ in responses]))
    expected.backward()
    leaves32 = leaves()
    with mock.patch.object(slime, "_head", OpsHead(leaves32[1], TOKEN_CHUNK)):
        loss, metrics = slime.sft_loss(args, batch, leaves32[0], local_reduce)
    assert abs(summed_over_ranks(loss).item() - expected.item()) <= VALUE_ATOL, (loss.item(), expected.item())
    loss.backward()
    check_grads(leaves32, leaves64, f"slime CP {layout} sft_loss")

    with torch.no_grad():
        current = torch.cat([lp for lp, _ in oracle()[0]])
    inputs = policy_loss_inputs(current, torch.cat(loss_masks), torch.Generator().manual_seed(13))
    whole = {name: list(value.split(SLIME_RESPONSES)) for name, value in inputs.items()}
    for key, name in (("log_probs", "old_logprob"), ("ref_log_probs", "ref_logprob"), ("advantages", "advantages")):
        batch[key] = [value[entries] for value, entries in zip(whole[name], held, strict=True)]
    responses, leaves64 = oracle()
    logprob, entropy = (torch.cat(values) for values in zip(*responses, strict=True))
    expected = slime_policy_oracle(logprob, entropy, inputs, args, whole_reduce)
    expected.backward()
    leaves32 = leaves()
    with mock.patch.object(slime, "_head", OpsHead(leaves32[1], TOKEN_CHUNK)):
        loss, metrics = slime.policy_loss(args, batch, leaves32[0], local_reduce)
    assert abs(summed_over_ranks(loss).item() - expected.item()) <= VALUE_ATOL, (loss.item(), expected.item())
    entropy_metric = summed_over_ranks(metrics["entropy_loss"]).item()
    assert abs(entropy_metric - whole_reduce(entropy.detach()).item()) <= VALUE_ATOL, entropy_metric
    loss.backward()
    check_grads(leaves32, leaves64, f"slime CP {layout} policy_loss")

    # On-policy (no old log-probs: slime skipped its log-prob pass): the current ones, detached; the
    # loss pass's log-probs captured as slime's debug dump takes them, this rank's pieces.
    on_policy = {key: value for key, value in batch.items() if key != "log_probs"}
    on_policy["partition"] = list(range(len(SLIME_TOTALS)))
    responses, leaves64 = oracle()
    logprob, entropy = (torch.cat(values) for values in zip(*responses, strict=True))
    expected = slime_policy_oracle(logprob, entropy, dict(inputs, old_logprob=logprob.detach()), args, whole_reduce)
    expected.backward()
    leaves32, captured = leaves(), []
    with mock.patch.object(slime, "_head", OpsHead(leaves32[1], TOKEN_CHUNK)):
        loss, metrics = slime.policy_loss(
            args, on_policy, leaves32[0], local_reduce, capture_log_probs=lambda _, pieces: captured.append(pieces)
        )
    assert abs(summed_over_ranks(loss).item() - expected.item()) <= VALUE_ATOL, (loss.item(), expected.item())
    assert metrics["ppo_kl"] == 0 and metrics["pg_clipfrac"] == 0, metrics
    for i, entries in enumerate(held):
        harness.assert_max_error(captured[0][i], responses[i][0][entries], VALUE_ATOL, f"slime CP {layout} captured")
    loss.backward()
    check_grads(leaves32, leaves64, f"slime CP {layout} on-policy policy_loss")

    with pytest.raises(ValueError, match="rows"):
        slime.sft_loss(args, batch, leaves()[0][:, : SLIME_ROWS // 2], local_reduce)
    if rank == 0:
        print(f"slime CP=2 {layout}: pieces, SFT and policy losses match the CP=1 oracle", flush=True)


# -------------------------------------------------------------------------------------- NeMo-RL

NEMO_LENGTHS, NEMO_WIDTH = [5, 9, 4], 10  # padded to 8, 12, 4; unpacked input_ids [3, 10]


class NeMoRLLogprobLoss:
    """What the recipe's prepare_loss_input reads of a LOGPROB loss (NeMo-RL's NLLLossFn): its
    input_type by name."""

    class input_type:  # LossInputType.LOGPROB
        name = "LOGPROB"


def nemo_rl_worker() -> None:
    rank, group = parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_group()
    tokens, hidden, weight = whole_sequences(NEMO_LENGTHS, seed=21)
    padded = [padded_length(length) for length in NEMO_LENGTHS]
    input_lengths = torch.tensor(NEMO_LENGTHS)
    cu_seqlens_padded = torch.tensor([0, *padded]).cumsum(0).int()
    packed_ids = torch.zeros(1, int(cu_seqlens_padded[-1]), dtype=torch.long)
    for ids, start in zip(tokens, cu_seqlens_padded.tolist(), strict=False):
        packed_ids[0, start : start + ids.numel()] = ids
    local_rows = torch.cat([this_ranks_rows(sample) for sample in hidden])
    positions = torch.cat([
        start + this_ranks_rows(torch.arange(length))
        for start, length in zip(cu_seqlens_padded.tolist(), padded, strict=False)
    ])  # fmt: skip
    assert torch.equal(context_parallel_positions(cu_seqlens_padded, rank, CP), positions), "not Megatron's split"
    starts = [start // CP for start in cu_seqlens_padded.tolist()]  # each sequence's rows on this rank

    def leaves():
        return local_rows.float()[None].requires_grad_(), weight.float().requires_grad_()

    def oracle():
        """Float64 ``[B, S - 1]`` log-probs (0 past each sequence) and the leaves."""
        leaves64 = [sample.clone().requires_grad_() for sample in hidden], weight.clone().requires_grad_()
        unpacked = []
        for sample, ids in zip(leaves64[0], tokens, strict=True):
            logprob = oracle_rows(sample, leaves64[1], ids)[0]
            unpacked.append(torch.nn.functional.pad(logprob, (0, NEMO_WIDTH - 1 - logprob.numel())))
        return torch.stack(unpacked), leaves64

    def check_grads(leaves32, leaves64, label, scale=1.0):
        expected_rows = torch.cat([this_ranks_rows(sample.grad) for sample in leaves64[0]]) * scale
        assert_grad_close(leaves32[0].grad[0], expected_rows, f"{label} hidden gradient")
        assert_grad_close(summed_over_ranks(leaves32[1].grad), leaves64[1].grad * scale, f"{label} weight gradient")

    upstream = [rank_weights((len(NEMO_LENGTHS), NEMO_WIDTH - 1), k, seed=40) for k in range(CP)]

    def run(label, logprobs_of):
        """``logprobs_of(hidden leaf, head)`` -> ``[B, S - 1]`` on every rank, against the oracle; each
        rank backpropagates its own weighted sum, so the gradient is the sum's."""
        expected, leaves64 = oracle()
        (sum(upstream) * expected).sum().backward()
        leaves32 = leaves()
        found = logprobs_of(leaves32[0], OpsHead(leaves32[1], TOKEN_CHUNK))
        harness.assert_max_error(found, expected, VALUE_ATOL, label)
        (upstream[rank] * found).sum().backward()
        check_grads(leaves32, leaves64, label)

    # The log-prob pass (LogprobsPostProcessor's packed branch), on the output NeMo-RL divided by T.
    run("NeMo-RL CP packed_next_token_logprobs", lambda output, head: nemo_rl.packed_next_token_logprobs(
        head, output / TEMPERATURE, packed_ids, input_lengths, cu_seqlens_padded, NEMO_WIDTH, cp_group=group,
    ))  # fmt: skip

    # SequencePackingLossWrapper: prepare_fn on each sequence's rows of this rank, its unpadded ids.
    def per_sequence(output, head):
        rows = []
        for i, (start, length) in enumerate(zip(cu_seqlens_padded.tolist(), NEMO_LENGTHS, strict=False)):
            data = {"input_ids": packed_ids[:, start : start + length]}
            sequence_rows = output[:, starts[i] : starts[i + 1]]
            found, same = nemo_rl.prepare_loss_input(
                sequence_rows / TEMPERATURE, data, NeMoRLLogprobLoss(), context_parallel_group=group, head=head
            )
            assert same is data and found["next_token_logprobs"].shape == (1, length - 1)
            rows.append(torch.nn.functional.pad(found["next_token_logprobs"], (0, NEMO_WIDTH - length)))
        return torch.cat(rows)

    run("NeMo-RL CP prepare_loss_input per sequence", per_sequence)

    # NLLLossFn in the forward, per sequence as the wrapper calls it: the whole loss on every rank.
    generator = torch.Generator().manual_seed(22)
    token_masks = [(torch.rand(1, length, generator=generator) > 0.25).float() for length in NEMO_LENGTHS]
    global_valid_toks = torch.tensor(25.0)
    expected, leaves64 = oracle()
    masks = torch.stack([torch.nn.functional.pad(mask[0, 1:], (0, NEMO_WIDTH - mask.shape[1])) for mask in token_masks])
    nll_expected = -(expected * masks).sum() / (global_valid_toks + 1e-8)
    nll_expected.backward()
    leaves32 = leaves()
    head = OpsHead(leaves32[1], TOKEN_CHUNK)
    loss = 0
    for i, (start, length) in enumerate(zip(cu_seqlens_padded.tolist(), NEMO_LENGTHS, strict=False)):
        data = {"input_ids": packed_ids[:, start : start + length], "token_mask": token_masks[i],
                "sample_mask": torch.ones(1)}  # fmt: skip
        sequence_loss, metrics = nemo_rl.nll_loss(
            head, leaves32[0][:, starts[i] : starts[i + 1]] / TEMPERATURE, data, global_valid_toks, cp_group=group
        )
        assert metrics["num_unmasked_tokens"] == token_masks[i][0, 1:].sum().item()
        loss = loss + sequence_loss
    assert abs(loss.item() - nll_expected.item()) <= VALUE_ATOL, (loss.item(), nll_expected.item())
    loss.backward()
    check_grads(leaves32, leaves64, "NeMo-RL CP nll_loss", scale=CP)

    with pytest.raises(ValueError, match="cannot hold"):
        nemo_rl.prepare_loss_input(
            leaves()[0][:, :2], {"input_ids": packed_ids[:, :9]}, NeMoRLLogprobLoss(), context_parallel_group=group,
            head=head,
        )  # fmt: skip
    if rank == 0:
        print("NeMo-RL CP=2: gathered log-probs and the SFT loss match the CP=1 oracle", flush=True)


def worker() -> None:
    torch._dynamo.config.disable = True
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=CP)
    slime_worker(allgather_cp=False)
    slime_worker(allgather_cp=True)
    nemo_rl_worker()


def test_slime_and_nemo_rl_recipes_under_context_parallelism_match_cp1():
    harness.spawn(worker, CP)
