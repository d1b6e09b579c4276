"""``FusedLMConfig(softcap=...)`` (trainer key ``fused_linear_logprob_softcap``) on the stock
Megatron-Core GPTModel at TP=1 and TP=2 (sequence parallel, tied embeddings): the head's log-probs,
entropy, every parameter's gradient, top-k and the labels path against the float64 oracle over the
stock logits (gathered across the ranks) capped as Gemma-2 caps them, with autograd into the stock
model; the logits a forward without a request returns stay the stock ones (Megatron-Core has no
softcap).

The cap is half the largest stock logit, so the largest logits sit where tanh bends and a cap left
out moves the log-probs visibly (checked). Tolerances as in test_integration_vocab_size (float32 on
both sides): 2e-5 absolute on values and 5e-5 of the largest entry of each stock gradient.
"""

import torch

from devkit import megatron_gpt as harness
from devkit.oracle import capped, logprob_entropy
from megatron_fused_lm.integration import FusedLMConfig, unwrap_model, wrap_model

VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5
TEMPERATURE = 0.7


def check_softcap(sequence_parallel: bool, tied: bool, label: str) -> None:
    model = harness.build_gpt(sequence_parallel=sequence_parallel, tied=tied)
    batch = harness.make_batch()
    targets = batch[3]
    stock = harness.gather_vocabulary(harness.forward(model, batch))
    softcap = round(float(stock.abs().max()) / 2, 3)  # the same on every rank: the gathered logits'
    logprob, entropy = logprob_entropy(capped(stock, softcap), targets, TEMPERATURE)
    uncapped, _ = logprob_entropy(stock, targets, TEMPERATURE)
    assert (uncapped - logprob).abs().max() > 0.05, f"{label}: the cap does not matter here"
    harness.head_loss(logprob, entropy).backward()
    stock_grads = harness.finalized_parameter_grads(model)
    stock_logits = stock.detach()
    labels_loss = -logprob_entropy(capped(stock_logits, softcap), targets, 1.0)[0]

    head = wrap_model(model, FusedLMConfig(enabled=True, softcap=softcap))
    fused_logprob, fused_entropy = head.logprobs(
        harness.forward(model, batch), targets, temperature=TEMPERATURE, return_entropy=True
    )
    harness.assert_max_error(fused_logprob, logprob, VALUE_ATOL, f"{label} logprob")
    harness.assert_max_error(fused_entropy, entropy, VALUE_ATOL, f"{label} entropy")
    harness.head_loss(fused_logprob, fused_entropy).backward()
    harness.assert_grads_close(harness.finalized_parameter_grads(model), stock_grads, GRAD_RTOL, f"{label} grads")
    logprobs, ids = head.topk(harness.forward(model, batch), 5, temperature=TEMPERATURE)
    oracle = torch.log_softmax(capped(stock_logits.double(), softcap) / TEMPERATURE, -1).topk(5, dim=-1)
    assert torch.equal(ids, oracle.indices), label
    harness.assert_max_error(logprobs, oracle.values, VALUE_ATOL, f"{label} top-k")
    loss = harness.forward(model, batch, labels=targets)
    harness.assert_max_error(loss, labels_loss, VALUE_ATOL, f"{label} labels loss")
    unwrap_model(model)
    # Unwrapped, the model's logits are the stock ones again, uncapped.
    harness.assert_max_error(harness.gather_vocabulary(harness.forward(model, batch)), stock_logits, 0.0, label)


def softcap_worker() -> None:
    for sequence_parallel, tied, label in harness.tensor_parallel_cases():
        if sequence_parallel == tied:  # TP=2 with sequence parallelism and tied, TP=1 untied
            check_softcap(sequence_parallel, tied, label)


def test_the_head_of_a_softcapped_model():
    harness.spawn(softcap_worker, 2)


def test_the_trainer_key():
    config = FusedLMConfig.from_trainer_config({"fused_linear_logprob": True, "fused_linear_logprob_softcap": 30})
    assert config.softcap == 30.0 and isinstance(config.softcap, float)
    for wrong, error in ((0, ValueError), (float("nan"), ValueError), ("30", TypeError)):
        try:
            FusedLMConfig(enabled=True, softcap=wrong)
        except error as raised:
            assert "fused_linear_logprob_softcap" in str(raised)
        else:
            raise AssertionError(f"softcap={wrong!r} was taken")
