"""Megatron-Core integration: a trainer config switch, ``wrap_model`` and the ``FusedLMHead``.

    config = FusedLMConfig.from_trainer_config(trainer_config)
    head = wrap_model(model, config)                 # once, where the model is built
    logprob, entropy = head.logprobs(model(tokens, positions, mask), targets, return_entropy=True)
    loss = model(tokens, positions, mask, labels=labels)   # SFT: the stock [b, s] loss
"""

from .config import FusedLMConfig
from .head import FusedLMHead, unwrap_model, wrap_model

__all__ = ["FusedLMConfig", "FusedLMHead", "unwrap_model", "wrap_model"]
