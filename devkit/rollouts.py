"""Micro-batches of sampled rollouts (prompt then response) and the model runs the trainer-recipe
tests share: the samples, their packing, SkyRL's padded and packed layouts, the stock model's
float64 per-row log-probs on them, the trainers' loss formulas, and a head over a plain weight."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from devkit import megatron_gpt
from megatron_fused_lm import fused_linear_logprob, fused_linear_loss

# Three samples: prompt and response lengths; the responses fill up to ACTIONS slots (SkyRL's
# num_actions), the prompts up to PROMPT_COLUMNS, so SkyRL's padded rows are 14 wide (even, for
# sequence parallelism over two ranks).
PROMPTS, RESPONSES, ACTIONS, PROMPT_COLUMNS = [5, 3, 7], [6, 2, 4], 6, 8
# The recipe tests' GPTModel: the CPU tests' sizes, with room for a packed micro-batch's positions.
MODEL_SHAPE = megatron_gpt.GPTShape(
    hidden=megatron_gpt.HIDDEN, heads=megatron_gpt.HEADS, layers=megatron_gpt.LAYERS, vocab=megatron_gpt.VOCAB_SHARD,
    seq=64, micro_batch=len(PROMPTS),
)  # fmt: skip


def sample_tokens(seed: int) -> List[torch.Tensor]:
    """Each sample's tokens (``PROMPTS[i] + RESPONSES[i]`` of them), int64 over ``MODEL_SHAPE``'s
    vocabulary split over the initialized tensor-parallel group, without 0 (padding)."""
    vocab = megatron_gpt.VOCAB_SHARD * megatron_gpt.tp_size()
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (p + r,), generator=generator) for p, r in zip(PROMPTS, RESPONSES, strict=True)]


def padded_cu_seqlens(lengths: Sequence[int], multiple: int = 2) -> torch.Tensor:
    """Boundaries of samples packed end to end, each padded to a multiple of ``multiple`` (SkyRL and
    verl align each to the tensor-parallel size), int32 ``[S + 1]``."""
    padded = [-(-length // multiple) * multiple for length in lengths]
    return torch.tensor([0] + padded).cumsum(0).int()


def pack(tokens: Sequence[torch.Tensor], cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The samples at their packed offsets ``cu_seqlens[:-1]``, int64 ``[1, cu_seqlens[-1]]``, 0 elsewhere."""
    packed = torch.zeros(1, int(cu_seqlens[-1]), dtype=torch.long)
    for sample, start in zip(tokens, cu_seqlens.tolist(), strict=False):
        packed[0, start : start + sample.numel()] = sample
    return packed


def skyrl_batches(tokens: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SkyRL's two layouts of the samples: ``sequences`` int64 ``[B, S]`` with each sample (prompt
    then response) one left-padded block, as SkyRL's ``convert_prompts_responses_to_batch_tensors``
    lays it out (its response-level tensors ``[B, ACTIONS]`` right-aligned; a short sample's whole
    block lies in the last ``ACTIONS + 1`` columns), ``S = PROMPT_COLUMNS + ACTIONS`` (even, for
    sequence parallelism), its bool ``attention_mask [B, S]``, and the packed ``[1, T]`` tokens with
    their boundaries (each sample padded to an even length)."""
    sequences = torch.zeros(len(tokens), PROMPT_COLUMNS + ACTIONS, dtype=torch.long)
    attention_mask = torch.zeros_like(sequences, dtype=torch.bool)
    for row, sample in enumerate(tokens):
        sequences[row, -sample.numel() :] = sample
        attention_mask[row, -sample.numel() :] = True
    cu_seqlens = padded_cu_seqlens([sample.numel() for sample in tokens])
    return sequences, attention_mask, pack(tokens, cu_seqlens), cu_seqlens


def skyrl_loss_mask() -> torch.Tensor:
    """SkyRL's ``loss_mask [B, ACTIONS]`` float for the samples: each response's slots, right-aligned."""
    return (torch.arange(ACTIONS) >= ACTIONS - torch.tensor(RESPONSES)[:, None]).float()


def run_model(
    model, input_ids: torch.Tensor, mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The model on ``input_ids [b, s]`` (causal attention unless ``mask`` is given; positions
    ``0..s-1`` unless given): the logits shard, or the hidden states when the head is fused."""
    length = input_ids.shape[1]
    if position_ids is None:
        position_ids = torch.arange(length).expand_as(input_ids)
    if mask is None:
        mask = torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool), diagonal=1)
    return model(input_ids, position_ids, mask)


