"""The three-GEMM loss ops on one rank (torch backend) and the ready-made losses, against float64
oracles.

- ``fused_linear_loss``: the loss, the log-prob and entropy metrics and both gradients against
  ``devkit.oracle.loss_reference`` for the SFT cross-entropy, the clipped policy loss (with and
  without dual clip, entropy bonus, KL penalty), a custom per-token loss and an entropy-only loss;
  float32, bfloat16 and float16; two temperatures; with and without a mask; chunks of 1, 7 and the
  default. The graph's contract (what is detached, a second backward, upstream scaling, zero
  tokens, ``no_grad``, frozen inputs, activation checkpointing), its input errors, and its
  working set.
- ``logits_loss`` (the unfused path) against the same oracle.
- ``fused_linear_cross_entropy``: per-token ``-logprob``, gradients for an upstream gradient that
  matches its declared weights (the stored gradients) or not (the recompute).
- ``losses``: ``token_mean_weights``, ``kl_penalty``, ``cross_entropy`` and ``ClippedPolicyLoss``
  against formulas written out here in float64, branch by branch.

Tolerances: float32 inputs, and the float32 loss and metrics of any input dtype, within
``FLOAT32_TOL`` of the oracle (measured errors below 1e-6). Gradients of bfloat16 and float16
inputs: at most ``STOCK_RATIO`` times the error of the stock path on the same inputs (logits
materialized in the inputs' dtype, ``logits_loss``, autograd through the product) plus a quarter
of the dtype's machine epsilon (measured here: 0.24 to 1.21 times the stock error; with 30 tokens
a few roundings decide the largest entry, the floor absorbs that); a dropped or misplaced term is
off by O(1).
"""

import itertools
import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from devkit.allocations import LargestAllocation
from devkit.oracle import (
    logprob_entropy,
    loss_reference,
    make_case,
    policy_loss_inputs,
    relative_error,
)
from megatron_fused_lm import (
    fused_linear_cross_entropy,
    fused_linear_logprob,
    fused_linear_loss,
    logits_loss,
    losses,
    weight_grad_corrections,
)

H, V = 24, 97
LEAD = (3, 10)  # [b, s]: the ops take any leading shape
FLOAT32_TOL = 1e-5
STOCK_RATIO = 1.2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CASES = ["sft", "policy", "dual_clip", "custom", "entropy_only"]


def generator(seed: int) -> torch.Generator:
    """A seeded CPU generator."""
    return torch.Generator().manual_seed(seed)


def custom_loss(logprob, entropy, *, w):
    """A per-token loss of both log-prob and entropy, nonlinear in the log-prob."""
    return w * (logprob**2 + 0.3 * entropy)


def entropy_bonus(logprob, entropy):
    """A loss of the entropy alone, with no per-token inputs."""
    return -entropy


def loss_case(name, hidden, weight, targets, temperature=1.0, mask=None, seed=5):
    """``(loss_fn, loss_inputs)`` of a named case. The policy cases' old and reference log-probs
    lie near the true ones (from float64 logits): the k3 KL estimator is exponential in their
    difference."""
    gen = generator(seed)
    shape = targets.shape
    weights = losses.token_mean_weights(torch.ones(shape, dtype=torch.bool) if mask is None else mask)
    if name == "sft":
        return losses.cross_entropy, {"weight": weights}
    if name in ("policy", "dual_clip"):
        logprob, _ = logprob_entropy(hidden.double() @ weight.double().t(), targets.clamp_min(0), temperature)
        loss_fn = losses.ClippedPolicyLoss(
            clip_low=0.2,
            clip_high=0.28,
            entropy_coef=0.01,
            kl_coef=0.05,
            dual_clip=3.0 if name == "dual_clip" else None,
        )
        return loss_fn, policy_loss_inputs(logprob, weights, gen, jitter=0.06)
    if name == "custom":
        return custom_loss, {"w": torch.rand(shape, generator=gen)}
    return entropy_bonus, None


def leaves(*tensors):
    """Fresh leaves requiring grad, with the given tensors' values."""
    return [tensor.detach().clone().requires_grad_() for tensor in tensors]


def run_fused(hidden, weight, targets, loss_fn, loss_inputs=None, upstream=1.0, **options):
    """``fused_linear_loss`` on fresh leaves, then ``(upstream * loss).backward()``: the result and
    the two gradients."""
    hidden, weight = leaves(hidden, weight)
    result = fused_linear_loss(hidden, weight, targets, loss_fn, loss_inputs=loss_inputs, **options)
    (upstream * result.loss).backward()
    return result, hidden.grad, weight.grad


def run_stock(hidden, weight, targets, loss_fn, loss_inputs=None, **options):
    """The unfused path: logits ``hidden @ weight.T`` materialized in the inputs' dtype,
    ``logits_loss``, autograd through the product. The result and the two gradients."""
    hidden, weight = leaves(hidden, weight)
    result = logits_loss(hidden @ weight.t(), targets, loss_fn, loss_inputs=loss_inputs, **options)
    result.loss.backward()
    return result, hidden.grad, weight.grad


def masked_case(dtype, masked, seed=3):
    """``hidden [3, 10, H]``, ``weight [V, H]``, ``targets``, ``mask``: unselected targets are out
    of range (never read)."""
    hidden, weight, targets = make_case(LEAD, H, V, dtype, peaky=False, seed=seed)
    if not masked:
        return hidden, weight, targets, None
    mask = torch.rand(LEAD, generator=generator(seed + 1)) < 0.6
    return hidden, weight, torch.where(mask, targets, -100), mask


