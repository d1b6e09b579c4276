"""The three-GEMM loss path (``fused_linear_loss``) on CUDA against the float64 oracle, next to the
four-GEMM recompute path (``fused_linear_logprob`` with the same loss taken outside) on the same
inputs.

Bounds:
- log-prob and entropy metrics: the same float32 statistics as the recompute path, so the same
  bound, ``VALUE_BOUND * |z|max`` (test_triton_parity.py says how it was measured).
- gradients, as relative L2 errors against the float64 oracle: at most ``GRAD_RATIO`` times the
  recompute path's own on the same inputs (both round ``dz``, or for the three-GEMM path's
  losses without an entropy term the stored exponentials and the scaled hidden rows, and the
  results to bf16; the three-GEMM path sums the weight gradient over its token chunks in float32,
  or writes it once from a single chunk). A dropped or misplaced term is off by O(1).
"""

from __future__ import annotations

import pytest
import torch

from devkit.kernel_references import torch_row_references
from devkit.oracle import loss_reference, max_abs_error, reference
from megatron_fused_lm import fused_linear_cross_entropy, fused_linear_logprob, fused_linear_loss, losses
from megatron_fused_lm.ops.backends.triton_reference import MAX_ABOVE_REFERENCE
from megatron_fused_lm.ops.backends.triton_tuning import REFERENCE_ROWS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VALUE_BOUND = 2e-5  # times the largest |logit|
GRAD_RATIO = 1.2
# (tokens, hidden, vocab): one chunk; one chunk that replaces the weight-gradient accumulator;
# several chunks of a real vocabulary; a prime vocabulary.
SHAPES = [(1024, 4096, 151936), (4096, 2048, 151936), (6144, 1024, 151936), (1000, 1000, 30011)]
# The loss is scaled before its backward, as Megatron scales by the number of micro-batches: the
# stored gradients are multiplied by the upstream gradient in the backward.
LOSS_SCALE = 0.37
DOMINANT_ROW = 1000  # not among the rows the reference samples at vocabulary 151936


def make_case(tokens, hidden_size, vocab, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * (4.0 / hidden_size**0.5)).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    return hidden, weight, targets, gen


def loss_cases(hidden, weight, targets, gen):
    """``{name: (loss_fn, loss_inputs)}``: SFT mean cross-entropy and a GRPO-style policy loss."""
    tokens = targets.shape[0]
    mask = torch.rand(tokens, device="cuda", generator=gen) < 0.8
    with torch.no_grad():
        current = fused_linear_logprob(hidden, weight, targets, backend="triton")
    policy_inputs = dict(
        old_logprob=current + 0.1 * torch.randn(tokens, device="cuda", generator=gen),
        ref_logprob=current + 0.1 * torch.randn(tokens, device="cuda", generator=gen),
        advantages=torch.randn(tokens, device="cuda", generator=gen),
        weight=losses.token_mean_weights(mask),
    )
    policy = losses.ClippedPolicyLoss(clip_high=0.28, entropy_coef=0.01, kl_coef=0.05)
    return {
        "sft": (losses.cross_entropy, dict(weight=losses.token_mean_weights(mask))),
        "policy": (policy, policy_inputs),
    }


def float64_reference(hidden, weight, targets, loss_fn, loss_inputs, temperature=1.0, mask=None):
    """``(logprob, entropy, grad_hidden, grad_weight)`` in float64 (devkit's oracle): the metrics 0 on
    the rows ``mask`` leaves out, the gradients those of ``LOSS_SCALE`` times the loss. The hidden
    states enter in the weight's dtype, as the ops' products take them."""
    exact = loss_reference(hidden.to(weight.dtype), weight, targets, loss_fn, loss_inputs, temperature, mask)
    return exact.logprob, exact.entropy, LOSS_SCALE * exact.grad_hidden, LOSS_SCALE * exact.grad_weight


