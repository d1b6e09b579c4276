"""The three-GEMM loss path through the integration, against the stock Megatron-Core GPTModel:
TP=1 and TP=2, sequence parallel on and off, tied and untied embeddings.

For each case, on one float32 model:
1. ``head.loss`` with a clipped policy loss (entropy bonus, KL penalty, a response mask): the loss
   and every parameter's gradient equal those of the same loss taken in float64 on the stock
   model's gathered logits; a disabled head (logits) gives the same through the same call.
2. The labels path: ``declare_loss_weights(loss_mask)`` then ``model(..., labels=labels)`` and
   Megatron's SFT reduction ``sum(losses * loss_mask) / count`` give the stock per-token loss and
   the stock gradients, without the recompute; an upstream gradient that does not match the
   declaration (another mask) still gets the stock gradients, by the recompute, with a warning;
   declared weights of another shape are an error. Labels outside the vocabulary (HF-style -100
   padding, an id past it) give the stock loss and gradients, declared or not; ``head.logprobs``
   refuses them, pointing to ``mask=``.

3. Inside Megatron's DistributedDataParallel (float32 gradient buffers, overlapped reduction),
   ``head.loss(..., main_grad_scale=...)`` adds the output weight's gradient into its
   ``main_grad`` in the forward: after the backward every parameter's ``main_grad`` equals that of
   the stock head (logits, Megatron's own backward) through the same DDP, for a declared scale
   equal to the one the loss receives and for another (then corrected, with a warning). The same
   for the labels path with ``declare_loss_weights(loss_mask, main_grad_scale=...)``, plus an
   upstream gradient of another mask. A main_grad-route loss released without its backward is
   logged at once, naming the model, and ``head.main_grad_outstanding()`` lists it until it is
   forgotten; one waiting for its backward is listed until it runs.

Tolerances as in test_integration_parity (float32 on both sides, measured errors about 2e-6): 2e-5
absolute on per-token values and 5e-5 of the largest entry of each stock gradient.
"""

import contextlib
from unittest import mock

import pytest
import torch

from devkit import megatron_gpt as harness
from megatron_fused_lm import losses
from megatron_fused_lm.integration import FusedLMConfig, unwrap_model, wrap_model

VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5
TEMPERATURE = 0.9
POLICY_LOSS = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01, kl_coef=0.05)


def oracle_policy_loss(logits_shard, targets, inputs, response):
    """The policy loss in float64 on the stock logits (vocabulary gathered), and its value."""
    logprob, entropy = harness.oracle_logprob_entropy(logits_shard, targets, TEMPERATURE)
    doubles = {name: value.double() for name, value in inputs.items()}
    per_token = POLICY_LOSS(logprob, entropy, **doubles)
    return per_token[response].sum()


def check_policy_loss(model, batch, response, label):
    targets = batch[3]
    with torch.no_grad():
        current, _ = harness.oracle_logprob_entropy(harness.forward(model, batch), targets, TEMPERATURE)
    inputs = harness.policy_inputs(current, response)
    want = oracle_policy_loss(harness.forward(model, batch), targets, inputs, response)
    want.backward()
    stock_grads = harness.parameter_grads(model)

    for enabled in (False, True):
        head = wrap_model(model, FusedLMConfig(enabled=enabled, token_chunk=5))
        assert head.fused == enabled, label
        result = head.loss(
            harness.forward(model, batch), targets, POLICY_LOSS, loss_inputs=inputs, mask=response,
            temperature=TEMPERATURE,
        )  # fmt: skip
        case = f"{label} {'fused' if enabled else 'stock'} head.loss"
        assert result.loss.dtype == torch.float32 and result.loss.dim() == 0, case
        assert abs(result.loss.item() - want.item()) <= VALUE_ATOL, f"{case}: {result.loss.item()} vs {want.item()}"
        assert not result.logprob.requires_grad and result.logprob.shape == targets.shape, case
        assert torch.count_nonzero(result.logprob[~response]) == 0, case
        result.loss.backward()
        harness.assert_grads_close(harness.parameter_grads(model), stock_grads, GRAD_RTOL, case)