def stock_rows(model, input_ids: torch.Tensor, mask: Optional[torch.Tensor] = None, temperature: float = 1.0):
    """Float64 ``(logprob, entropy)`` ``[b, s]`` of every row's next input token under the stock
    model's logits, with a graph to the parameters: row ``t`` scores token ``t + 1`` of the same row,
    the last row token 0."""
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    return megatron_gpt.oracle_logprob_entropy(run_model(model, input_ids, mask), targets, temperature)


def slime_top_p_sets(targets: Sequence[torch.Tensor], vocab: int, seed: int) -> Tuple[List, List]:
    """Rollout top-p sets as slime hands them over: per sample, int32 global ids and int32 offsets
    ``[response_i + 1]`` over its response tokens (``targets[i]``, the tokens they score). Sets of 0
    to 6 ids, some without their token (slime adds it back), some empty (a tool token's)."""
    generator = torch.Generator().manual_seed(seed)
    all_ids, all_offsets = [], []
    for sample in targets:
        ids, offsets = [], [0]
        for token in sample.tolist():
            count = int(torch.randint(0, 7, (1,), generator=generator))
            chosen = torch.randperm(vocab, generator=generator)[:count].tolist()
            if count > 2:
                chosen[0] = token
            ids += chosen
            offsets.append(len(ids))
        all_ids.append(torch.tensor(ids, dtype=torch.int32))
        all_offsets.append(torch.tensor(offsets, dtype=torch.int32))
    return all_ids, all_offsets


def slime_top_p_rows(model, input_ids, mask, temperature, spans: Sequence[slice], top_p_ids, top_p_offsets):
    """slime's ``get_log_probs_and_entropy`` under rollout top-p replay (``_build_topp_keep_mask`` and
    ``_VocabParallelLogProbEntropy``, slime PR 2102), float64 on the stock model's gathered logits,
    with a graph: every row keeps the whole vocabulary but the response rows ``spans[i]`` of sample
    ``i``, which keep their set and their own token; log-probs over the kept logits, the entropy
    over all. Returns ``(logprob, entropy)`` ``[b, s]``."""
    logits = megatron_gpt.gather_vocabulary(run_model(model, input_ids, mask)).double() / temperature
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    keep = torch.ones_like(logits, dtype=torch.bool)
    for span, ids, offsets in zip(spans, top_p_ids, top_p_offsets, strict=True):
        for response, row in enumerate(range(span.start, span.stop)):
            keep[0, row] = False
            keep[0, row, ids[offsets[response] : offsets[response + 1]].long()] = True
    keep.scatter_(-1, targets.unsqueeze(-1), True)
    log_probs = torch.log_softmax(logits.masked_fill(~keep, -torch.inf), dim=-1)
    whole = torch.log_softmax(logits, dim=-1)
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(whole.exp() * whole).sum(-1)


def weighted(values: Sequence[torch.Tensor], seed: int) -> torch.Tensor:
    """A random weighted sum of the float tensors ``values``, the same on every rank."""
    return sum(
        (megatron_gpt.random_weights(*value.shape, seed=seed + i) * value).sum() for i, value in enumerate(values)
    )


def skyrl_algorithm(**overrides):
    """SkyRL's ``trainer.algorithm`` fields the policy-loss recipe reads (dual clip, KL and entropy on)."""
    from megatron_fused_lm.recipes import skyrl

    correction = SimpleNamespace(**dict.fromkeys(skyrl.OFF_POLICY_CORRECTION_OPTIONS))
    values = dict(
        policy_loss_type="dual_clip", eps_clip_low=0.2, eps_clip_high=0.28, clip_ratio_c=3.0, use_kl_loss=True,
        kl_loss_coef=0.05, kl_estimator_type="k3", use_entropy_loss=True, entropy_loss_coef=0.01,
        off_policy_correction=correction,
    )  # fmt: skip
    values.update(overrides)
    return SimpleNamespace(**values)


