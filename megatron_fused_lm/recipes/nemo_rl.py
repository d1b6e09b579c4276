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
``input_ids [B, S]`` right-padded, next-token log-probs ``[B, S - 1]``. Under context parallelism
(which NeMo-RL runs with sequence packing only) the output holds this rank's two chunks of every
packed sequence and the log-probs come back whole on every rank, as NeMo-RL's functions return them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_fused_lm import (
    FusedLMConfig,
    FusedLMHead,
    context_parallel_gather,
    context_parallel_positions,
    context_parallel_sum,
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


@dataclass(frozen=True)
class _RankRows:
    """The output rows of this rank that score the ``positions = S - 1`` next tokens of
    ``input_ids [B, S]``: at CP = 1 the first ``S - 1`` rows; under CP this rank's rows
    (``context_parallel_positions``) of each row of ``input_ids`` padded to ``width = rows x CP``
    positions, the padding scoring nothing."""

    output: Tensor
    positions: int
    mask: Optional[Tensor] = None
    held: Optional[Tensor] = None
    width: int = 0
    cp_group: Optional[dist.ProcessGroup] = None

    @staticmethod
    def of(output: Tensor, positions: int, cp_group: Optional[dist.ProcessGroup]) -> "_RankRows":
        size = 1 if cp_group is None else dist.get_world_size(cp_group)
        if size == 1:
            return _RankRows(output[:, :positions], positions)
        width = output.shape[1] * size
        if width < positions:
            raise ValueError(f"{output.shape[1]} rows x CP {size} cannot hold {positions} next-token positions")
        held = context_parallel_positions(torch.tensor([0, width], device=output.device), dist.get_rank(cp_group), size)
        return _RankRows(output, positions, (held < positions).expand(output.shape[0], -1), held, width, cp_group)

    def on_this_rank(self, per_position: Tensor) -> Tensor:
        """``[B, S - 1]`` -> this rank's rows ``[B, rows]``."""
        if self.held is None:
            return per_position
        return torch.nn.functional.pad(per_position, (0, self.width - self.positions))[:, self.held]

    def everywhere(self, per_row: Tensor) -> Tensor:
        """This rank's per-row results ``[B, rows]`` -> ``[B, S - 1]`` on every rank; the backward
        sums every rank's upstream gradients, as NeMo-RL's ``AllGatherCPTensor`` does."""
        if self.held is None:
            return per_row
        every = context_parallel_gather(per_row, self.held, self.width, self.cp_group, gradient="summed")
        return every[:, : self.positions]


def next_token_logprobs(
    head: FusedLMHead,
    output: Tensor,
    input_ids: Tensor,
    temperature: float = 1.0,
    cp_group: Optional[dist.ProcessGroup] = None,
) -> Tensor:
    """``get_next_token_logprobs_from_logits`` with the fused head: float32 ``[B, S - 1]``, entry ``t``
    scoring ``input_ids[:, t + 1]``. ``output [B, S', h]`` may be longer than ``input_ids [B, S]`` (a
    packed sequence's padding); its first ``S - 1`` rows are used. Under context parallelism
    (``cp_group`` with more than one rank) ``output`` is this rank's rows of every row of
    ``input_ids`` padded to ``S' x CP``, and the result is gathered to every rank, as NeMo-RL's
    ``from_parallel_logits_to_logprobs`` gathers it (its backward sums the ranks' gradients)."""
    rows = _RankRows.of(output, input_ids.shape[1] - 1, cp_group)
    logprob = head.logprobs(rows.output, rows.on_this_rank(input_ids[:, 1:]), temperature=temperature, mask=rows.mask)
    return rows.everywhere(logprob)


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
    whole micro-batches and for the per-sequence slices of ``SequencePackingLossWrapper`` alike,
    under context parallelism too. Top-k / top-p filtering needs the logits: keep NeMo-RL's
    ``prepare_loss_input`` for it."""
    logprob = next_token_logprobs(head, logits, data["input_ids"], temperature, context_parallel_group)
    return {"next_token_logprobs": logprob}, data


def packed_next_token_logprobs(
    head: FusedLMHead,
    output: Tensor,
    packed_input_ids: Tensor,
    cu_seqlens: Tensor,
    cu_seqlens_padded: Tensor,
    unpacked_seqlen: int,
    temperature: float = 1.0,
    cp_group: Optional[dist.ProcessGroup] = None,
) -> Tensor:
    """The log-prob pass of a packed micro-batch (``LogprobsPostProcessor``'s packed branch): float32
    ``[B, S - 1]``, right-padded with 0 past each sequence's last scored token.

    Args:
        output: ``[1, T, h]``, or under context parallelism this rank's ``[1, T / CP, h]``.
        packed_input_ids: int ``[1, T]``, the sequences at ``cu_seqlens_padded`` (all of them under CP).
        cu_seqlens, cu_seqlens_padded: ``packed_seq_params.cu_seqlens_q`` and ``cu_seqlens_q_padded``.
        unpacked_seqlen: ``S``, the width of the unpacked ``input_ids``.
        cp_group: ``get_context_parallel_group()``: the result is then gathered to every rank.
    """
    scored_lengths = (cu_seqlens[1:] - cu_seqlens[:-1] - 1).clamp(min=0)
    first_tokens = torch.ones_like(scored_lengths)
    scored = response_mask(cu_seqlens_padded, first_tokens, scored_lengths).unsqueeze(0)
    targets = next_token_targets(packed_input_ids, cu_seqlens_padded)
    size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if size > 1:
        held = context_parallel_positions(cu_seqlens_padded, dist.get_rank(cp_group), size)
        targets, scored = targets[:, held], scored[:, held]
    logprob = head.logprobs(output, targets, temperature=temperature, mask=scored)
    if size > 1:
        logprob = context_parallel_gather(logprob, held, packed_input_ids.shape[1], cp_group, gradient="summed")
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
    cp_group: Optional[dist.ProcessGroup] = None,
) -> Tuple[Tensor, Dict[str, Any]]:
    """``NLLLossFn`` (SFT, not DPO) with the gradients finished in the forward: ``-sum(next_token_logprobs
    * mask) / global_valid_toks``, ``mask = token_mask[:, 1:] * sample_mask``. Call it from a loss
    function whose ``input_type`` is ``LossInputType.LOGIT`` (it receives the model's output), for a
    whole micro-batch or a ``SequencePackingLossWrapper`` slice.

    Under context parallelism (``cp_group``: ``get_context_parallel_group()``) ``output`` holds this
    rank's rows, as in ``next_token_logprobs``. Each rank then takes the loss over its own rows and
    returns the whole loss's value; its gradient is what NeMo-RL's loss on the gathered log-probs
    gives it: the gather's backward sums every rank's upstream gradient (``gradient="summed"``),
    CP times its rows' share when every rank backpropagates the whole loss."""
    input_ids = data["input_ids"]
    rows = _RankRows.of(output, input_ids.shape[1] - 1, cp_group)
    mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
    weight = rows.on_this_rank(mask.float() / (global_valid_toks + 1e-8))
    result = head.loss(
        rows.output, rows.on_this_rank(input_ids[:, 1:]), losses.cross_entropy, loss_inputs={"weight": weight},
        mask=rows.on_this_rank(mask.bool()), temperature=temperature,
    )  # fmt: skip
    loss = context_parallel_sum(result.loss, rows.cp_group, gradient="summed")
    return loss, {
        "loss": loss.item(),
        "num_unmasked_tokens": mask.sum().item(),
        "num_valid_samples": data["sample_mask"].sum().item(),
    }