def recompute_path(hidden, weight, targets, loss_fn, loss_inputs, backend):
    hidden, weight = (tensor.detach().requires_grad_() for tensor in (hidden, weight))
    logprob, entropy = fused_linear_logprob(hidden, weight, targets, return_entropy=True, backend=backend)
    (LOSS_SCALE * loss_fn(logprob, entropy, **loss_inputs).sum()).backward()
    return logprob.detach(), entropy.detach(), hidden.grad, weight.grad


def three_gemm_path(hidden, weight, targets, loss_fn, loss_inputs, backend):
    hidden, weight = (tensor.detach().requires_grad_() for tensor in (hidden, weight))
    result = fused_linear_loss(hidden, weight, targets, loss_fn, loss_inputs=loss_inputs, backend=backend)
    (LOSS_SCALE * result.loss).backward()
    return result.logprob, result.entropy, hidden.grad, weight.grad


def relative_l2(actual, expected):
    """``|actual - expected| / |expected|`` (``|actual|`` where ``expected`` is 0: no rows)."""
    norm = expected.norm()
    return float((actual.double() - expected).norm() / norm) if norm > 0 else float(actual.double().norm())


def check_against_float64(hidden, weight, targets, gen, loss_name, backend):
    loss_fn, loss_inputs = loss_cases(hidden, weight, targets, gen)[loss_name]
    expected = float64_reference(hidden, weight, targets, loss_fn, loss_inputs)
    ours = three_gemm_path(hidden, weight, targets, loss_fn, loss_inputs, backend)
    recompute = recompute_path(hidden, weight, targets, loss_fn, loss_inputs, backend)
    largest_logit = (hidden.double() @ weight.double().t()).abs().max().item()
    for name, index in (("logprob", 0), ("entropy", 1)):
        error = max_abs_error(ours[index], expected[index])
        assert error <= VALUE_BOUND * largest_logit, (name, error)
    for name, index in (("grad_hidden", 2), ("grad_weight", 3)):
        ours_error = relative_l2(ours[index], expected[index])
        recompute_error = relative_l2(recompute[index], expected[index])
        assert ours[index].dtype == torch.bfloat16
        assert ours_error <= GRAD_RATIO * recompute_error, (name, ours_error, recompute_error)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("loss_name", ["sft", "policy"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "x".join(map(str, shape)))
def test_three_gemm_path_against_float64(shape, loss_name, backend):
    hidden, weight, targets, gen = make_case(*shape)
    check_against_float64(hidden, weight, targets, gen, loss_name, backend)


@pytest.mark.parametrize("loss_name", ["sft", "policy"])
def test_three_gemm_path_refreshed_references(loss_name):
    # One vocabulary row lies about 90 above the others' logits for half the tokens, and it is
    # neither sampled for the reference nor a target there: with exponentials ("sft"), those rows'
    # are rewritten against their maximum (the precondition checks they are many); "policy" has
    # an entropy term, so its offsets need no reference and the case checks a dominant far row.
    hidden, weight, targets, gen = make_case(2048, 4096, 151936, seed=1)
    direction = torch.nn.functional.normalize(torch.randn(hidden.shape[1], device="cuda", generator=gen), dim=0)
    hidden[:1024] += (3.0 * direction).bfloat16()
    weight[DOMINANT_ROW] = (30.0 * direction).bfloat16()
    targets[targets == DOMINANT_ROW] = 0
    reference = torch_row_references(hidden, weight, targets, 1.0, REFERENCE_ROWS)
    row_max = (hidden.float() @ weight.float().t()).amax(dim=1)
    assert int((row_max > reference + MAX_ABOVE_REFERENCE).sum()) >= 256
    check_against_float64(hidden, weight, targets, gen, loss_name, "triton")


# Every regime of issue "as trustworthy as the recompute path": peaked rows (the chosen token, or
# another, at probability p), losses that are entropy-only, log-prob-only, KL-only and mixed, and
# every operand dtype; both backends. Bounds as above, the gradient ratio plus a float32 floor for
# float32 operands, whose errors are rounding of float32 sums.
REGIMES = [("random", None)] + [(kind, p) for kind in ("chosen", "other") for p in (0.9, 0.999, 1 - 1e-5, 1 - 1e-7)]
DTYPES = {  # name: (hidden dtype, weight dtype)
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16),
    "fp32": (torch.float32, torch.float32),
    "fp32 hidden, bf16 weight": (torch.float32, torch.bfloat16),
}