def megatron_sft_loss(per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's SFT reduction of the labels-path loss: masked sum over the token count."""
    return (per_token * loss_mask).sum() / loss_mask.sum()


def check_labels_path(model, batch, loss_mask, label):
    targets = batch[3]
    other_mask = torch.roll(loss_mask, 1, dims=1)
    stock = {}
    for name, mask in (("declared", loss_mask), ("other", other_mask)):
        per_token = harness.forward(model, batch, labels=targets)
        megatron_sft_loss(per_token, mask).backward()
        stock[name] = (per_token.detach(), harness.parameter_grads(model))

    head = wrap_model(model, FusedLMConfig(enabled=True))
    with harness.RecordedWarnings() as recorded:
        head.declare_loss_weights(loss_mask)
        for name, mask in (("declared", loss_mask), ("other", other_mask)):
            case = f"{label} labels path, {name} mask"
            per_token = harness.forward(model, batch, labels=targets)
            harness.assert_max_error(per_token, stock[name][0], VALUE_ATOL, case)
            megatron_sft_loss(per_token, mask).backward()
            harness.assert_grads_close(harness.parameter_grads(model), stock[name][1], GRAD_RTOL, case)
            recomputed = any("corrected by a second pass" in message for message in recorded.messages)
            assert recomputed == (name == "other"), f"{case}: recompute warning {recorded.messages}"

    head.declare_loss_weights(loss_mask[:, :-1])
    with pytest.raises(ValueError, match="declared loss weights have shape"):
        harness.forward(model, batch, labels=targets)
    head.declare_loss_weights(None)
    per_token = harness.forward(model, batch, labels=targets)
    megatron_sft_loss(per_token, loss_mask).backward()
    harness.assert_grads_close(harness.parameter_grads(model), stock["declared"][1], GRAD_RTOL, f"{label} cleared")


def transformer_engine_cross_entropy(logits, labels, *_):
    """TransformerEngine's fused cross-entropy as Megatron calls it (``ignore_idx=-100``: such a
    label gets a loss of 0 and no gradient), written with Megatron's own vocabulary-parallel
    cross-entropy: TransformerEngine cannot be installed here."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    ignored = labels == -100
    return torch.where(ignored, 0.0, vocab_parallel_cross_entropy(logits, torch.where(ignored, 0, labels)))


@contextlib.contextmanager
def transformer_engine_loss(model):
    """The model's labels path through TransformerEngine's fused cross-entropy
    (``cross_entropy_loss_fusion`` with ``cross_entropy_fusion_impl='te'``), by the stand-in."""
    from megatron.core.models.common.language_module import language_module

    config = model.config
    saved = config.cross_entropy_loss_fusion, config.cross_entropy_fusion_impl
    config.cross_entropy_loss_fusion, config.cross_entropy_fusion_impl = True, "te"
    try:
        with mock.patch.object(language_module, "te_parallel_cross_entropy", transformer_engine_cross_entropy):
            yield
    finally:
        config.cross_entropy_loss_fusion, config.cross_entropy_fusion_impl = saved


def check_labels_path_against_stock(model, batch, labels, loss_mask, label):
    """The fused labels path, undeclared (four GEMMs) and declared (three), gives the stock model's
    per-token loss and gradients for ``labels``, for Megatron's SFT reduction and for one that
    weights every position; the model is stock when called and stock again after."""
    assert harness.forward(model, batch).shape[-1] == harness.VOCAB_SHARD, f"{label}: the model is not stock"
    reductions = {"loss mask": loss_mask, "every position": torch.ones_like(loss_mask)}
    stock = {}
    for name, reduced in reductions.items():
        per_token = harness.forward(model, batch, labels=labels)
        assert torch.isfinite(per_token).all(), f"{label}: the stock loss of out-of-vocabulary labels"
        megatron_sft_loss(per_token, reduced).backward()
        stock[name] = (per_token.detach(), harness.parameter_grads(model))
    head = wrap_model(model, FusedLMConfig(enabled=True, token_chunk=5))
    for declared in (None, loss_mask):
        head.declare_loss_weights(declared)
        for name, reduced in reductions.items():
            case = f"{label}, declared={declared is not None}, {name}"
            per_token = harness.forward(model, batch, labels=labels)
            harness.assert_max_error(per_token, stock[name][0], VALUE_ATOL, case)
            megatron_sft_loss(per_token, reduced).backward()
            harness.assert_grads_close(harness.parameter_grads(model), stock[name][1], GRAD_RTOL, case)
    unwrap_model(model)


def check_labels_outside_the_vocabulary(model, batch, loss_mask, label):
    """Labels padded HF-style (-100 where the loss mask is 0) and one id past the vocabulary. The
    stock labels path (Megatron's vocabulary-parallel cross-entropy) scores each as if its logit
    were the row's largest (a finite loss, ``lse - max``, with the softmax as its gradient), and so
    must the fused one. Under TransformerEngine's fused cross-entropy a -100 label has a loss of 0
    and no gradient, and so it has fused; an id past the vocabulary, whose result there is not
    established, is an error."""
    unwrap_model(model)
    padded = torch.where(loss_mask.bool(), batch[3], -100)
    past = padded.clone()
    past[0, -1] = harness.VOCAB_SHARD * harness.tp_size() + 3
    check_labels_path_against_stock(model, batch, past, loss_mask, f"{label} labels outside the vocabulary")
    # head.logprobs has no log-prob to give such a position: it says to leave it out with mask=.
    head = wrap_model(model, FusedLMConfig(enabled=True, token_chunk=5))
    with pytest.raises(ValueError, match="outside the vocabulary.*mask="):
        head.logprobs(harness.forward(model, batch), past)
    unwrap_model(model)
    with transformer_engine_loss(model):
        check_labels_path_against_stock(model, batch, padded, loss_mask, f"{label} -100 under TransformerEngine's loss")
        wrap_model(model, FusedLMConfig(enabled=True, token_chunk=5))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            harness.forward(model, batch, labels=past)
        unwrap_model(model)


def loss_worker() -> None:
    for sequence_parallel, tied, label in harness.tensor_parallel_cases():
        model = harness.build_gpt(sequence_parallel=sequence_parallel, tied=tied)
        batch = harness.make_batch()
        positions = torch.arange(harness.SEQ).expand(harness.BATCH, harness.SEQ)
        response = positions >= harness.SEQ // 3
        check_policy_loss(model, batch, response, label)
        loss_mask = (harness.random_weights(harness.BATCH, harness.SEQ, seed=23) > -0.4).float()
        check_labels_path(model, batch, loss_mask, label)
        check_labels_outside_the_vocabulary(model, batch, loss_mask, label)


MAIN_GRAD_UPSTREAM = 0.5  # what the schedule multiplies the loss by (1 / num_microbatches)


def check_main_grad_route(model, batch, response, label):
    ddp = harness.megatron_ddp(model)
    targets = batch[3]
    with torch.no_grad():
        current, _ = harness.oracle_logprob_entropy(harness.forward(model, batch), targets, TEMPERATURE)
    inputs = harness.policy_inputs(current, response)
    grads = {}
    for run, enabled, declared in (
        ("stock", False, None),
        ("declared", True, MAIN_GRAD_UPSTREAM),
        ("other", True, 1.0),
    ):
        ddp.zero_grad_buffer()
        head = wrap_model(ddp, FusedLMConfig(enabled=enabled, token_chunk=5))
        with harness.RecordedWarnings() as recorded:
            result = head.loss(
                harness.forward(ddp, batch), targets, POLICY_LOSS, loss_inputs=inputs, mask=response,
                temperature=TEMPERATURE, main_grad_scale=declared,
            )  # fmt: skip
            (MAIN_GRAD_UPSTREAM * result.loss).backward()
        corrected = any("corrected by a second pass" in message for message in recorded.messages)
        assert corrected == (run == "other"), f"{label} {run}: {recorded.messages}"
        grads[run] = harness.ddp_main_grads(ddp)
        assert all(parameter.grad is None for parameter in model.parameters()), f"{label} {run}"
    for run in ("declared", "other"):
        harness.assert_grads_close(grads[run], grads["stock"], GRAD_RTOL, f"{label} main_grad, {run} scale")
    check_main_grad_labels_path(ddp, model, batch, label)
    check_main_grad_released(ddp, batch, response, inputs, label)


def check_main_grad_released(ddp, batch, response, inputs, label):
    """A main_grad-route loss whose backward never runs (a metric computed with gradients on, a
    skipped micro-batch) is logged at once, naming the model, and ``main_grad_outstanding`` lists
    it until it is forgotten; one still waiting for its backward is listed until the backward runs."""
    targets = batch[3]
    head = wrap_model(ddp, FusedLMConfig(enabled=True, token_chunk=5))
    ddp.zero_grad_buffer()

    def policy_loss():
        return head.loss(
            harness.forward(ddp, batch), targets, POLICY_LOSS, loss_inputs=inputs, mask=response,
            temperature=TEMPERATURE, main_grad_scale=MAIN_GRAD_UPSTREAM,
        ).loss  # fmt: skip

    with harness.RecordedWarnings() as recorded:
        loss = policy_loss()
        (waiting,) = head.main_grad_outstanding()
        assert "waits for its backward" in waiting and head.name in waiting, f"{label}: {waiting}"
        (MAIN_GRAD_UPSTREAM * loss).backward()
        del loss
        assert head.main_grad_outstanding() == [] and not recorded.messages, f"{label}: {recorded.messages}"

        metric = policy_loss()
        del metric
        head.declare_loss_weights(response.float(), main_grad_scale=MAIN_GRAD_UPSTREAM)
        skipped = harness.forward(ddp, batch, labels=targets)
        del skipped
        head.declare_loss_weights(None)
    assert len(recorded.messages) == 2, f"{label}: {recorded.messages}"
    for message in recorded.messages:
        assert "released without its backward" in message and head.name in message, f"{label}: {message}"
    assert len(head.main_grad_outstanding()) == 2, f"{label}: released losses stay listed until forgotten"
    assert len(head.main_grad_outstanding(forget_released=True)) == 2 and head.main_grad_outstanding() == [], label


def check_main_grad_labels_path(ddp, model, batch, label):
    """The labels path with declared loss weights and their scale: Megatron's SFT reduction
    ``sum(losses * loss_mask) / count`` times the micro-batch scale receives ``c * loss_mask``."""
    targets = batch[3]
    loss_mask = (harness.random_weights(harness.BATCH, harness.SEQ, seed=29) > -0.4).float()
    scale = MAIN_GRAD_UPSTREAM / float(loss_mask.sum())
    grads = {}
    cases = (
        ("stock", False, loss_mask, None, False),
        ("declared", True, loss_mask, scale, False),
        ("other scale", True, loss_mask, 1.0, True),
        ("other mask", True, torch.roll(loss_mask, 1, dims=1), scale, True),
    )
    for run, enabled, reduced_mask, declared_scale, corrected in cases:
        ddp.zero_grad_buffer()
        head = wrap_model(ddp, FusedLMConfig(enabled=enabled, token_chunk=5))
        head.declare_loss_weights(loss_mask, main_grad_scale=declared_scale)
        with harness.RecordedWarnings() as recorded:
            per_token = harness.forward(ddp, batch, labels=targets)
            (MAIN_GRAD_UPSTREAM * megatron_sft_loss(per_token, reduced_mask)).backward()
        assert any("second pass" in message for message in recorded.messages) == corrected, f"{label} {run}"
        grads[run] = harness.ddp_main_grads(ddp)
        head.declare_loss_weights(None)
    for run in ("declared", "other scale"):
        harness.assert_grads_close(grads[run], grads["stock"], GRAD_RTOL, f"{label} labels path main_grad, {run}")
    ddp.zero_grad_buffer()
    wrap_model(ddp, FusedLMConfig(enabled=False))
    (MAIN_GRAD_UPSTREAM * megatron_sft_loss(harness.forward(ddp, batch, labels=targets), cases[3][2])).backward()
    harness.assert_grads_close(
        grads["other mask"], harness.ddp_main_grads(ddp), GRAD_RTOL, f"{label} labels path, other mask"
    )


def main_grad_worker() -> None:
    from devkit.distributed import run_cuda_placements_on_cpu

    run_cuda_placements_on_cpu()  # later releases' gradient reduction asks for the current CUDA stream
    for sequence_parallel, tied, label in harness.tensor_parallel_cases():
        model = harness.build_gpt(sequence_parallel=sequence_parallel, tied=tied)
        positions = torch.arange(harness.SEQ).expand(harness.BATCH, harness.SEQ)
        check_main_grad_route(model, harness.make_batch(), positions >= harness.SEQ // 3, label)


def test_main_grad_route_matches_stock_megatron_ddp():
    harness.spawn(main_grad_worker, 2)


def test_head_loss_and_declared_labels_path_match_stock_megatron():
    harness.spawn(loss_worker, 2)


def test_declare_loss_weights_rejects_bad_input():
    head = wrap_model(torch.nn.Module(), FusedLMConfig(enabled=True))
    with pytest.raises(TypeError, match="tensor or None"):
        head.declare_loss_weights([1.0, 0.0])
    with pytest.raises(ValueError, match=r"\[b, s\]"):
        head.declare_loss_weights(torch.ones(4))
