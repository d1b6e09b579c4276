"""SkyRL 0.4.0 (``trainer.strategy: megatron``): the fused LM head in SkyRL's Megatron worker.

SkyRL's Megatron worker builds the model in ``MegatronPolicyWorkerBase.init_model`` (and the reference
model in ``MegatronRefWorkerBase.init_model``), then hands it to ``MegatronModelWrapper``, whose
``forward`` (``collection_func``: old and reference log-probs) and ``forward_backward_mini_batch``
(``loss_func``: the policy or SFT loss) turn the model's output into per-token log-probs, entropy and
sample-support scores with functions of SkyRL's ``model_utils`` and ``sample_support_replay``. Two
routes, both from what the wrapped model returns (hidden states, never the logits):

1. ``install_fused_heads()``, once per process: those functions' cores (``DistributedLogprob``,
   ``ChunkedDistributedLogprob``, ``vocab_parallel_entropy``, ``vocab_parallel_entropy_weighted_sum``,
   ``sample_support_scores``) compute with the fused head wherever they are handed a wrapped model's
   hidden states (``fused_head_of``), and as SkyRL's own do otherwise (an unwrapped reference model, a
   fallback). Everything else, SkyRL's layouts (padded, packed, SFT packing, context parallelism),
   losses, KL and metrics, is SkyRL's code, unchanged. SkyRL divides the model output by the
   sampling temperature in place before these run (``logits.div_(temperature)``): on hidden states
   that divides the logits (the output layer has no bias), so the cores take no temperature.
2. Three GEMMs for SkyRL's ``cross_entropy`` SFT loss and its ``regular`` / ``dual_clip`` PPO loss
   (``cross_entropy_loss``, ``policy_loss`` on an ``ActionLayout``), for a ``loss_func`` edited to
   take its loss from the head (docs/trainers/skyrl.md): only the scored rows are projected, and the
   gradients are finished in the forward.

SkyRL's layouts (``num_actions = A``; position ``t`` of the output scores token ``t + 1``): each row of
``sequences [B, S]`` holds one left-padded prompt-and-response block, its response-level tensors
``[B, A]`` right-aligned; unpacked (``trainer.remove_microbatch_padding: false``) the output after
``recover_left_padding`` is ``[B, S, ...]``; packed (the default) it is ``[1, T, ...]`` with the rows'
real tokens laid end to end at ``packed_seq_params.cu_seqlens_q_padded``, this rank's ``[1, T / CP,
...]`` under context parallelism.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron_fused_lm import (
    FusedLMConfig,
    FusedLMHead,
    FusedLoss,
    context_parallel_gather,
    context_parallel_positions,
    context_parallel_sum,
    fused_head_of,
    losses,
    next_token_targets,
    tie_to_forward,
    unwrap_model,
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
# SkyRL's k3 estimator clamps the log-ratio, then the estimate (``compute_approx_kl``).
K3_LOG_RATIO_LIMIT, K3_LIMIT = 20.0, 10.0


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
    fused_linear_logprob_vocab_size: Optional[int] = None
    fused_linear_logprob_softcap: Optional[float] = None


def wrap_actor_module(actor_module: list, trainer_cfg: Any) -> FusedLMHead:
    """Wrap the model chunks ``make_megatron_module`` returned (``self.actor_module``) with the settings
    of SkyRL's trainer section (the worker's ``self.cfg``), once, before ``MegatronModelWrapper``.

    Refused (``ValueError``): SkyRL's own fused path (``trainer.fused_lm_head_logprob``) on as well, as
    the two cannot both own the output layer; a model with multi-token-prediction heads, which
    SkyRL 0.4.0 trains whenever the model has them, distilling them against the main logits that the
    fused model does not return; and ``fused_linear_logprob_softcap``: SkyRL divides the model's
    output, here the hidden states, by the sampling temperature before the head, which commutes with
    the product but not with the cap.
    """
    config = FusedLMConfig.from_trainer_config(trainer_cfg)
    if config.enabled and getattr(trainer_cfg, "fused_lm_head_logprob", False):
        raise ValueError("set either trainer.fused_linear_logprob or SkyRL's trainer.fused_lm_head_logprob, not both")
    if config.enabled and config.softcap is not None:
        raise ValueError(
            "fused_linear_logprob_softcap with SkyRL: SkyRL divides the model's output, here the hidden states, by "
            "the sampling temperature before the head, which commutes with the product but not with the cap "
            "(softcap * tanh(z / softcap) / T); this recipe does not undo it yet"
        )
    head = wrap_model(actor_module, config)
    if head.fused and any(getattr(chunk.config, "mtp_num_layers", None) for chunk, _ in head._stock_layers):
        unwrap_model(actor_module)  # the model as it was
        raise ValueError(
            "SkyRL trains a model's multi-token-prediction heads against its main logits, which the fused head "
            "never builds: build the model without MTP layers (mtp_num_layers) or leave fused_linear_logprob off"
        )
    return head


# Where SkyRL 0.4.0 keeps the cores that ``install_fused_heads`` replaces.
_MODEL_UTILS = "skyrl.backends.skyrl_train.distributed.megatron.model_utils"
_WRAPPER = "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper"
_SAMPLE_SUPPORT = "skyrl.backends.skyrl_train.utils.sample_support_replay"


def install_fused_heads() -> None:
    """Make SkyRL's own log-prob, entropy and sample-support code compute with the fused head wherever
    it is handed a wrapped model's hidden states, and as before otherwise; once per process (again: a
    no-op). Imports SkyRL's ``MegatronModelWrapper`` module and the two it takes these from. Its
    ``recover_left_padding``, which lays the unpadded output out anew (a copy, under ``no_grad`` in the
    log-prob pass), ties the copy to the forward that made the output (``tie_to_forward``)."""
    for module_name, name, fused in (
        (_MODEL_UTILS, "DistributedLogprob", _token_logprobs),
        (_MODEL_UTILS, "ChunkedDistributedLogprob", _token_logprobs),
        (_MODEL_UTILS, "vocab_parallel_entropy", _token_entropy),
        (_MODEL_UTILS, "vocab_parallel_entropy_weighted_sum", _weighted_entropy_sum),
        (_WRAPPER, "vocab_parallel_entropy", _token_entropy),
        (_SAMPLE_SUPPORT, "sample_support_scores", _support_scores),
        (_WRAPPER, "recover_left_padding", None),
    ):
        module = importlib.import_module(module_name)
        original = getattr(module, name)
        if not isinstance(original, (_HeadOrStock, _TiedCopy)):
            setattr(module, name, _TiedCopy(original) if fused is None else _HeadOrStock(original, fused))


class _TiedCopy:
    """Stands where SkyRL keeps a function that lays a tensor out anew: its result tied to the forward
    that made its first argument (``tie_to_forward``)."""

    def __init__(self, original: Callable):
        self.original = original

    def __call__(self, source: Tensor, *args, **kwargs):
        return tie_to_forward(self.original(source, *args, **kwargs), source)


class _HeadOrStock:
    """Stands where SkyRL keeps ``original`` (a function, or an autograd Function called through
    ``.apply``): a call whose first argument is a wrapped model's hidden states runs ``fused(head,
    *arguments)``, any other SkyRL's own."""

    def __init__(self, original: Any, fused: Callable):
        self.original, self.fused = original, fused
        self.stock = original.apply if isinstance(original, type) else original

    def __call__(self, source: Tensor, *args, **kwargs):
        head = fused_head_of(source)
        return self.stock(source, *args, **kwargs) if head is None else self.fused(head, source, *args, **kwargs)

    apply = __call__