def entropy_only(logprob, entropy, *, weight):
    """An entropy bonus alone (a GRPO group with equal rewards has zero advantages)."""
    return -weight * entropy


def regime_losses(current, gen):
    """``{name: (loss_fn, loss_inputs)}`` for tokens whose log-probs are ``current``."""
    tokens = current.shape[0]
    weight = torch.full((tokens,), 1.0 / max(tokens, 1), device="cuda")
    noisy = lambda: current + 0.05 * torch.randn(tokens, device="cuda", generator=gen)  # noqa: E731
    kl_only = losses.ClippedPolicyLoss(kl_coef=0.1)
    mixed = losses.ClippedPolicyLoss(clip_high=0.28, entropy_coef=0.01, kl_coef=0.05)
    zero = torch.zeros(tokens, device="cuda")
    advantages = torch.randn(tokens, device="cuda", generator=gen)
    return {
        "entropy-only": (entropy_only, dict(weight=weight)),
        "logprob-only": (losses.cross_entropy, dict(weight=weight)),
        "kl-only": (kl_only, dict(old_logprob=noisy(), ref_logprob=noisy(), advantages=zero, weight=weight)),
        "mixed": (mixed, dict(old_logprob=noisy(), ref_logprob=noisy(), advantages=advantages, weight=weight)),
    }


def peaked_case(regime, dtypes, tokens=512, hidden_size=1000, vocab=32003, seed=3):
    """Inputs where each row's chosen token (``"chosen"``) or another one (``"other"``) has about
    probability ``p``: the hidden row is moved along that token's weight row."""
    kind, prob = regime
    hidden, weight, targets, gen = make_case(tokens, hidden_size, vocab, seed)
    hidden, weight = hidden.double(), weight.double()
    if kind != "random":
        offset = torch.randint(1, vocab, (tokens,), device="cuda", generator=gen)
        top = targets if kind == "chosen" else (targets + offset) % vocab
        rows, direction = torch.arange(tokens, device="cuda"), weight[top]
        minus_inf = torch.tensor(-torch.inf, dtype=torch.float64, device="cuda")
        for _ in range(4):  # moving the row moves the other logits too: settle the gap
            logits = hidden @ weight.t()
            rest = torch.logsumexp(logits.index_put((rows, top), minus_inf), dim=1)
            gap = rest + torch.log(torch.tensor(prob / (1 - prob), dtype=torch.float64)) - logits[rows, top]
            hidden = hidden + gap[:, None] * direction / (direction * direction).sum(1, keepdim=True)
    hidden_dtype, weight_dtype = dtypes
    return hidden.to(hidden_dtype), weight.to(weight_dtype), targets, gen