def assert_values_match(result, expected, mask):
    """The loss and the metrics within ``FLOAT32_TOL``; unselected rows exactly 0."""
    assert result.loss.shape == () and result.loss.dtype == torch.float32
    assert result.logprob.shape == result.entropy.shape == expected.logprob.shape
    assert result.logprob.dtype == result.entropy.dtype == torch.float32
    assert relative_error(result.loss, expected.loss) <= FLOAT32_TOL
    assert relative_error(result.logprob, expected.logprob) <= FLOAT32_TOL
    assert relative_error(result.entropy, expected.entropy) <= FLOAT32_TOL
    if mask is not None:
        assert torch.count_nonzero(result.logprob[~mask]) == torch.count_nonzero(result.entropy[~mask]) == 0


def grad_bound(stock_error: float, dtype: torch.dtype) -> float:
    """The gradient error allowed for low-precision inputs, given the stock path's."""
    return STOCK_RATIO * stock_error + torch.finfo(dtype).eps / 4


# The op against the float64 oracle.


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
@pytest.mark.parametrize("token_chunk", [1, 7, None])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_oracle(case, dtype, token_chunk, temperature, masked):
    hidden, weight, targets, mask = masked_case(dtype, masked)
    loss_fn, loss_inputs = loss_case(case, hidden, weight, targets, temperature, mask)
    options = dict(temperature=temperature, mask=mask)
    result, grad_hidden, grad_weight = run_fused(
        hidden, weight, targets, loss_fn, loss_inputs, token_chunk=token_chunk, **options
    )
    expected = loss_reference(hidden, weight, targets, loss_fn, loss_inputs, **options)
    assert_values_match(result, expected, mask)
    assert grad_hidden.dtype == grad_weight.dtype == dtype
    if mask is not None:
        assert torch.count_nonzero(grad_hidden[~mask]) == 0
    hidden_error = relative_error(grad_hidden, expected.grad_hidden)
    weight_error = relative_error(grad_weight, expected.grad_weight)
    if dtype == torch.float32:
        assert hidden_error <= FLOAT32_TOL and weight_error <= FLOAT32_TOL
    else:
        _, stock_hidden, stock_weight = run_stock(hidden, weight, targets, loss_fn, loss_inputs, **options)
        assert hidden_error <= grad_bound(relative_error(stock_hidden, expected.grad_hidden), dtype)
        assert weight_error <= grad_bound(relative_error(stock_weight, expected.grad_weight), dtype)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("token_chunk", [4, None])
@pytest.mark.parametrize("case", CASES)
def test_logits_loss_matches_float64_oracle(case, token_chunk, masked):
    hidden, weight, targets, mask = masked_case(torch.float32, masked, seed=8)
    loss_fn, loss_inputs = loss_case(case, hidden, weight, targets, 1.3, mask)
    result, grad_hidden, grad_weight = run_stock(
        hidden, weight, targets, loss_fn, loss_inputs, temperature=1.3, mask=mask, token_chunk=token_chunk
    )
    expected = loss_reference(hidden, weight, targets, loss_fn, loss_inputs, 1.3, mask)
    assert_values_match(result, expected, mask)
    assert not result.logprob.requires_grad and not result.entropy.requires_grad
    assert relative_error(grad_hidden, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(grad_weight, expected.grad_weight) <= FLOAT32_TOL


# The graph's contract.


def sft_case(tokens=LEAD):
    """A float32 case with the SFT loss over every token."""
    hidden, weight, targets = make_case(tokens, H, V, torch.float32, peaky=False, seed=4)
    return hidden, weight, targets, {"weight": losses.token_mean_weights(torch.ones(tokens))}


def test_only_the_loss_carries_a_graph():
    hidden, weight, targets, inputs = sft_case()
    hidden, weight = leaves(hidden, weight)
    result = fused_linear_loss(hidden, weight, targets, losses.cross_entropy, loss_inputs=inputs)
    assert result.loss.requires_grad and result.loss.grad_fn is not None
    for metric in (result.logprob, result.entropy):
        assert not metric.requires_grad and metric.grad_fn is None


def test_second_backward_is_an_error():
    hidden, weight, targets, inputs = sft_case()
    hidden, weight = leaves(hidden, weight)
    result = fused_linear_loss(hidden, weight, targets, losses.cross_entropy, loss_inputs=inputs)
    result.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="earlier backward"):
        result.loss.backward()


