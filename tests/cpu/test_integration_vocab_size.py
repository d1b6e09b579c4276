"""``FusedLMConfig(vocab_size=...)`` (trainer key ``fused_linear_logprob_vocab_size``) on the stock
Megatron-Core GPTModel at TP=1 and TP=2 (sequence parallel, tied embeddings), its head padded past
the tokenizer's vocabulary as Megatron pads it: the head's log-probs, entropy, every parameter's
gradient, top-k and the labels path against the float64 oracle over the stock logits' first
``vocab_size`` columns (gathered across the ranks), with autograd into the stock model; the padded
output rows get no gradient. The padding sits on the last rank (at TP=2, the last 9 of its 29).

The padded columns are made to score high (their output rows scaled up), so that one that leaks
into a softmax moves log-probs by O(1). Tolerances as in test_integration_parity (float32 on both
sides): 2e-5 absolute on values and 5e-5 of the largest entry of each stock gradient.
"""

import torch

from devkit import megatron_gpt as harness
from devkit.oracle import logprob_entropy
from megatron_fused_lm.integration import FusedLMConfig, unwrap_model, wrap_model

VALUE_ATOL = 2e-5
GRAD_RTOL = 5e-5
TEMPERATURE = 0.7
PADDING = 9  # ids past the tokenizer's vocabulary at the end of the head


def with_loud_padding(model, vocab_size: int) -> None:
    """Scale the output rows past ``vocab_size`` on this rank so that the padded logits are large."""
    from megatron.core import parallel_state

    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    weight = weight if weight is not None else model.output_layer.weight
    first = parallel_state.get_tensor_model_parallel_rank() * weight.shape[0]
    with torch.no_grad():
        weight[max(vocab_size - first, 0) :] *= 30


def check_vocab_size(sequence_parallel: bool, tied: bool, label: str) -> None:
    model = harness.build_gpt(sequence_parallel=sequence_parallel, tied=tied)
    vocab_size = harness.VOCAB_SHARD * harness.tp_size() - PADDING
    with_loud_padding(model, vocab_size)
    batch = harness.make_batch()
    targets = torch.where(batch[3] < vocab_size, batch[3], batch[3] % vocab_size)
    # Stock: the oracle over the true vocabulary, from the gathered logits' first vocab_size columns.
    logits = harness.gather_vocabulary(harness.forward(model, batch))
    logprob, entropy = logprob_entropy(logits[..., :vocab_size], targets, TEMPERATURE)
    padded_logprob, _ = logprob_entropy(logits, targets, TEMPERATURE)
    assert (padded_logprob - logprob).abs().max() > 1.0, f"{label}: the padding does not matter here"
    harness.head_loss(logprob, entropy).backward()
    stock_grads = harness.finalized_parameter_grads(model)
    true_logits = logits[..., :vocab_size].detach()
    labels_loss = -logprob_entropy(logits[..., :vocab_size], targets, 1.0)[0]

    head = wrap_model(model, FusedLMConfig(enabled=True, vocab_size=vocab_size))
    fused_logprob, fused_entropy = head.logprobs(
        harness.forward(model, batch), targets, temperature=TEMPERATURE, return_entropy=True
    )
    harness.assert_max_error(fused_logprob, logprob, VALUE_ATOL, f"{label} logprob")
    harness.assert_max_error(fused_entropy, entropy, VALUE_ATOL, f"{label} entropy")
    harness.head_loss(fused_logprob, fused_entropy).backward()
    fused_grads = harness.finalized_parameter_grads(model)
    harness.assert_grads_close(fused_grads, stock_grads, GRAD_RTOL, f"{label} grads")
    output = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    first = harness.VOCAB_SHARD * torch.distributed.get_rank() if harness.tp_size() > 1 else 0
    padded_rows = fused_grads[output][max(vocab_size - first, 0) :]
    if not tied:  # a tied embedding's padded rows still get the input side's gradient, if any id looks them up
        assert torch.count_nonzero(padded_rows) == 0, f"{label}: the padded rows got a gradient"
    # Top-k over the true vocabulary only, and the labels path's loss over it.
    logprobs, ids = head.topk(harness.forward(model, batch), 5, temperature=TEMPERATURE)
    oracle = torch.log_softmax(true_logits.double() / TEMPERATURE, -1).topk(5, dim=-1)
    assert torch.equal(ids, oracle.indices), label
    harness.assert_max_error(logprobs, oracle.values, VALUE_ATOL, f"{label} top-k")
    loss = harness.forward(model, batch, labels=targets)
    harness.assert_max_error(loss, labels_loss.detach(), VALUE_ATOL, f"{label} labels loss")
    unwrap_model(model)


def vocab_size_worker() -> None:
    for sequence_parallel, tied, label in harness.tensor_parallel_cases():
        if sequence_parallel == tied:  # TP=2 with sequence parallelism and tied, TP=1 untied
            check_vocab_size(sequence_parallel, tied, label)


def test_the_head_over_the_tokenizers_vocabulary():
    harness.spawn(vocab_size_worker, 2)


def test_the_trainer_key():
    config = FusedLMConfig.from_trainer_config(
        {"fused_linear_logprob": True, "fused_linear_logprob_vocab_size": 151643}
    )
    assert config.vocab_size == 151643
    for wrong, error in ((0, ValueError), ("151643", TypeError)):
        try:
            FusedLMConfig(enabled=True, vocab_size=wrong)
        except error as raised:
            assert "fused_linear_logprob_vocab_size" in str(raised)
        else:
            raise AssertionError(f"vocab_size={wrong!r} was taken")
