"""SkyRL 0.3.0 (``trainer.strategy: megatron``): the fused LM head in ``MegatronModelWrapper``.

SkyRL's Megatron worker builds the model in ``MegatronPolicyWorkerBase.init_model`` (and the reference
model in ``MegatronRefWorkerBase.init_model``), then hands it to ``MegatronModelWrapper``, whose
``forward`` (``collection_func``: old and reference log-probs) and ``forward_backward_mini_batch``
(``loss_func``: the policy or SFT loss) turn the logits into per-token log-probs with
``from_parallel_logits_to_logprobs`` or ``from_parallel_logits_to_logprobs_packed_sequences`` and into
entropy with ``vocab_parallel_entropy``. Here each of those becomes one ``head.logprobs`` call, and
SkyRL's ``regular`` / ``dual_clip`` PPO loss and its ``cross_entropy`` SFT loss can be taken in the
forward (``head.loss``, three GEMMs).

SkyRL's layouts (``num_actions = A``; position ``t`` of the output scores token ``t + 1``):

- padded (``trainer.remove_microbatch_padding: false``): ``sequences [B, S]``, the output after
  ``recover_left_padding`` is ``[B, S, ...]``, and the action tokens are the last ``A`` columns;
- packed (``remove_microbatch_padding: true``, the default): the output is ``[1, T, ...]`` with the
  sequences laid end to end at ``packed_seq_params.cu_seqlens_q_padded``; ``attention_mask [B, S]``
  marks each row's tokens (left-padded prompt, right-padded response), the response tokens of row
  ``i`` being the marked ones among its last ``A`` columns. Under context parallelism the output is
  this rank's ``[1, T / CP, ...]`` rows (``packed_layout``'s ``cp_group``); the log-probs,
  entropy and loss values come back whole on every rank, as SkyRL's own functions return them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron_fused_lm import (
    FusedLMConfig,
    FusedLMHead,
    FusedLoss,
    context_parallel_gather,
    context_parallel_positions,
    context_parallel_sum,
    losses,
    next_token_targets,
    response_mask,
    wrap_model,
)

Tensor = torch.Tensor

# SkyRL's off-policy correction (trainer.algorithm.off_policy_correction) reweights and masks the
# policy loss; the three-GEMM recipe below does not, so it refuses to run when one of these is set.
OFF_POLICY_CORRECTION_OPTIONS = (
    "tis_ratio_type",
    "sequence_mask_metric",
    "outlier_token_is_threshold_low",
    "outlier_token_is_threshold_high",
    "token_mask_is_threshold_low",
    "token_mask_is_threshold_high",
)


@dataclass
class FusedLMSettings:
    """The fused head's settings, which SkyRL's ``TrainerConfig`` lacks. SkyRL's config parser rejects
    keys a dataclass does not declare, so mix this into a ``TrainerConfig`` subclass (see
    docs/trainers/skyrl.md). SkyRL's own ``logprobs_chunk_size`` (default 1024) sizes its logits loop
    and is not read: the head's Triton path tunes its chunks itself."""

    fused_linear_logprob: bool = False
    fused_linear_logprob_backend: str = "torch"
    fused_linear_logprob_token_chunk: Optional[int] = None
    fused_linear_logprob_batch_invariant: bool = False


def wrap_actor_module(actor_module: list, trainer_cfg: Any) -> FusedLMHead:
    """Wrap the model chunks ``make_megatron_module`` returned (``self.actor_module``) with the settings
    of SkyRL's trainer section (the worker's ``self.cfg``), once, before ``MegatronModelWrapper``.

    SkyRL's own fused path (``trainer.fused_lm_head_logprob``) replaces the output layer through
    GPTModel's ``output_processor`` hook; the two cannot both own the output layer.
    """
    config = FusedLMConfig.from_trainer_config(trainer_cfg)
    if config.enabled and getattr(trainer_cfg, "fused_lm_head_logprob", False):
        raise ValueError("set either trainer.fused_linear_logprob or SkyRL's trainer.fused_lm_head_logprob, not both")
    return wrap_model(actor_module, config)


