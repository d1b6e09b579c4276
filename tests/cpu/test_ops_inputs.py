"""Bad inputs raise the documented error, for both public ops."""

import pytest
import torch

from megatron_fused_lm import fused_linear_logprob, logits_logprob

H, V = 8, 11


def fused_call(**overrides):
    arguments = dict(hidden=torch.randn(4, H), weight=torch.randn(V, H), targets=torch.randint(0, V, (4,)))
    options = {key: overrides.pop(key) for key in list(overrides) if key not in arguments}
    arguments.update(overrides)
    return fused_linear_logprob(arguments["hidden"], arguments["weight"], arguments["targets"], **options)


def logits_call(**overrides):
    arguments = dict(logits=torch.randn(4, V), targets=torch.randint(0, V, (4,)))
    options = {key: overrides.pop(key) for key in list(overrides) if key not in arguments}
    arguments.update(overrides)
    return logits_logprob(arguments["logits"], arguments["targets"], **options)


@pytest.mark.parametrize(
    "overrides,error,message",
    [
        (dict(targets=torch.tensor([0, 1, V, 2])), ValueError, "outside the vocabulary"),
        (dict(targets=torch.tensor([0, -1, 2, 2])), ValueError, "outside the vocabulary"),
        (dict(targets=torch.zeros(5, dtype=torch.long)), ValueError, "targets.shape"),
        (dict(targets=torch.zeros(4)), TypeError, "integer"),
        (dict(hidden=torch.randn(4, H + 1)), ValueError, "hidden size"),
        (dict(weight=torch.randn(2, V, H)), ValueError, "2-D"),
        (dict(weight=torch.randn(0, H)), ValueError, "2-D"),
        (dict(hidden=torch.ones(4, H, dtype=torch.long)), TypeError, "hidden must be float32"),
        (dict(weight=torch.ones(V, H, dtype=torch.int32)), TypeError, "weight must be float32"),
        (dict(hidden=torch.randn(4, H, dtype=torch.float64)), TypeError, "hidden must be float32"),
        (dict(token_chunk=0), ValueError, "token_chunk"),
        (dict(token_chunk=-3), ValueError, "token_chunk"),
        (dict(token_chunk=2.5), TypeError, "token_chunk"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(backend="cuda"), ValueError, "'torch', 'triton', 'cute', 'auto'"),
        # On another device than the rows: a clear error before anything reads them.
        (dict(targets=torch.randint(0, V, (4,), device="meta")), ValueError, "targets must be on cpu"),
        (dict(mask=torch.ones(4, dtype=torch.bool, device="meta")), ValueError, "mask must be on cpu"),
    ],
)
def test_fused_rejects(overrides, error, message):
    with pytest.raises(error, match=message):
        fused_call(**overrides)


@pytest.mark.parametrize(
    "overrides,error,message",
    [
        (dict(targets=torch.tensor([0, 1, V, 2])), ValueError, "outside the vocabulary"),
        (dict(targets=torch.zeros(4, 2, 1, dtype=torch.long)), ValueError, "targets.shape"),
        (dict(logits=torch.ones(4, V, dtype=torch.long)), TypeError, "logits must be float32"),
        (dict(logits=torch.randn(4, 0)), ValueError, "vocab_shard"),
        (dict(token_chunk=0), ValueError, "token_chunk"),
        (dict(temperature=0), ValueError, "temperature"),
        (dict(targets=torch.randint(0, V, (4,), device="meta")), ValueError, "targets must be on cpu"),
    ],
)
def test_logits_rejects(overrides, error, message):
    with pytest.raises(error, match=message):
        logits_call(**overrides)
