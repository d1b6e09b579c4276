"""``head.topk`` on the patched model against the float64 log-probs of the stock GPTModel's logits:
TP=1 and TP=2, sequence parallel on and off, tied and untied embeddings, fused and disabled
(``logits_topk`` on the logits, split or gathered to the whole vocabulary), a temperature, several chunks of rows. Forward only: the results
carry no graph, and the model computes the stock way again after unwrapping.

Tolerance as in test_integration_parity (float32 models, errors about 2e-6): 2e-5 absolute.
"""

import torch

from devkit import megatron_gpt as harness
from megatron_fused_lm.integration import FusedLMConfig, unwrap_model, wrap_model

TEMPERATURE = 0.7
VALUE_ATOL = 2e-5
K = 5


def topk_worker() -> None:
    for sequence_parallel, tied, label in harness.tensor_parallel_cases():
        model = harness.build_gpt(sequence_parallel=sequence_parallel, tied=tied)
        batch = harness.make_batch()
        stock_logits = harness.forward(model, batch).detach()
        for enabled in (True, False):
            case = f"{label} {'fused' if enabled else 'disabled'}"
            head = wrap_model(model, FusedLMConfig(enabled=enabled, token_chunk=5))
            assert head.fused == enabled, case
            logprobs, ids = head.topk(harness.forward(model, batch), K, temperature=TEMPERATURE)
            harness.assert_topk_matches(logprobs, ids, stock_logits, K, TEMPERATURE, VALUE_ATOL, case)
            if not enabled:  # logits gathered to the whole vocabulary, as runtime_gather_output gives them
                gathered = harness.gather_vocabulary(harness.forward(model, batch))
                logprobs, ids = head.topk(gathered, K, temperature=TEMPERATURE)
                harness.assert_topk_matches(logprobs, ids, stock_logits, K, TEMPERATURE, VALUE_ATOL, f"{case} gathered")
            unwrap_model(model)
        assert torch.equal(harness.forward(model, batch), stock_logits), f"{label}: the model is no longer stock"


def test_head_topk_matches_stock_megatron():
    harness.spawn(topk_worker, 2)
