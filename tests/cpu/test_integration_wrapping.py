"""wrap_model on real Megatron-Core GPTModels beyond the plain case (TP=2, gloo): each fallback
reason, model wrappers and virtual-pipeline chunk lists, stages without an output layer, wrapping
twice, multi-token prediction, MuP output scaling (megatron-core >= 0.17), gathered logits, misuse,
forwards without gradients (``no_grad``, ``inference_mode``).

Every result is compared with the stock model itself: a float64 oracle on its gathered logits, or
its own loss and gradients. Tolerances as in test_integration_parity (float32 models; measured
errors about 2e-6).
"""

import copy
import functools
import logging

import torch

from devkit import megatron_gpt as harness
from devkit.oracle import logprob_entropy
from megatron_fused_lm.integration import FusedLMConfig, unwrap_model, wrap_model

TEMPERATURE = 0.7
VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5
FUSED = FusedLMConfig(enabled=True, token_chunk=7)


def _is_stock(chunk):
    patched = ("forward", "compute_language_model_loss", "__deepcopy__")
    attributes = any(name in vars(module) for module in (chunk, chunk.output_layer) for name in patched)
    return not attributes and not chunk._forward_hooks and not chunk._forward_pre_hooks


def _stock_reference(model, batch, with_backward=True):
    return harness.stock_reference(model, batch, TEMPERATURE, with_backward)


def _check_head(model, head, batch, reference, label, with_backward=True):
    harness.check_head(
        model, head, batch, reference, label, temperature=TEMPERATURE, value_atol=VALUE_ATOL, grad_rtol=GRAD_RTOL,
        with_backward=with_backward,
    )  # fmt: skip


def _check_fallback(model, batch, expected_words, warnings, label, with_backward=True):
    """Wrapping falls back: one warning naming the reason (none on a second wrap), the model
    stays stock, and the head gives the oracle's answers from the stock logits."""
    reference = _stock_reference(model, batch, with_backward)
    before = len(warnings.messages)
    head = wrap_model(model, FUSED)
    assert not head.fused and head.fallback_reason, label
    for word in expected_words:
        assert word in head.fallback_reason, f"{label}: {head.fallback_reason!r} does not name {word!r}"
    assert len(warnings.messages) == before + 1 and head.fallback_reason in warnings.messages[-1], label
    chunk = harness_chunk(model)
    assert _is_stock(chunk), f"{label}: a fallback patched the model"
    assert torch.equal(harness.forward(model, batch), reference["logits"]), f"{label}: logits changed"
    _check_head(model, head, batch, reference, label, with_backward)
    head_again = wrap_model(model, FUSED)
    assert head_again.fallback_reason == head.fallback_reason and len(warnings.messages) == before + 1, label


def harness_chunk(model):
    return model.module if isinstance(model, harness.ModuleWrapper) else model