def check_regime(hidden, weight, targets, loss_fn, loss_inputs, backend, temperature=1.0, mask=None):
    """Values within the recompute path's error, gradients within ``GRAD_RATIO`` of its."""
    expected = float64_reference(hidden, weight, targets, loss_fn, loss_inputs, temperature, mask)
    runs = {}
    for path in ("three-gemm", "recompute"):
        leaves = [tensor.detach().requires_grad_() for tensor in (hidden, weight)]
        options = dict(temperature=temperature, backend=backend, mask=mask)
        if path == "three-gemm":
            result = fused_linear_loss(*leaves, targets, loss_fn, loss_inputs=loss_inputs, **options)
            loss, logprob, entropy = result
        else:
            logprob, entropy = fused_linear_logprob(*leaves, targets, return_entropy=True, **options)
            rows = slice(None) if mask is None else mask
            inputs = {name: value[rows] for name, value in loss_inputs.items()}
            loss = loss_fn(logprob[rows], entropy[rows], **inputs).sum()
        (LOSS_SCALE * loss).backward()
        runs[path] = (logprob.detach(), entropy.detach(), leaves[0].grad, leaves[1].grad)
    ours, recompute = runs["three-gemm"], runs["recompute"]
    floor = 1e-6 if weight.dtype == torch.float32 else 0.0
    for name, index in (("logprob", 0), ("entropy", 1)):
        # The same float32 statistics; the forward kernels' tiles, so their summation orders, may differ.
        error, bound = max_abs_error(ours[index], expected[index]), max_abs_error(recompute[index], expected[index])
        assert error <= 1.25 * bound + 2e-6, (name, error, bound)
    for name, index in (("grad_hidden", 2), ("grad_weight", 3)):
        assert ours[index].dtype == (hidden.dtype, weight.dtype)[index - 2]
        error, bound = relative_l2(ours[index], expected[index]), relative_l2(recompute[index], expected[index])
        assert error <= GRAD_RATIO * bound + floor, (name, error, bound)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtypes", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("regime", REGIMES, ids=lambda regime: f"{regime[0]}-{regime[1]}")
def test_every_regime_within_the_recompute_paths_error(regime, dtypes, backend):
    hidden, weight, targets, gen = peaked_case(regime, DTYPES[dtypes])
    with torch.no_grad():
        current = fused_linear_logprob(hidden, weight, targets, backend=backend)
    for name, (loss_fn, loss_inputs) in regime_losses(current, gen).items():
        try:
            check_regime(hidden, weight, targets, loss_fn, loss_inputs, backend)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    "shape, temperature, masked",
    [
        ((1, 1000, 32003), 1.0, False),
        ((0, 1000, 32003), 1.0, False),
        ((300, 1003, 50021), 0.7, True),
        ((300, 1003, 50021), "per_row", True),
    ],
    ids=["one token", "zero tokens", "odd sizes, temperature, mask", "odd sizes, temperature per row, mask"],
)
def test_odd_sizes_temperature_and_mask(shape, temperature, masked, backend):
    for dtypes in DTYPES.values():
        hidden, weight, targets, gen = peaked_case(("chosen", 0.999), dtypes, *shape)
        if temperature == "per_row":  # 0.5 to 2, each row its own
            temperature = torch.rand(shape[0], device="cuda", generator=gen) * 1.5 + 0.5
        mask = torch.rand(shape[0], device="cuda", generator=gen) < 0.6 if masked else None
        with torch.no_grad():
            current = fused_linear_logprob(hidden, weight, targets, backend=backend, temperature=temperature)
        for loss_fn, loss_inputs in regime_losses(current, gen).values():
            check_regime(hidden, weight, targets, loss_fn, loss_inputs, backend, temperature, mask)


