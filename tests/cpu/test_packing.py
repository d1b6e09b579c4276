"""The packed-sequence (THD) helpers: response masks, splitting per-token results, next-token
targets, the shift convention against an unpacked computation, the positions a context-parallel
rank holds (against Megatron's own split in test_recipes_context_parallel), and the way back from
them: ``context_parallel_gather`` and ``context_parallel_sum`` on two gloo ranks against the same
computation on the whole sequences in one process, gradients included (and with the fused head
against Megatron's split in test_integration_context_parallel)."""

import pytest
import torch
import torch.distributed as dist

from devkit.oracle import make_case, reference, relative_error
from devkit.spawn import run_ranks
from megatron_fused_lm import fused_linear_logprob
from megatron_fused_lm.packing import (
    context_parallel_gather,
    context_parallel_positions,
    context_parallel_sum,
    next_token_targets,
    response_mask,
    split_responses,
)

H, V = 24, 101


def test_response_mask_and_split_by_hand():
    # Three sequences: [p p r r r], [p r], [p p p] (no response), then a one-token sequence [p].
    cu_seqlens = torch.tensor([0, 5, 7, 10, 11])
    prompt = torch.tensor([2, 1, 3, 1])
    mask = response_mask(cu_seqlens, prompt)
    expected = torch.zeros(11, dtype=torch.bool)
    expected[[1, 2, 3, 5]] = True  # position t scores token t + 1
    assert torch.equal(mask, expected)
    values = torch.arange(11.0)
    pieces = split_responses(values, cu_seqlens, prompt)
    assert [piece.tolist() for piece in pieces] == [[1.0, 2.0, 3.0], [5.0], [], []]


def test_response_lengths_leave_padding_out():
    cu_seqlens = torch.tensor([0, 6])
    mask = response_mask(cu_seqlens, torch.tensor([2]), torch.tensor([2]))  # 2 padding tokens at the end
    assert mask.nonzero().squeeze(-1).tolist() == [1, 2]


def test_next_token_targets_respect_sequence_ends():
    tokens = torch.tensor([10, 11, 12, 20, 21, 30])
    cu_seqlens = torch.tensor([0, 3, 5, 6])
    assert next_token_targets(tokens, cu_seqlens, fill=-1).tolist() == [11, 12, -1, 21, -1, -1]


def test_shift_convention_matches_a_per_sequence_computation():
    # The packed log-probs of the response tokens equal each sequence's own, computed unpacked.
    hidden, weight, _ = make_case((9,), H, V, torch.float32, peaky=False, seed=4)
    tokens = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(5))
    cu_seqlens, prompt = torch.tensor([0, 4, 9]), torch.tensor([1, 3])
    targets = next_token_targets(tokens, cu_seqlens)
    mask = response_mask(cu_seqlens, prompt)
    pieces = split_responses(fused_linear_logprob(hidden, weight, targets, mask=mask), cu_seqlens, prompt)
    for start, end, prompt_length, piece in zip([0, 4], [4, 9], prompt.tolist(), pieces, strict=True):
        response_tokens = tokens[start + prompt_length : end]
        scoring_rows = hidden[start + prompt_length - 1 : end - 1]
        expected = reference(scoring_rows, weight, response_tokens, 1.0).logprob
        assert piece.shape == response_tokens.shape
        assert relative_error(piece, expected) <= 2e-5


# A Megatron-style packed micro-batch: int32 cu_seqlens (as in PackedSeqParams), an empty sequence,
# a one-token prompt, a sequence with no response and one with padding after its response.
CU_SEQLENS = torch.tensor([0, 4, 4, 9, 12, 18], dtype=torch.int32)
PROMPTS = torch.tensor([1, 0, 3, 3, 2])
RESPONSES = torch.tensor([3, 0, 2, 0, 3])  # the last sequence ends in one padding token
TOTAL = 18


def response_positions_by_loop(cu_seqlens, prompts, responses=None):
    """Independent of the package: the positions scoring response tokens, sequence by sequence."""
    pieces = []
    for index in range(len(cu_seqlens) - 1):
        start, end, prompt = int(cu_seqlens[index]), int(cu_seqlens[index + 1]), int(prompts[index])
        response = end - start - prompt if responses is None else int(responses[index])
        pieces.append(list(range(start + prompt - 1, start + prompt - 1 + response)))
    return pieces


