"""The fused head through Megatron-Core's ``output_processor`` hook (megatron-core >= 0.18), against
the stock GPTModel: TP=1 and TP=2, sequence parallel on and off, tied and untied embeddings. On
releases whose forward has no hook, the processor refuses the model with a clear error.

For each case, on one float32 model, nothing patched:
1. ``LogprobRequest`` (entropy, a response mask, a temperature per position): log-probs and entropy equal the
   float64 oracle on the stock model's gathered logits, and every parameter's gradient of a random
   weighted sum of both equals the stock one; a disabled config gives the same from the logits.
2. ``LossRequest`` with a clipped policy loss: the loss equals the float64 oracle's, the gradients
   the stock ones. ``TopkRequest``: the top log-probs and ids of the float64 oracle, fused and
   disabled.
3. The labels path: the per-token loss equals the stock model's; with ``declare_loss_mask`` and
   Megatron's SFT reduction, the stock gradients without the recompute's warning; labels outside
   the vocabulary (HF-style -100 padding) as the stock model scores them.
4. A forward without the processor returns the stock logits bitwise.
5. Inside Megatron's DistributedDataParallel (float32 ``main_grad``), one processor over two steps
   whose reductions differ (another micro-batch count): the labels path with each step's scale in
   its ``LabelsRequest``, and a ``LossRequest`` with each step's ``main_grad_scale``, leave every
   parameter's ``main_grad`` equal to the stock model's for that step, without the correcting
   second pass; a scale that is not the step's is corrected by it, with its warning.
Then multi-token prediction on the labels path and MuP output scaling on the log-probs (TP=2), and
bad input.

Tolerances as in test_integration_parity (float32 on both sides, measured errors about 2e-6): 2e-5
absolute on values and 5e-5 of the largest entry of each stock gradient.
"""

import itertools
import re

import pytest
import torch

from devkit import megatron_gpt as harness
from megatron_fused_lm import (
    FusedLMConfig,
    FusedOutputProcessor,
    LabelsRequest,
    LogprobRequest,
    LossRequest,
    TopkRequest,
    accepts_output_processor,
    losses,
)

VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5
# Each position its own temperature (0.5 to 2): every request carries a [b, s] tensor.
TEMPERATURE = torch.rand(harness.BATCH, harness.SEQ, generator=torch.Generator().manual_seed(4)) * 1.5 + 0.5
POLICY_LOSS = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01, kl_coef=0.05)


def processed(model, batch, processor, context=None, **kwargs):
    return harness.forward(model, batch, output_processor=processor, output_processor_context=context, **kwargs)


def check_logprobs(model, batch, response, label):
    targets = batch[3]
    logprob, entropy = harness.oracle_logprob_entropy(harness.forward(model, batch), targets, TEMPERATURE)
    harness.head_loss(logprob * response, entropy * response).backward()
    stock_grads = harness.parameter_grads(model)
    request = LogprobRequest(targets, temperature=TEMPERATURE, return_entropy=True, mask=response)
    for enabled in (True, False):
        case = f"{label} {'fused' if enabled else 'disabled'} LogprobRequest"
        processor = FusedOutputProcessor(model, FusedLMConfig(enabled=enabled, token_chunk=5))
        assert processor.fused == enabled and processor.fallback_reason is None, case
        got_logprob, got_entropy = processed(model, batch, processor, request)
        assert got_logprob.shape == targets.shape and got_logprob.dtype == torch.float32, case
        harness.assert_max_error(got_logprob, (logprob * response).detach(), VALUE_ATOL, case)
        harness.assert_max_error(got_entropy, (entropy * response).detach(), VALUE_ATOL, case)
        harness.head_loss(got_logprob, got_entropy).backward()
        harness.assert_grads_close(harness.parameter_grads(model), stock_grads, GRAD_RTOL, case)


