"""Copies of wrapped models and logits on demand, on real Megatron-Core GPTModels (TP=2, gloo,
sequence parallel on and off, tied and untied embeddings).

1. ``copy.deepcopy`` of a wrapped model (a trainer's reference policy or EMA copy) is a stock
   model: bitwise the stock logits and loss, the stock gradients, no patch attribute. Wrapping the
   copy fuses it with its own head (oracle log-probs and stock gradients, for a copy whose weights
   then differ from the original's, interleaved with the original's fused steps), unwrapping it
   restores the stock model, and a copy of the wrapped copy is stock again.
2. ``head.stock_logits()``: inside the context the wrapped model returns bitwise the stock logits
   (the stock layer runs) and loss, with the stock gradients; it nests, ends on an exception,
   holds for the entering thread only, refuses a superseded head, and the fused path works again
   after it.

Every result is compared with the stock model itself: its logits and loss bitwise, and a float64
oracle on its gathered logits with the tolerances of test_integration_parity (float32 models;
measured errors about 2e-6).
"""

import copy
import itertools
import threading

import torch
import torch.distributed as dist

from devkit import megatron_gpt as harness
from megatron_fused_lm.integration import FusedLMConfig, unwrap_model, wrap_model
from megatron_fused_lm.integration.head import PATCH_ATTRIBUTE

TEMPERATURE = 0.7
VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5
FUSED = FusedLMConfig(enabled=True, token_chunk=7)
PATCHED_NAMES = ("forward", "compute_language_model_loss", "__deepcopy__", PATCH_ATTRIBUTE)


def deep_copy(model):
    """``copy.deepcopy(model)`` sharing the process groups: megatron-core >= 0.16 modules hold
    them (``tp_group``, ``pg_collection``) and torch cannot copy them, so a trainer copying such a
    model passes them in the memo as well."""
    memo = {}
    for module in model.modules():
        for value in vars(module).values():
            for candidate in (value, *getattr(value, "__dict__", {}).values()):
                if isinstance(candidate, dist.ProcessGroup):
                    memo[id(candidate)] = candidate
    return copy.deepcopy(model, memo)


def assert_stock_modules(model, label):
    """No patch attribute on the model or its output layer, and no hook on the model."""
    for module in (model, model.output_layer):
        left = [name for name in PATCHED_NAMES if name in vars(module)]
        assert not left, f"{label}: {type(module).__name__} keeps {left}"
    assert not model._forward_hooks and not model._forward_pre_hooks, f"{label}: the model keeps hooks"


def stock_reference(model, batch):
    """The stock model's logits and loss, oracle log-probs/entropy from the logits, and the
    gradients of both losses."""
    targets = batch[3]
    logits = harness.forward(model, batch)
    logprob, entropy = harness.oracle_logprob_entropy(logits, targets, TEMPERATURE)
    harness.head_loss(logprob, entropy).backward()
    reference = dict(logits=logits.detach(), logprob=logprob.detach(), entropy=entropy.detach())
    reference["grads"] = harness.parameter_grads(model)
    loss = harness.forward(model, batch, labels=targets)
    harness.labels_loss(loss).backward()
    reference["loss"], reference["loss_grads"] = loss.detach(), harness.parameter_grads(model)
    return reference


def check_stock(model, batch, reference, label):
    """The model computes as the stock one: bitwise logits and loss, the oracle's gradients."""
    targets = batch[3]
    logits = harness.forward(model, batch)
    assert torch.equal(logits, reference["logits"]), f"{label}: not the stock logits"
    logprob, entropy = harness.oracle_logprob_entropy(logits, targets, TEMPERATURE)
    harness.head_loss(logprob, entropy).backward()
    harness.assert_grads_close(harness.parameter_grads(model), reference["grads"], GRAD_RTOL, f"{label} grads")
    loss = harness.forward(model, batch, labels=targets)
    assert torch.equal(loss, reference["loss"]), f"{label}: not the stock loss"
    harness.labels_loss(loss).backward()
    harness.assert_grads_close(harness.parameter_grads(model), reference["loss_grads"], GRAD_RTOL, f"{label} loss")