def next_token_targets_by_loop(tokens, cu_seqlens, fill):
    targets = []
    for index in range(len(cu_seqlens) - 1):
        start, end = int(cu_seqlens[index]), int(cu_seqlens[index + 1])
        targets += [int(tokens[t + 1]) for t in range(start, end - 1)] + [fill] * (end > start)
    return targets


@pytest.mark.parametrize("responses", [RESPONSES, None], ids=["response lengths", "to the end"])
def test_megatron_layout_against_a_loop(responses):
    expected = response_positions_by_loop(CU_SEQLENS, PROMPTS, responses)
    mask = response_mask(CU_SEQLENS, PROMPTS, responses)
    assert mask.dtype == torch.bool and mask.shape == (TOTAL,)
    assert mask.nonzero().squeeze(-1).tolist() == sum(expected, [])
    values = torch.arange(100.0, 100.0 + TOTAL)
    for per_token in (values, values.unsqueeze(0)):  # [T], and the model's [1, T]
        pieces = split_responses(per_token, CU_SEQLENS, PROMPTS, responses)
        assert [piece.shape for piece in pieces] == [(len(positions),) for positions in expected]
        assert [piece.tolist() for piece in pieces] == [[100.0 + t for t in positions] for positions in expected]


def test_split_responses_keeps_trailing_dims_of_batch_major_input():
    # Per-token vectors as Megatron returns them for a packed micro-batch, e.g. logits [1, T, V].
    values = torch.arange(TOTAL * 2).view(1, TOTAL, 2)
    pieces = split_responses(values, CU_SEQLENS, PROMPTS, RESPONSES)
    for positions, piece in zip(response_positions_by_loop(CU_SEQLENS, PROMPTS, RESPONSES), pieces, strict=True):
        assert piece.tolist() == [[2 * t, 2 * t + 1] for t in positions]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_next_token_targets_keep_the_input_layout(dtype):
    tokens = torch.randint(0, 1000, (TOTAL,), generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = next_token_targets_by_loop(tokens, CU_SEQLENS, fill=-100)
    flat = next_token_targets(tokens, CU_SEQLENS, fill=-100)
    assert flat.shape == (TOTAL,) and flat.dtype == dtype and flat.tolist() == expected
    batched = next_token_targets(tokens.unsqueeze(0), CU_SEQLENS, fill=-100)
    assert batched.shape == (1, TOTAL) and batched.dtype == dtype and batched[0].tolist() == expected


def test_packed_megatron_output_scores_the_response_tokens():
    # The model's per-token output for a packed micro-batch is [1, T]: the helpers take it as it is.
    hidden, weight, _ = make_case((1, 9), H, V, torch.float32, peaky=False, seed=6)
    tokens = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(7))
    cu_seqlens, prompt = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([2, 3])
    targets = next_token_targets(tokens, cu_seqlens)
    mask = response_mask(cu_seqlens, prompt).unsqueeze(0)
    pieces = split_responses(fused_linear_logprob(hidden, weight, targets, mask=mask), cu_seqlens, prompt)
    for start, end, prompt_length, piece in zip([0, 4], [4, 9], prompt.tolist(), pieces, strict=True):
        expected = reference(
            hidden[0, start + prompt_length - 1 : end - 1], weight, tokens[0, start + prompt_length : end], 1.0
        )
        assert piece.shape == (end - start - prompt_length,)
        assert relative_error(piece, expected.logprob) <= 2e-5


GOOD_CU, GOOD_PROMPT = torch.tensor([0, 3, 5]), torch.tensor([1, 1])

# (cu_seqlens, error, message): every function that takes cu_seqlens checks it the same way.
BAD_CU_SEQLENS = {
    "2-D": (torch.tensor([[0, 3, 5]]), ValueError, "cu_seqlens must be 1-D"),
    "empty": (torch.tensor([], dtype=torch.long), ValueError, "cu_seqlens must be 1-D"),
    "float": (torch.tensor([0.0, 3.0, 5.0]), TypeError, "cu_seqlens must .*integer"),
    "bool": (torch.tensor([False, True]), TypeError, "cu_seqlens must .*integer"),
    "list": ([0, 3, 5], TypeError, "cu_seqlens must be a torch.Tensor"),
    "not from 0": (torch.tensor([1, 3, 5]), ValueError, "start at 0"),
    "decreasing": (torch.tensor([0, 3, 2, 5]), ValueError, "never decrease"),
}
# For the functions that also take a per-token tensor of 5 tokens.
BAD_TOTAL = (torch.tensor([0, 3, 4]), ValueError, r"cu_seqlens\[-1\] = 4 .* 5 tokens")


