"""Row selection: ``mask`` on both ops, and the packed-sequence helpers."""

import pytest
import torch

from megatron_fused_lm import fused_linear_logprob, logits_logprob
from megatron_fused_lm.packing import next_token_targets, response_mask, split_responses
from oracle import fused_reference, make_case, relative_error
from test_ops_fused import LargestAllocation

H, V = 24, 101


def masked_and_reference(op, mask_kind):
    hidden, weight, targets = make_case((4, 9), H, V, torch.float32, peaky=True, seed=11)
    mask = {"random": torch.rand(4, 9, generator=torch.Generator().manual_seed(2)) < 0.4,
            "none": torch.zeros(4, 9, dtype=torch.bool), "all": torch.ones(4, 9, dtype=torch.bool)}[mask_kind]
    targets = torch.where(mask, targets, torch.full_like(targets, -100))  # unselected targets are never read
    grad_logprob, grad_entropy = torch.randn(4, 9), torch.randn(4, 9)
    hidden.requires_grad_()
    weight.requires_grad_()
    if op == "fused":
        leaf = hidden
        logprob, entropy = fused_linear_logprob(hidden, weight, targets, mask=mask, return_entropy=True, temperature=0.8, chunk_size=3)
    else:
        leaf = (hidden @ weight.t()).detach().requires_grad_()
        logprob, entropy = logits_logprob(leaf, targets, mask=mask, return_entropy=True, temperature=0.8, chunk_size=3)
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    # Reference: the unmasked problem with the upstream gradients zeroed on unselected rows.
    expected = fused_reference(hidden, weight, targets.clamp_min(0), 0.8, grad_logprob * mask, grad_entropy * mask)
    return mask, logprob, entropy, leaf, hidden, weight, expected


@pytest.mark.parametrize("op", ["fused", "logits"])
@pytest.mark.parametrize("mask_kind", ["random", "none", "all"])
def test_mask_selects_rows(op, mask_kind):
    mask, logprob, entropy, leaf, hidden, weight, expected = masked_and_reference(op, mask_kind)
    assert torch.equal(logprob[~mask], torch.zeros_like(logprob[~mask]))
    assert torch.equal(entropy[~mask], torch.zeros_like(entropy[~mask]))
    if mask.any():
        assert relative_error(logprob[mask], expected["logprob"][mask]) <= 2e-5
        assert relative_error(entropy[mask], expected["entropy"][mask]) <= 2e-5
    assert torch.count_nonzero(leaf.grad[~mask]) == 0
    if op == "fused" and mask.any():
        assert relative_error(hidden.grad, expected["grad_hidden"]) <= 2e-5
        assert relative_error(weight.grad, expected["grad_weight"]) <= 2e-5
    elif op == "fused":
        assert torch.count_nonzero(weight.grad) == 0


def test_work_follows_the_number_of_selected_rows():
    tokens = 256
    hidden, weight, targets = make_case((tokens,), 16, V, torch.float32, peaky=False)
    hidden.requires_grad_()
    largest = {}
    for selected in (tokens, tokens // 2, tokens // 4):
        mask = torch.zeros(tokens, dtype=torch.bool)
        mask[torch.randperm(tokens)[:selected]] = True
        recorder = LargestAllocation()
        with recorder:
            fused_linear_logprob(hidden, weight, targets, mask=mask).sum().backward()
        largest[selected] = max(size for size, _, _ in recorder.sizes)
    # The largest buffer is the float32 logits block of the selected rows (one chunk here).
    assert largest == {k: k * V for k in largest}


def test_mask_must_be_bool_with_the_targets_shape():
    hidden, weight, targets = make_case((6,), H, V, torch.float32, peaky=False)
    with pytest.raises(TypeError, match="bool"):
        fused_linear_logprob(hidden, weight, targets, mask=torch.ones(6))
    with pytest.raises(ValueError, match="mask.shape"):
        fused_linear_logprob(hidden, weight, targets, mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="outside the vocabulary"):  # selected targets are checked
        fused_linear_logprob(hidden, weight, torch.full((6,), V), mask=torch.ones(6, dtype=torch.bool))


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
    for start, end, prompt_length, piece in zip([0, 4], [4, 9], prompt.tolist(), pieces):
        response_tokens = tokens[start + prompt_length:end]
        scoring_rows = hidden[start + prompt_length - 1:end - 1]
        expected = fused_reference(scoring_rows, weight, response_tokens, 1.0)["logprob"]
        assert piece.shape == response_tokens.shape
        assert relative_error(piece, expected) <= 2e-5


@pytest.mark.parametrize(
    "cu_seqlens,prompt,response,message",
    [
        (torch.tensor([0, 3]), torch.tensor([0]), None, "prompt of at least one token"),
        (torch.tensor([0, 3]), torch.tensor([2]), torch.tensor([2]), "prompt \\+ response"),
        (torch.tensor([1, 3]), torch.tensor([1]), None, "start at 0"),
        (torch.tensor([0, 3, 2]), torch.tensor([1, 1]), None, "never decrease"),
        (torch.tensor([0, 3]), torch.tensor([1, 1]), None, "one entry per sequence"),
    ],
)
def test_packed_helpers_reject_bad_layouts(cu_seqlens, prompt, response, message):
    with pytest.raises(ValueError, match=message):
        response_mask(cu_seqlens, prompt, response)
