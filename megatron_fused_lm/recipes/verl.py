"""verl 0.9.1 (the Megatron engine, ``actor_rollout_ref.actor.strategy: megatron``): the fused LM head
in ``MegatronEngineWithLMHead``.

verl builds the model in ``MegatronEngine._build_megatron_module`` (``verl.workers.engine.megatron.
transformer_impl``), runs it through ``gptmodel_forward_model_engine`` (``verl.models.mcore.
model_forward``), which hands the model's output to the engine's ``_lm_head_logits_processor``: the
one place where logits become per-token log-probs (``vocab_parallel_log_probs_from_logits``) and
entropy (``vocab_parallel_entropy``). verl packs the micro-batch (``use_remove_padding: true``) with
``preprocess_thd_engine`` before the forward and unpacks what the processor returns with
``postprocess_thd_engine``; its losses (``verl.workers.utils.losses``) read those per-token results.

The processor receives, for a packed micro-batch, the output ``[1, T, ...]`` (``T / CP`` rows under
context parallelism), ``label [1, T]`` (each row's next token, already shifted and split across
context-parallel ranks by verl) and ``temperature [1, T]`` (each row's sampling temperature, 0 on
padding rows); for a padded one (``use_remove_padding: false``) the same as ``[b, s]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

import torch

from megatron_fused_lm import FusedLMConfig, FusedLMHead, wrap_model

Tensor = torch.Tensor

# Processor options that need the materialized logits.
LOGITS_ONLY_OPTIONS = ("calculate_sum_pi_squared", "distillation_use_topk", "distillation_only")


@dataclass
class FusedLMSettings:
    """The five settings, for a subclass of verl's ``McoreEngineConfig`` (the ``megatron`` section of
    ``actor_rollout_ref.actor``): verl instantiates that section from its ``_target_``, whose
    dataclass must declare every key."""

    fused_linear_logprob: bool = False
    fused_linear_logprob_backend: str = "torch"
    fused_linear_logprob_token_chunk: Optional[int] = None
    fused_linear_logprob_batch_invariant: bool = False
    fused_linear_logprob_vocab_size: Optional[int] = None
    fused_linear_logprob_softcap: Optional[float] = None


def head_temperature(temperature: Union[float, Tensor]) -> Union[float, Tensor]:
    """verl's ``temperature`` as the head takes it: a float as it is; per-row temperatures with the
    padding rows (0 or less, whose results verl's postprocessing drops) at 1."""
    if not isinstance(temperature, Tensor):
        return temperature
    return torch.where(temperature > 0, temperature, 1.0).detach()


def fused_logits_processor(
    head: FusedLMHead,
    output: Tensor,
    label: Tensor,
    temperature: Union[float, Tensor],
    *,
    calculate_entropy: bool,
    entropy_grad: bool = True,
) -> Dict[str, Tensor]:
    """What ``_lm_head_logits_processor`` returns, from what the wrapped model returned.

    Args:
        output: ``[1, T, h]`` (packed) or ``[b, s, h]`` hidden states when fused, else the logits shard.
        label: int ``[1, T]`` or ``[b, s]``: the row's next token.
        temperature: verl's per-row temperatures, of ``label``'s shape (or one float).
        calculate_entropy: also return the entropy (verl asks for it when the loss uses it).
        entropy_grad: ``False`` when the entropy is only a metric (``entropy_coeff: 0``).

    Returns:
        ``{"log_probs": ..., "entropy": ...}`` (entropy only if asked), float32, ``label``'s shape.
    """
    temperature = head_temperature(temperature)
    if calculate_entropy:
        log_probs, entropy = head.logprobs(
            output, label, temperature=temperature, return_entropy=True, entropy_grad=entropy_grad
        )
        return {"log_probs": log_probs, "entropy": entropy}
    return {"log_probs": head.logprobs(output, label, temperature=temperature)}


class FusedLMHeadEngine:
    """Mix into verl's ``MegatronEngineWithLMHead`` (first in the bases): wraps the model once it is
    built, with the settings of the engine's own config section, and computes the processor's results
    with the fused head. A stock head (setting off, or a fallback) leaves verl's processor in charge.
    """

    fused_head: Optional[FusedLMHead] = None

    def _build_megatron_module(self):
        module = super()._build_megatron_module()
        config = FusedLMConfig.from_trainer_config(self.engine_config)
        if config.enabled and self.engine_config.use_fused_kernels:
            raise ValueError("turn use_fused_kernels off: verl's fused forward bypasses the output layer")
        self.fused_head = wrap_model(module, config)
        return module

    def _lm_head_logits_processor(self, logits, label, temperature, **options):
        if not self.fused_head.fused:
            return super()._lm_head_logits_processor(logits, label, temperature, **options)
        asked = [name for name in LOGITS_ONLY_OPTIONS if options.get(name)]
        if asked:
            raise NotImplementedError(f"{', '.join(asked)} need the logits: turn fused_linear_logprob off for them")
        return fused_logits_processor(
            self.fused_head,
            logits,
            label,
            temperature,
            calculate_entropy=options["calculate_entropy"],
            entropy_grad=entropy_is_a_loss_term(options.get("logits_processor_func")),
        )


def entropy_is_a_loss_term(loss_function: Any) -> bool:
    """Whether verl's loss adds the entropy with a weight: ``False`` for its ``ppo_loss`` (and
    ``distillation_ppo_loss``), a ``functools.partial`` over the actor's config, when that config's
    ``entropy_coeff`` is 0 (verl then asks for the entropy as a metric, with ``calculate_entropy``);
    ``True`` for any other loss, which may use it."""
    config = getattr(loss_function, "keywords", {}).get("config")
    return getattr(config, "entropy_coeff", None) != 0