@pytest.mark.parametrize("upstream", [3.0, -0.5])
def test_backward_scales_by_the_upstream_gradient(upstream):
    hidden, weight, targets, inputs = sft_case()
    _, grad_hidden, grad_weight = run_fused(
        hidden, weight, targets, losses.cross_entropy, inputs, upstream=upstream, token_chunk=7
    )
    expected = loss_reference(hidden, weight, targets, losses.cross_entropy, inputs)
    assert relative_error(grad_hidden, upstream * expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(grad_weight, upstream * expected.grad_weight) <= FLOAT32_TOL


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_works_under_activation_checkpointing(use_reentrant):
    hidden, weight, targets, inputs = sft_case()
    hidden, weight = leaves(hidden, weight)

    def loss_of(hidden, weight):
        return fused_linear_loss(hidden * 1.5, weight, targets, custom_loss, loss_inputs={"w": inputs["weight"]}).loss

    checkpoint(loss_of, hidden, weight, use_reentrant=use_reentrant).backward()
    expected = loss_reference(hidden * 1.5, weight, targets, custom_loss, {"w": inputs["weight"]})
    assert relative_error(hidden.grad, 1.5 * expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(weight.grad, expected.grad_weight) <= FLOAT32_TOL


@pytest.mark.parametrize("requires_grad", ["hidden", "weight"])
def test_frozen_input_gets_no_gradient(requires_grad):
    hidden, weight, targets, inputs = sft_case()
    leaf = {"hidden": hidden, "weight": weight}[requires_grad].requires_grad_()
    fused_linear_loss(hidden, weight, targets, losses.cross_entropy, loss_inputs=inputs).loss.backward()
    expected = loss_reference(hidden, weight, targets, losses.cross_entropy, inputs)
    frozen = weight if requires_grad == "hidden" else hidden
    assert frozen.grad is None
    assert relative_error(leaf.grad, getattr(expected, f"grad_{requires_grad}")) <= FLOAT32_TOL


def test_zero_tokens_give_a_zero_loss_and_zero_gradients():
    hidden, weight = leaves(torch.randn(0, 3, H), torch.randn(V, H))
    targets = torch.zeros(0, 3, dtype=torch.long)
    result = fused_linear_loss(hidden, weight, targets, custom_loss, loss_inputs={"w": torch.ones(0, 3)})
    assert result.loss.item() == 0.0
    assert result.logprob.shape == result.entropy.shape == (0, 3)
    result.loss.backward()
    assert hidden.grad.shape == hidden.shape
    assert weight.grad.shape == weight.shape and torch.count_nonzero(weight.grad) == 0


@pytest.mark.parametrize("into", [False, True], ids=["own", "weight_grad_into"])
def test_the_declared_cross_entropy_of_zero_tokens_has_zero_gradients(into):
    hidden, weight = leaves(torch.randn(0, 3, H), torch.randn(V, H))
    accumulator = torch.zeros(V, H) if into else None
    out = fused_linear_cross_entropy(
        hidden, weight, torch.zeros(0, 3, dtype=torch.long), torch.ones(0, 3), weight_grad_into=accumulator
    )
    out.sum().backward()
    assert out.shape == (0, 3) and hidden.grad.shape == hidden.shape
    if into:
        assert weight.grad is None and torch.count_nonzero(accumulator) == 0
    else:
        assert weight.grad.shape == weight.shape and torch.count_nonzero(weight.grad) == 0


def test_a_mask_selecting_nothing_gives_a_zero_loss_and_zero_gradients():
    hidden, weight, targets, _ = sft_case()
    mask = torch.zeros(LEAD, dtype=torch.bool)
    result, grad_hidden, grad_weight = run_fused(
        hidden, weight, targets, custom_loss, {"w": torch.ones(LEAD)}, mask=mask
    )
    assert result.loss.item() == 0.0
    assert torch.count_nonzero(result.logprob) == torch.count_nonzero(result.entropy) == 0
    assert torch.count_nonzero(grad_hidden) == torch.count_nonzero(grad_weight) == 0


def test_no_grad_returns_the_value_and_computes_no_gradient():
    tokens, chunk = (64,), 16
    hidden, weight, targets, inputs = sft_case(tokens)
    hidden, weight = leaves(hidden, weight)
    recorder = LargestAllocation()
    with recorder, torch.no_grad():
        result = fused_linear_loss(hidden, weight, targets, losses.cross_entropy, loss_inputs=inputs, token_chunk=chunk)
    assert not result.loss.requires_grad and result.loss.grad_fn is None
    expected = loss_reference(hidden, weight, targets, losses.cross_entropy, inputs)
    assert relative_error(result.loss, expected.loss) <= FLOAT32_TOL
    # Nothing of either gradient's size was allocated (the chunk blocks are [16, V]).
    gradient_sized = [entry for entry in recorder.sizes if entry[0] in (hidden.numel(), weight.numel())]
    assert not gradient_sized, gradient_sized


def test_never_allocates_more_than_one_chunk_block():
    """The torch backend's working set is a few float32 ``[chunk, vocab]`` blocks, each its own
    tensor: nothing larger is allocated, in the forward (where the gradients are formed) or in the
    backward (which scales them). The inputs' and gradients' sizes are kept below one block."""
    tokens, hidden_size, vocab = 256, 8, 257
    for dtype, chunk in itertools.product([torch.float32, torch.bfloat16], [16, 40]):
        hidden, weight, targets = make_case((tokens,), hidden_size, vocab, dtype, peaky=False)
        hidden, weight = leaves(hidden, weight)
        inputs = {"weight": torch.full((tokens,), 1 / tokens)}
        recorder = LargestAllocation()
        with recorder:
            fused_linear_loss(
                hidden, weight, targets, losses.cross_entropy, loss_inputs=inputs, token_chunk=chunk
            ).loss.backward()
        assert recorder.largest() == chunk * vocab < tokens * vocab, (dtype, chunk, recorder.largest())


# Input errors.


def test_loss_fn_errors():
    hidden, weight, targets, inputs = sft_case()
    with pytest.raises(TypeError, match="callable"):
        fused_linear_loss(hidden, weight, targets, "cross_entropy", loss_inputs=inputs)
    with pytest.raises(ValueError, match="one loss per row"):
        fused_linear_loss(hidden, weight, targets, lambda logprob, entropy: logprob.mean())
    with pytest.raises(ValueError, match="one loss per row"):  # a single-row chunk too
        fused_linear_loss(hidden, weight, targets, lambda logprob, entropy: logprob.sum(), token_chunk=1)
    with pytest.raises(TypeError, match="float tensor"):
        fused_linear_loss(hidden, weight, targets, lambda logprob, entropy: logprob > 0)
    with pytest.raises(TypeError, match="float tensor"):
        fused_linear_loss(hidden, weight, targets, lambda logprob, entropy: 0.0)


@pytest.mark.parametrize(
    "loss_inputs,error,match",
    [
        ({"weight": torch.ones(3, 9)}, ValueError, "shape"),
        ({"weight": torch.ones(30)}, ValueError, "shape"),
        ({"weight": [1.0] * 30}, TypeError, "must be a tensor"),
        ({"weight": torch.ones(LEAD, requires_grad=True)}, ValueError, "requires grad"),
        ([torch.ones(LEAD)], TypeError, "dict"),
    ],
    ids=["wrong-shape", "flattened", "list", "requires-grad", "not-a-dict"],
)
def test_loss_inputs_errors(loss_inputs, error, match):
    hidden, weight, targets, _ = sft_case()
    with pytest.raises(error, match=match):
        fused_linear_loss(hidden, weight, targets, losses.cross_entropy, loss_inputs=loss_inputs)
    with pytest.raises(error, match=match):
        logits_loss(hidden @ weight.t(), targets, losses.cross_entropy, loss_inputs=loss_inputs)


@pytest.mark.parametrize(
    "options,error,match",
    [
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=math.inf), ValueError, "temperature"),
        (dict(temperature=math.nan), ValueError, "temperature"),
        (dict(temperature="1.0"), TypeError, "temperature"),
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(token_chunk=0), ValueError, "token_chunk"),
    ],
)
def test_option_errors(options, error, match):
    hidden, weight, targets, inputs = sft_case()
    with pytest.raises(error, match=match):
        fused_linear_loss(hidden, weight, targets, losses.cross_entropy, loss_inputs=inputs, **options)