def fused_logprobs(model, head, batch, reference, label):
    """The fused head's log-probs and entropy for the model's output, checked against the oracle;
    the graph is left for the caller's backward."""
    output = harness.forward(model, batch)
    assert output.shape[-1] == harness.HIDDEN, f"{label}: the model did not return hidden states"
    logprob, entropy = head.logprobs(output, batch[3], temperature=TEMPERATURE, return_entropy=True)
    harness.assert_max_error(logprob, reference["logprob"], VALUE_ATOL, f"{label} logprob")
    harness.assert_max_error(entropy, reference["entropy"], VALUE_ATOL, f"{label} entropy")
    return logprob, entropy


def check_fused(model, head, batch, reference, label):
    """The fused head gives the oracle's log-probs and the stock gradients; the labels path the
    stock loss and its gradients."""
    assert head.fused and head.fallback_reason is None, f"{label}: {head.fallback_reason}"
    harness.head_loss(*fused_logprobs(model, head, batch, reference, label)).backward()
    harness.assert_grads_close(harness.parameter_grads(model), reference["grads"], GRAD_RTOL, f"{label} grads")
    loss = harness.forward(model, batch, labels=batch[3])
    harness.assert_max_error(loss, reference["loss"], VALUE_ATOL, f"{label} loss")
    harness.labels_loss(loss).backward()
    harness.assert_grads_close(harness.parameter_grads(model), reference["loss_grads"], GRAD_RTOL, f"{label} loss")


def copy_case(sequence_parallel: bool, tied: bool, label: str) -> None:
    batch = harness.make_batch()
    model = harness.build_gpt(sequence_parallel=sequence_parallel, tied=tied)
    reference = stock_reference(model, batch)
    head = wrap_model(model, FUSED)
    fused_logprobs(model, head, batch, reference, label)  # the head holds a call when the copy is made

    clone = deep_copy(model)
    assert_stock_modules(clone, f"{label} copy")
    check_stock(clone, batch, reference, f"{label} copy")
    original_parameters = {id(parameter) for parameter in model.parameters()}
    assert not original_parameters & {id(parameter) for parameter in clone.parameters()}, f"{label}: shared weights"

    # The copy becomes a model of its own (a reference policy after the policy has trained).
    with torch.no_grad():
        clone.shared_embedding_or_output_weight().mul_(1.25)
    clone_reference = stock_reference(clone, batch)
    assert not torch.equal(clone_reference["logits"], reference["logits"]), label
    clone_head = wrap_model(clone, FUSED)
    assert clone_head is not head, label
    # Interleaved steps: each head computes from its own model's forward.
    original_terms = fused_logprobs(model, head, batch, reference, f"{label} original")
    clone_terms = fused_logprobs(clone, clone_head, batch, clone_reference, f"{label} wrapped copy")
    harness.head_loss(*original_terms).backward()
    harness.head_loss(*clone_terms).backward()
    harness.assert_grads_close(harness.parameter_grads(model), reference["grads"], GRAD_RTOL, f"{label} original")
    harness.assert_grads_close(
        harness.parameter_grads(clone), clone_reference["grads"], GRAD_RTOL, f"{label} wrapped copy"
    )
    check_fused(clone, clone_head, batch, clone_reference, f"{label} wrapped copy")

    # A copy of the wrapped copy is stock; unwrapping the copy leaves the original wrapped.
    second = deep_copy(clone)
    assert_stock_modules(second, f"{label} copy of the copy")
    check_stock(second, batch, clone_reference, f"{label} copy of the copy")
    unwrap_model(clone)
    assert_stock_modules(clone, f"{label} unwrapped copy")
    check_stock(clone, batch, clone_reference, f"{label} unwrapped copy")
    check_fused(model, head, batch, reference, f"{label} original after the copies")
    check_fused(clone, wrap_model(clone, FUSED), batch, clone_reference, f"{label} copy wrapped again")
    unwrap_model(model)
    check_stock(model, batch, reference, f"{label} original unwrapped")


