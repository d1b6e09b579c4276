"""``kept_tokens`` on CUDA (Triton backend, bf16, fp16 and fp32, whose tiles spread the mask by
another form) against the float64 oracle over the same
sets: sets of 1 to 1024 ids, half the rows without their largest logit, the recompute path and the
three-GEMM path with and without an entropy term (offsets and exponentials blocks); the Triton
bitmask builder against the torch one.

Bounds, as in test_loss_parity.py: values within ``VALUE_BOUND`` times the largest |logit|;
gradients (relative L2) within ``GRAD_RATIO`` of the torch backend's recompute path with the same
sets (plus ``FLOAT32_FLOOR`` for float32 operands) (a float32 block, the same rounding of ``dz`` and results). A column leaking into a row's
softmax, or a gradient reaching one left out, is off by O(1).
"""

from __future__ import annotations

import pytest
import torch

from devkit.oracle import logprob_entropy, max_abs_error
from megatron_fused_lm import fused_linear_logprob, fused_linear_loss, losses
from megatron_fused_lm.ops.inputs import select_rows
from megatron_fused_lm.ops.kept_tokens import checked_sets, torch_kept_mask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VALUE_BOUND = 2e-5
GRAD_RATIO = 1.2
FLOAT32_FLOOR = 1e-6  # float32 operands: both errors are float32 sums' rounding (test_loss_parity.py)
SHAPES = [(2048, 2048, 151936), (1000, 1000, 30011)]


def kept_case(tokens, hidden_size, vocab, dtype, seed=0):
    """Inputs and sets: ``(hidden, weight, targets, (offsets, token_ids), dense kept [tokens, vocab])``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * (4.0 / hidden_size**0.5)).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    sizes = torch.randint(1, 1025, (tokens,), device="cuda", generator=gen)
    offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
    ids = torch.randint(0, vocab, (int(offsets[-1]),), device="cuda", generator=gen)
    row = torch.repeat_interleave(torch.arange(tokens, device="cuda"), sizes)
    largest = (hidden.float() @ weight.float().t()).argmax(1)
    ids = torch.where((row < tokens // 2) & (ids == largest[row]), (ids + 1) % vocab, ids)  # left out
    ids[offsets[:-1]] = targets
    kept = torch.zeros(tokens, vocab, dtype=torch.bool, device="cuda")
    kept[row, ids] = True
    return hidden, weight, targets, (offsets, ids), kept


def loss_case(name, tokens):
    weight = torch.full((tokens,), 1.0 / tokens, device="cuda")
    if name == "sft":  # no entropy term: an exponentials block (bf16)
        return losses.cross_entropy, dict(weight=weight)
    gen = torch.Generator(device="cuda").manual_seed(5)
    inputs = dict(
        old_logprob=-torch.rand(tokens, device="cuda", generator=gen),
        advantages=torch.randn(tokens, device="cuda", generator=gen),
        weight=weight,
    )
    return losses.ClippedPolicyLoss(clip_high=0.28, entropy_coef=0.01), inputs


def float64_reference(hidden, weight, targets, kept, loss_fn, inputs):
    leaves = [tensor.detach().double().requires_grad_() for tensor in (hidden, weight)]
    logprob, entropy = logprob_entropy(leaves[0] @ leaves[1].t(), targets, kept=kept)
    loss = loss_fn(logprob, entropy, **{name: value.double() for name, value in inputs.items()}).sum()
    return (logprob.detach(), entropy.detach(), *torch.autograd.grad(loss, leaves))


def run(path, backend, hidden, weight, targets, kept_tokens, loss_fn, inputs):
    leaves = [tensor.detach().requires_grad_() for tensor in (hidden, weight)]
    if path == "three-gemm":
        result = fused_linear_loss(
            *leaves, targets, loss_fn, loss_inputs=inputs, backend=backend, kept_tokens=kept_tokens
        )
        result.loss.backward()
        return result.logprob, result.entropy, *(leaf.grad for leaf in leaves)
    logprob, entropy = fused_linear_logprob(
        *leaves, targets, return_entropy=True, backend=backend, kept_tokens=kept_tokens
    )
    loss_fn(logprob, entropy, **inputs).sum().backward()
    return logprob.detach(), entropy.detach(), *(leaf.grad for leaf in leaves)


def relative_l2(actual, expected):
    return float((actual.double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("loss_name", ["sft", "policy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "x".join(map(str, shape)))
def test_kept_tokens_against_float64(shape, dtype, loss_name):
    hidden, weight, targets, kept_tokens, kept = kept_case(*shape, dtype)
    loss_fn, inputs = loss_case(loss_name, shape[0])
    expected = float64_reference(hidden, weight, targets, kept, loss_fn, inputs)
    whole = logprob_entropy(hidden.double() @ weight.double().t(), targets)[0]
    assert max_abs_error(expected[0], whole) > 1.0  # the sets matter
    baseline = run("recompute", "torch", hidden, weight, targets, kept_tokens, loss_fn, inputs)
    largest_logit = (hidden.double() @ weight.double().t()).abs().max().item()
    for path in ("recompute", "three-gemm"):
        ours = run(path, "triton", hidden, weight, targets, kept_tokens, loss_fn, inputs)
        for name, index in (("logprob", 0), ("entropy", 1)):
            error = max_abs_error(ours[index], expected[index])
            assert error <= VALUE_BOUND * largest_logit, (path, name, error)
        for name, index in (("grad_hidden", 2), ("grad_weight", 3)):
            error, allowed = relative_l2(ours[index], expected[index]), relative_l2(baseline[index], expected[index])
            assert error <= GRAD_RATIO * allowed + FLOAT32_FLOOR * (dtype == torch.float32), (
                path,
                name,
                error,
                allowed,
            )
        left_out = ~kept.any(0)
        assert not ours[3][left_out].any(), path  # ids no row keeps take no gradient


def test_triton_bitmask_equals_torch_bitmask():
    hidden, weight, targets, kept_tokens, _ = kept_case(4096, 64, 151936, torch.bfloat16, seed=2)
    offsets, ids = kept_tokens
    kept_tokens = offsets, torch.cat([ids[: offsets[1]], ids])  # the first row's ids repeated
    kept_tokens = torch.cat([offsets[:1], offsets[1:] + offsets[1]]), kept_tokens[1]
    selection = select_rows(targets, targets.shape, None, None, weight.shape[0], None)
    sets = checked_sets(kept_tokens, selection, targets, weight.shape[0], None)
    from megatron_fused_lm.ops.kernels.kept_mask_kernel import kept_mask

    assert torch.equal(kept_mask(sets, weight.shape[0]), torch_kept_mask(sets, weight.shape[0]))
