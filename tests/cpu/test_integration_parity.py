"""The fused head against the stock Megatron-Core GPTModel: TP=1 and TP=2, sequence parallel on
and off, tied and untied embeddings, chunked and unchunked.

For each case, on one model:
1. stock: logits -> float64 oracle log-probs and entropy (plain torch on the gathered vocabulary),
   backward of a random weighted sum of both -> reference gradients; labels path -> stock loss and
   its gradients.
2. disabled config: the model is untouched (bitwise the same logits) and the head's log-probs on
   the logits shard match the oracle.
3. fused: the model returns hidden states; the head's log-probs and entropy match the oracle and
   every parameter's gradient (the tied embedding included) matches the stock one, also for a
   response mask with a temperature per position; several ids per position give their log-probs;
   the labels path
   returns the stock loss with the same gradients.
4. unwrap: bitwise the stock logits and loss again.

The distributions are peaky (logits up to ~16 after the temperature, some entropies near 0).
Tolerances (float32 models, so both paths round only at float32; measured errors are about 2e-6
for values and 2.5e-6 relative for gradients, from summing in another order than the stock
matmul): 2e-5 absolute for log-probs, entropy and loss, 5e-5 of the largest entry of each stock
gradient. A dropped or doubled term moves values by O(1); a hidden gradient reduced twice or not
at all is off by tens of percent.
"""

import re

import pytest
import torch

from devkit import megatron_gpt as harness
from megatron_fused_lm import losses
from megatron_fused_lm.integration import FusedLMConfig, unwrap_model, wrap_model

TEMPERATURE = 0.7
# The masked case: each position its own temperature, from 0.5 to 2 (as rollouts sampled at several).
PER_ROW_TEMPERATURE = torch.rand(harness.BATCH, harness.SEQ, generator=torch.Generator().manual_seed(3)) * 1.5 + 0.5
VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5