def check_topk(model, batch, label):
    stock_logits = harness.forward(model, batch).detach()
    for enabled in (True, False):
        case = f"{label} {'fused' if enabled else 'disabled'} TopkRequest"
        processor = FusedOutputProcessor(model, FusedLMConfig(enabled=enabled, token_chunk=5))
        logprobs, ids = processed(model, batch, processor, TopkRequest(5, temperature=TEMPERATURE))
        harness.assert_topk_matches(logprobs, ids, stock_logits, 5, TEMPERATURE, VALUE_ATOL, case)
        # A 0-dim tensor: one temperature for every position, not swapped with the [b, s] ones.
        logprobs, ids = processed(model, batch, processor, TopkRequest(5, temperature=torch.tensor(0.8)))
        harness.assert_topk_matches(logprobs, ids, stock_logits, 5, 0.8, VALUE_ATOL, f"{case} 0-dim temperature")


def check_loss(model, batch, response, label):
    targets = batch[3]
    with torch.no_grad():
        current, _ = harness.oracle_logprob_entropy(harness.forward(model, batch), targets, TEMPERATURE)
    inputs = harness.policy_inputs(current, response)
    logprob, entropy = harness.oracle_logprob_entropy(harness.forward(model, batch), targets, TEMPERATURE)
    want = POLICY_LOSS(logprob, entropy, **{name: value.double() for name, value in inputs.items()})[response].sum()
    want.backward()
    stock_grads = harness.parameter_grads(model)
    processor = FusedOutputProcessor(model, FusedLMConfig(enabled=True, token_chunk=5))
    request = LossRequest(targets, POLICY_LOSS, loss_inputs=inputs, mask=response, temperature=TEMPERATURE)
    result = processed(model, batch, processor, request)
    case = f"{label} LossRequest"
    assert abs(result.loss.item() - want.item()) <= VALUE_ATOL, f"{case}: {result.loss.item()} vs {want.item()}"
    assert result.logprob.shape == targets.shape and torch.count_nonzero(result.logprob[~response]) == 0, case
    result.loss.backward()
    harness.assert_grads_close(harness.parameter_grads(model), stock_grads, GRAD_RTOL, case)


def check_labels_path(model, batch, loss_mask, label):
    """Megatron's SFT reduction over the forward's ``loss_mask`` (the declared three-GEMM path
    takes it without a recompute) and over another mask (the declared path recomputes, warning),
    for the batch's labels and for labels padded HF-style (-100 where the loss mask is 0, and one
    id past the vocabulary), which the stock loss scores as if their logit were the row's largest."""
    padded = torch.where(loss_mask.bool(), batch[3], -100)
    padded[0, -1] = harness.VOCAB_SHARD * harness.tp_size() + 3
    for labels, name in ((batch[3], "labels"), (padded, "padded labels")):
        check_labels(model, batch, labels, loss_mask, f"{label} {name}")


def check_labels(model, batch, targets, loss_mask, label):
    other_mask = torch.roll(loss_mask, 1, dims=1)
    stock_loss = harness.forward(model, batch, labels=targets, loss_mask=loss_mask).detach()
    stock_grads = {}
    for name, mask in (("loss_mask", loss_mask), ("other", other_mask)):
        per_token = harness.forward(model, batch, labels=targets, loss_mask=loss_mask)
        ((per_token * mask).sum() / mask.sum()).backward()
        stock_grads[name] = harness.parameter_grads(model)
    for declare, (name, mask) in itertools.product((False, True), (("loss_mask", loss_mask), ("other", other_mask))):
        case = f"{label} labels path, declare_loss_mask={declare}, reduced over {name}"
        with harness.RecordedWarnings() as recorded:
            processor = FusedOutputProcessor(model, FusedLMConfig(enabled=True), declare_loss_mask=declare)
            per_token = processed(model, batch, processor, labels=targets, loss_mask=loss_mask)
            harness.assert_max_error(per_token, stock_loss, VALUE_ATOL, case)
            ((per_token * mask).sum() / mask.sum()).backward()
        harness.assert_grads_close(harness.parameter_grads(model), stock_grads[name], GRAD_RTOL, case)
        recomputed = any("second pass" in message for message in recorded.messages)
        assert recomputed == (declare and name == "other"), f"{case}: {recorded.messages}"


# What the schedule multiplies the loss by at two steps (1 / num_microbatches of each).
STEP_UPSTREAMS = (0.5, 0.25)


