"""slime (THUDM/slime, Megatron backend): the fused LM head where slime computes log-probs.

slime builds the model in ``setup_model_and_optimizer`` (``slime.backends.megatron_utils.model``,
``model = get_model(...)``) and computes every per-token log-prob and entropy, for the old and
reference log-prob passes (``forward_only``) as for its losses (``policy_loss_function``,
``sft_loss_function``), in ``get_log_probs_and_entropy`` (``slime.backends.megatron_utils.loss``) from
the model's output ``[1, T, ...]``: the micro-batch's sequences laid end to end (``batch["tokens"]``)
and padded at the end; under context parallelism, this rank's two chunks of every sequence. The
settings are command-line flags (argparse), read from ``args``.

Each function here takes the arguments and returns the results of the slime function it stands for
(``log_probs_and_entropy`` for ``get_log_probs_and_entropy``, ``policy_loss`` for
``policy_loss_function``, ``sft_loss`` for ``sft_loss_function``): the user routes slime's own
functions to them when the head is fused, keeping ``--loss-type policy_loss`` / ``sft_loss``, so that
slime's own conditions (its reuse of the loss pass's log-probs among them) hold as without the fused
head. They also serve as ``--loss-type custom_loss`` functions, whose path slime loads by name, which
is why ``wrap_slime_model`` keeps this process's head here for them to find.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from megatron.core import parallel_state

from megatron_fused_lm import (
    FusedLMConfig,
    FusedLMHead,
    KeptTokens,
    context_parallel_gather,
    context_parallel_positions,
    losses,
    next_token_targets,
    response_mask,
    wrap_model,
)

Tensor = torch.Tensor

_head: Optional[FusedLMHead] = None


def add_fused_lm_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The six settings as slime flags: pass this as ``parse_args(add_custom_arguments=...)``.
    (slime's own ``--log-probs-chunk-size`` chunks its logits path and is not read;
    ``--fused-linear-logprob-token-chunk`` is the fused head's tokens per chunk, best left unset.)"""
    parser.add_argument("--fused-linear-logprob", action="store_true", help="fuse the LM head (megatron-fused-lm)")
    parser.add_argument("--fused-linear-logprob-backend", choices=["torch", "triton", "cute", "auto"], default="torch")
    parser.add_argument(
        "--fused-linear-logprob-token-chunk", type=int, default=None, help="tokens per chunk of the fused head"
    )
    parser.add_argument(
        "--fused-linear-logprob-batch-invariant",
        action="store_true",
        help="each row's hidden gradient independent of the other rows of a call (Triton backend)",
    )
    parser.add_argument(
        "--fused-linear-logprob-vocab-size",
        type=int,
        default=None,
        help="the tokenizer's vocabulary: Megatron's padded ids out of the fused head's softmax",
    )
    parser.add_argument(
        "--fused-linear-logprob-softcap",
        type=float,
        default=None,
        help="the head's logit softcap, softcap * tanh(z / softcap) (Gemma-2: 30.0)",
    )
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


def _cu_seqlens(lengths: List[int], device: torch.device) -> Tensor:
    """The boundaries of spans of ``lengths`` laid end to end, int64 ``[n + 1]``."""
    return torch.tensor([0, *lengths], device=device).cumsum(0)