@pytest.mark.parametrize("bad_target", [V, -1, -100])
def test_targets_outside_the_vocabulary_are_an_error(bad_target):
    hidden, weight, targets, inputs = sft_case()
    targets[1, 2] = bad_target
    match = r"outside the vocabulary .*leave such positions out with mask="
    with pytest.raises(ValueError, match=match):
        fused_linear_loss(hidden, weight, targets, losses.cross_entropy, loss_inputs=inputs)
    with pytest.raises(ValueError, match=match):
        fused_linear_cross_entropy(hidden, weight, targets, torch.ones(LEAD))
    with pytest.raises(ValueError, match=match):
        fused_linear_logprob(hidden, weight, targets)
    with pytest.raises(ValueError, match="out_of_vocab must be one of"):
        fused_linear_logprob(hidden, weight, targets, out_of_vocab="ignore")


def out_of_vocab_case():
    """Peaky rows whose targets include HF-style -100 padding, -1 and the first id past the
    vocabulary, and the float64 oracle of the convention of Megatron's vocabulary-parallel
    cross-entropy for them: no rank owns such an id, so its logit counts as the row's largest (its
    cross-entropy is ``lse - max``), and its backward treats that maximum as a constant (the
    softmax is the logits' gradient)."""
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=True, seed=8)
    targets[0, 1], targets[1, 4], targets[2, 9], targets[2, 0] = -100, V, -1, -100
    outside = (targets < 0) | (targets >= V)

    def oracle_logprob(hidden, weight):
        logits = hidden.double() @ weight.double().t()
        chosen = logits.gather(-1, targets.clamp(0, V - 1).unsqueeze(-1)).squeeze(-1)
        largest = logits.detach().amax(dim=-1)
        return torch.where(outside, largest, chosen) - torch.logsumexp(logits, dim=-1)

    return hidden, weight, targets, outside, oracle_logprob


@pytest.mark.parametrize("token_chunk", [1, 7, None])
def test_out_of_vocab_targets_score_as_megatron_scores_them_when_asked(token_chunk):
    hidden, weight, targets, outside, oracle_logprob = out_of_vocab_case()
    gen = generator(9)
    upstream = torch.randn(LEAD, generator=gen)
    declared = (torch.rand(LEAD, generator=gen) < 0.7).float()
    declared[0, 1] = declared[2, 9] = 1.0  # the declared weights reach out-of-vocabulary rows too
    # The recompute op, and the declared cross-entropy for the declared upstream (the held
    # gradients) and another one (the recompute).
    runs = {
        "logprob": (lambda h, w: fused_linear_logprob(h, w, targets, out_of_vocab="max_logit", token_chunk=token_chunk),
                    lambda value: (value * upstream).sum()),
        "declared": (lambda h, w: -fused_linear_cross_entropy(
            h, w, targets, declared, out_of_vocab="max_logit", token_chunk=token_chunk),
                     lambda value: (value * declared).sum() * 0.3),
        "other upstream": (lambda h, w: -fused_linear_cross_entropy(
            h, w, targets, declared, out_of_vocab="max_logit", token_chunk=token_chunk),
                           lambda value: (value * upstream).sum()),
    }  # fmt: skip
    for name, (run, reduce) in runs.items():
        leaf_hidden, leaf_weight = leaves(hidden, weight)
        logprob = run(leaf_hidden, leaf_weight)
        oracle_hidden, oracle_weight = (tensor.double().requires_grad_() for tensor in (hidden, weight))
        expected = oracle_logprob(oracle_hidden, oracle_weight)
        assert torch.isfinite(logprob).all(), name
        assert relative_error(logprob, expected.detach()) <= FLOAT32_TOL, name
        reduce(logprob).backward()
        reduce(expected).backward()
        assert relative_error(leaf_hidden.grad, oracle_hidden.grad) <= FLOAT32_TOL, name
        assert relative_error(leaf_weight.grad, oracle_weight.grad) <= FLOAT32_TOL, name
    assert outside.sum() == 4


# A loss_fn whose rows depend on each other: a mean spread over the rows, a normalizer by the chunk's
# length, advantages centred on the chunk's mean.
MIXING_LOSSES = {
    "mean": lambda logprob, entropy: (-logprob).mean().expand_as(logprob),
    "normalized": lambda logprob, entropy: -logprob / logprob.numel(),
    "centred": lambda logprob, entropy: -(logprob - logprob.mean()),
}


@pytest.mark.parametrize("name", list(MIXING_LOSSES))
def test_a_loss_fn_that_mixes_rows_is_refused(name):
    hidden, weight, targets, _ = sft_case()
    with pytest.raises(ValueError, match="each row's loss from that row alone.*per-token weights"):
        fused_linear_loss(hidden, weight, targets, MIXING_LOSSES[name])
    with pytest.raises(ValueError, match="each row's loss from that row alone.*per-token weights"):
        logits_loss(hidden @ weight.t(), targets, MIXING_LOSSES[name])


