"""A GRPO-style clipped policy loss through the fused head, computed on the response tokens only.

    python examples/grpo_policy_loss.py

One process (TP=1; CPU, or the first GPU with ``backend="auto"``), the small GPTModel of
``quickstart.py``. Each row of the micro-batch is a prompt followed by a sampled response and
padding. ``response_mask`` picks the positions whose log-probs score response tokens (position
``t`` scores token ``t + 1``), and ``head.logprobs(..., mask=...)`` projects only those rows, so the
LM head's cost follows the response tokens. The entropy coefficient is 0, so the entropy is asked
for as a metric (``entropy_grad=False``): no graph, no backward term.
"""

from __future__ import annotations

import torch
from quickstart import SEQ, build_model, single_process_megatron

from megatron_fused_lm import FusedLMConfig, next_token_targets, response_mask, wrap_model

GROUPS, GROUP_SIZE = 2, 4  # prompts, and sampled responses per prompt
CLIP, ENTROPY_COEFF, STEPS, LEARNING_RATE = 0.2, 0.0, 8, 1e-4


def make_rollouts(vocab: int, device: torch.device):
    """Padded rows ``[GROUPS * GROUP_SIZE, SEQ]`` of prompt + response + padding, their targets,
    the response mask and a group-normalized advantage per row."""
    generator = torch.Generator().manual_seed(0)
    rows = GROUPS * GROUP_SIZE
    prompt_lengths = torch.randint(24, 64, (GROUPS,), generator=generator).repeat_interleave(GROUP_SIZE)
    response_lengths = torch.randint(4, 32, (rows,), generator=generator)
    tokens = torch.randint(0, vocab, (rows, SEQ), generator=generator)
    for row in range(1, rows):  # responses of one group share their prompt
        if row % GROUP_SIZE:
            tokens[row, : prompt_lengths[row]] = tokens[row - 1, : prompt_lengths[row]]
    # The rows laid end to end are a packed batch of equal-length sequences.
    cu_seqlens = torch.arange(0, rows * SEQ + 1, SEQ)
    mask = response_mask(cu_seqlens, prompt_lengths, response_lengths).view(rows, SEQ)
    targets = next_token_targets(tokens.reshape(-1), cu_seqlens).view(rows, SEQ)
    rewards = torch.rand(GROUPS, GROUP_SIZE, generator=generator)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).reshape(rows, 1)
    position_ids = torch.arange(SEQ).expand(rows, SEQ)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return tuple(t.to(device) for t in (tokens, position_ids, causal, targets, mask, advantages))


def main() -> None:
    with single_process_megatron() as (device, backend):
        train(device, backend)


def train(device: torch.device, backend: str) -> None:
    model = build_model(device)
    head = wrap_model(model, FusedLMConfig(enabled=True, backend=backend))
    tokens, position_ids, causal, targets, mask, advantages = make_rollouts(model.vocab_size, device)
    with torch.no_grad():  # the behaviour policy's log-probs, as recorded at sampling time
        old_logprob = head.logprobs(model(tokens, position_ids, causal), targets, mask=mask)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    print(
        f"fused head: {head.fused}; rows computed: {int(mask.sum())} of {mask.numel()} ({mask.float().mean():.0%})",
        flush=True,
    )
    print(f"{'step':>4}{'policy loss':>14}{'clip fraction':>15}{'entropy':>10}{'approx KL':>12}", flush=True)
    for step in range(STEPS):
        logprob, entropy = head.logprobs(
            model(tokens, position_ids, causal),
            targets,
            return_entropy=True,
            entropy_grad=ENTROPY_COEFF != 0,
            mask=mask,
        )
        ratio = torch.exp(logprob - old_logprob)
        surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
        per_token = -surrogate - ENTROPY_COEFF * entropy
        loss = per_token[mask].mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        clipped = ((ratio - 1).abs() > CLIP)[mask].float().mean()
        kl = (old_logprob - logprob)[mask].mean()
        print(
            f"{step:>4}{loss.item():>14.4f}{clipped.item():>15.2f}{entropy[mask].mean().item():>10.3f}{kl.item():>12.2e}",
            flush=True,  # each step takes a moment on a CPU
        )


if __name__ == "__main__":
    main()