def fallback_cases(warnings) -> None:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    batch = harness.make_batch()

    model = harness.build_gpt(sequence_parallel=True)
    model.output_layer.bias = torch.nn.Parameter(harness.random_weights(harness.VOCAB_SHARD, seed=3))
    _check_fallback(model, batch, ["bias"], warnings, "bias")

    # TransformerEngine's MXFP8 head, recognized by its name; a stand-in that computes like
    # the stock layer, so the comparison is with known logits.
    te_head = type(
        "TELMHeadColumnParallelLinear",
        (ColumnParallelLinear,),
        {"__module__": "megatron.core.extensions.transformer_engine"},
    )
    model = harness.build_gpt(tied=True)
    model.output_layer.__class__ = te_head
    _check_fallback(model, batch, ["TransformerEngine", "TELMHeadColumnParallelLinear"], warnings, "TE head")

    class SoftCappedHead(ColumnParallelLinear):
        def forward(self, input_, weight=None, runtime_gather_output=None):
            logits, bias = super().forward(input_, weight, runtime_gather_output)
            return 8.0 * torch.tanh(logits / 8.0), bias

    model = harness.build_gpt()
    model.output_layer.__class__ = SoftCappedHead
    # Caught by what it computes (a probe through its forward), whatever private methods it overrides.
    _check_fallback(model, batch, ["SoftCappedHead", "does not compute input @ weight.T"], warnings, "custom head")

    # Deferred embedding wgrad needs pipelining and the fused wgrad kernel to be built, and its
    # stock backward leaves the weight gradient to the pipeline flush: switch it on after the
    # build, on the output layer's own copy of the config, and check the forward only.
    model = harness.build_gpt()
    model.output_layer.config = copy.copy(model.config)
    model.output_layer.config.defer_embedding_wgrad_compute = True
    model.output_layer.embedding_activation_buffer = []
    _check_fallback(model, batch, ["defer_embedding_wgrad_compute"], warnings, "deferred wgrad", with_backward=False)
    assert model.output_layer.embedding_activation_buffer, "deferred wgrad: the stock layer did not run"

    class SoftCappedGPT(GPTModel):
        """megatron-core >= 0.17 applies this to the output layer's result; 0.16 never calls it."""

        def _scale_logits(self, logits):
            return 8.0 * torch.tanh(logits / 8.0)

    model = harness.build_gpt(model_class=SoftCappedGPT)
    _check_fallback(model, batch, ["_scale_logits"], warnings, "_scale_logits override")

    # The stock model returns the whole vocabulary's logits on every rank, which the head computes from.
    model = harness.build_gpt(model_class=functools.partial(GPTModel, parallel_output=False))
    head = wrap_model(model, FUSED)
    assert not head.fused and "parallel_output=False" in head.fallback_reason, head.fallback_reason
    assert head.fallback_reason in warnings.messages[-1]
    logits, targets = harness.forward(model, batch), batch[3]
    assert logits.shape[-1] == harness.VOCAB_SHARD * harness.tp_size(), tuple(logits.shape)
    expected = logprob_entropy(logits.detach(), targets, TEMPERATURE)
    actual = head.logprobs(logits, targets, temperature=TEMPERATURE, return_entropy=True)
    for ours, theirs, name in zip(actual, expected, ("logprob", "entropy"), strict=True):
        harness.assert_max_error(ours, theirs, VALUE_ATOL, f"parallel_output=False {name}")


def route_line_cases() -> None:
    """``wrap_model`` logs one INFO line: fused or not and why, the backend that runs, TP."""
    batch = harness.make_batch()
    model = harness.build_gpt()
    for config, words, backend in (
        (FusedLMConfig(enabled=True, backend="auto"), "fused head: backend 'torch' on cpu (asked: 'auto'), TP=2, 1 chunk", "torch"),
        (FusedLMConfig(enabled=True, backend="triton"), "fused head: backend 'torch' on cpu (asked: 'triton')", "torch"),
        (FusedLMConfig(), "stays stock: the config leaves the fused head off", None),
    ):  # fmt: skip
        with harness.RecordedWarnings(logging.INFO) as recorded:
            head = wrap_model(model, config)
        [line] = [message for message in recorded.messages if "wrap_model (the patched output layer)" in message]
        assert words in line and head.name in line, line
        assert ("returns the hidden states [..., 32]" in line) == config.enabled, line
        assert head.backend == backend, f"{config}: head.backend is {head.backend!r}"
        harness.forward(model, batch)
    model.output_layer.bias = torch.nn.Parameter(harness.random_weights(harness.VOCAB_SHARD, seed=3))
    with harness.RecordedWarnings(logging.INFO) as recorded:
        wrap_model(model, FUSED)
    assert any("stays stock: the output layer has a bias" in message for message in recorded.messages), (
        recorded.messages
    )