def _token_logprobs(head: FusedLMHead, hidden: Tensor, target: Tensor, vocab_start_index, vocab_end_index, *rest):
    """``(Chunked)DistributedLogprob.apply(hidden [..., h], target [...] global ids, vocab range,
    [chunk_size,] group, inference_only)``: each row's log-prob of its target, float32 ``[...]``
    (the head knows its own shard, group and chunks)."""
    with torch.no_grad() if rest[-1] else contextlib.nullcontext():  # inference_only: no graph
        return head.logprobs(hidden, target)


def _token_entropy(head: FusedLMHead, hidden: Tensor, chunk_size=None, chunk_memory_mb=512) -> Tensor:
    """``vocab_parallel_entropy(hidden [..., h])``: each row's entropy, float32 ``[...]``, with a
    gradient where gradients are on (SkyRL switches them with ``use_entropy_loss``)."""
    targets = torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device)  # any id: not read back
    return head.logprobs(hidden, targets, return_entropy=True, entropy_grad=torch.is_grad_enabled())[1]


def _weighted_entropy_sum(head: FusedLMHead, hidden: Tensor, weights: Tensor, chunk_size=None, chunk_memory_mb=512):
    """``vocab_parallel_entropy_weighted_sum(hidden [1, T, h], weights [T])``: ``sum_t w_t H_t``,
    projecting only the rows of nonzero weight (SkyRL's action tokens)."""
    weights = weights.reshape(hidden.shape[:-1])
    targets = torch.zeros(weights.shape, dtype=torch.long, device=hidden.device)
    _, entropy = head.logprobs(
        hidden, targets, return_entropy=True, entropy_grad=torch.is_grad_enabled(), mask=weights != 0
    )
    return (entropy * weights).sum()


