"""Losses known in the forward: SFT and a GRPO step at three GEMMs, through Megatron's schedule.

    python examples/loss_in_forward.py

One process (TP=1; CPU, or the first GPU with ``backend="auto"``), the small GPTModel of
``quickstart.py``, two micro-batches per step through ``get_forward_backward_func``. Each part
trains a stock model and a fused copy from the same seed and prints both side by side:

1. SFT through Megatron's own labels path: ``model(..., labels=labels)`` and the usual masked sum
   over the token count. The one extra line is ``head.declare_loss_weights(loss_mask)`` before the
   forward: the fused head then finishes the gradients in the forward (three GEMMs) and the
   backward only scales them.
2. GRPO: ``head.loss`` with the ready-made clipped policy loss (DAPO's asymmetric clip, an entropy
   bonus) on the response tokens. The same call runs on the stock head's logits.

At each optimizer step it asks ``weight_grad_corrections()`` whether a backward received an upstream
gradient other than the one declared, so that a second pass corrected its weight gradient (it should not:
the declaration matches Megatron's loss).
"""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

import torch
from quickstart import BATCH, SEQ, build_model, make_batch, single_process_megatron

from megatron_fused_lm import FusedLMConfig, losses, weight_grad_corrections, wrap_model

MICRO_BATCHES, SFT_STEPS, GRPO_STEPS, LEARNING_RATE = 2, 6, 3, 1e-2
POLICY_LOSS = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)


def sft_micro_batches(step: int, device: torch.device):
    """Micro-batches of the quickstart's toy language, each with a loss mask that drops a prompt
    of random length from every row."""
    batches = []
    for index in range(MICRO_BATCHES):
        input_ids, position_ids, mask, labels = make_batch(device, step=MICRO_BATCHES * step + index)
        prompt = torch.randint(8, SEQ // 2, (BATCH, 1), generator=torch.Generator().manual_seed(step))
        loss_mask = (torch.arange(SEQ).expand(BATCH, SEQ) >= prompt).float().to(device)
        batches.append((input_ids, position_ids, mask, labels, loss_mask))
    return batches


def sft_forward_step(head):
    """Megatron's forward step for SFT; the declaration is the only line the fused head adds."""

    def forward_step(data_iterator, model):
        input_ids, position_ids, mask, labels, loss_mask = next(data_iterator)
        head.declare_loss_weights(loss_mask)
        per_token = model(input_ids, position_ids, mask, labels=labels)

        def loss_func(per_token):
            loss = (per_token * loss_mask).sum()
            count = loss_mask.sum().int()
            return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}

        return per_token, loss_func

    return forward_step


def grpo_micro_batches(device: torch.device, vocab: int):
    """Rollouts: prompt, response (a mask over the scored positions), old log-probs near the
    current policy's, and group-normalized advantages per row."""
    generator = torch.Generator().manual_seed(99)
    batches = []
    for _ in range(MICRO_BATCHES):
        input_ids = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
        prompt = torch.randint(16, SEQ // 2, (BATCH, 1), generator=generator)
        response = torch.arange(SEQ).expand(BATCH, SEQ) >= prompt
        rewards = torch.rand(BATCH, 1, generator=generator)
        advantages = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).expand(BATCH, SEQ).contiguous()
        targets = torch.roll(input_ids, -1, dims=1)
        position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
        tensors = (input_ids, position_ids, mask, targets, response, advantages)
        batches.append(tuple(tensor.to(device) for tensor in tensors))
    return batches


def grpo_forward_step(head, old_logprobs):
    """Megatron's forward step for the policy loss: ``head.loss`` on what the model returned."""

    def forward_step(data_iterator, model):
        index, (input_ids, position_ids, mask, targets, response, advantages) = next(data_iterator)
        output = model(input_ids, position_ids, mask)

        def loss_func(output):
            inputs = {
                "old_logprob": old_logprobs[index],
                "advantages": advantages,
                "weight": losses.token_mean_weights(response),
            }
            result = head.loss(output, targets, POLICY_LOSS, loss_inputs=inputs, mask=response)
            entropy = result.entropy[response].mean()
            return result.loss, {"policy loss": result.loss.detach(), "entropy": entropy}

        return output, loss_func

    return forward_step


def train(fused: bool, backend: str, device: torch.device):
    """SFT then GRPO steps on a fresh model; returns ``(SFT losses, GRPO losses, gradients after
    the first SFT step, weight-gradient corrections)``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = build_model(device)
    head = wrap_model(model, FusedLMConfig(enabled=fused, backend=backend))
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    schedule = get_forward_backward_func()
    corrections = 0

    def step(forward_step, micro_batches):
        nonlocal corrections
        optimizer.zero_grad(set_to_none=True)
        reports = schedule(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=model,
            num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=BATCH,
        )  # fmt: skip
        grads = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
        corrections += weight_grad_corrections()  # where a trainer synchronizes anyway
        optimizer.step()
        return reports, grads

    sft_losses, first_grads = [], None
    for index in range(SFT_STEPS):
        reports, grads = step(sft_forward_step(head), sft_micro_batches(index, device))
        total, count = torch.stack([report["lm loss"] for report in reports]).sum(0)
        sft_losses.append((total / count).item())
        first_grads = first_grads or grads

    rollouts = grpo_micro_batches(device, model.vocab_size)
    with torch.no_grad():  # the behaviour policy's log-probs, recorded before the updates
        old_logprobs = [
            head.logprobs(model(input_ids, position_ids, mask), targets, mask=response)
            for input_ids, position_ids, mask, targets, response, _ in rollouts
        ]
    grpo_losses = []
    for _ in range(GRPO_STEPS):
        reports, _ = step(grpo_forward_step(head, old_logprobs), list(enumerate(rollouts)))
        grpo_losses.append(sum(report["policy loss"].item() for report in reports) / MICRO_BATCHES)
    return sft_losses, grpo_losses, first_grads, corrections


def main() -> None:
    with single_process_megatron() as (device, backend):
        print(f"Training a stock and a fused model side by side ({device.type}, {MICRO_BATCHES} micro-batches)...")
        stock = train(False, backend, device)
        fused = train(True, backend, device)

    largest = max(grad.abs().max().item() for grad in stock[2].values())
    difference = max((fused[2][name] - grad).abs().max().item() for name, grad in stock[2].items())
    print(f"first SFT step: largest gradient difference {difference:.2e} (largest entry {largest:.2e})")
    print(f"{'SFT step':>8}{'stock loss':>14}{'fused loss':>14}")
    for index, (want, got) in enumerate(zip(stock[0], fused[0], strict=True)):
        print(f"{index:>8}{want:>14.6f}{got:>14.6f}")
    print(f"{'GRPO step':>9}{'stock loss':>13}{'fused loss':>14}")
    for index, (want, got) in enumerate(zip(stock[1], fused[1], strict=True)):
        print(f"{index:>9}{want:>13.6f}{got:>14.6f}")
    print(f"backward passes that corrected a weight gradient: {fused[3]}")


if __name__ == "__main__":
    main()