def wrapping_cases() -> None:
    batch = harness.make_batch()

    # A virtual-pipeline list: a chunk without an output layer and a wrapped one with it.
    first_chunk = harness.build_gpt(post_process=False, seed=5)
    last_chunk = harness.build_gpt(sequence_parallel=True, tied=True)
    wrapped_last = harness.ModuleWrapper(last_chunk)
    reference = _stock_reference(wrapped_last, batch)
    first_stock_state = dict(vars(first_chunk))
    head = wrap_model([first_chunk, wrapped_last], FUSED)
    # The wrapper gets hooks too: what it returns is tied to the forward that made it.
    assert head.fused and not _is_stock(last_chunk) and wrapped_last._forward_hooks, head.fallback_reason
    assert dict(vars(first_chunk)) == first_stock_state, "chunk list: the chunk without output layer was touched"
    _check_head(wrapped_last, head, batch, reference, "chunk list")

    # Wrapping twice replaces the patches instead of stacking them; the old head refuses work.
    second_head = wrap_model(wrapped_last, FUSED)
    hidden = harness.forward(wrapped_last, batch)
    assert hidden.shape[-1] == harness.HIDDEN, "wrap twice: the output layer was patched twice"
    _check_head(wrapped_last, second_head, batch, reference, "wrap twice")
    try:
        head.logprobs(hidden, batch[3])
    except RuntimeError as error:
        assert "unwrapped or wrapped again" in str(error)
    else:
        raise AssertionError("a superseded head still computed log-probs")
    unwrap_model([first_chunk, wrapped_last])
    assert _is_stock(last_chunk) and not wrapped_last._forward_hooks, "unwrap after wrapping twice"
    assert torch.equal(harness.forward(wrapped_last, batch), reference["logits"]), "unwrap after wrapping twice"
    unwrap_model(wrapped_last)  # a no-op on a stock model

    # A pipeline stage without an output layer: nothing to fuse, nothing to compute.
    stage_head = wrap_model(first_chunk, FUSED)
    assert not stage_head.fused and stage_head.fallback_reason is None
    try:
        stage_head.logprobs(torch.zeros(1, 1, harness.VOCAB_SHARD), torch.zeros(1, 1, dtype=torch.long))
    except RuntimeError as error:
        assert "no output layer" in str(error)
    else:
        raise AssertionError("a stage without output layer computed log-probs")

    # The disabled head also takes logits the model gathered over the whole vocabulary.
    disabled = wrap_model(last_chunk, FusedLMConfig())
    gathered = harness.forward(last_chunk, batch, runtime_gather_output=True)
    assert gathered.shape[-1] == harness.VOCAB_SHARD * harness.tp_size()
    logprob = disabled.logprobs(gathered, batch[3], temperature=TEMPERATURE)
    harness.assert_max_error(logprob, reference["logprob"], VALUE_ATOL, "gathered logits")

    # A subclass that computes what the stock layer computes is fused: the layer is judged by a
    # probe through its forward, not by which private methods it has (they differ across releases).
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class LoggingHead(ColumnParallelLinear):
        calls = 0

        def forward(self, input_, weight=None, runtime_gather_output=None):
            LoggingHead.calls += 1
            return super().forward(input_, weight, runtime_gather_output)

    model = harness.build_gpt(sequence_parallel=True)
    model.output_layer.__class__ = LoggingHead
    reference = _stock_reference(model, batch)
    calls_before_wrap = LoggingHead.calls
    head = wrap_model(model, FUSED)
    assert head.fused and LoggingHead.calls == calls_before_wrap + 1, "faithful subclass: not probed once, or not fused"
    _check_head(model, head, batch, reference, "faithful subclass")
    unwrap_model(model)

    # Someone else's instance-level forward comes back on unwrap.
    model = harness.build_gpt()
    traced_forward = model.output_layer.forward
    model.output_layer.forward = traced_forward
    wrap_model(model, FUSED)
    assert vars(model.output_layer)["forward"] is not traced_forward
    unwrap_model(model)
    assert vars(model.output_layer)["forward"] is traced_forward and "compute_language_model_loss" not in vars(model)

    # Misuse gets clear errors.
    head = wrap_model(model, FUSED)
    for bad_call, message in (
        (lambda: head.logprobs(torch.zeros(2, 3, harness.HIDDEN), torch.zeros(2, 3, dtype=torch.long)), "forward"),
        (lambda: head.logprobs(harness.forward(model, batch)[..., :5], batch[3]), "hidden states"),
    ):
        try:
            bad_call()
        except (RuntimeError, ValueError) as error:
            assert message in str(error), str(error)
        else:
            raise AssertionError(f"no error mentioning {message!r}")