class CheckedAdvantages:
    """A policy-gradient loss that validates its inputs, as a user's may: all-zero advantages are an
    error. The entropy probe's row of zeros trips the check."""

    def __call__(self, logprob, entropy, *, advantages):
        if not bool(advantages.abs().sum() > 0):
            raise ValueError("all advantages are zero")
        return -advantages * logprob


def test_a_loss_fn_the_entropy_probe_cannot_run_is_refused_by_name():
    # Guessing whether it has an entropy term would pick a path silently; the attribute decides.
    hidden, weight, targets, _ = sft_case()
    inputs = {"advantages": torch.randn(targets.shape, generator=generator(3))}
    with pytest.raises(TypeError, match="failed on the probe.*all advantages are zero.*entropy_grad"):
        fused_linear_loss(hidden, weight, targets, CheckedAdvantages(), loss_inputs=inputs)
    declared = CheckedAdvantages()
    declared.entropy_grad = False
    result = fused_linear_loss(hidden, weight, targets, declared, loss_inputs=inputs)
    expected = (-inputs["advantages"] * fused_linear_logprob(hidden, weight, targets)).sum()
    torch.testing.assert_close(result.loss, expected, rtol=1e-6, atol=1e-5)


class CountingLoss:
    """A per-row cross-entropy that counts its calls (declaring no entropy term, so no probe runs)."""

    calls = 0
    entropy_grad = False

    def __call__(self, logprob, entropy):
        CountingLoss.calls += 1
        return -logprob


class ChunkNormalized:
    """A cross-entropy whose ``normalize`` setting divides by the chunk's length (mixing rows)."""

    entropy_grad = False

    def __init__(self, normalize: bool):
        self.normalize = normalize

    def __call__(self, logprob, entropy):
        return -logprob / logprob.numel() if self.normalize else -logprob


def test_a_differently_configured_loss_object_is_checked_again(monkeypatch):
    from megatron_fused_lm.ops.loss_pass import chunks

    monkeypatch.setattr(chunks, "_rows_checked", set())
    hidden, weight, targets, _ = sft_case()
    fused_linear_loss(hidden, weight, targets, ChunkNormalized(normalize=False))
    with pytest.raises(ValueError, match="each row's loss from that row alone"):
        fused_linear_loss(hidden, weight, targets, ChunkNormalized(normalize=True))


def test_a_per_row_loss_fn_is_checked_once_per_definition(monkeypatch):
    from megatron_fused_lm.ops.loss_pass import chunks

    monkeypatch.setattr(chunks, "_rows_checked", set())
    hidden, weight, targets, _ = sft_case()
    calls = []
    for _ in range(2):  # a new object of the same class each step, as trainers make them
        CountingLoss.calls = 0
        fused_linear_loss(hidden, weight, targets, CountingLoss(), token_chunk=10)
        calls.append(CountingLoss.calls)
    # Three chunks of 10 rows; the first use also runs the first chunk whole and in halves.
    assert calls == [3 + 3, 3], calls


def test_declared_weights_errors():
    hidden, weight, targets, _ = sft_case()
    with pytest.raises(TypeError, match="float or bool"):
        fused_linear_cross_entropy(hidden, weight, targets, torch.ones(LEAD, dtype=torch.long))
    with pytest.raises(ValueError, match="shape"):
        fused_linear_cross_entropy(hidden, weight, targets, torch.ones(30))
    with pytest.raises(ValueError, match="requires grad"):
        fused_linear_cross_entropy(hidden, weight, targets, torch.ones(LEAD, requires_grad=True))


# fused_linear_cross_entropy: the declared-weights path.

# name: (declared weights, the loss per token taken on the returned losses ``out`` given the
# declared weights ``d`` and another mask ``o``, whether its upstream gradient is c * d).
DECLARED_CASES = {
    "mask-scaled": ("mask", lambda out, d, o: out * d * 0.37, True),
    "bool-mask": ("bool", lambda out, d, o: out * d, True),
    "weights-negative-scale": ("weights", lambda out, d, o: -out * d, True),
    "other-mask": ("mask", lambda out, d, o: out * o / 7, False),
    "squared": ("mask", lambda out, d, o: out**2, False),
    "zero-declared": ("zeros", lambda out, d, o: out, False),
    # A skipped micro-batch (loss times 0): c = 0 fits, nothing to correct.
    "zero-upstream": ("mask", lambda out, d, o: out * 0.0, True),
    # An upstream orthogonal to the declaration: the fit is 0, yet all of it needs the correction.
    "orthogonal": ("mask", lambda out, d, o: out * (1 - d) * o, False),
}


