"""slime (THUDM/slime, Megatron backend): the fused LM head where slime computes log-probs.

slime builds the model in ``setup_model_and_optimizer`` (``slime.backends.megatron_utils.model``,
``model = get_model(...)``) and computes every per-token log-prob and entropy, for the old and
reference log-prob passes (``forward_only``) as for its losses (``policy_loss_function``,
``sft_loss_function``), in ``get_log_probs_and_entropy`` (``slime.backends.megatron_utils.loss``) from
the model's output ``[1, T, ...]``: the micro-batch's sequences laid end to end (``batch["tokens"]``)
and padded at the end; under context parallelism, this rank's two chunks of every sequence. The
settings are command-line flags (argparse), read from ``args``.

slime loads custom code by module path (``--custom-loss-function-path``), so the head of this process
is kept here by ``wrap_slime_model`` for the loss functions below to find.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from megatron.core import parallel_state

from megatron_fused_lm import (
    FusedLMConfig,
    FusedLMHead,
    context_parallel_positions,
    losses,
    next_token_targets,
    response_mask,
    wrap_model,
)

Tensor = torch.Tensor

_head: Optional[FusedLMHead] = None


def add_fused_lm_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The three settings as slime flags: pass this as ``parse_args(add_custom_arguments=...)``.
    (slime's own ``--log-probs-chunk-size`` chunks its logits path; ``--logprobs-chunk-size`` is the
    fused head's tokens per chunk.)"""
    parser.add_argument("--fused-linear-logprob", action="store_true", help="fuse the LM head (megatron-fused-lm)")
    parser.add_argument("--fused-linear-logprob-backend", choices=["torch", "triton", "auto"], default="torch")
    parser.add_argument("--logprobs-chunk-size", type=int, default=None, help="tokens per chunk of the fused head")
    return parser


def wrap_slime_model(model: List[torch.nn.Module], args: argparse.Namespace) -> FusedLMHead:
    """Wrap the chunks ``get_model`` returned in ``setup_model_and_optimizer``, for the actor only
    (``role == "actor"``: a critic's output layer is a value head)."""
    global _head
    _head = wrap_model(model, FusedLMConfig.from_trainer_config(args))
    return _head


def fused_head() -> Optional[FusedLMHead]:
    """This process's head when it is fused, else ``None`` (slime's own code then runs)."""
    return _head if _head is not None and _head.fused else None