def _support_scores(
    head: FusedLMHead,
    hidden: Tensor,
    sampled_ids: Tensor,
    support_ids: Tensor,
    *,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group,
    compute_entropy: bool = False,
    entropy_requires_grad: bool = False,
    lm_head_weight: Optional[Tensor] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
):
    """``sample_support_scores`` (sample-support replay): each row's log-prob of its sampled token and
    its entropy, renormalized over the sampler's recorded support (``support_ids [..., top_k]`` int32,
    ``-1`` padding), by the head's kept-token sets; rows without a support score 0 and are not
    valid. A support that lacks its sampled token is an error (``kept_tokens``), where SkyRL would
    score the token against a set without it."""
    if lm_head_weight is not None:
        raise ValueError("sample-support replay on hidden states takes no lm_head_weight: SkyRL's own fused path")
    lead = sampled_ids.shape
    members = support_ids.reshape(lead.numel(), -1).long() >= 0
    valid = members.any(-1)
    counts = members[valid].sum(-1)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    kept_ids = support_ids.reshape(lead.numel(), -1).long()[members & valid[:, None]]
    result = head.logprobs(
        hidden,
        sampled_ids.long(),
        mask=valid.view(lead),
        kept_tokens=(offsets, kept_ids),
        return_entropy=compute_entropy,
        entropy_grad=entropy_requires_grad,
    )
    logprob, entropy = result if compute_entropy else (result, None)
    if entropy is not None:
        entropy = entropy.clamp(min=0.0) if entropy_requires_grad else entropy.detach().clamp(min=0.0)
    scores = importlib.import_module(_SAMPLE_SUPPORT).SampleSupportScores
    return scores(logprobs=logprob, entropy=entropy, valid_mask=valid.view(lead))


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
    """The layout of a packed micro-batch (one row of ``sequences`` per packed sequence), as SkyRL's
    ``from_parallel_logits_to_logprobs_packed_sequences`` maps it: row ``i``'s real tokens (its
    ``attention_mask``) lie in order at ``cu_seqlens_padded[i]``; the packed position of its ``k``-th
    real token scores its ``(k + 1)``-th, and that value fills the action slot of the column where the
    ``k``-th token sits, counted from the row's last ``A + 1`` columns.

    Args:
        packed_targets: int ``[1, T]``: the tokens at their packed positions, all of them, on every
            context-parallel rank (``data["packed_targets"]``).
        cu_seqlens_padded: int ``[B + 1]``: ``packed_seq_params.cu_seqlens_q_padded``.
        attention_mask: ``[B, S]``: the rows' real tokens (``data["attention_mask"]``).
        num_actions: ``A``.
        sub_seq_lengths: SkyRL's SFT sequence packing (several sequences per row): not covered by this
            route (``install_fused_heads`` serves it).
        cp_group: SkyRL's context-parallel group (``mpu.get_context_parallel_group()``) when CP > 1:
            the output then holds this rank's two chunks of every sequence, as SkyRL's
            ``preprocess_packed_seqs`` laid them out.
    """
    if sub_seq_lengths is not None:
        raise NotImplementedError(
            "several sequences per row (SFT's use_sequence_packing) is not covered by the three-GEMM route: "
            "install_fused_heads() serves it"
        )
    real = attention_mask.bool()
    columns = real.shape[1]
    ordinal = real.long().cumsum(1) - 1  # k of each real token
    lengths = real.sum(1)
    # A real token that is not its row's last scores the next one, in the action slot of its column.
    scoring = real & (ordinal < lengths[:, None] - 1)
    first_slot_column = columns - 1 - num_actions
    in_window = scoring & (torch.arange(columns, device=real.device) >= first_slot_column)
    positions = (cu_seqlens_padded[:-1, None].long() + ordinal)[in_window]
    scored = torch.zeros(1, packed_targets.shape[1], dtype=torch.bool, device=packed_targets.device)
    scored[0, positions] = True
    actions = in_window[:, first_slot_column : columns - 1]
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
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """SkyRL's ``action_log_probs [B, A]`` (``token_logprobs[:, -num_actions:]``), and with
    ``with_entropy`` the per-action entropy ``[B, A]``, from what the wrapped model returned (and
    SkyRL divided by the temperature in place). Only the scored rows are projected.
    ``entropy_grad=False`` makes the entropy a metric (``use_entropy_loss: false``). Returns float32
    ``[B, A]`` tensors.
    """
    result = head.logprobs(
        output,
        layout.on_this_rank(layout.targets),
        return_entropy=with_entropy,
        entropy_grad=entropy_grad,
        mask=layout.on_this_rank(layout.scored),
    )
    if with_entropy:
        return tuple(layout.to_actions(layout.everywhere(value)) for value in result)
    return layout.to_actions(layout.everywhere(result))