@dataclass(frozen=True)
class ActionLayout:
    """Where SkyRL's action tokens ``[B, A]`` sit among the rows of one micro-batch's model output.

    Attributes:
        targets: int64, the output's leading shape (``[B, S]`` padded, ``[1, T]`` packed): the token
            each row scores.
        scored: bool, the same shape: the rows that score an action token.
        actions: bool ``[B, A]``: the action slots those rows fill, in row order (all of them when
            padded: SkyRL scores padding slots too, and masks them with its ``loss_mask``).
        rank_rows: under context parallelism, int64 ``[T / CP]``: the packed positions this rank's
            output rows hold, in their order (``targets`` and ``scored`` cover every position);
            ``None`` at CP = 1.
        cp_group: under context parallelism, the group the results are gathered and the losses
            summed over.
    """

    targets: Tensor
    scored: Tensor
    actions: Tensor
    rank_rows: Optional[Tensor] = None
    cp_group: Optional[dist.ProcessGroup] = None

    def on_this_rank(self, per_position: Tensor) -> Tensor:
        """Per-position values ``[1, T]`` -> those of this rank's output rows."""
        return per_position if self.rank_rows is None else per_position[:, self.rank_rows]

    def everywhere(self, per_row: Tensor) -> Tensor:
        """This rank's per-row values ``[1, T / CP]`` -> every position's ``[1, T]``, each rank's rows
        taking back their own gradient, as SkyRL's ``allgather_cp_sharded_packed_tensor`` does."""
        if self.rank_rows is None:
            return per_row
        return context_parallel_gather(per_row, self.rank_rows, self.targets.shape[1], self.cp_group, gradient="local")

    def to_actions(self, per_row: Tensor) -> Tensor:
        """Per-row values (the output's leading shape) -> ``[B, A]``, 0 in unfilled slots."""
        zeros = per_row.new_zeros(self.actions.shape)
        return zeros.masked_scatter(self.actions, per_row[self.scored])

    def to_rows(self, per_action: Tensor) -> Tensor:
        """``[B, A]`` values -> the output's leading shape, 0 on rows that score no action."""
        zeros = per_action.new_zeros(self.scored.shape)
        return zeros.masked_scatter(self.scored, per_action[self.actions])


def padded_layout(sequences: Tensor, num_actions: int) -> ActionLayout:
    """The layout of a padded micro-batch: ``sequences`` int ``[B, S]``, the output ``[B, S, ...]``."""
    scored = torch.zeros(sequences.shape, dtype=torch.bool, device=sequences.device)
    scored[:, -num_actions - 1 : -1] = True
    actions = torch.ones(sequences.shape[0], num_actions, dtype=torch.bool, device=sequences.device)
    return ActionLayout(sequences.roll(shifts=-1, dims=1), scored, actions)


def packed_layout(
    packed_targets: Tensor,
    cu_seqlens_padded: Tensor,
    attention_mask: Tensor,
    num_actions: int,
    sub_seq_lengths: Optional[list] = None,
    cp_group: Optional[dist.ProcessGroup] = None,
) -> ActionLayout:
    """The layout of a packed micro-batch (one sequence per row).

    Args:
        packed_targets: int ``[1, T]``: the tokens at their packed positions, all of them, on every
            context-parallel rank (``data["packed_targets"]``).
        cu_seqlens_padded: int ``[B + 1]``: ``packed_seq_params.cu_seqlens_q_padded``.
        attention_mask: ``[B, S]``: the rows' tokens (``data["attention_mask"]``).
        num_actions: ``A``.
        sub_seq_lengths: SkyRL's controller-side packing (several sequences per row); not covered.
        cp_group: SkyRL's context-parallel group (``mpu.get_context_parallel_group()``) when CP > 1:
            the output then holds this rank's two chunks of every sequence, as SkyRL's
            ``preprocess_packed_seqs`` laid them out.
    """
    if sub_seq_lengths is not None:
        raise NotImplementedError("several sequences per row (use_sequence_packing) is not covered by this recipe")
    actions = attention_mask[:, -num_actions:].bool()
    response_lengths = actions.sum(dim=1)
    prompt_lengths = attention_mask.bool().sum(dim=1) - response_lengths
    scored = response_mask(cu_seqlens_padded, prompt_lengths, response_lengths).unsqueeze(0)
    layout = ActionLayout(next_token_targets(packed_targets, cu_seqlens_padded), scored, actions)
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return layout
    rows = context_parallel_positions(cu_seqlens_padded, dist.get_rank(cp_group), dist.get_world_size(cp_group))
    return dataclasses.replace(layout, rank_rows=rows.to(packed_targets.device), cp_group=cp_group)