def check_main_grad_per_call(model, batch, response, label):
    """Point 5: the scale each call declares, not one fixed when the processor was made."""
    targets = batch[3]
    loss_mask = (harness.random_weights(harness.BATCH, harness.SEQ, seed=29) > -0.4).float()
    with torch.no_grad():
        current, _ = harness.oracle_logprob_entropy(harness.forward(model, batch), targets, TEMPERATURE)
    inputs = harness.policy_inputs(current, response)
    ddp = harness.megatron_ddp(model)
    processor = FusedOutputProcessor(ddp, FusedLMConfig(enabled=True, token_chunk=5), declare_loss_mask=True)

    def sft_step(upstream, declared_scale):
        per_token = processed(ddp, batch, processor, LabelsRequest(main_grad_scale=declared_scale), labels=targets,
                              loss_mask=loss_mask)  # fmt: skip
        # Megatron's SFT reduction, times the schedule's factor: c * sum(losses * loss_mask).
        (upstream * (per_token * loss_mask).sum() / loss_mask.sum()).backward()

    def stock_sft_step(upstream, _):
        per_token = harness.forward(ddp, batch, labels=targets, loss_mask=loss_mask)
        (upstream * (per_token * loss_mask).sum() / loss_mask.sum()).backward()

    def policy_step(upstream, declared_scale):
        request = LossRequest(targets, POLICY_LOSS, loss_inputs=inputs, mask=response, temperature=TEMPERATURE,
                              main_grad_scale=declared_scale)  # fmt: skip
        (upstream * processed(ddp, batch, processor, request).loss).backward()

    def stock_policy_step(upstream, _):
        logprob, entropy = harness.oracle_logprob_entropy(harness.forward(ddp, batch), targets, TEMPERATURE)
        per_token = POLICY_LOSS(logprob, entropy, **{name: value.double() for name, value in inputs.items()})
        (upstream * per_token[response].sum()).backward()

    for name, step, stock_step, per_upstream in (
        ("labels path", sft_step, stock_sft_step, 1 / float(loss_mask.sum())),
        ("LossRequest", policy_step, stock_policy_step, 1.0),
    ):
        for upstream, declared in [(u, u) for u in STEP_UPSTREAMS] + [(STEP_UPSTREAMS[0], STEP_UPSTREAMS[1])]:
            case = f"{label} {name}, step upstream {upstream}, declared {declared}"
            ddp.zero_grad_buffer()
            stock_step(upstream, None)
            stock = harness.ddp_main_grads(ddp)
            ddp.zero_grad_buffer()
            with harness.RecordedWarnings() as recorded:
                step(upstream, declared * per_upstream)
            corrected = any("second pass" in message for message in recorded.messages)
            assert corrected == (declared != upstream), f"{case}: {recorded.messages}"
            assert all(parameter.grad is None for parameter in model.parameters()), case
            harness.assert_grads_close(harness.ddp_main_grads(ddp), stock, GRAD_RTOL, case)
            assert processor.main_grad_outstanding() == [], case
    # The scale belongs to the declared loss mask: without it, said rather than ignored.
    undeclared = FusedOutputProcessor(ddp, FusedLMConfig(enabled=True))
    for target, mask in ((undeclared, loss_mask), (processor, None)):
        with pytest.raises(ValueError, match="declare_loss_mask=True and pass loss_mask="):
            processed(ddp, batch, target, LabelsRequest(main_grad_scale=1.0), labels=targets, loss_mask=mask)


