"""Row selection: ``mask`` on both ops."""

import pytest
import torch

from devkit.allocations import LargestAllocation
from devkit.oracle import make_case, reference, relative_error
from megatron_fused_lm import fused_linear_logprob, logits_logprob

H, V = 24, 101


def masked_and_reference(op, mask_kind):
    hidden, weight, targets = make_case((4, 9), H, V, torch.float32, peaky=True, seed=11)
    mask = {
        "random": torch.rand(4, 9, generator=torch.Generator().manual_seed(2)) < 0.4,
        "none": torch.zeros(4, 9, dtype=torch.bool),
        "all": torch.ones(4, 9, dtype=torch.bool),
    }[mask_kind]
    targets = torch.where(mask, targets, torch.full_like(targets, -100))  # unselected targets are never read
    grad_logprob, grad_entropy = torch.randn(4, 9), torch.randn(4, 9)
    hidden.requires_grad_()
    weight.requires_grad_()
    if op == "fused":
        leaf = hidden
        logprob, entropy = fused_linear_logprob(
            hidden, weight, targets, mask=mask, return_entropy=True, temperature=0.8, token_chunk=3
        )
    else:
        leaf = (hidden @ weight.t()).detach().requires_grad_()
        logprob, entropy = logits_logprob(leaf, targets, mask=mask, return_entropy=True, temperature=0.8, token_chunk=3)
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    # Reference: the unmasked problem with the upstream gradients zeroed on unselected rows.
    expected = reference(hidden, weight, targets.clamp_min(0), 0.8, grad_logprob * mask, grad_entropy * mask)
    return mask, logprob, entropy, leaf, hidden, weight, expected


@pytest.mark.parametrize("op", ["fused", "logits"])
@pytest.mark.parametrize("mask_kind", ["random", "none", "all"])
def test_mask_selects_rows(op, mask_kind):
    mask, logprob, entropy, leaf, hidden, weight, expected = masked_and_reference(op, mask_kind)
    assert torch.equal(logprob[~mask], torch.zeros_like(logprob[~mask]))
    assert torch.equal(entropy[~mask], torch.zeros_like(entropy[~mask]))
    if mask.any():
        assert relative_error(logprob[mask], expected.logprob[mask]) <= 2e-5
        assert relative_error(entropy[mask], expected.entropy[mask]) <= 2e-5
    assert torch.count_nonzero(leaf.grad[~mask]) == 0
    if op == "fused" and mask.any():
        assert relative_error(hidden.grad, expected.grad_hidden) <= 2e-5
        assert relative_error(weight.grad, expected.grad_weight) <= 2e-5
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
        largest[selected] = recorder.largest()
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