def check_case(sequence_parallel: bool, tied: bool, token_chunk, label: str) -> None:
    model = harness.build_gpt(sequence_parallel=sequence_parallel, tied=tied)
    batch = harness.make_batch()
    targets = batch[3]
    layer = model.output_layer

    stock_logits = harness.forward(model, batch)
    assert stock_logits.shape == (harness.BATCH, harness.SEQ, harness.VOCAB_SHARD), label
    oracle_logprob, oracle_entropy = harness.oracle_logprob_entropy(stock_logits, targets, TEMPERATURE)
    assert oracle_entropy.min() < 0.2, f"{label}: the distributions are not peaky enough to test"
    harness.head_loss(oracle_logprob, oracle_entropy).backward()
    stock_grads = harness.parameter_grads(model)
    # Row selection: a response mask (the later positions of every sequence).
    response = torch.arange(harness.SEQ).expand(harness.BATCH, harness.SEQ) >= harness.SEQ // 3
    stock_logits = harness.forward(model, batch)
    masked_logprob, masked_entropy = harness.oracle_logprob_entropy(stock_logits, targets, PER_ROW_TEMPERATURE)
    harness.head_loss(masked_logprob * response, masked_entropy * response).backward()
    stock_masked_grads = harness.parameter_grads(model)
    # Top-k distillation's student side ([b, s, k] ids, a teacher's log-probs there) on the stock logits.
    several = torch.stack([targets, torch.roll(targets, 1, dims=1), (targets + 5) % harness.VOCAB_SHARD], dim=-1)
    teacher = torch.log_softmax(torch.randn(*several.shape, generator=torch.Generator().manual_seed(3)), -1) - 0.5
    distillation = losses.TopkDistillation("forward", "tail")
    distillation_inputs = {"teacher_logprob": teacher, "weight": torch.full(targets.shape, 1.0 / targets.numel())}
    stock_log_probs = torch.log_softmax(
        harness.gather_vocabulary(harness.forward(model, batch)).double() / TEMPERATURE, -1
    )
    stock_distillation = distillation(
        stock_log_probs.gather(-1, several).reshape(-1, 3), None,
        **{name: value.double().reshape(targets.numel(), *value.shape[2:]) for name, value in distillation_inputs.items()},
    ).sum()  # fmt: skip
    stock_distillation.backward()
    stock_distillation_grads = harness.parameter_grads(model)
    stock_loss = harness.forward(model, batch, labels=targets)
    harness.labels_loss(stock_loss).backward()
    stock_loss_grads = harness.parameter_grads(model)
    if tied:
        assert "embedding.word_embeddings.weight" in stock_grads and layer.weight is None, label

    disabled = wrap_model(model, FusedLMConfig(enabled=False, token_chunk=token_chunk))
    assert not disabled.fused and disabled.fallback_reason is None, label
    assert "forward" not in vars(layer) and "compute_language_model_loss" not in vars(model), label
    logits = harness.forward(model, batch)
    assert torch.equal(logits, stock_logits), f"{label}: disabled config changed the logits"
    logprob, entropy = disabled.logprobs(logits, targets, temperature=TEMPERATURE, return_entropy=True)
    harness.assert_max_error(logprob, oracle_logprob, VALUE_ATOL, f"{label} disabled logprob")
    harness.assert_max_error(entropy, oracle_entropy, VALUE_ATOL, f"{label} disabled entropy")
    harness.head_loss(logprob, entropy).backward()
    harness.assert_grads_close(harness.parameter_grads(model), stock_grads, GRAD_RTOL, f"{label} disabled")

    config = FusedLMConfig(enabled=True, token_chunk=token_chunk)
    head = wrap_model(model, config)
    assert head.fused and head.fallback_reason is None, label
    hidden = harness.forward(model, batch)
    assert hidden.shape == (harness.BATCH, harness.SEQ, harness.HIDDEN), f"{label}: {tuple(hidden.shape)}"
    logprob, entropy = head.logprobs(hidden, targets, temperature=TEMPERATURE, return_entropy=True)
    assert logprob.dtype == entropy.dtype == torch.float32, label
    harness.assert_max_error(logprob, oracle_logprob, VALUE_ATOL, f"{label} fused logprob")
    harness.assert_max_error(entropy, oracle_entropy, VALUE_ATOL, f"{label} fused entropy")
    harness.head_loss(logprob, entropy).backward()
    harness.assert_grads_close(harness.parameter_grads(model), stock_grads, GRAD_RTOL, f"{label} fused")

    logprob, entropy = head.logprobs(
        harness.forward(model, batch), targets, temperature=PER_ROW_TEMPERATURE, return_entropy=True, mask=response
    )
    harness.assert_max_error(logprob[response], masked_logprob[response], VALUE_ATOL, f"{label} masked logprob")
    harness.assert_max_error(entropy[response], masked_entropy[response], VALUE_ATOL, f"{label} masked entropy")
    assert torch.count_nonzero(logprob[~response]) == 0 and torch.count_nonzero(entropy[~response]) == 0, label
    harness.head_loss(logprob, entropy).backward()
    harness.assert_grads_close(harness.parameter_grads(model), stock_masked_grads, GRAD_RTOL, f"{label} fused masked")

    # Several ids per position ([b, s, k]: a teacher's top-k, say) against the gathered stock logits;
    # and the distillation loss on them by the three-GEMM path.
    stock_log_probs = stock_log_probs.detach()
    logprob = head.logprobs(harness.forward(model, batch), several, temperature=TEMPERATURE)
    assert logprob.shape == several.shape, label
    harness.assert_max_error(logprob, stock_log_probs.gather(-1, several), VALUE_ATOL, f"{label} several targets")
    result = head.loss(
        harness.forward(model, batch), several, distillation, loss_inputs=distillation_inputs, temperature=TEMPERATURE
    )
    assert abs(result.loss.item() - stock_distillation.item()) <= VALUE_ATOL * max(1.0, abs(stock_distillation.item()))
    result.loss.backward()
    harness.assert_grads_close(
        harness.parameter_grads(model), stock_distillation_grads, GRAD_RTOL, f"{label} fused distillation"
    )
    # The labels path takes one id per position; the error names the labels in their own [b, s, k].
    expected = f"labels {tuple(several.shape)} must be [b, s] = {tuple(several.shape[:2])}: the labels path takes one"
    with pytest.raises(ValueError, match=re.escape(expected)):
        harness.forward(model, batch, labels=several)

    fused_loss = harness.forward(model, batch, labels=targets)
    assert fused_loss.shape == stock_loss.shape and fused_loss.dtype == torch.float32, label
    harness.assert_max_error(fused_loss, stock_loss, VALUE_ATOL, f"{label} fused labels loss")
    harness.labels_loss(fused_loss).backward()
    harness.assert_grads_close(harness.parameter_grads(model), stock_loss_grads, GRAD_RTOL, f"{label} fused labels")

    unwrap_model(model)
    assert "forward" not in vars(layer) and "compute_language_model_loss" not in vars(model), label
    assert torch.equal(harness.forward(model, batch), stock_logits), f"{label}: unwrap did not restore the logits"
    assert torch.equal(harness.forward(model, batch, labels=targets), stock_loss), (
        f"{label}: unwrap did not restore the loss"
    )


def parity_worker() -> None:
    for sequence_parallel, tied, label in harness.tensor_parallel_cases():
        for token_chunk in (None, 5):
            check_case(sequence_parallel, tied, token_chunk, f"{label} token_chunk={token_chunk}")


def test_head_and_labels_match_stock_megatron():
    harness.spawn(parity_worker, 2)