def check_bad_input() -> None:
    model = harness.build_gpt(sequence_parallel=False, tied=False)
    batch = harness.make_batch()
    processor = FusedOutputProcessor(model, FusedLMConfig(enabled=True))
    with pytest.raises(ValueError, match="needs labels= or an output_processor_context"):
        processed(model, batch, processor)
    several = torch.stack([batch[3], batch[3]], -1)
    with pytest.raises(ValueError, match=re.escape(f"labels {tuple(several.shape)} must be [b, s]")):
        processed(model, batch, processor, labels=several)
    with pytest.raises(TypeError, match="a LossRequest, a TopkRequest or a LabelsRequest"):
        processed(model, batch, processor, {"targets": batch[3]})
    other = harness.build_gpt(sequence_parallel=False, tied=False)
    with pytest.raises(RuntimeError, match="made for another model"):
        processed(other, batch, processor, LogprobRequest(batch[3]))
    with pytest.raises(TypeError, match="FusedLMConfig"):
        FusedOutputProcessor(model, {"enabled": True})
    # A main_grad route asked of a model outside Megatron's DDP: said, not ignored.
    request = LossRequest(batch[3], losses.cross_entropy, main_grad_scale=1.0)
    with pytest.raises(ValueError, match="has none: wrap the model in megatron.core's DistributedDataParallel"):
        processed(model, batch, processor, request)


def check_mtp_and_mup() -> None:
    """Multi-token prediction (Megatron computes its losses before the processor runs) on the
    labels path, and MuP output scaling (megatron-core >= 0.17) on the log-probs."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    batch = harness.make_batch()
    targets = batch[3]
    loss_mask = torch.ones(targets.shape)
    for sequence_parallel, tied in ((False, True), (True, False)):
        label = f"MTP sequence_parallel={sequence_parallel} tied={tied}"
        model = harness.build_gpt(sequence_parallel=sequence_parallel, tied=tied, mtp_num_layers=1)
        stock_loss = harness.forward(model, batch, labels=targets, loss_mask=loss_mask)
        harness.labels_loss(stock_loss).backward()
        stock_grads = harness.parameter_grads(model)
        assert any(name.startswith("mtp.") for name in stock_grads), label
        processor = FusedOutputProcessor(model, FusedLMConfig(enabled=True))
        loss = processed(model, batch, processor, labels=targets, loss_mask=loss_mask)
        harness.assert_max_error(loss, stock_loss.detach(), VALUE_ATOL, label)
        harness.labels_loss(loss).backward()
        harness.assert_grads_close(harness.parameter_grads(model), stock_grads, GRAD_RTOL, label)
    assert "use_mup" in TransformerConfig.__dataclass_fields__  # every release with the hook has MuP
    response = torch.ones(targets.shape, dtype=torch.bool)
    for tied in (False, True):
        overrides = dict(use_mup=True, mup_output_mult=2.5)
        model = harness.build_gpt(sequence_parallel=True, tied=tied, config_overrides=overrides)
        check_logprobs(model, batch, response, f"MuP tied={tied}")


def processor_worker() -> None:
    from devkit.distributed import run_cuda_placements_on_cpu

    run_cuda_placements_on_cpu()  # later releases' gradient reduction asks for the current CUDA stream
    harness.tensor_parallel(2)
    if not accepts_output_processor(harness.build_gpt(sequence_parallel=False, tied=False)):
        # Releases before 0.18: the forward has no hook, and the processor says so at once.
        with pytest.raises(RuntimeError, match="takes no output_processor"):
            FusedOutputProcessor(harness.build_gpt(sequence_parallel=False, tied=False), FusedLMConfig(enabled=True))
        return
    for sequence_parallel, tied, label in harness.tensor_parallel_cases():
        model = harness.build_gpt(sequence_parallel=sequence_parallel, tied=tied)
        batch = harness.make_batch()
        stock_logits = harness.forward(model, batch).detach()
        response = torch.arange(harness.SEQ).expand(harness.BATCH, harness.SEQ) >= harness.SEQ // 3
        check_logprobs(model, batch, response, label)
        check_loss(model, batch, response, label)
        check_topk(model, batch, label)
        loss_mask = (harness.random_weights(harness.BATCH, harness.SEQ, seed=23) > -0.4).float()
        check_labels_path(model, batch, loss_mask, label)
        assert torch.equal(harness.forward(model, batch), stock_logits), f"{label}: the model is no longer stock"
        check_main_grad_per_call(model, batch, response, label)
    harness.tensor_parallel(2)
    check_mtp_and_mup()
    harness.tensor_parallel(1)
    check_bad_input()


def test_output_processor_matches_stock_megatron_or_is_refused_clearly():
    harness.spawn(processor_worker, 2)