@pytest.mark.parametrize("token_chunk", [1, 7, None])
@pytest.mark.parametrize("name", list(DECLARED_CASES))
def test_cross_entropy_gradients_for_any_upstream(name, token_chunk, package_warnings):
    declared_kind, per_token, matches = DECLARED_CASES[name]
    hidden, weight, targets = make_case(LEAD, H, V, torch.float32, peaky=False, seed=6)
    gen = generator(6)
    mask = (torch.rand(LEAD, generator=gen) < 0.7).float()
    other = (torch.rand(LEAD, generator=gen) < 0.5).float()
    declared = {
        "mask": mask,
        "bool": mask.bool(),
        "weights": torch.rand(LEAD, generator=gen),
        "zeros": torch.zeros(LEAD),
    }[declared_kind]
    leaf_hidden, leaf_weight = leaves(hidden, weight)
    weight_grad_corrections()  # what earlier tests left
    out = fused_linear_cross_entropy(
        leaf_hidden, leaf_weight, targets, declared, temperature=0.9, token_chunk=token_chunk
    )
    per_token(out, declared.float(), other).sum().backward()
    assert weight_grad_corrections() == (0 if matches else 1)
    expected = loss_reference(
        hidden, weight, targets, lambda logprob, entropy, *, d, o: per_token(-logprob, d, o),
        {"d": declared.float(), "o": other}, 0.9,
    )  # fmt: skip
    assert out.shape == LEAD and out.dtype == torch.float32
    assert relative_error(out, -expected.logprob) <= FLOAT32_TOL
    assert relative_error(leaf_hidden.grad, expected.grad_hidden) <= FLOAT32_TOL
    assert relative_error(leaf_weight.grad, expected.grad_weight) <= FLOAT32_TOL
    warnings = package_warnings()
    if matches:  # the stored gradients, scaled
        assert warnings == []
    else:  # the second pass, announced once
        assert len(warnings) == 1 and "second pass" in warnings[0], warnings


def test_cross_entropy_second_backward_is_an_error():
    hidden, weight, targets, _ = sft_case()
    hidden, weight = leaves(hidden, weight)
    out = fused_linear_cross_entropy(hidden, weight, targets, torch.ones(LEAD))
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="earlier backward"):
        out.sum().backward()


@pytest.mark.parametrize("upstream", ["matching", "mismatching"])
def test_cross_entropy_never_allocates_more_than_one_chunk_block(upstream):
    tokens, hidden_size, vocab, chunk = 256, 8, 257, 16
    hidden, weight, targets = make_case((tokens,), hidden_size, vocab, torch.float32, peaky=False)
    hidden, weight = leaves(hidden, weight)
    recorder = LargestAllocation()
    with recorder:
        out = fused_linear_cross_entropy(hidden, weight, targets, torch.ones(tokens), token_chunk=chunk)
        (out.sum() if upstream == "matching" else (out**2).sum()).backward()
    assert recorder.largest() == chunk * vocab


# The ready-made losses against formulas written out in float64.


