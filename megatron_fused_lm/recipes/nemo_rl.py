"""NeMo-RL (NVIDIA-NeMo/RL, the Megatron policy worker): the fused LM head where NeMo-RL turns the
model's output into next-token log-probs.

NeMo-RL builds the model in ``setup_model_and_optimizer`` (``nemo_rl.models.megatron.setup``), whose
``ModelAndOptimizerState.model`` the worker (``MegatronPolicyWorkerImpl``) keeps as ``self.model``.
Every forward goes through ``forward_with_post_processing_fn`` (``nemo_rl.models.megatron.train``),
which hands the model's output to one of three post-processors: ``LossPostProcessor`` (training; its
``prepare_fn``, by default ``nemo_rl.algorithms.loss.utils.prepare_loss_input``, turns the output into
the loss's input by the loss's ``input_type``), ``LogprobsPostProcessor`` (the log-prob pass) and
``TopkLogitsPostProcessor`` (a distillation teacher). The settings live in the ``policy`` section of
the YAML config (a plain dict). Shapes are NeMo-RL's: ``input_ids [B, S]`` right-padded, next-token
log-probs ``[B, S - 1]``.

The temperature is taken once, by NeMo-RL: before any of the three post-processors runs,
``forward_with_post_processing_fn`` divides the model's output in place by the sampling temperature
(``apply_temperature_scaling``). With the fused head that output is the hidden states, and as the
output layer has no bias, ``(hidden / T) @ W.T`` is ``logits / T``: the functions below take no
temperature.

What a user combines with NeMo-RL's classes (this module never imports NeMo-RL): the mixins
``LossPostProcessorMixin``, ``LogprobsPostProcessorMixin`` and ``TopkLogitsPostProcessorMixin``, first
in the bases of a subclass of the post-processor of the same name, and ``NLLLossMixin`` with
``NLLLossFn`` for the SFT loss with its gradients finished in the forward. Under context parallelism
(which NeMo-RL runs with sequence packing) the output holds this rank's two chunks of every packed
sequence and the log-probs come back whole on every rank, as NeMo-RL's functions return them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

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

# The loss input types (``LossInputType``, compared by name) this recipe computes from hidden states.
SERVED_INPUT_TYPES = ("LOGPROB", "DISTILLATION")
_REFUSED_INPUT_TYPES = {
    "LOGIT": "it receives the model's output as logits [B, S, V/TP], and the fused model returns hidden states",
    "DISTILLATION_CROSS_TOKENIZER": "it projects the student's full-vocabulary logits onto the teachers' vocabularies",
    "DRAFT": "the draft model learns from the policy's logits",
}


def wrap_policy_model(model: Any, policy_cfg: Dict[str, Any]) -> FusedLMHead:
    """Wrap ``ModelAndOptimizerState.model`` (what the worker keeps as ``self.model``: DDP or
    Float16Module around the GPTModel) with the settings of the ``policy`` section.

    Raises, when the section enables the fused head, for what it cannot serve:
        ValueError: ``policy.megatron_cfg.use_fused_linear_logprobs`` (NeMo-RL's own Linear-CE
            fusion replaces GPTModel's forward; the two cannot both own the output layer).
        NotImplementedError: ``policy.generation.top_k`` / ``top_p`` filtering (NeMo-RL then
            renormalizes the trainer's log-probs over the kept tokens of the full logits),
            ``policy.sequence_packing.fuse_loss`` (its loss wrapper takes no custom ``prepare_fn``) and
            ``fused_linear_logprob_softcap`` at a ``policy.generation.temperature`` other than 1
            (NeMo-RL divides the hidden states by it before the head: that commutes with the
            product, not with the cap).
    """
    config = FusedLMConfig.from_trainer_config(policy_cfg)
    if config.enabled:
        if policy_cfg.get("megatron_cfg", {}).get("use_fused_linear_logprobs", False):
            raise ValueError("set either policy.fused_linear_logprob or policy.megatron_cfg.use_fused_linear_logprobs")
        generation = policy_cfg.get("generation") or {}
        _refuse_filtering(generation.get("top_k"), generation.get("top_p", 1.0), "policy.generation")
        packing = policy_cfg.get("sequence_packing") or {}
        if packing.get("enabled", False) and packing.get("fuse_loss", False):
            raise NotImplementedError(
                "policy.sequence_packing.fuse_loss: NeMo-RL's SequencePackingFusionLossWrapper takes no custom "
                "prepare_fn; set it to false (SequencePackingLossWrapper then serves the fused head)"
            )
        temperature = generation.get("temperature", 1.0)
        if config.softcap is not None and temperature not in (None, 1, 1.0):
            raise NotImplementedError(
                f"fused_linear_logprob_softcap at policy.generation.temperature={temperature}: NeMo-RL divides the "
                "model's output, here the hidden states, by the temperature before the head, which commutes with "
                "the product but not with the cap (softcap * tanh(z / softcap) / T); sample at temperature 1 or "
                "leave the softcap off"
            )
    return wrap_model(model, config)


def _refuse_filtering(top_k: Optional[int], top_p: Optional[float], where: str) -> None:
    """NotImplementedError where NeMo-RL would filter (``need_top_k_or_top_p_filtering``: ``top_k > 0``
    or ``top_p != 1``): its log-probs are then over each position's kept tokens of the full logits."""
    asked = []
    if top_k is not None and top_k > 0:
        asked.append(f"{where}.top_k = {top_k}")
    if top_p is not None and top_p != 1.0:
        asked.append(f"{where}.top_p = {top_p}")
    if asked:
        raise NotImplementedError(
            f"{' and '.join(asked)}: NeMo-RL renormalizes the trainer's log-probs over the tokens top-k / top-p keeps "
            "of the full logits, which the fused head does not build; turn fused_linear_logprob off for this run"
        )


def _refuse_sampling_filtering(sampling_params: Any, where: str) -> None:
    """``_refuse_filtering`` for a ``TrainingSamplingParams`` (or ``None``)."""
    if sampling_params is not None:
        _refuse_filtering(sampling_params.top_k, sampling_params.top_p, where)


@dataclass(frozen=True)
class _RankRows:
    """The output rows of this rank that score ``positions`` positions of ``[B, positions]``
    per-position inputs: at CP = 1 the first ``positions`` rows; under CP this rank's rows
    (``context_parallel_positions``) of each row padded to ``width = rows x CP`` positions, the
    padding scoring nothing."""

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
        """``[B, positions, ...]`` -> this rank's rows ``[B, rows, ...]``."""
        if self.held is None:
            return per_position
        padding = (0, 0) * (per_position.dim() - 2) + (0, self.width - self.positions)
        return torch.nn.functional.pad(per_position, padding)[:, self.held]

    def everywhere(self, per_row: Tensor) -> Tensor:
        """This rank's per-row results ``[B, rows, ...]`` -> ``[B, positions, ...]`` on every rank; the
        backward sums every rank's upstream gradients, as NeMo-RL's ``AllGatherCPTensor`` does."""
        if self.held is None:
            return per_row
        rows_last = per_row.movedim(1, -1)  # context_parallel_gather gathers the last dimension
        every = context_parallel_gather(rows_last, self.held, self.width, self.cp_group, gradient="summed")
        return every.movedim(-1, 1)[:, : self.positions]


def next_token_logprobs(
    head: FusedLMHead, output: Tensor, input_ids: Tensor, cp_group: Optional[dist.ProcessGroup] = None
) -> Tensor:
    """``get_next_token_logprobs_from_logits`` with the fused head: float32 ``[B, S - 1]``, entry ``t``
    scoring ``input_ids[:, t + 1]``, at the temperature NeMo-RL divided ``output`` by.

    Args:
        output: ``[B, S', h]`` hidden states (the logits shard when the head is not fused), ``S'``
            possibly longer than ``S`` (a packed sequence's padding): its first ``S - 1`` rows are
            used. Under context parallelism (``cp_group`` with more than one rank) this rank's
            rows of every row of ``input_ids`` padded to ``S' x CP``.
        input_ids: int ``[B, S]``.
        cp_group: ``get_context_parallel_group()``: the result is then gathered to every rank, as
            NeMo-RL's ``from_parallel_logits_to_logprobs`` gathers it (its backward sums the ranks'
            gradients).
    """
    rows = _RankRows.of(output, input_ids.shape[1] - 1, cp_group)
    logprob = head.logprobs(rows.output, rows.on_this_rank(input_ids[:, 1:]), mask=rows.mask)
    return rows.everywhere(logprob)


def packed_next_token_logprobs(
    head: FusedLMHead,
    output: Tensor,
    packed_input_ids: Tensor,
    input_lengths: Tensor,
    cu_seqlens_padded: Tensor,
    unpacked_seqlen: int,
    cp_group: Optional[dist.ProcessGroup] = None,
) -> Tensor:
    """The log-prob pass of a packed micro-batch (``LogprobsPostProcessor``'s packed branch): float32
    ``[B, S - 1]``, right-padded with 0 past each sequence's last scored token.

    Args:
        output: ``[1, T, h]``, or under context parallelism this rank's ``[1, T / CP, h]``.
        packed_input_ids: int ``[1, T]``, the sequences at ``cu_seqlens_padded`` (all of them under
            CP): the ``input_ids`` NeMo-RL's forward step hands the post-processor.
        input_lengths: int ``[B]``, each sequence's tokens (``data_dict["input_lengths"]``).
        cu_seqlens_padded: int ``[B + 1]``, the padded boundaries (``cu_seqlens_padded``, also
            ``packed_seq_params.cu_seqlens_q``, which NeMo-RL sets to the padded ones).
        unpacked_seqlen: ``S``, the width of the unpacked ``input_ids``.
        cp_group: ``get_context_parallel_group()``: the result is then gathered to every rank.
    """
    input_lengths = input_lengths.to(device=cu_seqlens_padded.device, dtype=torch.long)
    scored_lengths = (input_lengths - 1).clamp(min=0)
    first_tokens = (input_lengths > 0).long()  # an empty sequence scores nothing
    scored = response_mask(cu_seqlens_padded, first_tokens, scored_lengths).unsqueeze(0)
    targets = next_token_targets(packed_input_ids, cu_seqlens_padded)
    size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if size > 1:
        held = context_parallel_positions(cu_seqlens_padded, dist.get_rank(cp_group), size)
        targets, scored = targets[:, held], scored[:, held]
    logprob = head.logprobs(output, targets, mask=scored)
    if size > 1:
        logprob = context_parallel_gather(logprob, held, packed_input_ids.shape[1], cp_group, gradient="summed")
    pieces = split_responses(logprob, cu_seqlens_padded, first_tokens, scored_lengths)
    unpacked = logprob.new_zeros(len(pieces), unpacked_seqlen - 1)
    for row, piece in enumerate(pieces):
        unpacked[row, : piece.shape[0]] = piece
    return unpacked


def distillation_topk_logprobs(
    head: FusedLMHead,
    output: Tensor,
    data: Any,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    cp_group: Optional[dist.ProcessGroup] = None,
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``get_distillation_topk_logprobs_from_logits`` with the fused head, what a ``DISTILLATION``
    loss (``DistillationLossFn``) receives: the student's row ``t`` scored at the teacher's top-k ids
    of position ``t``, for ``t < S - 1``.

    Args:
        output: ``[B, S', h]`` (``S' >= S - 1``), as for ``next_token_logprobs``; CP = 1 only.
        data: with ``teacher_topk_indices`` int ``[B, S, k]`` and ``teacher_topk_logits`` ``[B, S, k]``.
        zero_outside_topk: ``True``: the student's log-probs over the whole vocabulary at those ids;
            ``False``: renormalized over the ``k`` ids (``log_softmax`` of the student's logits there).
        calculate_entropy: also ``H_all = sum_v p_v log p_v`` over the whole vocabulary (minus the
            entropy).

    Returns:
        ``(student_topk_logprobs [B, S - 1, k], teacher_topk_logprobs [B, S - 1, k], H_all [B, S - 1]
        or None)``, float32; the teacher's log-probs are ``log_softmax`` of its top-k logits.
    """
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        raise NotImplementedError(
            "DISTILLATION losses under context parallelism: not yet served by the fused head; turn "
            "fused_linear_logprob off for CP > 1 distillation"
        )
    indices = data["teacher_topk_indices"]
    positions = indices.shape[1] - 1
    rows = _RankRows.of(output, positions, cp_group)
    found = head.logprobs(rows.output, indices[:, :positions].to(output.device), return_entropy=calculate_entropy)
    student, entropy = found if calculate_entropy else (found, None)
    if not zero_outside_topk:
        # log_softmax over the k ids of the logits equals that of their full-vocabulary log-probs.
        student = student - torch.logsumexp(student, dim=-1, keepdim=True)
    teacher = torch.log_softmax(data["teacher_topk_logits"].to(student.device, torch.float32), dim=-1)
    return student, teacher[:, :positions], None if entropy is None else -entropy


@dataclass(frozen=True)
class FusedLMInput:
    """What ``prepare_loss_input`` hands a loss with ``NLLLossMixin`` (as its one keyword
    ``fused_lm_input``, which no NeMo-RL loss takes): the model's output rows and how to compute
    them."""

    output: Tensor  # [B, S', h] hidden states (under CP this rank's rows)
    head: FusedLMHead
    cp_group: Optional[dist.ProcessGroup] = None


def _input_type(loss_fn: Any) -> str:
    """The loss's ``input_type`` by name (``LossInputType`` is NeMo-RL's enum), after refusing what
    the fused head cannot serve: NotImplementedError naming the input type and the loss class."""
    loss_name = type(loss_fn).__name__
    if getattr(loss_fn, "use_fused_linear_logprobs", False):
        raise NotImplementedError(
            f"{loss_name}(use_fused_linear_logprobs=True) reads NeMo-RL's own fused log-probs: with the fused head "
            "build the loss with use_fused_linear_logprobs=False"
        )
    if isinstance(loss_fn, NLLLossMixin):
        return "FUSED_NLL"
    kind = getattr(getattr(loss_fn, "input_type", None), "name", None)
    if kind in SERVED_INPUT_TYPES:
        return kind
    why = _REFUSED_INPUT_TYPES.get(kind, "the recipe does not know this input type")
    raise NotImplementedError(
        f"{loss_name} takes input type {kind}: {why}. The fused head serves LOGPROB and DISTILLATION losses (and "
        "NLLLossMixin's); turn fused_linear_logprob off for this loss"
    )


def prepare_loss_input(
    logits: Tensor,
    data: Any,
    loss_fn: Any,
    vocab_parallel_rank: Optional[int] = None,
    vocab_parallel_group: Optional[dist.ProcessGroup] = None,
    context_parallel_group: Optional[dist.ProcessGroup] = None,
    *,
    head: FusedLMHead,
) -> Tuple[Dict[str, Any], Any]:
    """A ``prepare_fn`` for ``LossPostProcessor`` (``functools.partial(prepare_loss_input, head=head)``;
    ``LossPostProcessorMixin`` passes it), for whole micro-batches and the per-sequence slices of
    ``SequencePackingLossWrapper`` alike, under context parallelism too. ``logits`` is the model's
    output, hidden states ``[B, S', h]`` already divided by the temperature by NeMo-RL; the
    vocabulary-parallel rank and group are the head's own, so those two arguments are not read.

    By the loss's ``input_type``:
        LOGPROB: ``{"next_token_logprobs": [B, S - 1]}`` float32 (``NLLLossFn``, ``ClippedPGLossFn``,
            ``DPOLossFn``).
        DISTILLATION: ``distillation_topk_logprobs``'s three (``DistillationLossFn``), CP = 1.
        a loss with ``NLLLossMixin``: ``{"fused_lm_input": FusedLMInput}``, for its three-GEMM loss.
        anything else (``LOGIT``: ``PreferenceLossFn``, ``MseValueLossFn``;
            ``DISTILLATION_CROSS_TOKENIZER``; ``DRAFT``), or a loss built with
            ``use_fused_linear_logprobs``: NotImplementedError naming the input type and the loss.
    """
    kind = _input_type(loss_fn)
    if kind == "FUSED_NLL":
        return {"fused_lm_input": FusedLMInput(logits, head, context_parallel_group)}, data
    if kind == "DISTILLATION":
        calculate_entropy = loss_fn.zero_outside_topk and loss_fn.kl_type != "forward"  # as NeMo-RL decides
        student, teacher, entropy = distillation_topk_logprobs(
            head,
            logits,
            data=data,
            zero_outside_topk=loss_fn.zero_outside_topk,
            calculate_entropy=calculate_entropy,
            cp_group=context_parallel_group,
        )
        return {"student_topk_logprobs": student, "teacher_topk_logprobs": teacher, "H_all": entropy}, data
    return {"next_token_logprobs": next_token_logprobs(head, logits, data["input_ids"], context_parallel_group)}, data


def nll_loss(
    head: FusedLMHead,
    output: Tensor,
    data: Any,
    global_valid_toks: Tensor,
    cp_group: Optional[dist.ProcessGroup] = None,
) -> Tuple[Tensor, Dict[str, Any]]:
    """``NLLLossFn`` (SFT, not DPO) with the gradients finished in the forward (three GEMMs):
    ``-sum(next_token_logprobs * mask) / global_valid_toks``, ``mask = token_mask[:, 1:] *
    sample_mask``, for a whole micro-batch or a ``SequencePackingLossWrapper`` slice.

    Args:
        output: as for ``next_token_logprobs`` (already divided by the temperature by NeMo-RL).
        data: ``input_ids`` int ``[B, S]``, ``token_mask`` ``[B, S]``, ``sample_mask`` ``[B]``.
        global_valid_toks: float scalar tensor, the step's valid tokens over all micro-batches and ranks.
        cp_group: ``get_context_parallel_group()``. Each rank then takes the loss over its own rows
            and returns the whole loss's value; its gradient is what NeMo-RL's loss on the gathered
            log-probs gives it: the gather's backward sums every rank's upstream gradient
            (``gradient="summed"``), CP times its rows' share when every rank backpropagates the
            whole loss.

    Returns:
        ``(loss, metrics)``: a float32 scalar and ``NLLLossFn``'s metrics.
    """
    input_ids = data["input_ids"]
    rows = _RankRows.of(output, input_ids.shape[1] - 1, cp_group)
    mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
    weight = rows.on_this_rank(mask.float() / (global_valid_toks + 1e-8))
    result = head.loss(
        rows.output,
        rows.on_this_rank(input_ids[:, 1:]),
        losses.cross_entropy,
        loss_inputs={"weight": weight},
        mask=rows.on_this_rank(mask.bool()),
    )
    loss = context_parallel_sum(result.loss, rows.cp_group, gradient="summed")
    return loss, {
        "loss": loss.detach().item(),
        "num_unmasked_tokens": mask.sum().item(),
        "num_valid_samples": data["sample_mask"].sum().item(),
    }


class NLLLossMixin:
    """Mix into NeMo-RL's ``NLLLossFn`` (first in the bases): the SFT loss with its gradients finished
    in the forward (``nll_loss``) when ``prepare_loss_input`` hands it the model's output
    (``fused_lm_input``); given ``next_token_logprobs`` (NeMo-RL's own ``prepare_loss_input``, a head
    that is not fused) it is ``NLLLossFn``. Its ``input_type`` stays ``LOGPROB``, so NeMo-RL's own
    preparation never hands it logits. DPO's use of ``NLLLossFn`` (``dpo_loss=True``) is refused."""

    def __call__(
        self,
        next_token_logprobs: Optional[Tensor] = None,
        data: Any = None,
        global_valid_seqs: Optional[Tensor] = None,
        global_valid_toks: Optional[Tensor] = None,
        *,
        fused_lm_input: Optional[FusedLMInput] = None,
        **options: Any,
    ) -> Tuple[Tensor, Dict[str, Any]]:
        if fused_lm_input is None:
            return super().__call__(next_token_logprobs, data, global_valid_seqs, global_valid_toks, **options)
        if any(options.values()):
            raise NotImplementedError(f"{type(self).__name__} in the forward is SFT only, got {sorted(options)}")
        fused = fused_lm_input
        return nll_loss(
            fused.head, fused.output, data=data, global_valid_toks=global_valid_toks, cp_group=fused.cp_group
        )


class LossPostProcessorMixin:
    """Mix into NeMo-RL's ``LossPostProcessor`` (first in the bases) and add ``head=`` to its
    arguments: with a fused head it prepares the loss's input with ``prepare_loss_input``, refusing
    at construction what that cannot serve (the loss's input type, top-k / top-p in its
    ``sampling_params``, ``sequence_packing.fuse_loss``, a draft model, a ``prepare_fn`` of the
    caller's); with a stock head it is ``LossPostProcessor``."""

    def __init__(self, *args: Any, head: FusedLMHead, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head = head
        if not head.fused:
            return
        name = type(self).__name__
        if self.prepare_fn is not None:
            raise ValueError(f"{name} prepares the loss input with the fused head: pass no prepare_fn")
        if kwargs.get("draft_model") is not None:
            raise NotImplementedError(f"{name}: {_REFUSED_INPUT_TYPES['DRAFT']} (DRAFT); turn fused_linear_logprob off")
        _refuse_sampling_filtering(self.sampling_params, f"{name}.sampling_params")
        packing = self.cfg.get("sequence_packing") or {}
        if packing.get("enabled", False) and packing.get("fuse_loss", False):
            raise NotImplementedError(f"{name}: sequence_packing.fuse_loss takes no custom prepare_fn; set it to false")
        _input_type(self.loss_fn)
        self.prepare_fn = functools.partial(prepare_loss_input, head=head)


class LogprobsPostProcessorMixin:
    """Mix into NeMo-RL's ``LogprobsPostProcessor`` (first in the bases) and add ``head=`` to its
    arguments: with a fused head the log-prob pass computes from the hidden states, unpacked
    (``next_token_logprobs``) or packed (``packed_next_token_logprobs``, the lengths from
    ``data_dict["input_lengths"]``), gathered over context parallelism, and returns what NeMo-RL's
    returns: ``{"logprobs": [B, S]}`` float32 with a leading 0 column (past a packed sequence's end 0,
    where NeMo-RL's leaves the padding's log-probs; its losses mask both). Top-k / top-p in its
    ``sampling_params`` and ``use_fused_linear_logprobs`` are refused at construction. With a stock
    head it is ``LogprobsPostProcessor``."""

    def __init__(self, *args: Any, head: FusedLMHead, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head = head
        if head.fused:
            if self.use_fused_linear_logprobs:
                raise ValueError(
                    "set either policy.fused_linear_logprob or policy.megatron_cfg.use_fused_linear_logprobs"
                )
            _refuse_sampling_filtering(self.sampling_params, f"{type(self).__name__}.sampling_params")

    def __call__(self, data_dict: Any, input_ids: Tensor, cu_seqlens_padded: Optional[Tensor]):
        if not self.head.fused:
            return super().__call__(data_dict, input_ids, cu_seqlens_padded)
        unpacked_ids = data_dict["input_ids"]
        packed = self.cfg["sequence_packing"]["enabled"] and cu_seqlens_padded is not None

        def processor(output: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
            cp_group = parallel_state.get_context_parallel_group()
            if packed:
                logprobs = packed_next_token_logprobs(
                    self.head,
                    output,
                    packed_input_ids=input_ids,
                    input_lengths=data_dict["input_lengths"],
                    cu_seqlens_padded=cu_seqlens_padded,
                    unpacked_seqlen=unpacked_ids.shape[1],
                    cp_group=cp_group,
                )
            else:
                logprobs = next_token_logprobs(self.head, output, unpacked_ids, cp_group)
            logprobs = torch.cat([torch.zeros_like(logprobs[:, :1]), logprobs], dim=1)  # NeMo-RL's first column
            return logprobs.new_zeros(()), {"logprobs": logprobs}

        return processor


class TopkLogitsPostProcessorMixin:
    """Mix into NeMo-RL's ``TopkLogitsPostProcessor`` (first in the bases) and add ``head=``: with a
    fused head it refuses at construction: NeMo-RL's teacher returns its top-k logits, and the fused
    head computes top-k log-probs (``head.topk``), which differ from them by each position's
    log-normalizer, so a teacher wrapped with it would hand over wrong values under the name of logits.
    Keep ``fused_linear_logprob`` off in the teacher's policy section. With a stock head it is
    ``TopkLogitsPostProcessor``."""

    def __init__(self, *args: Any, head: FusedLMHead, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head = head
        if head.fused:
            raise NotImplementedError(
                f"{type(self).__name__}: the teacher's top-k logits need the logits, and the fused head gives top-k "
                "log-probs only; set fused_linear_logprob: false in the teacher's policy section"
            )
