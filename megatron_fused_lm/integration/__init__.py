"""Megatron-Core integration: a trainer config switch, ``wrap_model`` and the ``FusedLMHead``.

Use::

    config = FusedLMConfig.from_trainer_config(trainer_config)
    head = wrap_model(model, config)                 # once, where the model is built
    logprob, entropy = head.logprobs(model(tokens, positions, mask), targets, return_entropy=True)
    loss = model(tokens, positions, mask, labels=labels)   # SFT: the stock [b, s] loss

or through the model's own hook, nothing patched (megatron-core >= 0.18; ``output_processor``).
"""

import contextlib
import importlib
import warnings

# Megatron-Core announces, as each of the modules imported here loads, that TransformerEngine and
# Apex are absent and it uses torch's implementations instead, and (0.17 on) that absl's logging is
# absent and it uses Python's: expected wherever they are not installed (every CPU machine), and no
# other message is filtered.
with warnings.catch_warnings():
    warnings.filterwarnings(
        "ignore",
        message=r"((Transformer Engine and Apex are|Apex is) not installed\. Falling back|absl\.logging is not installed)",
        category=UserWarning,
    )
    try:
        import megatron.core  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "megatron_fused_lm's Megatron-Core integration needs megatron-core (0.13 to 0.20): "
            'pip install "megatron-fused-lm[megatron]" (or megatron-core itself); '
            "the ops (fused_linear_logprob, logits_logprob) work without it"
        ) from error

    # The modules a GPTModel of the local layer spec needs announce the same at import; loaded
    # here, so that a user's later imports of them are quiet too.
    for module in ("megatron.core.models.backends", "megatron.core.models.gpt.gpt_layer_specs"):
        with contextlib.suppress(ImportError):  # not in every release
            importlib.import_module(module)

    from .calls import LogprobRequest, LossRequest, TopkRequest
    from .config import FusedLMConfig
    from .head import FusedLMHead, fused_head_of, tie_to_forward, unwrap_model, wrap_model
    from .output_processor import FusedOutputProcessor, LabelsRequest, accepts_output_processor

__all__ = [
    "FusedLMConfig",
    "FusedLMHead",
    "FusedOutputProcessor",
    "LabelsRequest",
    "LogprobRequest",
    "LossRequest",
    "TopkRequest",
    "accepts_output_processor",
    "fused_head_of",
    "tie_to_forward",
    "unwrap_model",
    "wrap_model",
]