def call_each(cu_seqlens):
    """The helpers on 5 tokens, each as a callable, with a one-token prompt per sequence."""
    prompt = torch.ones(max(len(cu_seqlens) - 1, 0), dtype=torch.long)
    return {
        "response_mask": lambda: response_mask(cu_seqlens, prompt),
        "split_responses [T]": lambda: split_responses(torch.zeros(5), cu_seqlens, prompt),
        "split_responses [1, T]": lambda: split_responses(torch.zeros(1, 5), cu_seqlens, prompt),
        "next_token_targets [T]": lambda: next_token_targets(torch.zeros(5, dtype=torch.long), cu_seqlens),
        "next_token_targets [1, T]": lambda: next_token_targets(torch.zeros(1, 5, dtype=torch.long), cu_seqlens),
    }


@pytest.mark.parametrize(
    "case, function",
    [(case, function) for case in BAD_CU_SEQLENS for function in call_each(GOOD_CU)]
    # response_mask takes no per-token tensor: its T is cu_seqlens[-1].
    + [("last entry is not T", function) for function in call_each(GOOD_CU) if function != "response_mask"],
)
def test_bad_cu_seqlens_raise_the_functions_own_error(case, function):
    cu_seqlens, error, message = BAD_TOTAL if case == "last entry is not T" else BAD_CU_SEQLENS[case]
    with pytest.raises(error, match=message):
        call_each(cu_seqlens)[function]()


@pytest.mark.parametrize("split", [False, True], ids=["response_mask", "split_responses"])
@pytest.mark.parametrize(
    "prompt,response,error,message",
    [
        (torch.tensor([1]), None, ValueError, r"prompt_lengths must have one entry per sequence \(2\)"),
        (torch.tensor([1, 1, 1]), None, ValueError, r"prompt_lengths must have one entry per sequence \(2\)"),
        (torch.tensor([[1, 1]]), None, ValueError, r"prompt_lengths must have one entry per sequence \(2\)"),
        (torch.tensor([1, 1]), torch.tensor([1]), ValueError, r"response_lengths must have one entry per sequence"),
        (torch.tensor([1.0, 1.0]), None, TypeError, "prompt_lengths must .*integer"),
        ([1.5, 1.0], None, TypeError, "prompt_lengths must .*integer"),
        (torch.tensor([1, 1]), torch.tensor([1.0, 1.0]), TypeError, "response_lengths must .*integer"),
        (torch.tensor([1, -1]), None, ValueError, r"prompt_lengths\[1\] = -1 is negative"),
        (torch.tensor([1, 1]), torch.tensor([-1, 0]), ValueError, r"response_lengths\[0\] = -1 is negative"),
        (torch.tensor([1, 3]), None, ValueError, r"prompt_lengths\[1\] = 3 is longer than sequence 1 \(2 tokens\)"),
        (torch.tensor([1, 3]), torch.tensor([0, 0]), ValueError, r"prompt_lengths\[1\] = 3 is longer than"),
        (torch.tensor([2, 1]), torch.tensor([2, 1]), ValueError, r"response_lengths\[0\] = 2 does not fit .*at most 1"),
        (torch.tensor([0, 1]), None, ValueError, "prompt of at least one token"),
    ],
)
def test_bad_lengths_raise_the_functions_own_error(prompt, response, error, message, split):
    with pytest.raises(error, match=message):
        if split:
            split_responses(torch.zeros(1, 5), GOOD_CU, prompt, response)
        else:
            response_mask(GOOD_CU, prompt, response)


def test_lengths_may_be_python_lists():
    assert response_mask(GOOD_CU, [1, 1], [2, 1]).tolist() == [True, True, False, True, False]
    assert split_responses(torch.zeros(1, 0), torch.tensor([0]), []) == []


@pytest.mark.parametrize(
    "values,message",
    [
        (torch.zeros(2, 5), r"values of shape \(2, 5\): .*\[1, T"),
        (torch.zeros(5, 1), r"values of shape \(5, 1\): .*\[1, T"),
        (torch.zeros(1, 5, 1)[:, :4], r"cu_seqlens\[-1\] = 5 .* 4 tokens"),
        (torch.tensor(1.0), r"values of shape \(\)"),
    ],
)
def test_split_responses_rejects_other_layouts(values, message):
    with pytest.raises(TypeError, match="values must be a torch.Tensor"):
        split_responses([0.0] * 5, GOOD_CU, GOOD_PROMPT)
    with pytest.raises(ValueError, match=message):
        split_responses(values, GOOD_CU, GOOD_PROMPT)


