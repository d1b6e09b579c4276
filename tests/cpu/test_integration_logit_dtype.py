"""``GPTModel(logit_dtype=torch.float32)`` (megatron-core main): a bf16 model whose output layer writes
its product in float32, as RL trainers ask to narrow the trainer/rollout gap, on real GPTModels
(TP=2 with sequence parallelism off and on, TP=1; tied and untied).

1. Stock calls of the wrapped model's output layer (a direct call) return the stock float32 logits,
   bitwise: the setting is honoured where the stock layer runs.
2. The fused head computes what that setting asks, logits never rounded to bf16: its log-probs,
   entropy and labels-path loss match the float64 oracle of the stock float32 logits far more
   closely than the bf16-logit model (``logit_dtype=None``) does, and its gradients match stock's
   (the gradient of the logits in bf16 on both, as Megatron's backward casts it).

On CPU without TransformerEngine, Megatron's mixed-dtype product (``te_general_gemm``) is stood in
for by a float32 product of the bf16 operands: exact products, float32 sums, as the GPU's GEMM.
Skipped on releases whose GPTModel has no ``logit_dtype``.
"""

import functools
import inspect
from unittest import mock

import pytest
import torch

from devkit import megatron_gpt as harness
from megatron_fused_lm.integration import FusedLMConfig, unwrap_model, wrap_model

TEMPERATURE = 0.7
FUSED = FusedLMConfig(enabled=True, token_chunk=7)


def has_logit_dtype() -> bool:
    from megatron.core.models.gpt import GPTModel

    return "logit_dtype" in inspect.signature(GPTModel.__init__).parameters


def float32_product(weight, inputs, *, out_dtype, layout, bias=None):
    """``te_general_gemm(weight, inputs, out_dtype=, layout="TN")`` of bf16 operands: ``inputs @ weight.T``
    with exact products and float32 sums."""
    assert layout == "TN" and bias is None
    return (torch.matmul(inputs.to(out_dtype), weight.to(out_dtype).t()),)


def build(sequence_parallel: bool, tied: bool, logit_dtype):
    from megatron.core.models.gpt import GPTModel

    return harness.build_gpt(
        sequence_parallel=sequence_parallel, tied=tied, dtype=torch.bfloat16, init_method_std=harness.PEAKY_INIT_STD,
        model_class=functools.partial(GPTModel, logit_dtype=logit_dtype),
    )  # fmt: skip


def stock_reference(model, batch):
    """``harness.stock_reference`` with the labels path's loss taken from the oracle of the float32
    logits: Megatron's own labels path fails there (its cross-entropy edits the float32 logits in
    place, and they are the output layer's own output, which autograd then refuses to differentiate)."""
    targets = batch[3]
    logits = harness.forward(model, batch)
    logprob, entropy = harness.oracle_logprob_entropy(logits, targets, TEMPERATURE)
    reference = dict(logits=logits.detach(), logprob=logprob.detach(), entropy=entropy.detach())
    harness.head_loss(logprob, entropy).backward()
    reference["grads"] = harness.parameter_grads(model)
    loss = -harness.oracle_logprob_entropy(harness.forward(model, batch), targets, 1.0)[0]
    harness.labels_loss(loss).backward()
    reference["loss"], reference["loss_grads"] = loss.detach(), harness.parameter_grads(model)
    return reference


def check_logit_dtype(sequence_parallel: bool, tied: bool, label: str) -> None:
    batch = harness.make_batch()
    targets = batch[3]
    rounded = harness.forward(build(sequence_parallel, tied, None), batch).detach()
    rounded_logprob, rounded_entropy = harness.oracle_logprob_entropy(rounded, targets, TEMPERATURE)
    model = build(sequence_parallel, tied, torch.float32)
    reference = stock_reference(model, batch)
    assert reference["logits"].dtype == torch.float32 and rounded.dtype == torch.bfloat16, label
    rows = harness.SEQ // harness.tp_size() if sequence_parallel else harness.SEQ
    x = harness.random_weights(rows, harness.BATCH, harness.HIDDEN, seed=3).to(torch.bfloat16)
    weight = model.shared_embedding_or_output_weight() if tied else None
    stock_direct = model.output_layer(x, weight=weight)[0].detach()

    head = wrap_model(model, FUSED)
    assert head.fused, label
    direct = model.output_layer(x, weight=weight)[0].detach()
    assert direct.dtype == torch.float32 and torch.equal(direct, stock_direct), f"{label}: a direct call is not stock's"
    # How far rounding the logits to bf16 moves the results: what the fused head must stay well inside.
    gap = min(
        harness.max_abs_error(rounded_logprob, reference["logprob"]),
        harness.max_abs_error(rounded_entropy, reference["entropy"]),
    )
    assert gap > 1e-3, f"{label}: bf16 logits moved the results by only {gap:.3g}; the check would prove nothing"
    # Gradients: bf16 on both sides, within two bf16 roundings (2^-8 each) of the largest entry.
    harness.check_head(
        model, head, batch, reference, label, temperature=TEMPERATURE, value_atol=gap / 20, grad_rtol=1e-2,
    )  # fmt: skip
    unwrap_model(model)


def logit_dtype_worker() -> None:
    from megatron.core.extensions import transformer_engine

    with mock.patch.object(transformer_engine, "te_general_gemm", float32_product):
        for case in harness.tensor_parallel_cases():
            check_logit_dtype(*case)


@pytest.mark.skipif(not has_logit_dtype(), reason="this megatron-core's GPTModel has no logit_dtype")
def test_a_float32_logit_dtype_is_computed_as_stock_asks():
    harness.spawn(logit_dtype_worker, 2)