def copy_wrapper_cases() -> None:
    """A copy of a wrapped model inside a DDP-like wrapper, and of one whose output layer had an
    instance-level forward of its own before wrapping: that forward comes with the copy, bound to
    the copy's layer."""
    batch = harness.make_batch()
    model = harness.build_gpt(sequence_parallel=True)
    model.output_layer.forward = model.output_layer.forward
    wrapped = harness.ModuleWrapper(model)
    reference = stock_reference(wrapped, batch)
    head = wrap_model(wrapped, FUSED)
    clone = deep_copy(wrapped)
    traced = vars(clone.module.output_layer)["forward"]
    assert traced.__self__ is clone.module.output_layer and traced.__func__ is type(model.output_layer).forward
    assert "compute_language_model_loss" not in vars(clone.module), "wrapper: the copy keeps the loss patch"
    assert not clone._forward_hooks and not clone.module._forward_hooks, "wrapper: the copy keeps the hooks"
    check_stock(clone, batch, reference, "wrapper copy")
    check_fused(clone, wrap_model(clone, FUSED), batch, reference, "wrapper copy wrapped")
    check_fused(wrapped, head, batch, reference, "wrapper original")


def stock_logits_case(sequence_parallel: bool, tied: bool, label: str) -> None:
    batch = harness.make_batch()
    model = harness.build_gpt(sequence_parallel=sequence_parallel, tied=tied)
    reference = stock_reference(model, batch)
    gathered = harness.forward(model, batch, runtime_gather_output=True).detach()
    head = wrap_model(model, FUSED)
    hidden = harness.forward(model, batch)  # a fused forward before the context: still usable after

    with head.stock_logits():
        check_stock(model, batch, reference, f"{label} in the context")
        assert torch.equal(harness.forward(model, batch, runtime_gather_output=True), gathered), label
        with head.stock_logits():
            assert torch.equal(harness.forward(model, batch), reference["logits"]), f"{label} nested"
        assert torch.equal(harness.forward(model, batch), reference["logits"]), f"{label} after the nested exit"
        # Another thread is not in the context: it gets the fused path.
        outputs = []
        thread = threading.Thread(target=lambda: outputs.append(harness.forward(model, batch)))
        thread.start()
        thread.join()
        assert outputs and outputs[0].shape[-1] == harness.HIDDEN, f"{label}: the context leaked to another thread"
    logprob = head.logprobs(hidden, batch[3], temperature=TEMPERATURE)
    harness.assert_max_error(logprob, reference["logprob"], VALUE_ATOL, f"{label} earlier hidden")
    check_fused(model, head, batch, reference, f"{label} after the context")

    try:
        with head.stock_logits():
            raise KeyError("inside")
    except KeyError:
        pass
    check_fused(model, head, batch, reference, f"{label} after an exception")

    # A stock head's context changes nothing; a superseded head refuses it.
    disabled = wrap_model(model, FusedLMConfig())
    with disabled.stock_logits():
        assert torch.equal(harness.forward(model, batch), reference["logits"]), f"{label} disabled"
    try:
        with head.stock_logits():
            raise AssertionError(f"{label}: a superseded head entered the context")
    except RuntimeError as error:
        assert "unwrapped or wrapped again" in str(error), str(error)


def worker() -> None:
    harness.tensor_parallel(2)
    for sequence_parallel, tied in itertools.product((False, True), (False, True)):
        label = f"sequence_parallel={sequence_parallel} tied={tied}"
        copy_case(sequence_parallel, tied, label)
        stock_logits_case(sequence_parallel, tied, label)
    copy_wrapper_cases()


def test_copies_and_stock_logits():
    harness.spawn(worker, 2)