@pytest.mark.parametrize(
    "tokens,fill,error,message",
    [
        (torch.zeros(2, 5, dtype=torch.long), 0, ValueError, r"tokens of shape \(2, 5\): .*\[1, T\]"),
        (torch.zeros(1, 5, 1, dtype=torch.long), 0, ValueError, r"tokens of shape \(1, 5, 1\): .*\[1, T\]"),
        ([0] * 5, 0, TypeError, "tokens must be a torch.Tensor"),
        (torch.zeros(5), 0, TypeError, "tokens must .*integer"),
        (torch.zeros(5, dtype=torch.bool), 0, TypeError, "tokens must .*integer"),
        (torch.zeros(5, dtype=torch.long), 0.5, TypeError, "fill must be an integer"),
        (torch.zeros(5, dtype=torch.long), True, TypeError, "fill must be an integer"),
        (torch.zeros(5, dtype=torch.int32), 2**40, ValueError, "fill .* does not fit in torch.int32"),
    ],
)
def test_next_token_targets_reject_bad_tokens_and_fill(tokens, fill, error, message):
    with pytest.raises(error, match=message):
        next_token_targets(tokens, GOOD_CU, fill=fill)


def test_context_parallel_positions_by_hand():
    # Sequences of 8 and 4 positions over CP = 2: chunks of 2 and 1; rank r holds chunks r and 3 - r.
    cu_seqlens = torch.tensor([0, 8, 12], dtype=torch.int32)
    assert context_parallel_positions(cu_seqlens, 0, 2).tolist() == [0, 1, 6, 7, 8, 11]
    assert context_parallel_positions(cu_seqlens, 1, 2).tolist() == [2, 3, 4, 5, 9, 10]
    # CP = 4 on one sequence of 8: rank 1 holds chunks 1 and 6.
    assert context_parallel_positions(torch.tensor([0, 8]), 1, 4).tolist() == [1, 6]
    # CP = 1: every position, whatever the lengths; an empty sequence holds none.
    assert context_parallel_positions(torch.tensor([0, 3, 3, 8]), 0, 1).tolist() == list(range(8))
    assert context_parallel_positions(torch.tensor([0, 0, 4]), 1, 2).tolist() == [1, 2]


@pytest.mark.parametrize(
    "cu_seqlens,cp_rank,cp_size,error,message",
    [
        (torch.tensor([0, 8, 14]), 0, 2, ValueError, "sequence 1 has 6 positions, not a multiple of 2 x cp_size = 4"),
        (torch.tensor([0, 8]), 2, 2, ValueError, "cp_rank must be in"),
        (torch.tensor([0, 8]), 0, 0, ValueError, "cp_rank must be in"),
        (torch.tensor([0, 8]), 0, 2.0, TypeError, "cp_size must be an int"),
        (torch.tensor([0.0, 8.0]), 0, 2, TypeError, "cu_seqlens must hold integers"),
    ],
)
def test_context_parallel_positions_rejects_bad_input(cu_seqlens, cp_rank, cp_size, error, message):
    with pytest.raises(error, match=message):
        context_parallel_positions(cu_seqlens, cp_rank, cp_size)


# context_parallel_gather and context_parallel_sum.

CP_CU_SEQLENS = torch.tensor([0, 8, 12, 20])  # padded for CP = 2
# Positions held unevenly, in no order, some by no rank (those gather to 0): slime's --allgather-cp
# gathers per-row results this way.
UNEVEN_POSITIONS = (torch.tensor([7, 0, 3]), torch.tensor([15, 9, 1, 10, 12]))