def skyrl_policy_oracle(logprob, entropy, inputs, loss_mask, algorithm, correction, scale):
    """SkyRL's ``loss_func`` for ``dual_clip`` with KL (k3) and entropy terms, float64, from
    ``ppo_policy_loss``, ``compute_approx_kl`` and ``masked_mean`` in SkyRL 0.4.0 (test_skyrl_parity compares
    the k3 term with SkyRL's own)."""
    old, advantages, ref = (inputs[name].double() for name in ("old_logprob", "advantages", "ref_logprob"))
    mask = loss_mask.double()
    ratio = (logprob - old).clamp(-20, 20).exp()
    clipped_ratio = ratio.clamp(1 - algorithm.eps_clip_low, 1 + algorithm.eps_clip_high)
    pg = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    pg = torch.where(advantages < 0, torch.minimum(-advantages * algorithm.clip_ratio_c, pg), pg)
    log_ratio = (ref - logprob).clamp(-20, 20)
    kl = (log_ratio.exp() - log_ratio - 1).clamp(-10, 10) * mask
    kl_loss = ((kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    entropy_mean = (entropy * mask).sum() / mask.sum().clamp(min=1)
    return (pg * mask).sum() * correction + (
        algorithm.kl_loss_coef * kl_loss - algorithm.entropy_loss_coef * entropy_mean
    ) * scale


def slime_args(temperature: float, *flags: str) -> argparse.Namespace:
    """slime's ``args``: the recipe's flags parsed as slime parses them, and the slime settings the
    recipes read (GRPO with dual clip, KL (k3) and entropy terms); the others slime's own loss code
    reads (``slime.backends.megatron_utils.loss``) at slime's defaults (``slime/utils/arguments.py``
    at 624b824): ``--loss-type policy_loss``, no top-p replay, per-sample means, unchunked log-probs."""
    from megatron_fused_lm.recipes import slime

    args = slime.add_fused_lm_arguments(argparse.ArgumentParser()).parse_args(list(flags))
    args.__dict__.update(
        rollout_temperature=temperature, entropy_coef=0.01, allgather_cp=False, eps_clip=0.2, eps_clip_high=0.28,
        eps_clip_c=3.0, use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="k3", use_unbiased_kl=False,
        advantage_estimator="grpo", use_opsm=False, use_tis=False, get_mismatch_metrics=False,
        custom_pg_loss_reducer_function_path=None, use_rollout_logprobs=False,
        rollout_top_p=1.0, loss_type="policy_loss", custom_loss_function_path=None, calculate_per_token_loss=False,
        recompute_loss_function=False, log_probs_chunk_size=-1, custom_tis_function_path=None, kl_coef=0.0,
    )  # fmt: skip
    return args


def slime_sample_mean(
    mask_pieces: Sequence[torch.Tensor], mask_sums: Sequence[torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """slime's ``sum_of_sample_mean`` (``get_sum_of_sample_mean`` without rollout sums): the
    concatenated per-token values split per sample as ``mask_pieces`` are (each sample's loss mask,
    or under CP this rank's pieces of it), masked, and divided by each sample's whole mask sum."""

    def reduce(values: torch.Tensor) -> torch.Tensor:
        pieces = values.split([piece.numel() for piece in mask_pieces])
        return sum(
            (piece * mask).sum() / total.clamp(min=1)
            for piece, mask, total in zip(pieces, mask_pieces, mask_sums, strict=True)
        )

    return reduce


def slime_policy_oracle(logprob, entropy, inputs: Dict[str, torch.Tensor], args, reduce) -> torch.Tensor:
    """slime's ``policy_loss_function`` (``compute_policy_loss`` with dual clip, ``compute_approx_kl``
    k3), float64, on the concatenated response tokens; ``inputs``: ``old_logprob``, ``advantages``
    and ``ref_logprob`` of those tokens."""
    old, advantages, ref = (inputs[name].double() for name in ("old_logprob", "advantages", "ref_logprob"))
    ratio = (logprob - old).exp()
    pg = torch.maximum(-ratio * advantages, -ratio.clamp(1 - args.eps_clip, 1 + args.eps_clip_high) * advantages)
    pg = torch.where(advantages < 0, torch.minimum(-args.eps_clip_c * advantages, pg), pg)
    kl = (ref - logprob).exp() - 1 - (ref - logprob)
    return reduce(pg) - args.entropy_coef * reduce(entropy) + args.kl_loss_coef * reduce(kl)


class OpsHead:
    """What a recipe asks of a ``FusedLMHead``, over a plain weight ``[V, h]``: the fused ops. The
    context-parallel recipe tests start from the hidden states, as Megatron's attention has no CPU
    kernel under CP."""

    fused = True

    def __init__(self, weight: torch.Tensor, token_chunk: int):
        self.weight, self.token_chunk = weight, token_chunk

    def logprobs(self, output, targets, **options):
        return fused_linear_logprob(output, self.weight, targets, token_chunk=self.token_chunk, **options)

    def loss(self, output, targets, loss_fn, **options):
        return fused_linear_loss(output, self.weight, targets, loss_fn, token_chunk=self.token_chunk, **options)
