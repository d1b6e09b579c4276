"""The packed-sequence (THD) helpers: response masks, splitting per-token results, next-token
targets, and the shift convention against an unpacked computation."""

import pytest
import torch

from devkit.oracle import make_case, reference, relative_error
from megatron_fused_lm import fused_linear_logprob
from megatron_fused_lm.packing import next_token_targets, response_mask, split_responses

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