def action_log_probs(
    head: FusedLMHead,
    output: Tensor,
    layout: ActionLayout,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """SkyRL's ``action_log_probs [B, A]`` (``token_logprobs[:, -num_actions:]``), and with
    ``with_entropy`` the per-action entropy ``[B, A]``, from what the wrapped model returned.

    Only the scored rows are projected. ``temperature`` replaces SkyRL's in-place ``logits.div_``;
    ``entropy_grad=False`` makes the entropy a metric (``use_entropy_loss: false``).
    Returns float32 ``[B, A]`` tensors.
    """
    result = head.logprobs(
        output, layout.on_this_rank(layout.targets), temperature=temperature, return_entropy=with_entropy,
        entropy_grad=entropy_grad, mask=layout.on_this_rank(layout.scored),
    )  # fmt: skip
    if with_entropy:
        return tuple(layout.to_actions(layout.everywhere(value)) for value in result)
    return layout.to_actions(layout.everywhere(result))


def layout_loss(
    head: FusedLMHead, output: Tensor, layout: ActionLayout, loss_fn, per_row_inputs: dict, temperature: float
) -> FusedLoss:
    """``head.loss`` over the layout's scored rows, ``per_row_inputs`` given per packed position.

    Under context parallelism each rank's loss covers its own rows, which gives each rank's
    parameters exactly the gradient SkyRL's whole-batch loss gives them through its gathered
    log-probs; its value is made the whole batch's (summed over the group, the gradient left
    alone) and the metrics are gathered, as SkyRL reports them."""
    result = head.loss(
        output, layout.on_this_rank(layout.targets), loss_fn,
        loss_inputs={name: layout.on_this_rank(value) for name, value in per_row_inputs.items()},
        mask=layout.on_this_rank(layout.scored), temperature=temperature,
    )  # fmt: skip
    if layout.cp_group is None:
        return result
    return FusedLoss(
        context_parallel_sum(result.loss, layout.cp_group, gradient="local"),
        layout.everywhere(result.logprob),
        layout.everywhere(result.entropy),
    )


def cross_entropy_loss(
    head: FusedLMHead,
    output: Tensor,
    layout: ActionLayout,
    loss_mask: Tensor,
    grad_sum_correction_factor: float,
    temperature: float = 1.0,
) -> FusedLoss:
    """SkyRL's SFT loss (``cross_entropy``: ``sum(-action_log_probs * loss_mask)`` times
    ``num_microbatches * dp_size``) with its gradients finished in the forward.

    ``loss_mask [B, A]``: SkyRL's pre-scaled mask. Returns the ``FusedLoss``; ``layout.to_actions(
    result.logprob)`` gives the detached ``action_log_probs`` for SkyRL's ``loss_fn_outputs``.
    """
    weight = layout.to_rows(loss_mask.float() * grad_sum_correction_factor)
    return layout_loss(head, output, layout, losses.cross_entropy, {"weight": weight}, temperature)


@dataclass(frozen=True)
class SkyRLPolicyLoss:
    """SkyRL's ``regular`` / ``dual_clip`` PPO loss with its KL and entropy terms, per token::

        loss_t = pg_weight_t * pg_t + kl_weight_t * kl_t - entropy_weight_t * H_t

    ``pg_t``: ``losses.ClippedPolicyLoss`` (SkyRL's ``ppo_policy_loss``); ``kl_t``: SkyRL's
    ``compute_approx_kl`` estimators ``k1``, ``k2``, ``abs`` and ``k3`` (capped at 10 as SkyRL caps it).
    Every input is ``[rows]``.
    """

    policy: losses.ClippedPolicyLoss
    kl_estimator: str = "k3"

    def __call__(self, logprob, entropy, *, old_logprob, advantages, pg_weight, ref_logprob, kl_weight, entropy_weight):
        loss = self.policy(logprob, entropy, old_logprob=old_logprob, advantages=advantages, weight=pg_weight)
        if self.kl_estimator == "abs":
            kl = (logprob - ref_logprob).abs()
        else:
            kl = losses.kl_penalty(logprob, ref_logprob, self.kl_estimator)
            if self.kl_estimator == "k3":
                kl = kl.clamp(max=10.0)
        return loss + kl_weight * kl - entropy_weight * entropy


def policy_loss(
    head: FusedLMHead,
    output: Tensor,
    layout: ActionLayout,
    *,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    base_log_probs: Optional[Tensor],
    rollout_log_probs: Optional[Tensor],
    algorithm: Any,
    grad_sum_correction_factor: float,
    kl_entropy_microbatch_scale: float,
    temperature: float = 1.0,
) -> FusedLoss:
    """The loss ``loss_func`` returns for SkyRL's ``regular`` and ``dual_clip`` policy losses:
    ``policy_loss * grad_sum_correction_factor + (kl_loss_coef * kl - entropy_loss_coef * entropy)
    * kl_entropy_microbatch_scale``, with the gradients finished in the forward.

    Args:
        old_log_probs, advantages, loss_mask, base_log_probs, rollout_log_probs: SkyRL's micro-batch
            fields ``[B, A]`` (advantages already scaled for ``loss_reduction``); ``base_log_probs``
            is read only with ``use_kl_loss``, ``rollout_log_probs`` may be ``None``.
        algorithm: SkyRL's ``trainer.algorithm`` (``AlgorithmConfig``).
        grad_sum_correction_factor: ``num_microbatches * dp_size``.
        kl_entropy_microbatch_scale: ``num_microbatches / max(1, num_real_microbatches)``.

    Raises:
        NotImplementedError: another ``policy_loss_type``, or an active off-policy correction: use
            ``action_log_probs`` with SkyRL's own loss for those.
    """
    if algorithm.policy_loss_type not in ("regular", "dual_clip"):
        raise NotImplementedError(f"policy_loss_type {algorithm.policy_loss_type!r}: use action_log_probs")
    correction = algorithm.off_policy_correction
    if rollout_log_probs is not None and any(
        getattr(correction, name) is not None for name in OFF_POLICY_CORRECTION_OPTIONS
    ):
        raise NotImplementedError("off-policy correction reweights the loss per token: use action_log_probs")
    mask = loss_mask.float()
    entropy_coef = algorithm.entropy_loss_coef if algorithm.use_entropy_loss else 0.0
    kl_coef = algorithm.kl_loss_coef if algorithm.use_kl_loss else 0.0
    loss_fn = SkyRLPolicyLoss(
        losses.ClippedPolicyLoss(
            clip_low=algorithm.eps_clip_low, clip_high=algorithm.eps_clip_high,
            dual_clip=algorithm.clip_ratio_c if algorithm.policy_loss_type == "dual_clip" else None,
        ),
        kl_estimator=algorithm.kl_estimator_type,
    )  # fmt: skip
    # SkyRL's KL term is the mean over sequences of each sequence's masked mean (of a KL it already
    # masked: hence the mask squared); its entropy term is the masked mean over the micro-batch.
    scale = kl_entropy_microbatch_scale
    kl_weight = mask.square() * (kl_coef * scale / mask.shape[0]) / mask.sum(1, keepdim=True).clamp(min=1)
    per_action = {
        "old_logprob": old_log_probs,
        "advantages": advantages,
        "pg_weight": mask * grad_sum_correction_factor,
        "ref_logprob": base_log_probs if algorithm.use_kl_loss else old_log_probs,
        "kl_weight": kl_weight,
        "entropy_weight": mask * (entropy_coef * scale) / mask.sum().clamp(min=1),
    }
    per_row = {name: layout.to_rows(value.float()) for name, value in per_action.items()}
    return layout_loss(head, output, layout, loss_fn, per_row, temperature)
