"""Batch invariance on the Triton backend: a row's log-prob and entropy are bitwise the same whatever
other rows share the call and however many (alone, first or last of a few sizes up to the whole
8192-row call), on the forward-only, recompute and three-GEMM paths, with and without an entropy
term (a bfloat16 or a float16-offsets stored block); with ``batch_invariant=True`` its hidden
gradient row too, at the accuracy of the default path against float64."""

from __future__ import annotations

import pytest
import torch

from devkit.oracle import make_case, reference, relative_error
from megatron_fused_lm import fused_linear_logprob, fused_linear_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOKENS, HIDDEN, VOCAB = 8192, 2048, 151936
PROBES = (0, 2049, TOKENS - 1)  # rows of the whole call placed in smaller ones
SIZES = (1, 64, 1000, 4097)


def inputs():
    gen = torch.Generator(device="cuda").manual_seed(5)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen) * (4.0 / HIDDEN**0.5)).bfloat16()
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=gen)
    return hidden, weight, targets


def forward_only(hidden, weight, targets):
    with torch.no_grad():
        return fused_linear_logprob(hidden, weight, targets, return_entropy=True, backend="triton")


def recompute(hidden, weight, targets):
    return fused_linear_logprob(
        hidden.requires_grad_(), weight.requires_grad_(), targets, return_entropy=True, backend="triton"
    )


def three_gemm(entropy_coef):
    def run(hidden, weight, targets):
        result = fused_linear_loss(
            hidden.requires_grad_(), weight.requires_grad_(), targets,
            lambda logprob, entropy: entropy_coef * entropy - logprob, backend="triton",
        )  # fmt: skip
        return result.logprob, result.entropy

    return run


PATHS = {
    "forward_only": forward_only,
    "recompute": recompute,
    "three_gemm": three_gemm(0.0),
    "three_gemm_entropy": three_gemm(0.01),
}


@pytest.mark.parametrize("path", PATHS)
def test_a_rows_forward_does_not_depend_on_the_other_rows(path):
    hidden, weight, targets = inputs()
    call = PATHS[path]
    whole_logprob, whole_entropy = (value.detach() for value in call(hidden.clone(), weight.clone(), targets))
    others = torch.arange(TOKENS, device="cuda").flip(0)  # fill rows: the whole call's, reversed
    for probe in PROBES:
        for size in SIZES:
            for position in sorted({0, size - 1}):
                fill = others[others != probe][: size - 1]
                order = torch.cat([fill[:position], torch.tensor([probe], device="cuda"), fill[position:]])
                logprob, entropy = call(hidden[order].clone(), weight.clone(), targets[order])
                where = f"{path}: row {probe} at {position} of {size}"
                assert torch.equal(logprob.detach()[position], whole_logprob[probe]), where
                assert torch.equal(entropy.detach()[position], whole_entropy[probe]), where


def recompute_grad(hidden, weight, targets, batch_invariant):
    hidden, weight = hidden.requires_grad_(), weight.detach().requires_grad_()
    logprob, entropy = fused_linear_logprob(
        hidden, weight, targets, return_entropy=True, backend="triton", batch_invariant=batch_invariant
    )
    (logprob.sum() + entropy.sum()).backward()
    return hidden.grad


def three_gemm_grad(entropy_coef):
    def run(hidden, weight, targets, batch_invariant):
        hidden, weight = hidden.requires_grad_(), weight.detach().requires_grad_()
        fused_linear_loss(
            hidden, weight, targets, lambda logprob, entropy: entropy_coef * entropy - logprob, backend="triton",
            batch_invariant=batch_invariant,
        ).loss.backward()  # fmt: skip
        return hidden.grad

    return run


GRADIENT_PATHS = {
    "recompute": recompute_grad,
    "three_gemm": three_gemm_grad(0.0),
    "three_gemm_entropy": three_gemm_grad(0.01),
}


def argmax_targets(hidden, weight):
    """Each row's largest logit: a confident model's label, which the three-GEMM path's references
    would otherwise lean on."""
    return torch.cat([(rows @ weight.t()).argmax(-1) for rows in hidden.split(1024)])


@pytest.mark.parametrize("labels", ["random", "argmax"])
@pytest.mark.parametrize("path", GRADIENT_PATHS)
def test_with_batch_invariant_a_rows_hidden_gradient_does_not_depend_on_the_other_rows(path, labels):
    # The weight gradient is asked for too, as in training.
    hidden, weight, targets = inputs()
    if labels == "argmax":
        targets = argmax_targets(hidden, weight)
    call = GRADIENT_PATHS[path]
    whole = call(hidden.clone(), weight, targets, True)
    others = torch.arange(TOKENS, device="cuda").flip(0)
    for probe in (0, 4097, TOKENS - 1):
        for size in (1, 8, 64, 4097):
            for position in sorted({0, size - 1}):
                fill = others[others != probe][: size - 1]
                order = torch.cat([fill[:position], torch.tensor([probe], device="cuda"), fill[position:]])
                grad = call(hidden[order].clone(), weight, targets[order], True)
                assert torch.equal(grad[position], whole[probe]), f"{path}: row {probe} at {position} of {size}"


@pytest.mark.parametrize("path", GRADIENT_PATHS)
@pytest.mark.parametrize("peaky", [False, True], ids=["flat", "confident"])
def test_batch_invariant_gradient_is_as_accurate_as_the_default(path, peaky):
    # The same float32 sums in another order: within 1.2x the default path's error against float64.
    hidden, weight, targets = make_case((700,), 512, 32000, torch.bfloat16, peaky=peaky, seed=4, device="cuda")
    ones = torch.ones(700, device="cuda", dtype=torch.float64)
    # recompute: d/d(logprob, entropy) of their sum; the losses: entropy_coef * entropy - logprob.
    upstream = (ones, ones) if path == "recompute" else (-ones, (0.01 if path == "three_gemm_entropy" else 0.0) * ones)
    expected = reference(hidden, weight, targets, 1.0, *upstream)
    errors = [
        relative_error(GRADIENT_PATHS[path](hidden.clone(), weight, targets, batch_invariant), expected.grad_hidden)
        for batch_invariant in (False, True)
    ]
    assert errors[1] <= 1.2 * errors[0] + 1e-6, errors
