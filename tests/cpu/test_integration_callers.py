"""Whoever else calls the output layer of a wrapped model gets what the stock model gives it, on real
Megatron-Core GPTModels (TP=2 with sequence parallelism off and on, TP=1; tied and untied):

1. A direct call of ``model.output_layer(x)`` outside the model's forward (an MTP adapter, a
   generation engine's own projection, a trainer's probe): bitwise the stock logits and the stock
   gradients of its input and the weight, with one INFO line naming the calling line however often
   it calls; the head refuses those logits as what they are; the model's own forward goes on
   returning hidden states that the head computes as the float64 oracle does.
   ``model.compute_language_model_loss(labels, logits)`` called directly: bitwise the stock loss.
2. A forward with an inference context (``inference_context=``, and the older ``inference_params=``):
   bitwise the stock logits, as Megatron's generation engines receive them.
3. A forward with a caller's own ``output_processor`` (megatron-core >= 0.18): its ``output_layer``
   returns bitwise the stock logits.
4. A forward that raises leaves nothing behind: the next direct call is stock, the next forward fused.
5. Megatron's ``LinearCrossEntropyModule`` (its dev branch's output layer under
   ``cross_entropy_fusion_impl="linear"``), where the release under test has it: the labels path
   through ``output_cross_entropy_loss=True`` gives the float64 oracle's loss and gradients, its
   ``ignore_index`` labels scoring 0.

Stock results are compared bitwise with the same model before it was wrapped (the stock layer runs);
the fused results with the float64 oracle at test_integration_parity's tolerances (float32 models,
measured errors about 2e-6).
"""

import inspect
import logging

import pytest
import torch

from devkit import megatron_gpt as harness
from megatron_fused_lm.integration import (
    FusedLMConfig,
    accepts_output_processor,
    fused_head_of,
    tie_to_forward,
    unwrap_model,
    wrap_model,
)

TEMPERATURE = 0.7
VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5
FUSED = FusedLMConfig(enabled=True, token_chunk=7)


def layer_input(model, seed: int) -> torch.Tensor:
    """An input of the output layer ``[s/TP if sequence parallel else s, b, h]``, the same on every
    rank but for its sequence part, with gradients."""
    layer, size = model.output_layer, harness.tp_size()
    rows = harness.SEQ // size if layer.sequence_parallel else harness.SEQ
    full = harness.random_weights(harness.SEQ, harness.BATCH, harness.HIDDEN, seed=seed)
    rank = torch.distributed.get_rank() % size if layer.sequence_parallel else 0
    return full[rank * rows : (rank + 1) * rows].clone().requires_grad_()


def direct_call(model, x: torch.Tensor, weight=None):
    """``model.output_layer(x)`` and the gradients of a weighted sum of its logits: ``(logits,
    d x, d output weight)``."""
    logits, bias = model.output_layer(x, weight=weight)
    assert bias is None
    (harness.random_weights(*logits.shape, seed=5) * logits).sum().backward()
    owner = weight if weight is not None else model.output_layer.weight
    grads = x.grad.clone(), owner.grad.clone()
    x.grad, owner.grad = None, None
    return logits.detach(), *grads


