"""NeMo-RL (NVIDIA-NeMo/RL, the Megatron policy worker): the fused LM head where NeMo-RL turns the
model's output into next-token log-probs.

NeMo-RL builds the model in ``setup_model_and_optimizer`` (``nemo_rl.models.megatron.setup``,
``model = get_model(...)``). Its training losses receive their inputs from a ``prepare_fn``
(``LossPostProcessor``'s argument, by default ``prepare_loss_input`` in
``nemo_rl.algorithms.loss.utils``), which calls ``get_next_token_logprobs_from_logits`` for the
``LOGPROB`` losses (``NLLLossFn``, ``ClippedPGLossFn``, ``DPOLossFn``); the log-prob pass
(``LogprobsPostProcessor`` in ``nemo_rl.models.megatron.train``) calls
``from_parallel_logits_to_logprobs`` or, for packed batches, ``..._packed_sequences``. The settings
live in the ``policy`` section of the YAML config (a plain dict). Shapes are NeMo-RL's:
``input_ids [B, S]`` right-padded, next-token log-probs ``[B, S - 1]``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_fused_lm import (
    FusedLMConfig,
    FusedLMHead,
    losses,
    next_token_targets,
    response_mask,
    split_responses,
    wrap_model,
)

Tensor = torch.Tensor


def wrap_policy_model(model: Any, policy_cfg: Dict[str, Any]) -> FusedLMHead:
    """Wrap what ``get_model`` returned, with the settings of the ``policy`` section.

    NeMo-RL's own Linear-CE fusion (``policy.megatron_cfg.use_fused_linear_logprobs``) replaces
    GPTModel's forward; the two cannot both own the output layer.
    """
    config = FusedLMConfig.from_trainer_config(policy_cfg)
    if config.enabled and policy_cfg.get("megatron_cfg", {}).get("use_fused_linear_logprobs", False):
        raise ValueError("set either policy.fused_linear_logprob or policy.megatron_cfg.use_fused_linear_logprobs")
    return wrap_model(model, config)


def next_token_logprobs(head: FusedLMHead, output: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """``get_next_token_logprobs_from_logits`` with the fused head: float32 ``[B, S - 1]``, entry ``t``
    scoring ``input_ids[:, t + 1]``. ``output [B, S', h]`` may be longer than ``input_ids [B, S]`` (a
    packed sequence's padding); its first ``S - 1`` rows are used."""
    rows = input_ids.shape[1] - 1
    return head.logprobs(output[:, :rows], input_ids[:, 1:], temperature=temperature)


def _check_context_parallel(context_parallel_group: Optional[dist.ProcessGroup]) -> None:
    if context_parallel_group is not None and dist.get_world_size(context_parallel_group) > 1:
        raise NotImplementedError("this recipe takes CP = 1 outputs; see docs/INTEGRATIONS.md for CP")


def prepare_loss_input(
    logits: Tensor,
    data: Any,
    loss_fn: Any,
    vocab_parallel_rank: Optional[int] = None,
    vocab_parallel_group: Optional[dist.ProcessGroup] = None,
    context_parallel_group: Optional[dist.ProcessGroup] = None,
    *,
    head: FusedLMHead,
    temperature: float = 1.0,
) -> Tuple[Dict[str, Tensor], Any]:
    """A ``prepare_fn`` for ``LossPostProcessor`` (``functools.partial(prepare_loss_input, head=head,
    temperature=...)``): the ``{"next_token_logprobs": [B, S - 1]}`` a ``LOGPROB`` loss expects, for
    whole micro-batches and for the per-sequence slices of ``SequencePackingLossWrapper`` alike.
    Top-k / top-p filtering needs the logits: keep NeMo-RL's ``prepare_loss_input`` for it."""
    _check_context_parallel(context_parallel_group)
    return {"next_token_logprobs": next_token_logprobs(head, logits, data["input_ids"], temperature)}, data


def packed_next_token_logprobs(
    head: FusedLMHead,
    output: Tensor,
    packed_input_ids: Tensor,
    cu_seqlens: Tensor,
    cu_seqlens_padded: Tensor,
    unpacked_seqlen: int,
    temperature: float = 1.0,
) -> Tensor:
    """The log-prob pass of a packed micro-batch (``LogprobsPostProcessor``'s packed branch): float32
    ``[B, S - 1]``, right-padded with 0 past each sequence's last scored token.

    Args:
        output: ``[1, T, h]``; packed_input_ids: int ``[1, T]``, the sequences at ``cu_seqlens_padded``.
        cu_seqlens, cu_seqlens_padded: ``packed_seq_params.cu_seqlens_q`` and ``cu_seqlens_q_padded``.
        unpacked_seqlen: ``S``, the width of the unpacked ``input_ids``.
    """
    scored_lengths = (cu_seqlens[1:] - cu_seqlens[:-1] - 1).clamp(min=0)
    first_tokens = torch.ones_like(scored_lengths)
    scored = response_mask(cu_seqlens_padded, first_tokens, scored_lengths).unsqueeze(0)
    targets = next_token_targets(packed_input_ids, cu_seqlens_padded)
    logprob = head.logprobs(output, targets, temperature=temperature, mask=scored)
    pieces = split_responses(logprob, cu_seqlens_padded, first_tokens, scored_lengths)
    unpacked = logprob.new_zeros(len(pieces), unpacked_seqlen - 1)
    for row, piece in enumerate(pieces):
        unpacked[row, : piece.shape[0]] = piece
    return unpacked


def nll_loss(
    head: FusedLMHead,
    output: Tensor,
    data: Any,
    global_valid_toks: Tensor,
    temperature: float = 1.0,
) -> Tuple[Tensor, Dict[str, Any]]:
    """``NLLLossFn`` (SFT, not DPO) with the gradients finished in the forward: ``-sum(next_token_logprobs
    * mask) / global_valid_toks``, ``mask = token_mask[:, 1:] * sample_mask``. Call it from a loss
    function whose ``input_type`` is ``LossInputType.LOGIT`` (it receives the model's output)."""
    input_ids = data["input_ids"]
    rows = input_ids.shape[1] - 1
    mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
    weight = mask.float() / (global_valid_toks + 1e-8)
    result = head.loss(
        output[:, :rows], input_ids[:, 1:], losses.cross_entropy, loss_inputs={"weight": weight}, mask=mask.bool(),
        temperature=temperature,
    )  # fmt: skip
    return result.loss, {
        "loss": result.loss.item(),
        "num_unmasked_tokens": mask.sum().item(),
        "num_valid_samples": data["sample_mask"].sum().item(),
    }
