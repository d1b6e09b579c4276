"""What the head says, and does, on calls off the usual path, on real Megatron-Core GPTModels (TP=2
with sequence parallelism, gloo):

1. Labels that differ between the tensor-parallel ranks (a data loader that splits the batch over
   the wrong group): ``model(..., labels=)`` raises a ``ValueError`` on every rank naming the labels
   path and the labels, not the op underneath; ``check_ranks_agree("always")`` catches it on a
   later call too, where the default checks each signature's first call only.
2. ``head.loss`` and ``head.logprobs`` under ``torch.compile`` (the default ``fullgraph=False``):
   the same loss, log-probs and gradients as eager, the head's lookup of the forward that made its
   input running eagerly between the graphs; ``fullgraph=True`` is refused by Dynamo at that lookup
   (the ops themselves compile with ``fullgraph=True``: tests/cpu/test_ops_pytorch.py).

Compiled results equal eager ones to 1e-6 (the same float32 arithmetic, another fusion of it).
"""

import pytest
import torch

from devkit import megatron_gpt as harness
from megatron_fused_lm import check_ranks_agree, losses
from megatron_fused_lm.integration import FusedLMConfig, wrap_model

FUSED = FusedLMConfig(enabled=True, token_chunk=7)


def check_labels_that_differ_between_ranks(model, batch) -> None:
    rank = torch.distributed.get_rank()
    labels = batch[3]
    harness.forward(model, batch, labels=labels).sum().backward()  # this signature's first call: checked
    check_ranks_agree("always")
    try:
        with pytest.raises(ValueError, match=r"model\(\.\.\., labels=\) \(the labels path of GPTModel") as raised:
            harness.forward(model, batch, labels=(labels + rank) % harness.VOCAB_SHARD)
    finally:
        check_ranks_agree(True)
    assert "given different labels" in str(raised.value) and "fused_linear" not in str(raised.value)


def check_compiled_head(model, head, batch) -> None:
    targets = batch[3]
    weights = harness.random_weights(*targets.shape, seed=8)

    def step(output):
        logprob, entropy = head.logprobs(output, targets, temperature=0.7, return_entropy=True)
        result = head.loss(output, targets, losses.cross_entropy, loss_inputs={"weight": weights}, temperature=0.7)
        return logprob, entropy, result.loss + (entropy * weights.flip(0)).sum()

    results = {}
    for name, run in (("compiled", torch.compile(step)), ("eager", step)):
        *values, loss = run(harness.forward(model, batch))
        loss.backward()
        results[name] = (*values, loss, *harness.parameter_grads(model).values())
    for expected, actual in zip(results["eager"], results["compiled"], strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)

    def whole_graph(output):  # code of its own: Dynamo keeps one cache entry per code object
        return head.logprobs(output, targets)

    with pytest.raises(Exception, match="_call_for"):
        torch.compile(whole_graph, fullgraph=True)(harness.forward(model, batch))


def worker() -> None:
    harness.tensor_parallel(2)
    model = harness.build_gpt(sequence_parallel=True)
    head = wrap_model(model, FUSED)
    batch = harness.make_batch()
    check_labels_that_differ_between_ranks(model, batch)
    harness.parameter_grads(model)
    check_compiled_head(model, head, batch)


def test_labels_that_differ_between_ranks_and_a_compiled_head():
    harness.spawn(worker, 2)
