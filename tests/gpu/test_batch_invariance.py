"""Batch invariance of the Triton backend's forward: a row's log-prob and entropy are bitwise the
same whatever other rows share the call and however many (alone, first or last of a few sizes up to
the whole 8192-row call), on the forward-only, recompute and three-GEMM paths, with and without an
entropy term (a bfloat16 or a float16-offsets stored block). The gradient rows are not covered:
``benchmarks/batch_invariance.py`` reports them."""

from __future__ import annotations

import pytest
import torch

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