def _samples_at(
    held: Tensor,
    cu_seqlens: Tensor,
    unconcat_tokens: List[Tensor],
    total_lengths: List[int],
    response_lengths: List[int],
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(targets, scored, sample, response index)`` at the positions ``held`` of the samples laid
    end to end at ``cu_seqlens`` (each sample's span at least its length; a tail past the samples
    scores nothing): the token each position scores, whether that is a response token, of which
    sample, and its index among all the samples' response tokens. Built over whole samples and then
    indexed, so a response token is scored from the position before it wherever that is held."""
    device = cu_seqlens.device
    spans = zip(unconcat_tokens, (cu_seqlens[1:] - cu_seqlens[:-1]).tolist(), strict=False)
    tokens = torch.cat([torch.nn.functional.pad(sample, (0, span - sample.numel())) for sample, span in spans])
    tokens = torch.nn.functional.pad(tokens, (0, int(cu_seqlens[-1]) - tokens.numel()))
    tail = [0] * (cu_seqlens.numel() - 1 - len(total_lengths))  # the tail has no response
    responses = torch.tensor([*response_lengths, *tail], device=device)
    prompts = torch.tensor([*total_lengths, *tail], device=device) - responses
    targets = next_token_targets(tokens, cu_seqlens)[held]
    scored = response_mask(cu_seqlens, prompts, responses)[held]
    sample = torch.searchsorted(cu_seqlens[1:], held, right=True)
    first_response = torch.cat([responses.new_zeros(1), responses.cumsum(0)])[sample]
    index = first_response + held - cu_seqlens[sample] - (prompts[sample] - 1)
    return targets, scored, sample, index


@dataclass(frozen=True)
class _SlimeRows:
    """This rank's output rows, and how their per-row results map to slime's per-sample lists.

    slime lays the samples end to end and pads the end. Under CP it first pads each sample to
    ``2 x CP`` equal chunks of which each rank holds two (``data.get_batch``, ``slice_with_cp``); its
    per-sample results and per-token inputs are then this rank's pieces of every response, in row
    order. With ``--allgather-cp`` a rank holds a contiguous slice of the samples laid end to end,
    yet slime still hands out and expects those same two-chunk pieces (``_allgather_cp_redistribute``):
    the results and inputs go through the whole responses, summed over the CP group.

    Attributes:
        targets: int64 ``[1, rows]``, the token each row scores.
        scored: bool ``[1, rows]``, the rows that score a response token.
        counts: per sample, how many results slime expects from this rank.
        response_index: int64 ``[scored rows]``, the index among all the samples' response tokens
            of each scored row, in row order.
        piece_index: with ``--allgather-cp``, the index of each of slime's per-rank entries among all
            the response tokens; else ``None``.
        responses: with ``--allgather-cp``, the number of response tokens of all the samples.
    """

    targets: Tensor
    scored: Tensor
    counts: List[int]
    response_index: Tensor
    piece_index: Optional[Tensor] = None
    responses: int = 0

    @staticmethod
    def of(
        args: argparse.Namespace,
        unconcat_tokens: List[Tensor],
        total_lengths: List[int],
        response_lengths: List[int],
        rows: int,
    ) -> "_SlimeRows":
        cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
        samples, device = (unconcat_tokens, total_lengths, response_lengths), unconcat_tokens[0].device
        chunks = 2 * cp_size if cp_size > 1 else 1
        cu_seqlens = _cu_seqlens([-(-length // chunks) * chunks for length in total_lengths], device)
        held = context_parallel_positions(cu_seqlens, cp_rank, cp_size)
        targets, scored, sample, piece_index = _samples_at(held, cu_seqlens, *samples)
        counts = torch.bincount(sample[scored], minlength=len(total_lengths)).tolist()
        if cp_size == 1 or not args.allgather_cp:
            if held.numel() > rows:
                raise ValueError(f"the output has {rows} rows, fewer than the {held.numel()} this rank's samples take")
            padding = rows - held.numel()
            return _SlimeRows(
                torch.nn.functional.pad(targets, (0, padding)).unsqueeze(0),
                torch.nn.functional.pad(scored, (0, padding)).unsqueeze(0),
                counts,
                piece_index[scored],
            )
        total = sum(total_lengths)
        if rows * cp_size < total:
            raise ValueError(f"{rows} rows x CP {cp_size} cannot hold the samples' {total} positions")
        contiguous = _cu_seqlens([*total_lengths, rows * cp_size - total], device)
        held = torch.arange(cp_rank * rows, (cp_rank + 1) * rows, device=device)
        targets, scored_rows, _, row_index = _samples_at(held, contiguous, *samples)
        return _SlimeRows(
            targets.unsqueeze(0),
            scored_rows.unsqueeze(0),
            counts,
            row_index[scored_rows],
            piece_index[scored],
            sum(response_lengths),
        )

    def per_sample(self, per_row: Tensor) -> List[Tensor]:
        """Per-row results ``[1, rows]`` -> this rank's piece of every sample, in slime's order. With
        ``--allgather-cp`` a rank's pieces come from other ranks' rows, so the backward sums every
        rank's upstream gradients (each rank's loss is over its own pieces)."""
        scored = per_row[self.scored]
        if self.piece_index is not None:
            group = parallel_state.get_context_parallel_group()
            whole = context_parallel_gather(scored, self.response_index, self.responses, group, gradient="summed")
            scored = whole[self.piece_index]
        return list(scored.split(self.counts))

    def to_rows(self, pieces: Tensor) -> Tensor:
        """slime's per-token values of this rank (its pieces concatenated, no gradient) -> ``[1, rows]``,
        0 on rows that score no response token."""
        if self.piece_index is not None:
            group = parallel_state.get_context_parallel_group()
            pieces = context_parallel_gather(pieces, self.piece_index, self.responses, group, gradient="local")
            pieces = pieces[self.response_index]
        return pieces.new_zeros(self.scored.shape).masked_scatter(self.scored, pieces)

    def kept_tokens(self, token_ids: List[Any], token_offsets: List[Any], response_lengths: List[int]) -> KeptTokens:
        """slime's rollout top-p sets (per sample: global ids ``[nnz_i]`` and offsets ``[response_i +
        1]`` over its response tokens, int32, as ``get_rollout_top_p_logprob_kwargs`` hands them) as
        the ``kept_tokens`` of this rank's scored rows, each set with its row's target added: slime
        keeps the sampled token's logit (an empty span, a tool token's, then scores 0, as in slime).
        ``ValueError`` unless every sample has one span per response token and its ids."""
        if token_offsets is None or not len(token_ids) == len(token_offsets) == len(response_lengths):
            raise ValueError("rollout top-p replay needs top_p_token_ids and top_p_token_offsets for every sample")
        spans = [torch.as_tensor(offsets, dtype=torch.long).cpu() for offsets in token_offsets]
        samples = [torch.as_tensor(sample, dtype=torch.long) for sample in token_ids]
        for index, (offsets, sample, response) in enumerate(zip(spans, samples, response_lengths, strict=True)):
            if offsets.numel() != response + 1 or offsets[0] != 0 or offsets[-1] != sample.numel():
                raise ValueError(
                    f"sample {index}'s top-p offsets must run from 0 to its {sample.numel()} ids in {response + 1} "
                    f"entries (one span per response token), got {offsets.numel()} from {offsets[:1].tolist()}"
                )
        device = self.targets.device
        counts = torch.cat([offsets.diff() for offsets in spans]).to(device)
        ids = torch.cat([*samples, torch.zeros(1, dtype=torch.long)]).to(device)  # one more: never empty
        starts = counts.cumsum(0) - counts
        count, start = counts[self.response_index], starts[self.response_index]
        offsets = torch.cat([count.new_zeros(1), (count + 1).cumsum(0)])  # each set and its target
        row = torch.repeat_interleave(torch.arange(count.shape[0], device=device), count + 1)
        position = torch.arange(row.shape[0], device=device) - offsets[row]
        from_span = position < count[row]
        token_ids = torch.where(
            from_span, ids[torch.where(from_span, start[row] + position, 0)], self.targets[self.scored][row]
        )
        return offsets, token_ids


def _temperature(args: argparse.Namespace) -> float:
    """slime's ``--rollout-temperature``, read as ``get_log_probs_and_entropy`` reads it. The head
    divides the logits by it inside; the hidden states must not be divided."""
    return getattr(args, "rollout_temperature", 1.0)


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
    """``get_log_probs_and_entropy`` with the fused head: the same arguments and results. Route slime's
    function to it when the head is fused: every log-prob pass (``compute_log_prob``: old, reference,
    OPD teacher) and slime's own losses then read the fused head. The logits are divided by
    ``--rollout-temperature`` inside the head, as slime divides them.

    Args:
        logits: what the wrapped model returned, hidden states ``[1, T, h]``.
        unconcat_tokens: each sample's tokens, int ``[total_length_i]``.
        total_lengths, response_lengths: per sample.
        with_entropy: also return the entropy (with a gradient only if ``args.entropy_coef != 0``).
        top_p_token_ids, top_p_token_offsets: slime's rollout top-p replay (``--rollout-top-p`` below
            1): per sample, the ids the rollout's sampler kept for each response token. The log-probs
            are then each token's over its set and itself (``kept_tokens``); the entropy stays the
            whole vocabulary's, as slime's, from a second pass of the head without the sets.

    Returns:
        ``(empty tensor, {"log_probs": [...], "entropy": [...]})``: float32 per sample, the entropy
        only with ``with_entropy``: ``[response_length_i]``, or under CP this rank's pieces of the
        response in slime's order (its first chunk's, then its second's).
    """
    rows = _SlimeRows.of(args, unconcat_tokens, total_lengths, response_lengths, logits.shape[1])
    options = dict(temperature=_temperature(args), mask=rows.scored)
    entropy_grad = with_entropy and getattr(args, "entropy_coef", 0.0) != 0  # as slime: a metric unless a loss term
    entropy_options = dict(return_entropy=with_entropy, entropy_grad=entropy_grad)
    if top_p_token_ids is None:
        values = fused_head().logprobs(logits, rows.targets, **options, **entropy_options)
    else:
        kept_tokens = rows.kept_tokens(top_p_token_ids, top_p_token_offsets, response_lengths)
        values = fused_head().logprobs(logits, rows.targets, **options, kept_tokens=kept_tokens)
        if with_entropy:  # slime's entropy is the whole vocabulary's
            values = (values, fused_head().logprobs(logits, rows.targets, **options, **entropy_options)[1])
    values = values if with_entropy else (values,)
    per_sample = [rows.per_sample(value) for value in values]
    found = {"log_probs": per_sample[0]}
    if with_entropy:
        found["entropy"] = per_sample[1]
    return torch.empty((0,), device=logits.device), found


def _loss_layout(args, batch, logits, sum_of_sample_mean: Callable[[Tensor], Tensor]):
    """``(this rank's rows, per-token weights [1, rows])`` of a micro-batch: the weights are what
    slime's reducer gives each response token (its derivative, the reducer being linear), so every
    slime normalization (per-sample mean, rollout means, per-token) carries over."""
    rows = _SlimeRows.of(
        args, batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"], logits.shape[1]
    )
    probe = torch.zeros(sum(rows.counts), device=logits.device, requires_grad=True)
    (weights,) = torch.autograd.grad(sum_of_sample_mean(probe), probe)
    return rows, rows.to_rows(weights)


def sft_loss(args, batch, logits, sum_of_sample_mean) -> Tuple[Tensor, Dict[str, Tensor]]:
    """slime's ``sft_loss_function`` with the gradients finished in the forward: the same arguments
    (``logits``: the wrapped model's hidden states ``[1, T, h]``) and results, ``(loss [] float32,
    {"loss": detached})``, the loss ``-sum_of_sample_mean`` of the response tokens' log-probs at
    ``--rollout-temperature``. Route ``sft_loss_function`` to it (``--loss-type sft_loss``), or set
    ``--loss-type custom_loss --custom-loss-function-path <this module>.sft_loss``."""
    rows, weights = _loss_layout(args, batch, logits, sum_of_sample_mean)
    result = fused_head().loss(
        logits,
        rows.targets,
        losses.cross_entropy,
        loss_inputs={"weight": weights},
        mask=rows.scored,
        temperature=_temperature(args),
    )
    return result.loss, {"loss": result.loss.detach()}


def policy_loss(
    args, batch, logits, sum_of_sample_mean, capture_log_probs: Optional[Callable[[Dict, List[Tensor]], None]] = None
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """slime's ``policy_loss_function`` for PPO / GRPO clipping (the default reducer, no TIS, OPSM,
    GSPO or CISPO) with the gradients finished in the forward: the same arguments (``logits``: the
    wrapped model's hidden states ``[1, T, h]``) and results, ``(loss [] float32, metrics)`` with
    slime's metrics in slime's order (``loss``, ``pg_loss``, ``entropy_loss``, ``pg_clipfrac``,
    ``ppo_kl``, then ``train_rollout_logprob_abs_diff`` when the batch has rollout log-probs,
    ``kl_loss`` with ``--use-kl-loss``, ``opd_reverse_kl`` when the batch has it). Route
    ``policy_loss_function`` to it (``--loss-type policy_loss``), or set ``--loss-type custom_loss
    --custom-loss-function-path <this module>.policy_loss`` (slime then runs its log-prob pass).

    Without old log-probs in the batch (slime skipped its log-prob pass: ``can_reuse_log_probs_in_loss``)
    the step is on-policy, as in slime: the old log-probs are the current ones, detached (ratio 1,
    ``ppo_kl`` and ``pg_clipfrac`` 0). ``capture_log_probs``: slime's ``_maybe_capture_log_probs``,
    called as slime calls it, with this rank's per-sample log-probs (detached, slime's order), when the
    batch carries ``partition`` (``--save-debug-train-data``).

    With rollout top-p replay the log-probs are over each token's kept set, as slime's; slime's
    entropy stays the whole vocabulary's, which one pass cannot give beside them: the loss then
    takes no entropy term, and the entropy metric comes from a second forward-only pass."""
    top_p_replay = getattr(args, "rollout_top_p", 1.0) != 1.0
    unsupported = {
        "advantage_estimator in (gspo, cispo)": args.advantage_estimator in ("gspo", "cispo"),
        "--use-opsm": args.use_opsm,
        "--use-tis / --get-mismatch-metrics": args.use_tis or args.get_mismatch_metrics,
        "--custom-pg-loss-reducer-function-path": args.custom_pg_loss_reducer_function_path is not None,
        "--use-unbiased-kl": args.use_kl_loss and args.use_unbiased_kl,
        "--kl-loss-type low_var_kl": args.use_kl_loss and args.kl_loss_type == "low_var_kl",
        "--rollout-top-p with --entropy-coef": top_p_replay and args.entropy_coef != 0,
    }
    if any(unsupported.values()):
        raise NotImplementedError(
            f"{[name for name, on in unsupported.items() if on]}: the recipe's policy_loss does not express these; "
            "leave slime's policy_loss_function unrouted, its own loss then runs on log_probs_and_entropy's log-probs"
        )
    old = batch.get("rollout_log_probs") if args.use_rollout_logprobs else batch.get("log_probs")
    if args.use_rollout_logprobs and not old:
        raise ValueError("--use-rollout-logprobs needs the batch's rollout_log_probs")
    rows, weights = _loss_layout(args, batch, logits, sum_of_sample_mean)
    scored = rows.scored
    per_token = {"advantages": torch.cat(batch["advantages"])}
    if old:  # else on-policy: ClippedPolicyLoss takes the current log-probs, detached
        per_token["old_logprob"] = torch.cat(old)
    if args.use_kl_loss:
        per_token["ref_logprob"] = torch.cat(batch["ref_log_probs"])
    inputs = {name: rows.to_rows(value.float()) for name, value in per_token.items()}
    kl_coef, kl_estimator = (args.kl_loss_coef, args.kl_loss_type) if args.use_kl_loss else (0.0, "k1")
    loss_fn = losses.ClippedPolicyLoss(
        clip_low=args.eps_clip,
        clip_high=args.eps_clip_high,
        dual_clip=args.eps_clip_c,
        entropy_coef=args.entropy_coef,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
    )
    kept_tokens = None
    if top_p_replay:
        kept_tokens = rows.kept_tokens(
            batch["rollout_top_p_token_ids"], batch["rollout_top_p_token_offsets"], batch["response_lengths"]
        )
    result = fused_head().loss(
        logits,
        rows.targets,
        loss_fn,
        loss_inputs={**inputs, "weight": weights},
        mask=scored,
        temperature=_temperature(args),
        kept_tokens=kept_tokens,
    )
    if capture_log_probs is not None and batch.get("partition"):
        capture_log_probs(batch, rows.per_sample(result.logprob))
    # slime's metrics, from the detached per-token results; each a sum of weighted tokens, which is
    # what slime's (linear) sum_of_sample_mean gives.
    logprob, entropy = result.logprob[scored], result.entropy[scored]
    if top_p_replay:  # the whole vocabulary's, as slime's
        with torch.no_grad():
            entropy = fused_head().logprobs(
                logits, rows.targets, temperature=_temperature(args), return_entropy=True, mask=scored
            )[1][scored]
    weight, advantages = weights[scored], inputs["advantages"][scored]
    old_logprob = inputs["old_logprob"][scored] if old else logprob
    ratio = (logprob - old_logprob).exp()
    clipped = -ratio.clamp(1 - args.eps_clip, 1 + args.eps_clip_high) * advantages > -ratio * advantages
    entropy_loss = (weight * entropy).sum()
    extra = -args.entropy_coef * entropy_loss
    if args.use_kl_loss:
        kl_loss = (weight * losses.kl_penalty(logprob, inputs["ref_logprob"][scored], kl_estimator)).sum()
        extra = extra + kl_coef * kl_loss
    metrics = {
        "loss": result.loss.detach(),
        "pg_loss": result.loss.detach() - extra,
        "entropy_loss": entropy_loss,
        "pg_clipfrac": (weight * clipped.float()).sum(),
        "ppo_kl": (weight * (old_logprob - logprob)).sum(),
    }
    if batch.get("rollout_log_probs"):  # as slime: this step's old (or, with them, current) against them
        rollout = rows.to_rows(torch.cat(batch["rollout_log_probs"]).float())[scored]
        compared = logprob if args.use_rollout_logprobs else old_logprob
        metrics["train_rollout_logprob_abs_diff"] = (weight * (compared - rollout).abs()).sum()
    if args.use_kl_loss:
        metrics["kl_loss"] = kl_loss
    if batch.get("opd_reverse_kl"):  # slime's per-token values in its own order: its own reducer
        metrics["opd_reverse_kl"] = sum_of_sample_mean(torch.cat(batch["opd_reverse_kl"])).detach()
    return result.loss, metrics