@pytest.mark.parametrize("declared", [LOSS_SCALE, 1.0], ids=["declared-scale", "other-scale"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("loss_name", ["sft", "policy"])
def test_weight_grad_into_against_float64(loss_name, backend, declared):
    # Several chunks; the weight gradient added into a float32 accumulator (Megatron's main_grad)
    # in the forward, never rounded: within the recompute path's error, which rounds it to bf16.
    hidden, weight, targets, gen = make_case(4096, 2048, 151936)
    loss_fn, loss_inputs = loss_cases(hidden, weight, targets, gen)[loss_name]
    expected = float64_reference(hidden, weight, targets, loss_fn, loss_inputs)
    recompute = recompute_path(hidden, weight, targets, loss_fn, loss_inputs, backend)
    before = 1e-3 * torch.randn(weight.shape, device="cuda", generator=gen)  # about the gradient's size
    accumulator = before.clone()
    leaves = [tensor.detach().requires_grad_() for tensor in (hidden, weight)]
    result = fused_linear_loss(
        *leaves, targets, loss_fn, loss_inputs=loss_inputs, backend=backend, weight_grad_into=accumulator,
        weight_grad_scale=declared,
    )  # fmt: skip
    (LOSS_SCALE * result.loss).backward()
    assert leaves[1].grad is None
    added = accumulator.double() - before.double()
    assert relative_l2(added, expected[3]) <= GRAD_RATIO * relative_l2(recompute[3], expected[3])
    assert relative_l2(leaves[0].grad, expected[2]) <= GRAD_RATIO * relative_l2(recompute[2], expected[2])


@pytest.mark.parametrize("arriving", ["declared", "not-proportional"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_declared_cross_entropy_into_weight_grad_into_against_float64(backend, arriving):
    # The labels path's declared loss weights and scale, the weight gradient added into a float32
    # accumulator; the upstream gradient as declared, or not proportional to the declaration (a
    # second pass adds what is missing).
    hidden, weight, targets, gen = make_case(4096, 2048, 151936)
    declared = torch.rand(targets.shape, device="cuda", generator=gen)
    upstream = (
        LOSS_SCALE * declared if arriving == "declared" else torch.randn(targets.shape, device="cuda", generator=gen)
    )
    weights = {"weight": upstream / LOSS_SCALE}  # float64_reference multiplies by LOSS_SCALE
    expected = float64_reference(hidden, weight, targets, losses.cross_entropy, weights)
    recompute = recompute_path(hidden, weight, targets, losses.cross_entropy, weights, backend)
    before = 1e-3 * torch.randn(weight.shape, device="cuda", generator=gen)  # about the gradient's size
    accumulator = before.clone()
    leaves = [tensor.detach().requires_grad_() for tensor in (hidden, weight)]
    per_token = fused_linear_cross_entropy(
        *leaves, targets, declared, backend=backend, weight_grad_into=accumulator, weight_grad_scale=LOSS_SCALE
    )
    (per_token * upstream).sum().backward()
    assert leaves[1].grad is None
    added = accumulator.double() - before.double()
    assert relative_l2(added, expected[3]) <= GRAD_RATIO * relative_l2(recompute[3], expected[3])
    assert relative_l2(leaves[0].grad, expected[2]) <= GRAD_RATIO * relative_l2(recompute[2], expected[2])


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("op", ["logprob", "declared", "other-upstream"])
def test_out_of_vocab_targets_score_as_megatron_scores_them(op, backend):
    # A fifth of the rows get HF-style -100 (or an id past the vocabulary): no rank owns them, so
    # every kernel sees the column OUTSIDE_VOCAB, which none owns. Each error against the
    # float64 oracle of that convention must stay within GRAD_RATIO times the same op's error on
    # the same rows with their in-vocabulary targets.
    hidden, weight, targets, gen = make_case(4096, 2048, 151936)
    outside = torch.rand(targets.shape, device="cuda", generator=gen) < 0.2
    padded = torch.where(outside, torch.where(targets % 2 == 0, -100, weight.shape[0] + 7), targets)
    declared = (torch.rand(targets.shape, device="cuda", generator=gen) < 0.7).float()
    upstream = declared * 0.37 if op == "declared" else torch.randn(targets.shape, device="cuda", generator=gen)

    def run(these_targets):
        leaves = [tensor.detach().requires_grad_() for tensor in (hidden, weight)]
        if op == "logprob":
            logprob = fused_linear_logprob(*leaves, these_targets, backend=backend, out_of_vocab="max_logit")
        else:
            logprob = -fused_linear_cross_entropy(
                *leaves, these_targets, declared, backend=backend, out_of_vocab="max_logit"
            )
        (logprob * upstream).sum().backward()
        exact = reference(hidden, weight, these_targets, grad_logprob=upstream, out_of_vocab="max_logit")
        expected = exact.logprob, exact.grad_hidden, exact.grad_weight
        results = (logprob.detach(), *(leaf.grad for leaf in leaves))
        return [relative_l2(got, want) for got, want in zip(results, expected, strict=True)]

    padded_errors, baseline_errors = run(padded), run(targets)
    names = ("logprob", "grad_hidden", "grad_weight")
    for name, error, baseline in zip(names, padded_errors, baseline_errors, strict=True):
        assert error <= GRAD_RATIO * baseline + 1e-7, (name, error, baseline)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("loss_name", ["distillation", "with-entropy"])
def test_several_targets_three_gemm(loss_name, dtype):
    # k = 8 ids per row (a teacher's top-k; one repeated for the general loss) on the three-GEMM
    # path: bf16 without an entropy term reads the stored exponentials directly (every target's
    # element zeroed, each distinct column's term added in float32), the others run the dz kernel.
    hidden, weight, targets, gen = make_case(1024, 2048, 30011, seed=5)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    ids = torch.stack([targets, *(torch.randint(0, 30011, (7, 1024), device="cuda", generator=gen))], -1)
    rows = torch.full((1024,), 1.0 / 1024, device="cuda")
    if loss_name == "distillation":
        ids[:, 1:] = (ids[:, :1] + torch.arange(1, 8, device="cuda")) % 30011  # distinct
        teacher = torch.log_softmax(torch.randn(1024, 8, device="cuda", generator=gen), -1) - 0.3
        loss_fn, inputs = losses.TopkDistillation("forward", "tail"), dict(teacher_logprob=teacher, weight=rows)
    else:
        ids[:, 3] = ids[:, 1]
        goal = -torch.rand(1024, 8, device="cuda", generator=gen) * 10

        def loss_fn(logprob, entropy, *, goal, weight):
            return weight * (((logprob - goal) ** 2).sum(-1) - 0.01 * entropy)

        inputs = dict(goal=goal, weight=rows)
    exact = loss_reference(hidden, weight, ids, loss_fn, inputs)
    expected = exact.grad_hidden, exact.grad_weight
    errors = {}
    for backend in ("torch", "triton"):
        run = [tensor.detach().requires_grad_() for tensor in (hidden, weight)]
        fused_linear_loss(*run, ids, loss_fn, loss_inputs=inputs, backend=backend).loss.backward()
        errors[backend] = [relative_l2(leaf.grad, grad) for leaf, grad in zip(run, expected, strict=True)]
    for ours, torch_backend in zip(errors["triton"], errors["torch"], strict=True):
        assert ours <= GRAD_RATIO * torch_backend, errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("prob", [0.99, 1 - 1e-5])
def test_a_dominant_target_among_several(prob, dtype):
    # The first of k = 8 ids holds probability prob: its 1 - p needs its logit to be the value the
    # statistics' maximum came from (softmax.summarize), not a second product's.
    hidden, weight, targets, gen = peaked_case(("chosen", prob), (dtype, dtype))
    others = torch.randint(0, weight.shape[0], (targets.shape[0], 7), device="cuda", generator=gen)
    ids = torch.cat([targets[:, None], others], -1)
    coef = torch.rand(ids.shape, device="cuda", generator=gen)

    def loss_fn(logprob, entropy, *, coef):
        return -(coef * logprob).sum(-1)

    exact = loss_reference(hidden, weight, ids, loss_fn, dict(coef=coef))
    expected = exact.grad_hidden, exact.grad_weight
    three_gemm = [tensor.detach().requires_grad_() for tensor in (hidden, weight)]
    recompute = [tensor.detach().requires_grad_() for tensor in (hidden, weight)]
    fused_linear_loss(*three_gemm, ids, loss_fn, loss_inputs=dict(coef=coef), backend="triton").loss.backward()
    loss_fn(fused_linear_logprob(*recompute, ids, backend="triton"), None, coef=coef).sum().backward()
    for ours, theirs, want in zip(three_gemm, recompute, expected, strict=True):
        errors = relative_l2(ours.grad, want), relative_l2(theirs.grad, want)
        assert errors[0] <= GRAD_RATIO * errors[1], errors