def inference_contexts():
    """``(keyword, make)`` for each way this release hands a forward its inference context."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.models.gpt import GPTModel

    parameters = inspect.signature(GPTModel.forward).parameters
    return [(name, lambda: StaticInferenceContext(harness.BATCH, 2 * harness.SEQ)) for name in (
        "inference_context", "inference_params") if name in parameters]  # fmt: skip


def inference_logits(model, batch, keyword, make):
    with torch.no_grad():
        return harness.forward(model, batch, runtime_gather_output=True, **{keyword: make()})


def check_callers(sequence_parallel: bool, tied: bool, label: str) -> None:
    model = harness.build_gpt(sequence_parallel=sequence_parallel, tied=tied)
    batch = harness.make_batch()
    targets = batch[3]
    tied_weight = model.shared_embedding_or_output_weight() if tied else None
    x = layer_input(model, seed=3)
    stock = direct_call(model, x, tied_weight)
    stock_logits = harness.forward(model, batch).detach()
    stock_loss = model.compute_language_model_loss(targets, stock_logits.transpose(0, 1).contiguous()).detach()
    stock_inference = [inference_logits(model, batch, keyword, make) for keyword, make in inference_contexts()]
    reference = harness.stock_reference(model, batch, TEMPERATURE)

    head = wrap_model(model, FUSED)
    assert head.fused, label
    with harness.RecordedWarnings(logging.INFO) as recorded:
        for _ in range(2):  # the line is logged once
            calls = zip(direct_call(model, x, tied_weight), stock, ("logits", "d x", "d weight"), strict=True)
            for ours, theirs, name in calls:
                assert torch.equal(ours, theirs), f"{label}: a direct call's {name} differ from stock's"
    here = [message for message in recorded.messages if f"{__file__}:" in message and "direct_call" in message]
    assert len(here) == 1 and "stock logits" in here[0], f"{label}: {recorded.messages}"
    with pytest.raises(ValueError, match="made from the stock logits"):
        head.logprobs(model.output_layer(x, weight=tied_weight)[0].transpose(0, 1), targets)
    loss = model.compute_language_model_loss(targets, stock_logits.transpose(0, 1).contiguous())
    assert torch.equal(loss, stock_loss), f"{label}: compute_language_model_loss on logits is not stock's"
    # Called directly on the model's own output, its hidden states: the loss the stock model gives on its logits.
    output = harness.forward(model, batch)
    loss = model.compute_language_model_loss(targets, output.transpose(0, 1).contiguous())
    harness.assert_max_error(loss, stock_loss, VALUE_ATOL, f"{label} compute_language_model_loss on hidden states")
    head = check_fused_head_of(model, head, batch, stock_logits, label)
    for (keyword, make), expected in zip(inference_contexts(), stock_inference, strict=True):
        logits = inference_logits(model, batch, keyword, make)
        assert torch.equal(logits, expected), f"{label}: a forward with {keyword}= did not return the stock logits"
        with pytest.raises(ValueError, match="made from the stock logits"):
            head.logprobs(logits, targets[:, -1:])
    # The forward after them is the fused one.
    harness.check_head(
        model, head, batch, reference, f"{label} after the stock calls", temperature=TEMPERATURE,
        value_atol=VALUE_ATOL, grad_rtol=GRAD_RTOL,
    )  # fmt: skip
    with pytest.raises(ValueError, match="labels"):
        harness.forward(model, batch, labels=targets[:, :-1])  # raises inside the forward
    assert torch.equal(direct_call(model, x, tied_weight)[0], stock[0]), f"{label}: stock after a failed forward"
    assert harness.forward(model, batch).shape[-1] == harness.HIDDEN, f"{label}: fused after a failed forward"
    if accepts_output_processor(model):
        check_foreign_processor(model, batch, stock_logits, label)
    unwrap_model(model)


def check_fused_head_of(model, head, batch, stock_logits: torch.Tensor, label: str):
    """``fused_head_of`` tells the model's hidden states (with a graph, without one, a view, a copy tied
    with ``tie_to_forward``) from anything else (the stock logits, a loss, a tensor of the hidden size
    whose graph leads to no fused forward), and refuses a copy that nothing links to a forward;
    unwrapped, the model's outputs are nobody's. Returns the head of the model wrapped again."""
    output = harness.forward(model, batch)
    assert fused_head_of(output) is head and fused_head_of(output[:, 1:].float()) is head, label
    with torch.no_grad():
        untraced = harness.forward(model, batch)
        copy = untraced.clone()
    assert fused_head_of(untraced) is head and fused_head_of(untraced.transpose(0, 1)) is head, label
    assert fused_head_of(tie_to_forward(untraced.clone(), untraced)) is head, label
    del untraced
    with pytest.raises(RuntimeError, match="nothing tells whether it holds its hidden states"):
        fused_head_of(copy)
    with head.stock_logits():
        logits = harness.forward(model, batch)
    loss = harness.forward(model, batch, labels=batch[3])
    assert fused_head_of(logits) is None and fused_head_of(loss) is None and fused_head_of(stock_logits) is None, label
    unrelated = torch.ones(harness.BATCH, harness.SEQ, harness.HIDDEN, requires_grad=True) * 2  # hidden-sized
    assert fused_head_of(unrelated) is None, label
    unwrap_model(model)
    assert fused_head_of(copy) is None, f"{label}: an unwrapped model's tensors are nobody's"
    return wrap_model(model, FUSED)


def check_foreign_processor(model, batch, stock_logits: torch.Tensor, label: str) -> None:
    """A processor of the caller's own (not the package's) sees the stock output layer."""

    def logits_processor(*, hidden_states, output_layer, output_weight, runtime_gather_output, **_):
        logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
        return logits.transpose(0, 1)

    logits = harness.forward(model, batch, output_processor=logits_processor)
    assert torch.equal(logits.detach(), stock_logits), f"{label}: a caller's output_processor got no stock logits"


def linear_cross_entropy_module():
    """Megatron's ``LinearCrossEntropyModule`` where this release has it, else ``None``."""
    try:
        from megatron.core.transformer.linear_cross_entropy import LinearCrossEntropyModule
    except ImportError:
        return None
    return LinearCrossEntropyModule


def check_linear_cross_entropy(sequence_parallel: bool, tied: bool, label: str) -> None:
    """A model whose output layer fuses the cross-entropy (``cross_entropy_fusion_impl="linear"``):
    its labels path, which calls the layer with ``output_cross_entropy_loss=True``, against the
    float64 oracle of its own logits, with ``-100`` labels scoring 0."""
    fusion = {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "linear"}
    model = harness.build_gpt(sequence_parallel=sequence_parallel, tied=tied, config_overrides=fusion)
    assert isinstance(model.output_layer, linear_cross_entropy_module()), label
    batch = harness.make_batch()
    labels = batch[3].clone()
    labels[0, :3] = -100
    logits = harness.forward(model, batch)
    logprob, _ = harness.oracle_logprob_entropy(logits, labels.clamp(min=0), 1.0)
    expected = torch.where(labels >= 0, -logprob, 0.0)
    harness.labels_loss(expected).backward()
    reference = harness.parameter_grads(model)
    wrap_model(model, FUSED)
    loss = harness.forward(model, batch, labels=labels)
    harness.assert_max_error(loss, expected, VALUE_ATOL, f"{label} linear cross-entropy loss")
    harness.labels_loss(loss).backward()
    harness.assert_grads_close(harness.parameter_grads(model), reference, GRAD_RTOL, f"{label} linear cross-entropy")
    unwrap_model(model)


def callers_worker() -> None:
    for case in harness.tensor_parallel_cases():
        check_callers(*case)


def linear_cross_entropy_worker() -> None:
    for case in harness.tensor_parallel_cases():
        check_linear_cross_entropy(*case)


def test_every_caller_of_the_output_layer_gets_what_the_stock_model_gives():
    harness.spawn(callers_worker, 2)


@pytest.mark.skipif(linear_cross_entropy_module() is None, reason="this megatron-core has no LinearCrossEntropyModule")
def test_linear_cross_entropy_module_labels_path():
    harness.spawn(linear_cross_entropy_worker, 2)
