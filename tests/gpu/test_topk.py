"""``fused_linear_topk`` on CUDA against the float64 oracle of the whole vocabulary: a realistic
vocabulary in bf16, flat, confident, crowded and tied rows, more than one chunk of rows, on both
backends (the Triton one's two launches of its forward kernel, the torch one's cuBLAS products and
torch selection); the Triton one's settled rows the same bits whatever rows share the call."""

from __future__ import annotations

import pytest
import torch

from devkit.oracle import make_case
from megatron_fused_lm import fused_linear_topk, logits_topk

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("peaky", [False, True], ids=["flat", "confident"])
def test_topk_against_float64(peaky, backend):
    hidden, weight, _ = make_case((300,), 1024, 151936, torch.bfloat16, peaky=peaky, seed=2, device="cuda")
    k = 64
    logprobs, ids = fused_linear_topk(hidden, weight, k, temperature=0.9, backend=backend, token_chunk=128)
    expected = torch.log_softmax((hidden.double() @ weight.double().t()) / 0.9, dim=-1)
    # The float32 logits of the products round by about 1e-6 x |z|max; confident rows reach |z| ~ 1e3.
    tolerance = 2e-6 * float(expected.abs().max()) + 1e-5
    assert all(len(set(row.tolist())) == k for row in ids)
    assert (logprobs.double() - expected.gather(1, ids)).abs().max() <= tolerance
    assert bool((logprobs[:, :-1] >= logprobs[:, 1:]).all())
    assert bool((logprobs[:, -1].double() >= expected.topk(k, dim=1).values[:, -1] - tolerance).all())


def test_negative_logits_ties_and_the_fallback_on_cuda():
    # Negative logits (the keys' sign handling), a tie within the margin and one past it (the
    # whole-shard fallback, with nonzero and an indexed write on the device), in one chunk.
    logits = -torch.arange(1000, device="cuda", dtype=torch.float32).repeat(3, 1) / 7
    logits[1, [10, 500, 900]] = 5.0
    logits[2, 100:140] = 5.0
    ids = logits_topk(logits, 3)[1].tolist()
    assert ids == [[0, 1, 2], [10, 500, 900], [100, 101, 102]]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_crowded_and_tied_rows(backend):
    # Row 0's 300 largest logits crowded into three column tiles (more than a tile's picks on the
    # Triton backend: the torch form's keys), row 1 tied across tiles (lower ids first); each
    # row's ids distinct, scored as the float64 oracle scores them, descending, and none missing
    # that the oracle ranks clearly above our last.
    hidden, weight, _ = make_case((700,), 1024, 151936, torch.bfloat16, peaky=False, seed=4, device="cuda")
    plain = weight.clone()
    generator = torch.Generator(device="cuda").manual_seed(5)  # the noise the same in any test order
    direction = hidden[0].float() / hidden[0].float().norm()
    noise = torch.randn(300, 1024, device="cuda", generator=generator) * 0.01
    weight[1000:1300] = (direction * 2 + noise).bfloat16()
    weight[[7, 90000, 150000]] = (hidden[1].float() / hidden[1].float().norm() * 3).bfloat16()
    k = 64
    logprobs, ids = fused_linear_topk(hidden, weight, k, backend=backend)
    logits = hidden.double() @ weight.double().t()
    expected = torch.log_softmax(logits, dim=-1)
    # The float32 products of 1024 bf16 terms round by a few 1e-6 of the largest logit (64 in row 0).
    tolerance = 4e-6 * float(logits.abs().max()) + 1e-5
    assert (logprobs.double() - expected.gather(1, ids)).abs().max() <= tolerance
    assert ids[1, :3].tolist() == [7, 90000, 150000] and bool((ids[0] >= 1000).all() & (ids[0] < 1300).all())
    assert all(len(set(row.tolist())) == k for row in ids)
    assert bool((logprobs[:, :-1] >= logprobs[:, 1:]).all())
    assert bool((logprobs[:, -1].double() >= expected.topk(k, dim=1).values[:, -1] - tolerance).all())
    if backend == "triton":
        # Rows the kernels settle (the plain weight: the crowded columns above reach every row's
        # top 64 and send some to the torch form, whose cuBLAS products depend on the rows beside
        # them): the same bits whatever rows share the call.
        whole = fused_linear_topk(hidden, plain, k, backend=backend)
        for rows in (slice(2, 3), slice(2, 18), slice(690, 700)):
            alone = fused_linear_topk(hidden[rows], plain, k, backend=backend)
            assert torch.equal(alone[0], whole[0][rows]) and torch.equal(alone[1], whole[1][rows])