def gather_worker(rank: int, cp_size: int) -> None:
    """Each rank holds some positions of float64 results ``[2, 20]``; rank k's loss on the whole
    sequences is ``sum(u_k * whole ** 2)``. The oracle computes each rank's loss on the whole
    sequences in one process: the gathered results are the whole ones, and each rank's rows get the
    oracle's gradient of its own loss ("local") or of the sum of every rank's ("summed") at their
    positions."""
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(3)
    results = torch.randn(2, 20, generator=generator, dtype=torch.float64)
    upstream = [torch.randn(2, 20, generator=generator, dtype=torch.float64) for _ in range(cp_size)]
    layouts = {
        "zigzag": [context_parallel_positions(CP_CU_SEQLENS, k, cp_size) for k in range(cp_size)],
        "uneven": UNEVEN_POSITIONS,
    }
    for layout, held in layouts.items():
        whole = torch.zeros_like(results)
        for positions in held:
            whole[:, positions] = results[:, positions]
        oracle_grads = []
        for k in range(cp_size):
            leaf = whole.clone().requires_grad_()
            (upstream[k] * leaf.square()).sum().backward()
            oracle_grads.append(leaf.grad)
        positions = held[rank]
        for gradient, expected in (("local", oracle_grads[rank]), ("summed", sum(oracle_grads))):
            rows = results[:, positions].clone().requires_grad_()
            gathered = context_parallel_gather(rows, positions.int(), 20, group, gradient=gradient)
            assert torch.equal(gathered, whole), (layout, gradient)
            (upstream[rank] * gathered.square()).sum().backward()
            torch.testing.assert_close(rows.grad, expected[:, positions], rtol=1e-12, atol=0)

    # The sum: every rank's value summed; rank k backpropagates c_k, its value gets c_rank or sum(c).
    values = [torch.randn(3, generator=generator, dtype=torch.float64) for _ in range(cp_size)]
    scales = [torch.randn(3, generator=generator, dtype=torch.float64) for _ in range(cp_size)]
    for gradient, expected in (("local", scales[rank]), ("summed", sum(scales))):
        value = values[rank].clone().requires_grad_()
        total = context_parallel_sum(value, group, gradient=gradient)
        torch.testing.assert_close(total, sum(values), rtol=1e-12, atol=0)
        (scales[rank] * total).sum().backward()
        torch.testing.assert_close(value.grad, expected, rtol=1e-12, atol=0)


def test_context_parallel_gather_and_sum_against_the_whole_sequences():
    run_ranks(gather_worker, 2)


def test_without_context_parallelism_the_gather_places_and_the_sum_returns():
    values = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    placed = context_parallel_gather(values, torch.tensor([4, 0, 2]), 5, None, gradient="summed")
    assert placed.tolist() == [[2.0, 0.0, 3.0, 0.0, 1.0]]
    (placed * torch.arange(5.0)).sum().backward()
    assert values.grad.tolist() == [[4.0, 0.0, 2.0]]
    assert context_parallel_sum(values, None, gradient="local") is values


ROWS = torch.zeros(1, 3)


@pytest.mark.parametrize(
    "values,positions,num_positions,gradient,error,message",
    [
        (ROWS.long(), torch.tensor([0, 1, 2]), 4, "local", TypeError, "values must be a floating-point tensor"),
        (torch.tensor(1.0), torch.tensor([0]), 4, "local", TypeError, r"values must be .*\[\.\.\., rows\]"),
        (ROWS, torch.tensor([[0, 1, 2]]), 4, "local", TypeError, "positions must be a 1-D integer tensor"),
        (ROWS, torch.tensor([0.0, 1.0, 2.0]), 4, "local", TypeError, "positions must be a 1-D integer tensor"),
        (ROWS, torch.tensor([0, 1]), 4, "local", ValueError, "positions has 2 entries but values 3 rows"),
        (ROWS, torch.tensor([0, 1, 2]), 2.0, "local", TypeError, "num_positions must be an int"),
        (ROWS, torch.tensor([0, 1, 2]), -1, "local", ValueError, "num_positions must be at least 0"),
        (ROWS, torch.tensor([0, 4, 2]), 4, "local", ValueError, r"positions must lie in \[0, num_positions = 4\)"),
        (ROWS, torch.tensor([0, -1, 2]), 4, "local", ValueError, r"positions must lie in \[0, num_positions = 4\)"),
        (ROWS, torch.tensor([0, 2, 2]), 4, "local", ValueError, "positions must be distinct"),
        (ROWS, torch.tensor([0, 1, 2]), 4, "both", ValueError, "gradient must be one of"),
    ],
)
def test_context_parallel_gather_rejects_bad_input(values, positions, num_positions, gradient, error, message):
    with pytest.raises(error, match=message):
        context_parallel_gather(values, positions, num_positions, None, gradient=gradient)


def test_context_parallel_sum_rejects_bad_input():
    with pytest.raises(TypeError, match="value must be a floating-point tensor"):
        context_parallel_sum(torch.ones(2, dtype=torch.long), None, gradient="local")
    with pytest.raises(ValueError, match="gradient must be one of"):
        context_parallel_sum(torch.ones(2), None, gradient="global")