def test_token_mean_weights():
    mask = torch.tensor([[True, False, True], [True, True, False]])
    weights = losses.token_mean_weights(mask)
    assert weights.dtype == torch.float32 and weights.shape == mask.shape
    assert torch.equal(weights, torch.tensor([[0.25, 0.0, 0.25], [0.25, 0.25, 0.0]]))
    assert torch.equal(losses.token_mean_weights(mask.float() * 1.0), weights)
    empty = losses.token_mean_weights(torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(empty, torch.zeros(2, 3))  # no NaN from 0 / 0


def test_cross_entropy_formula():
    logprob, weight = -torch.rand(7, dtype=torch.float64) * 5, torch.rand(7, dtype=torch.float64)
    assert torch.equal(losses.cross_entropy(logprob, torch.rand(7), weight=weight), -weight * logprob)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_formulas(estimator):
    logprob = -torch.rand(50, dtype=torch.float64, generator=generator(1)) * 4
    ref_logprob = logprob + torch.randn(50, dtype=torch.float64, generator=generator(2))
    expected = []
    for lp, ref in zip(logprob.tolist(), ref_logprob.tolist(), strict=True):
        d = ref - lp
        expected.append({"k1": lp - ref, "k2": d * d / 2, "k3": math.exp(d) - d - 1}[estimator])
    actual = losses.kl_penalty(logprob, ref_logprob, estimator)
    assert torch.allclose(actual, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_kl_penalty_unknown_estimator():
    with pytest.raises(ValueError, match="estimator"):
        losses.kl_penalty(torch.zeros(2), torch.zeros(2), "k4")


def policy_token(log_ratio, advantage, entropy, ref_delta, *, clip_low, clip_high, dual_clip, entropy_coef, kl_coef):
    """One token's clipped policy loss (weight 1) and its derivative in the log-prob, written out
    branch by branch; ``ref_delta = ref_logprob - logprob``, k3 KL."""
    ratio = math.exp(log_ratio)
    low, high = 1 - clip_low, 1 + clip_high
    clipped_ratio = min(max(ratio, low), high)
    if -advantage * ratio >= -advantage * clipped_ratio:  # the unclipped term is the max
        loss, grad = -advantage * ratio, -advantage * ratio
    else:
        loss, grad = -advantage * clipped_ratio, 0.0
    if dual_clip is not None and advantage < 0 and loss > -advantage * dual_clip:
        loss, grad = -advantage * dual_clip, 0.0
    loss += -entropy_coef * entropy + kl_coef * (math.exp(ref_delta) - ref_delta - 1)
    grad += kl_coef * (1 - math.exp(ref_delta))
    return loss, grad


POLICY_SETTINGS = [
    dict(clip_low=0.2, clip_high=0.28, dual_clip=None, entropy_coef=0.0, kl_coef=0.0),
    dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, entropy_coef=0.01, kl_coef=0.05),
    dict(clip_low=0.1, clip_high=0.1, dual_clip=2.0, entropy_coef=0.0, kl_coef=0.1),
]


@pytest.mark.parametrize("settings", POLICY_SETTINGS, ids=["plain", "dapo-dual-clip", "symmetric"])
def test_clipped_policy_loss_formula_and_gradients(settings):
    # Log-ratios in every branch for both advantage signs, none on a kink.
    log_ratio = torch.tensor([-2.0, -0.5, -0.15, -0.02, 0.03, 0.15, 0.5, 0.9, 1.5, 3.0], dtype=torch.float64)
    log_ratio = torch.cat([log_ratio, log_ratio])
    advantages = torch.cat([torch.full((10,), 1.3), torch.full((10,), -0.7)]).double()
    logprob = (-torch.rand(20, dtype=torch.float64, generator=generator(3)) * 3).requires_grad_()
    entropy = (torch.rand(20, dtype=torch.float64, generator=generator(4)) * 2).requires_grad_()
    ref_delta = 0.2 * torch.randn(20, dtype=torch.float64, generator=generator(5))
    weight = torch.rand(20, dtype=torch.float64, generator=generator(6))
    inputs = dict(
        old_logprob=(logprob - log_ratio).detach(),
        advantages=advantages,
        weight=weight,
        ref_logprob=(logprob + ref_delta).detach(),
    )
    policy = losses.ClippedPolicyLoss(**settings)
    loss = policy(logprob, entropy, **inputs)
    grad_logprob, grad_entropy = torch.autograd.grad(loss.sum(), (logprob, entropy), allow_unused=True)
    tokens = zip(log_ratio.tolist(), advantages.tolist(), entropy.tolist(), ref_delta.tolist(), strict=True)
    expected = torch.tensor([policy_token(*token, **settings) for token in tokens], dtype=torch.float64)
    # The closed form the three-GEMM pass takes instead of autograd's, against the same oracle.
    closed_loss, closed_grad, closed_entropy_grad = policy.with_grads(logprob.detach(), entropy.detach(), **inputs)
    for value, grad in ((loss, grad_logprob), (closed_loss, closed_grad)):
        assert torch.allclose(value, weight * expected[:, 0], rtol=1e-12, atol=1e-15)
        assert torch.allclose(grad, weight * expected[:, 1], rtol=1e-12, atol=1e-15)
    if settings["entropy_coef"]:
        for grad in (grad_entropy, closed_entropy_grad):
            assert torch.allclose(grad, -settings["entropy_coef"] * weight, rtol=1e-12, atol=0)
    else:
        assert grad_entropy is None and closed_entropy_grad is None


def policy_loss_and_grad(loss_fn, log_ratio, advantage):
    """``(loss, d loss / d logprob)`` of one token with weight 1 and the given log-ratio."""
    logprob = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    loss = loss_fn(
        logprob,
        torch.zeros(1, dtype=torch.float64),
        old_logprob=torch.tensor([-1.0 - log_ratio], dtype=torch.float64),
        advantages=torch.tensor([advantage], dtype=torch.float64),
        weight=torch.ones(1, dtype=torch.float64),
    )
    (grad,) = torch.autograd.grad(loss.sum(), logprob)
    return loss.item(), grad.item()


def test_clipped_policy_loss_branches():
    ppo = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28)
    high, low = math.log(1.5), math.log(0.6)  # beyond 1 + clip_high, below 1 - clip_low
    # Ratio above 1 + clip_high with A > 0: clipped, no gradient.
    assert policy_loss_and_grad(ppo, high, 2.0) == pytest.approx((-2.0 * 1.28, 0.0))
    # Below 1 - clip_low with A < 0: clipped, no gradient.
    assert policy_loss_and_grad(ppo, low, -2.0) == pytest.approx((2.0 * 0.8, 0.0))
    # The other sign in each case keeps the unclipped (pessimistic) term and its gradient.
    assert policy_loss_and_grad(ppo, high, -2.0) == pytest.approx((2.0 * 1.5, 2.0 * 1.5))
    assert policy_loss_and_grad(ppo, low, 2.0) == pytest.approx((-2.0 * 0.6, -2.0 * 0.6))
    # Dual clip caps the loss of A < 0 at -A * dual_clip, with no gradient.
    dual = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert policy_loss_and_grad(dual, math.log(5.0), -2.0) == pytest.approx((2.0 * 3.0, 0.0))
    assert policy_loss_and_grad(ppo, math.log(5.0), -2.0) == pytest.approx((2.0 * 5.0, 2.0 * 5.0))
    assert policy_loss_and_grad(dual, math.log(5.0), 2.0) == pytest.approx((-2.0 * 1.28, 0.0))


def test_log_ratio_is_clamped_before_exp():
    ppo = losses.ClippedPolicyLoss()
    logprob = torch.tensor([-1.0, -1.0], requires_grad=True)
    loss = ppo(
        logprob,
        torch.zeros(2),
        old_logprob=torch.tensor([-1000.0, 1000.0]),
        advantages=torch.tensor([-1.0, 1.0]),
        weight=torch.ones(2),
    )
    (grad,) = torch.autograd.grad(loss.sum(), logprob)
    closed_loss, closed_grad, _ = ppo.with_grads(
        logprob.detach(),
        torch.zeros(2),
        old_logprob=torch.tensor([-1000.0, 1000.0]),
        advantages=torch.tensor([-1.0, 1.0]),
        weight=torch.ones(2),
    )
    limit = losses.LOG_RATIO_LIMIT
    # A < 0 keeps the unclipped term e^20; A > 0 the larger of -e^-20 and -(1 - clip_low).
    expected = torch.tensor([math.exp(limit), -math.exp(-limit)])
    for value, gradient in ((loss, grad), (closed_loss, closed_grad)):
        assert torch.allclose(value, expected, rtol=1e-6)
        assert torch.count_nonzero(gradient) == 0  # outside the clamp