def mtp_and_mup_cases(warnings: harness.RecordedWarnings) -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    batch = harness.make_batch()
    for sequence_parallel, tied in ((False, True), (True, False)):
        label = f"MTP sequence_parallel={sequence_parallel} tied={tied}"
        model = harness.build_gpt(sequence_parallel=sequence_parallel, tied=tied, mtp_num_layers=1)
        targets = batch[3]
        stock_loss = harness.forward(model, batch, labels=targets)
        harness.labels_loss(stock_loss).backward()
        stock_grads = harness.parameter_grads(model)
        assert any(name.startswith("mtp.") for name in stock_grads), label
        wrap_model(model, FUSED)
        loss = harness.forward(model, batch, labels=targets)
        harness.assert_max_error(loss, stock_loss, VALUE_ATOL, f"{label} loss")
        harness.labels_loss(loss).backward()
        # The MTP layers learn only through the MTP loss, which the fused head computes too.
        harness.assert_grads_close(harness.parameter_grads(model), stock_grads, GRAD_RTOL, label)
        unwrap_model(model)
    # megatron-core 0.19 logs an MTP acceptance rate from the output layer's result (an argmax),
    # which hidden states make meaningless: the wrap says so there, and only there.
    from megatron.core import package_info  # the code imported (a source checkout has no metadata of its own)

    release = (int(package_info.MAJOR), int(package_info.MINOR))
    warned = any("acceptance-rate metric" in message for message in warnings.messages)
    assert warned == (release >= (0, 19)), (release, warnings.messages)

    if "use_mup" not in TransformerConfig.__dataclass_fields__:
        return  # megatron-core < 0.17 has no MuP output scaling
    for tied in (False, True):
        label = f"MuP tied={tied}"
        model = harness.build_gpt(
            sequence_parallel=True, tied=tied, config_overrides=dict(use_mup=True, mup_output_mult=2.5)
        )
        reference = _stock_reference(model, batch)
        head = wrap_model(model, FUSED)
        assert head.fused, label
        _check_head(model, head, batch, reference, label)
        # Under no_grad the scaling copies the hidden states without a graph: the labels path
        # takes the call it follows, even while another wrapped model's output is alive.
        other = harness.build_gpt(sequence_parallel=True, tied=tied, seed=5)
        other_head = wrap_model(other, FUSED)
        with torch.no_grad():
            alive = harness.forward(other, batch)
            loss = harness.forward(model, batch, labels=batch[3])
        harness.assert_max_error(loss, reference["loss"], VALUE_ATOL, f"{label} labels loss under no_grad")
        assert other_head.fused and alive.shape[-1] == harness.HIDDEN, label
        unwrap_model(model)


def grad_mode_cases() -> None:
    """A forward under ``no_grad`` or ``inference_mode``, then ``head.logprobs`` / ``head.loss`` on
    its output with gradients on (a rollout's old log-probs taken later, say): the fused head gives
    the oracle's values as the stock head does, with no error and no graph when the stock result
    has none; after a forward with gradients both have a graph."""
    from megatron_fused_lm import losses

    batch = harness.make_batch()
    targets = batch[3]
    model = harness.build_gpt(sequence_parallel=True, tied=True)
    loss_fn = losses.ClippedPolicyLoss(entropy_coef=0.01)
    loss_inputs = {
        "old_logprob": torch.full(targets.shape, -5.0),
        "advantages": torch.linspace(-1.0, 1.0, targets.numel()).reshape(targets.shape),
        "weight": torch.full(targets.shape, 1.0 / targets.numel()),
    }
    reference = _stock_reference(model, batch, with_backward=False)
    for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        results = {}
        for config in (FusedLMConfig(), FUSED):
            head = wrap_model(model, config)
            with mode():
                output = harness.forward(model, batch)
            logprob, entropy = head.logprobs(output, targets, temperature=TEMPERATURE, return_entropy=True)
            result = head.loss(output, targets, loss_fn, loss_inputs=loss_inputs, temperature=TEMPERATURE)
            label = f"{mode.__name__}, fused={head.fused}"
            harness.assert_max_error(logprob, reference["logprob"], VALUE_ATOL, f"{label} logprob")
            harness.assert_max_error(entropy, reference["entropy"], VALUE_ATOL, f"{label} entropy")
            results[head.fused] = (logprob.requires_grad, entropy.requires_grad, result.loss.requires_grad)
            if result.loss.requires_grad:
                result.loss.backward()
        assert results[True] == results[False], f"{mode.__name__}: fused {results[True]}, stock {results[False]}"
        assert results[True] == ((True,) * 3 if mode is torch.enable_grad else (False,) * 3), mode.__name__
    unwrap_model(model)


def worker() -> None:
    harness.tensor_parallel(2)
    with harness.RecordedWarnings() as warnings:
        fallback_cases(warnings)
    route_line_cases()
    wrapping_cases()
    with harness.RecordedWarnings() as warnings:
        mtp_and_mup_cases(warnings)
    grad_mode_cases()


def test_fallbacks_wrappers_mtp_mup():
    harness.spawn(worker, 2)