def layout_loss(head: FusedLMHead, output: Tensor, layout: ActionLayout, loss_fn, per_row_inputs: dict) -> FusedLoss:
    """``head.loss`` over the layout's scored rows, ``per_row_inputs`` given per packed position.

    Under context parallelism each rank's loss covers its own rows, which gives each rank's
    parameters exactly the gradient SkyRL's whole-batch loss gives them through its gathered
    log-probs; its value is made the whole batch's (summed over the group, the gradient left
    alone) and the metrics are gathered, as SkyRL reports them."""
    result = head.loss(
        output,
        layout.on_this_rank(layout.targets),
        loss_fn,
        loss_inputs={name: layout.on_this_rank(value) for name, value in per_row_inputs.items()},
        mask=layout.on_this_rank(layout.scored),
    )
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
) -> FusedLoss:
    """SkyRL's SFT loss (``cross_entropy``: ``sum(-action_log_probs * loss_mask)`` times
    ``num_microbatches * dp_size``) with its gradients finished in the forward.

    ``loss_mask [B, A]``: SkyRL's pre-scaled mask. Returns the ``FusedLoss``; ``layout.to_actions(
    result.logprob)`` gives the detached ``action_log_probs`` for SkyRL's ``loss_fn_outputs``.
    """
    weight = layout.to_rows(loss_mask.float() * grad_sum_correction_factor)
    return layout_loss(head, output, layout=layout, loss_fn=losses.cross_entropy, per_row_inputs={"weight": weight})


@dataclass(frozen=True)
class SkyRLPolicyLoss:
    """SkyRL's ``regular`` / ``dual_clip`` PPO loss with its KL and entropy terms, per token::

        loss_t = pg_weight_t * pg_t + kl_weight_t * kl_t - entropy_weight_t * H_t

    ``pg_t``: ``losses.ClippedPolicyLoss`` (SkyRL's ``ppo_policy_loss``); ``kl_t``: SkyRL's
    ``compute_approx_kl`` estimators ``k1``, ``k2``, ``abs`` and ``k3``, the last with SkyRL's clamps
    (the log-ratio to +-20, the estimate to [-10, 10]). Every input is ``[rows]``.
    """

    policy: losses.ClippedPolicyLoss
    kl_estimator: str = "k3"

    def __call__(self, logprob, entropy, *, old_logprob, advantages, pg_weight, ref_logprob, kl_weight, entropy_weight):
        loss = self.policy(logprob, entropy, old_logprob=old_logprob, advantages=advantages, weight=pg_weight)
        if self.kl_estimator == "abs":
            kl = (logprob - ref_logprob).abs()
        elif self.kl_estimator == "k3":
            log_ratio = (ref_logprob - logprob).clamp(-K3_LOG_RATIO_LIMIT, K3_LOG_RATIO_LIMIT)
            kl = (log_ratio.exp() - log_ratio - 1).clamp(-K3_LIMIT, K3_LIMIT)
        else:
            kl = losses.kl_penalty(logprob, ref_logprob, self.kl_estimator)
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
            clip_low=algorithm.eps_clip_low,
            clip_high=algorithm.eps_clip_high,
            dual_clip=algorithm.clip_ratio_c if algorithm.policy_loss_type == "dual_clip" else None,
        ),
        kl_estimator=algorithm.kl_estimator_type,
    )
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
    return layout_loss(head, output, layout=layout, loss_fn=loss_fn, per_row_inputs=per_row)