def _rank_rows(
    unconcat_tokens: List[Tensor], total_lengths: List[int], response_lengths: List[int], rows: int
) -> Tuple[Tensor, Tensor, List[int]]:
    """``(targets [1, rows], scored [1, rows], per-sample counts)`` of this rank's output rows: the
    token each row scores, the rows that score a response token, and how many of those each sample
    has here. slime lays the samples end to end; under CP (``data.get_batch``, ``slice_with_cp``)
    each is first padded to ``2 x CP`` equal chunks of which this rank holds two. The padding at the
    end scores nothing. Targets and mask are built over whole samples and then indexed, so a
    response token is scored from the position before it even where that lies in another chunk."""
    cp_size = parallel_state.get_context_parallel_world_size()
    device = unconcat_tokens[0].device
    lengths = torch.tensor(total_lengths)
    if cp_size > 1:
        lengths = -(-lengths // (2 * cp_size)) * (2 * cp_size)
    cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(device)
    padded = zip(unconcat_tokens, lengths.tolist(), strict=True)
    tokens = torch.cat([torch.nn.functional.pad(sample, (0, length - sample.numel())) for sample, length in padded])
    responses = torch.tensor(response_lengths, device=device)
    prompts = torch.tensor(total_lengths, device=device) - responses
    held = context_parallel_positions(cu_seqlens, parallel_state.get_context_parallel_rank(), cp_size)
    if held.numel() > rows:
        raise ValueError(f"the output has {rows} rows, fewer than the {held.numel()} this rank's samples take")
    scored = response_mask(cu_seqlens, prompts, responses)[held]
    samples = torch.searchsorted(cu_seqlens[1:], held, right=True)[scored]
    counts = torch.bincount(samples, minlength=len(total_lengths)).tolist()
    padding = rows - held.numel()
    targets = torch.nn.functional.pad(next_token_targets(tokens, cu_seqlens)[held], (0, padding))
    return targets.unsqueeze(0), torch.nn.functional.pad(scored, (0, padding)).unsqueeze(0), counts


def _check_supported(args: argparse.Namespace, top_p_token_ids: Any = None) -> None:
    if parallel_state.get_context_parallel_world_size() > 1 and args.allgather_cp:
        raise NotImplementedError("--allgather-cp splits the rows contiguously, which this recipe does not lay out")
    if top_p_token_ids is not None:
        raise NotImplementedError("rollout top-p replay masks the logits: turn --fused-linear-logprob off for it")


def log_probs_and_entropy(
    logits: Tensor,
    *,
    args: argparse.Namespace,
    unconcat_tokens: List[Tensor],
    total_lengths: List[int],
    response_lengths: List[int],
    with_entropy: bool = False,
    non_loss_data: bool = True,
    top_p_token_ids: Any = None,
    top_p_token_offsets: Any = None,
) -> Tuple[Tensor, Dict[str, List[Tensor]]]:
    """``get_log_probs_and_entropy`` with the fused head: the same arguments and results.

    Args:
        logits: what the wrapped model returned, hidden states ``[1, T, h]``.
        unconcat_tokens: each sample's tokens, int ``[total_length_i]``.
        total_lengths, response_lengths: per sample.
        with_entropy: also return the entropy (with a gradient only if ``args.entropy_coef != 0``).

    Returns:
        ``(empty tensor, {"log_probs": [...], "entropy": [...]})``: float32 per sample, the entropy
        only with ``with_entropy``: ``[response_length_i]``, or under CP this rank's pieces of the
        response in slime's order (its first chunk's, then its second's).
    """
    _check_supported(args, top_p_token_ids)
    targets, scored, counts = _rank_rows(unconcat_tokens, total_lengths, response_lengths, logits.shape[1])
    result = fused_head().logprobs(
        logits, targets, temperature=args.rollout_temperature, return_entropy=with_entropy,
        entropy_grad=with_entropy and args.entropy_coef != 0, mask=scored,
    )  # fmt: skip
    values = result if with_entropy else (result,)
    per_sample = [list(value[scored].split(counts)) for value in values]
    found = {"log_probs": per_sample[0]}
    if with_entropy:
        found["entropy"] = per_sample[1]
    return torch.empty((0,), device=logits.device), found


def _loss_layout(args, batch, logits, sum_of_sample_mean: Callable[[Tensor], Tensor]):
    """``(targets [1, T], response rows bool [1, T], per-token weights [1, T])`` of a micro-batch:
    the weights are what slime's reducer gives each response token (its derivative, the reducer
    being linear), so every slime normalization (per-sample mean, rollout means, per-token) carries
    over."""
    _check_supported(args)
    targets, scored, counts = _rank_rows(
        batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"], logits.shape[1]
    )
    probe = torch.zeros(sum(counts), device=logits.device, requires_grad=True)
    (weights,) = torch.autograd.grad(sum_of_sample_mean(probe), probe)
    weight_rows = torch.zeros(scored.shape, device=logits.device).masked_scatter(scored, weights)
    return targets, scored, weight_rows


def sft_loss(args, batch, logits, sum_of_sample_mean) -> Tuple[Tensor, Dict[str, Tensor]]:
    """slime's ``sft_loss_function`` with the gradients finished in the forward: set
    ``--loss-type custom_loss --custom-loss-function-path <this module>.sft_loss``."""
    targets, scored, weights = _loss_layout(args, batch, logits, sum_of_sample_mean)
    result = fused_head().loss(
        logits, targets, losses.cross_entropy, loss_inputs={"weight": weights}, mask=scored,
        temperature=args.rollout_temperature,
    )  # fmt: skip
    return result.loss, {"loss": result.loss.detach()}


def policy_loss(args, batch, logits, sum_of_sample_mean) -> Tuple[Tensor, Dict[str, Tensor]]:
    """slime's ``policy_loss_function`` for PPO / GRPO clipping (the default reducer, no TIS, OPSM,
    GSPO or CISPO) with the gradients finished in the forward: ``--loss-type custom_loss
    --custom-loss-function-path <this module>.policy_loss``. Returns the loss and slime's metrics."""
    unsupported = {
        "advantage_estimator in (gspo, cispo)": args.advantage_estimator in ("gspo", "cispo"),
        "--use-opsm": args.use_opsm,
        "--use-tis / --get-mismatch-metrics": args.use_tis or args.get_mismatch_metrics,
        "--custom-pg-loss-reducer-function-path": args.custom_pg_loss_reducer_function_path is not None,
        "--use-unbiased-kl": args.use_kl_loss and args.use_unbiased_kl,
        "--kl-loss-type low_var_kl": args.use_kl_loss and args.kl_loss_type == "low_var_kl",
    }
    if any(unsupported.values()):
        raise NotImplementedError(f"{[name for name, on in unsupported.items() if on]}: use log_probs_and_entropy")
    old = batch["rollout_log_probs"] if args.use_rollout_logprobs else batch.get("log_probs")
    if not old:
        raise NotImplementedError("the old log-probs must be computed before the step (slime's log-prob pass)")
    targets, scored, weights = _loss_layout(args, batch, logits, sum_of_sample_mean)
    per_token = {"old_logprob": torch.cat(old), "advantages": torch.cat(batch["advantages"])}
    if args.use_kl_loss:
        per_token["ref_logprob"] = torch.cat(batch["ref_log_probs"])
    inputs = {
        name: weights.new_zeros(weights.shape).masked_scatter(scored, value.float())
        for name, value in per_token.items()
    }
    kl_coef, kl_estimator = (args.kl_loss_coef, args.kl_loss_type) if args.use_kl_loss else (0.0, "k1")
    loss_fn = losses.ClippedPolicyLoss(
        clip_low=args.eps_clip, clip_high=args.eps_clip_high, dual_clip=args.eps_clip_c,
        entropy_coef=args.entropy_coef, kl_coef=kl_coef, kl_estimator=kl_estimator,
    )  # fmt: skip
    result = fused_head().loss(
        logits, targets, loss_fn, loss_inputs={**inputs, "weight": weights}, mask=scored,
        temperature=args.rollout_temperature,
    )  # fmt: skip
    # slime's metrics, from the detached per-token results.
    logprob, entropy = result.logprob[scored], result.entropy[scored]
    weight, advantages, old_logprob = weights[scored], inputs["advantages"][scored], inputs["old_logprob"][scored]
    ratio = (logprob - old_logprob).exp()
    clipped = -ratio.clamp(1 - args.eps_clip, 1 + args.eps_clip_high) * advantages > -ratio * advantages
    metrics = {
        "loss": result.loss.detach(),
        "entropy_loss": (weight * entropy).sum(),
        "pg_clipfrac": (weight * clipped.float()).sum(),
        "ppo_kl": (weight * (old_logprob - logprob)).sum(),
    }
    extra = -args.entropy_coef * metrics["entropy_loss"]
    if args.use_kl_loss:
        kl = losses.kl_penalty(logprob, inputs["ref_logprob"][scored], kl_estimator)
        metrics["kl_loss"] = (weight * kl).sum()
        extra = extra + kl_coef * metrics["kl_loss"]
    metrics["pg_loss"] = metrics["loss"] - extra
    return result.loss, metrics
