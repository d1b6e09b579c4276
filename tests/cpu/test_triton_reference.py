"""The torch steps of the Triton loss-in-forward pass (the reference of the stored block, and the
direct products' per-row factor), against float64. The kernels around them run in
test_triton_interpreter.py and, in bfloat16, in tests/gpu/test_loss_parity.py."""

import torch

from devkit.kernel_references import torch_row_references, torch_stale_references
from megatron_fused_lm.ops.backends.triton_loss import direct_factor
from megatron_fused_lm.ops.backends.triton_reference import (
    EMPTY_REFERENCE,
    MAX_ABOVE_REFERENCE,
    MAX_BELOW_REFERENCE,
    REFERENCE_HEADROOM,
)
from megatron_fused_lm.ops.softmax import block_statistics, chosen_logit_grad, summarize, zero_chosen


def test_row_references_bracket_the_row_maximum():
    torch.manual_seed(1)
    hidden, weight = torch.randn(64, 16), torch.randn(1000, 16)
    target_column = torch.randint(-1, 1000, (64,))
    temperature = torch.rand(64) * 1.5 + 0.5  # one per row
    reference = torch_row_references(hidden, weight, target_column, temperature, sample_rows=10)
    logits = hidden.double() @ weight.double().t() / temperature.double()[:, None]
    row_max = logits.amax(1)
    # Never more than the headroom above the maximum: the top exponentials stay normal numbers.
    assert (reference <= row_max + REFERENCE_HEADROOM + 1e-3).all()
    # At least the chosen token's logit plus the headroom, where this shard owns it.
    owned = target_column >= 0
    chosen = logits[owned, target_column[owned]]
    assert (reference[owned] >= chosen + REFERENCE_HEADROOM - 1e-3).all()
    # With every row sampled, the reference is the maximum plus the headroom.
    exact = torch_row_references(hidden, weight, target_column, temperature, sample_rows=1000)
    assert torch.allclose(exact.double(), row_max + REFERENCE_HEADROOM, atol=1e-4)


def test_stale_references_take_the_maximum():
    # Too far above or (a kept set without the sampled rows' largest logits) too far below the
    # reference: refreshed; a shard keeping none of the row's columns (-inf): its zeros stay, with a
    # reference far below any lse.
    reference = torch.tensor([0.0, 0.0, 10.0, 10.0, 10.0])
    local_max = torch.tensor(
        [
            MAX_ABOVE_REFERENCE - 1,
            MAX_ABOVE_REFERENCE + 1,
            11 - MAX_BELOW_REFERENCE,
            9 - MAX_BELOW_REFERENCE,
            -torch.inf,
        ]
    )
    refreshed, refresh = torch_stale_references(reference, local_max)
    assert refresh.tolist() == [0, 1, 0, 1, 0] and refresh.dtype == torch.int8
    assert refreshed.tolist() == [0.0, MAX_ABOVE_REFERENCE + 1, 10.0, 9 - MAX_BELOW_REFERENCE, EMPTY_REFERENCE]


def test_factor_and_chosen_term_give_dz():
    # The factor times exp(z - r), with the chosen token's element zeroed and its term added, is
    # dz / T of the float64 formula, including a chosen token with p near 1, where 1 - p is small.
    torch.manual_seed(2)
    logits = torch.randn(4, 50, dtype=torch.float64) * 3
    logits[0, 7] = 14.0  # 1 - p_y about 1e-3
    targets = torch.tensor([7, 3, 0, 49])
    target_column = torch.tensor([7, 3, -1, 49])  # row 2's target lies in another shard
    grad_logprob = torch.tensor([0.5, -1.0, 2.0, 0.25])
    temperature = torch.tensor([0.8, 1.3, 0.6, 2.0])  # one per row
    lse = logits.logsumexp(1)
    expected = -grad_logprob.double()[:, None] * (logits - lse[:, None]).exp()
    owned = target_column >= 0
    expected[owned, targets[owned]] += grad_logprob.double()[owned]
    expected /= temperature.double()[:, None]
    reference = logits.amax(1) + 5.0
    stored = (logits - reference[:, None]).exp().float()
    zero_chosen(stored, target_column)
    assert stored[2, 0] != 0 and (stored[owned, targets[owned]] == 0).all()  # another shard's chosen token stays
    summary = summarize(block_statistics(logits.float(), target_column))
    # Row 2 as its own shard sees it: the owner's statistics would add its target logit.
    factor = direct_factor(reference.float(), summary.lse, grad_logprob, temperature)
    chosen = chosen_logit_grad(target_column, summary, grad_logprob, None) / temperature
    dz = factor[:, None].double() * stored.double()
    dz[owned, targets[owned]] += chosen.double()[owned]
    assert torch.allclose(dz, expected, rtol=1e-5, atol=1e-7 * expected.abs().max().item())
    # Near p = 1 the chosen term keeps the relative precision of the float32 log-prob (1e-6
    # absolute at logits near 14, on 1 - p near 1e-3).
    assert abs(chosen[0].item() / expected[0, 7].item() - 1) < 2e-3


def test_factor_without_log_prob_term_is_zero():
    factor = direct_factor(torch.zeros(3), torch.ones(3), None, torch.ones(3))
    assert factor.tolist() == [0.0, 0.0, 0.0]
