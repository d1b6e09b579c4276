"""logits_logprob, the unfused path, against a float64 oracle."""

import itertools

import pytest
import torch

from devkit.allocations import LargestAllocation
from devkit.oracle import LEAD_SHAPES, make_case, reference_from_logits, relative_error
from megatron_fused_lm import logits_logprob

TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1e-4, 1e-2)}


def make_logits(lead_shape, vocab, dtype, peaky, seed):
    hidden, weight, targets = make_case(lead_shape, 40, vocab, torch.float64, peaky, seed)
    return (hidden @ weight.t()).to(dtype), targets


@pytest.mark.parametrize(
    "dtype,temperature,peaky,token_chunk,case",
    list(itertools.product([torch.float32, torch.bfloat16], [0.7, 1.3], [False, True], [1, 7, None, 1000], range(3))),
)
def test_matches_float64_oracle(dtype, temperature, peaky, token_chunk, case):
    lead_shape, vocab = LEAD_SHAPES[case]
    logits, targets = make_logits(lead_shape, vocab, dtype, peaky, case)
    logits.requires_grad_()
    grad_logprob, grad_entropy = torch.randn(lead_shape), torch.randn(lead_shape)
    logprob, entropy = logits_logprob(
        logits, targets, temperature=temperature, return_entropy=True, token_chunk=token_chunk
    )
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    expected = reference_from_logits(logits, targets, temperature, grad_logprob, grad_entropy)
    output_tol, grad_tol = TOLERANCE[dtype]
    assert logprob.dtype == torch.float32 and logprob.shape == lead_shape
    assert relative_error(logprob, expected.logprob) <= output_tol
    assert relative_error(entropy, expected.entropy) <= output_tol
    assert logits.grad.dtype == dtype
    assert relative_error(logits.grad, expected.grad_logits) <= grad_tol


def test_backward_when_another_function_saved_the_same_logits():
    # pow saves its input; an in-place edit of the logits in our backward would trip its
    # version check (the bug another library shipped).
    logits, targets = make_logits((19,), 97, torch.float32, False, 0)
    logits.requires_grad_()
    shared = logits * 1.0
    squares = shared.pow(2)
    grad_logprob, grad_entropy = torch.randn(19), torch.randn(19)
    logprob, entropy = logits_logprob(shared, targets, return_entropy=True, token_chunk=4)
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum() + squares.sum()).backward()
    expected = reference_from_logits(logits, targets, 1.0, grad_logprob, grad_entropy)
    assert relative_error(logits.grad, expected.grad_logits + 2 * logits.detach().double()) <= 2e-5


def test_input_logits_are_left_unchanged():
    logits, targets = make_logits((11,), 97, torch.float32, True, 1)
    before = logits.clone()
    logits.requires_grad_()
    logits_logprob(logits, targets, temperature=0.7, return_entropy=True)[1].sum().backward()
    assert torch.equal(logits.detach(), before)


def test_chunked_backward_builds_no_full_size_temporaries():
    # Only the returned gradient (in the logits' dtype) may be [tokens, vocab]: no one_hot, no
    # float32 copy of the whole logits.
    tokens, vocab = 128, 101
    logits, targets = make_logits((tokens,), vocab, torch.bfloat16, False, 2)
    logits.requires_grad_()
    recorder = LargestAllocation()
    with recorder:
        logprob, entropy = logits_logprob(logits, targets, return_entropy=True, token_chunk=16)
        (logprob.sum() + entropy.sum()).backward()
    too_big = [entry for entry in recorder.sizes if entry[0] >= tokens * vocab and entry[2] != torch.bfloat16]
    assert not too_big, too_big


def test_entropy_without_grad():
    logits, targets = make_logits((13,), 97, torch.float32, False, 3)
    logits.requires_grad_()
    logprob, entropy = logits_logprob(logits, targets, return_entropy=True, entropy_grad=False)
    assert entropy.grad_fn is None and not entropy.requires_grad
    grad_logprob = torch.randn(13)
    (logprob * grad_logprob).sum().backward()
    expected = reference_from_logits(logits, targets, 1.0, grad_logprob, torch.zeros(13))
    assert relative_error(logits.grad, expected.grad_logits) <= 2e-5


def test_empty_input():
    logits = torch.randn(0, 97, requires_grad=True)
    logprob, entropy = logits_logprob(logits, torch.zeros(0, dtype=torch.long), return_entropy=True)
    (logprob.sum() + entropy.sum()).backward()
    assert logprob.shape == (0,) and logits.grad.shape == (0, 97)