def test_clipped_policy_loss_on_policy_and_at_the_clip_bounds():
    # Autograd of the value and the closed form take the same derivative where a side ties: ratios
    # exactly on the clip bounds and a loss exactly at the dual clip's bound (the bounds set from the
    # ratios as the loss computes them), and without old log-probs (a ratio of 1, derivative 1).
    logprob = torch.full((6,), -1.0, dtype=torch.float64, requires_grad=True)
    log_ratio = torch.tensor([0.0, 0.0, math.log(1.5), math.log(0.75), math.log(4.0), math.log(2.0)]).double()
    old_logprob = logprob.detach() - log_ratio
    ratio = (logprob.detach() - old_logprob).exp()
    policy = losses.ClippedPolicyLoss(
        clip_low=float(1 - ratio[3]), clip_high=float(ratio[2] - 1), dual_clip=float(ratio[5]), kl_coef=0.1,
        kl_estimator="k2",
    )  # fmt: skip
    advantages = torch.tensor([1.5, -1.5, 2.0, -2.0, -0.5, -0.5], dtype=torch.float64)
    ref_logprob = torch.tensor([-1.2, -0.9, -1.0, -1.1, -1.3, -1.0], dtype=torch.float64)
    weight = torch.linspace(0.5, 1.5, 6, dtype=torch.float64)
    entropy = torch.zeros(6, dtype=torch.float64)
    kl_grad = 0.1 * -(ref_logprob - logprob.detach())  # k2's derivative
    # On the clip bounds and the dual clip's: the unclipped side's -A r; past the dual clip: none.
    unclipped = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    for old, expected in (
        (None, weight * (-advantages + kl_grad)),
        (old_logprob, weight * (unclipped * -advantages * ratio + kl_grad)),
    ):
        inputs = dict(advantages=advantages, weight=weight, ref_logprob=ref_logprob, old_logprob=old)
        (grad,) = torch.autograd.grad(policy(logprob, entropy, **inputs).sum(), logprob)
        closed_grad = policy.with_grads(logprob.detach(), entropy, **inputs)[1]
        for got in (grad, closed_grad):
            assert torch.allclose(got, expected, rtol=1e-12, atol=1e-15), (old is None, got, expected)


def test_a_nan_or_an_infinity_in_the_policy_loss_inputs_takes_autograds_derivative():
    # A NaN advantage (inside the clip range, off it, past the log-ratio's clamp) or a NaN old
    # log-prob is not clipped away: its token's loss is NaN, and the closed form's derivative is
    # autograd's of the value (NaN for the advantage where the clamp passes the gradient, 0 past
    # it and for a NaN log-ratio, whatever the advantage); the other tokens keep their numbers.
    policy = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, dual_clip=3.0, entropy_coef=0.01)
    log_ratio = torch.tensor([0.2, math.nan, 1.0, 21.0, math.nan, math.nan, 0.5, 0.1], dtype=torch.float64)
    advantages = torch.tensor([math.nan, 1.0, math.nan, math.nan, math.inf, math.nan, -1.0, 0.5]).double()
    logprob = torch.full((8,), -1.0, dtype=torch.float64, requires_grad=True)
    inputs = dict(advantages=advantages, old_logprob=-1.0 - log_ratio, weight=torch.ones(8, dtype=torch.float64))
    entropy = torch.ones(8, dtype=torch.float64)
    loss = policy(logprob, entropy, **inputs)
    (grad,) = torch.autograd.grad(loss.sum(), logprob)
    closed_loss, closed_grad, _ = policy.with_grads(logprob.detach(), entropy, **inputs)
    assert loss[:6].isnan().all() and loss[6:].isfinite().all(), loss
    assert grad[[0, 2]].isnan().all() and (grad[[1, 3, 4, 5]] == 0).all() and grad[6:].isfinite().all(), grad
    torch.testing.assert_close(closed_loss, loss.detach(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(closed_grad, grad, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(clip_low=-0.1), "clip_low"),
        (dict(clip_low=1.0), "clip_low"),
        (dict(clip_high=-0.1), "clip_high"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(dual_clip=0.5), "dual_clip"),
        (dict(kl_estimator="k4"), "kl_estimator"),
    ],
)
def test_clipped_policy_loss_validates_its_settings(settings, match):
    with pytest.raises(ValueError, match=match):
        losses.ClippedPolicyLoss(**settings)


def test_kl_coef_needs_ref_logprob():
    loss_fn = losses.ClippedPolicyLoss(kl_coef=0.1)
    with pytest.raises(ValueError, match="ref_logprob"):
        loss_fn(
            torch.zeros(3), torch.zeros(3), old_logprob=torch.zeros(3), advantages=torch.ones(3), weight=torch.ones(3)
        )
    hidden, weight, targets, inputs = sft_case()
    inputs = dict(inputs, old_logprob=torch.zeros(LEAD), advantages=torch.ones(LEAD))
    with pytest.raises(ValueError, match="ref_logprob"):  # through the op too
        fused_linear_loss(hidden, weight, targets, loss_fn, loss_inputs=inputs)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_a_policy_loss_without_old_log_probs_is_on_policy(dual_clip):
    # A trainer that skips the old log-prob pass (one update per rollout) takes the current log-probs
    # as the old ones: the same loss and gradients as old_logprob = the float64 oracle's log-probs.
    # 2e-5 and 5e-5 as the oracle tests: on-policy, the ratio is 1 within the old log-probs' float32
    # rounding (1e-7), where an old_logprob read as 0 would make it exp(logprob): off by O(1).
    hidden, weight, targets = make_case(LEAD, 16, 37, torch.float32, peaky=True, seed=8)
    current, _ = logprob_entropy(hidden.double() @ weight.double().t(), targets)
    loss_fn = losses.ClippedPolicyLoss(clip_high=0.28, dual_clip=dual_clip, entropy_coef=0.01)
    inputs = {"advantages": torch.randn(LEAD, generator=generator(9)), "weight": torch.full(LEAD, 0.1)}
    expected = loss_reference(hidden, weight, targets, loss_fn, {**inputs, "old_logprob": current})
    for run in (run_fused, run_stock):
        result, grad_hidden, grad_weight = run(hidden, weight, targets, loss_fn, inputs)
        assert abs(float(result.loss) - float(expected.loss)) <= 2e-5
        assert relative_error(grad_hidden, expected.grad_hidden) <= 5e-5
        assert relative_error(grad_weight, expected.grad_weight) <= 5e-5
