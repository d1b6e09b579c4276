"""Fused equals stock on a real training run: a Megatron-Core GPTModel trained on real text with a
byte-level BPE tokenizer of production size, SFT then GRPO-style RL, the LM head stock and fused.

    python benchmarks/real_training.py --json docs/real_training/real_training_h100.json    # one GPU
    python benchmarks/real_training.py --size cpu --json out.json                             # a CPU dry run
    python benchmarks/report_training.py docs/real_training/real_training_h100.json            # the plots

1. Data: the Python files of the running interpreter's standard library (nobody here wrote them, and
   every machine has them), split by file: a file whose path hashes to 0 mod 20 is held out.
2. Tokenizer: a byte-level BPE vocabulary trained with ``tokenizers`` on the training files, every
   merge the files allow up to the size's target (151936 on a GPU; merges stop at word bounds, so
   the files give fewer); the model's head has the target's rows (a multiple of 128, as Megatron
   pads), a production model's size, the rows beyond the trained vocabulary taking part in the
   softmax as Megatron's padding rows do.
3. SFT: a bf16 GPTModel (Megatron's local spec) in Float16Module and Megatron-Core's DDP with
   Megatron's Adam, trained through ``get_forward_backward_func`` on the labels path, every run
   from the same seed and the same data order: ``stock``; ``fused`` (the three-GEMM labels path,
   ``declare_loss_weights``); ``recompute`` (the fused head without a declaration: four GEMMs);
   ``reference`` (stock with every initial weight moved by about one bf16 rounding: how far two
   equally valid runs drift apart). Every EVAL_EVERY steps: the held-out loss, and the fraction of
   held-out tokens whose probability exceeds 0.9 and 0.999.
4. RL: from the stock run's SFT weights, GRPO-style on one fixed set of prompts (held-out code cut
   mid-line, drawn once, so that the reward curve measures learning rather than which prompts a
   rollout drew): several completions per prompt sampled from the policy's stock logits
   (``head.stock_logits()``), the reward the share of the line's true rest that a completion
   reproduces (its longest common prefix), advantages normalized per prompt; ``losses.ClippedPolicyLoss`` (clip 0.2 / 0.28, entropy bonus,
   k3 KL against the SFT weights, whose log-probs come from a forward-only head of the run's kind),
   token mean. ``stock`` and ``reference`` take ``head.loss`` on the logits, ``fused`` ``head.loss``
   (three GEMMs), ``recompute`` ``head.logprobs`` and the same loss by hand (four GEMMs).
5. Recorded per step: the loss (RL: reward, entropy, KL, clipped fraction, and the share of sampled
   tokens whose probability exceeds 0.9 and 0.999 too), gradient norm, step time and the bytes the
   step allocated beyond what it started with; per run and phase, the peak memory and the head's
   share of the step (the head alone, timed at the step's shapes). The fused curves must stay within NOISE_FACTOR x the reference
   run's largest distance from stock (plus NOISE_FLOOR); the JSON says where they do and do not.

The CPU size is a dry run of the same logic (a tiny model, a 512-token vocabulary, a few steps, the
torch backend): ``tests/cpu/test_real_training.py`` runs it in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import socket
import statistics
import sysconfig
import time
import zlib
from pathlib import Path
from typing import Dict, List, Optional

import torch

from devkit import distributed, measure
from devkit.megatron_gpt import GPTShape, build_bf16_gpt, padded_vocab_size
from devkit.megatron_training import (
    RecomputeCounter,
    megatron_training,
    move_by_one_rounding,
    set_learning_rate,
    sft_loss,
)
from megatron_fused_lm import (
    fused_linear_cross_entropy,
    fused_linear_logprob,
    fused_linear_loss,
    logits_loss,
    losses,
)
from megatron_fused_lm.integration import FusedLMConfig, wrap_model

EOS = "<|endoftext|>"
HELD_OUT_MODULUS = 20
# Each run: (name, fused head, loss path, initial weights moved by one bf16 rounding).
RUNS = (
    ("stock", False, "stock", False),
    ("fused", True, "three-gemm", False),
    ("main_grad", True, "main-grad", False),
    ("recompute", True, "recompute", False),
    ("reference", False, "stock", True),
)
# The runs every comparison needs: RL starts from stock's SFT weights; the reference is the noise.
REQUIRED_RUNS = ("stock", "reference")
# A small entropy bonus: at 0.01 it outweighs the reward's gradient here and the entropy climbs.
CLIP_LOW, CLIP_HIGH, ENTROPY_COEF, KL_COEF = 0.2, 0.28, 0.001, 0.05
POLICY_LOSS = losses.ClippedPolicyLoss(
    clip_low=CLIP_LOW, clip_high=CLIP_HIGH, entropy_coef=ENTROPY_COEF, kl_coef=KL_COEF, kl_estimator="k3"
)
NOISE_FACTOR, NOISE_FLOOR = 3.0, 0.02
WARMUP_STEPS = 3


@dataclasses.dataclass(frozen=True)
class Size:
    """A run's sizes: the model, the steps and the RL rollouts."""

    shape: GPTShape  # its vocab is the tokenizer's target
    micro_batches: int
    sft_steps: int
    sft_learning_rate: float
    eval_every: int
    eval_sequences: int
    rl_steps: int
    rl_learning_rate: float
    updates_per_rollout: int
    prompts: int
    samples: int
    prompt_tokens: int
    completion_tokens: int
    max_files: Optional[int]  # training files read (None: all)


SIZES = {
    "gpu": Size(
        GPTShape(hidden=1024, heads=16, layers=8, vocab=151936, seq=2048, micro_batch=4),
        micro_batches=2,
        sft_steps=300,
        sft_learning_rate=6e-4,
        eval_every=25,
        eval_sequences=4,
        rl_steps=60,
        rl_learning_rate=5e-5,
        updates_per_rollout=2,
        prompts=16,
        samples=8,
        prompt_tokens=96,
        completion_tokens=16,
        max_files=None,
    ),
    "cpu": Size(
        GPTShape(hidden=64, heads=4, layers=2, vocab=512, seq=64, micro_batch=2),
        micro_batches=2,
        sft_steps=40,
        sft_learning_rate=3e-3,
        eval_every=10,
        eval_sequences=4,
        rl_steps=6,
        rl_learning_rate=1e-4,
        updates_per_rollout=2,
        prompts=4,
        samples=4,
        prompt_tokens=24,
        completion_tokens=6,
        max_files=60,
    ),
}


@dataclasses.dataclass
class Corpus:
    """The tokenizer and the two token streams (files joined with EOS)."""

    tokenizer: object
    train: torch.Tensor  # [T] int64
    held_out: torch.Tensor  # [T'] int64
    stats: dict


def stdlib_files(max_files: Optional[int]) -> tuple[list, list]:
    """The standard library's Python files (site-packages aside), training and held-out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(path for path in root.rglob("*.py") if "site-packages" not in path.parts)
    held_out = [path for path in paths if zlib.crc32(str(path.relative_to(root)).encode()) % HELD_OUT_MODULUS == 0]
    train = [path for path in paths if path not in set(held_out)]
    if max_files is not None:
        train, held_out = train[:max_files], held_out[: max(4, max_files // 10)]
    return train, held_out


def build_corpus(size: Size) -> Corpus:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    train_paths, held_out_paths = stdlib_files(size.max_files)
    read = lambda paths: [path.read_text(encoding="utf-8", errors="replace") for path in paths]  # noqa: E731
    train_texts, held_out_texts = read(train_paths), read(held_out_paths)
    start = time.perf_counter()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size.shape.vocab,
        min_frequency=1,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(train_texts, trainer=trainer)
    trained_s = time.perf_counter() - start
    eos = tokenizer.token_to_id(EOS)

    def stream(texts):
        ids = []
        for encoding in tokenizer.encode_batch(texts):
            ids.extend(encoding.ids)
            ids.append(eos)
        return torch.tensor(ids, dtype=torch.long)

    train, held_out = stream(train_texts), stream(held_out_texts)
    stats = dict(
        train_files=len(train_paths),
        held_out_files=len(held_out_paths),
        train_bytes=sum(len(text.encode()) for text in train_texts),
        train_tokens=train.numel(),
        held_out_tokens=held_out.numel(),
        tokenizer_vocab=tokenizer.get_vocab_size(),
        model_vocab=padded_vocab_size(size.shape.vocab, 1),
        tokenizer_seconds=trained_s,
    )
    return Corpus(tokenizer, train, held_out, stats)


def sequences(stream: torch.Tensor, seq: int, seed: Optional[int]) -> torch.Tensor:
    """``[N, seq + 1]`` consecutive windows of the stream, shuffled by ``seed`` (``None``: in order)."""
    count = stream.numel() // (seq + 1)
    windows = stream[: count * (seq + 1)].view(count, seq + 1)
    return windows if seed is None else windows[torch.randperm(count, generator=torch.Generator().manual_seed(seed))]


def micro_batches(windows: torch.Tensor, device: torch.device, loss_mask: Optional[torch.Tensor] = None) -> Dict:
    """One micro-batch of ``windows [b, L + 1]``: inputs, next-token labels, positions, the causal
    mask and the loss mask (every token unless given)."""
    batch, length = windows.shape[0], windows.shape[1] - 1
    return dict(
        input_ids=windows[:, :-1].to(device),
        labels=windows[:, 1:].to(device),
        position_ids=torch.arange(length, device=device).unsqueeze(0).expand(batch, length),
        attention_mask=torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool, device=device), diagonal=1),
        loss_mask=(torch.ones(batch, length) if loss_mask is None else loss_mask).to(device),
        # The loss mask's token count, known on the host (the main_grad run declares its scale).
        tokens=float(length * batch if loss_mask is None else loss_mask.sum()),
    )


class Training:
    """One run: the model, its DDP and optimizer, the head, the schedule."""

    def __init__(self, size: Size, device: torch.device, fused: bool, loss_path: str, state=None, perturbed=False):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.size, self.device, self.loss_path = size, device, loss_path
        self.num_microbatches = 1
        self.gpt = build_bf16_gpt(size.shape, device, tied=False, sequence_parallel=False, seed=1234)
        if state is not None:
            self.gpt.load_state_dict(state)
        if perturbed:
            move_by_one_rounding(self.gpt)
        self.chunks, self.optimizer = megatron_training([self.gpt], device, size.sft_learning_rate)
        self.model = self.chunks[0]
        self.head = wrap_model(self.chunks, FusedLMConfig(enabled=fused, backend="auto"))
        self.forward_backward = get_forward_backward_func()

    def schedule(self, forward_step, batches: List[Dict], forward_only: bool = False):
        length = batches[0]["input_ids"].shape[1]
        self.num_microbatches = len(batches)  # the schedule divides each micro-batch's loss by it
        return self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=[iter(batches)],
            model=self.chunks,
            num_microbatches=len(batches),
            seq_length=length,
            micro_batch_size=batches[0]["input_ids"].shape[0],
            forward_only=forward_only,
        )

    def step(self, forward_step, batches: List[Dict]) -> Dict[str, float]:
        """One optimizer step; the mean over the micro-batches of what the loss function reported,
        the gradient norm, the step's milliseconds and the most bytes it allocated beyond what was
        allocated before it (activations, the head's buffers, gradients in flight)."""
        allocated_before = measure.reset_peak_memory(self.device)
        start = time.perf_counter()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reported = self.schedule(forward_step, batches)
        updated, grad_norm, _ = self.optimizer.step()
        measure.synchronize(self.device)
        assert updated, "the optimizer skipped a step"
        values = {name: torch.stack([entry[name] for entry in reported]).float().mean().item() for name in reported[0]}
        values["grad_norm"] = None if grad_norm is None else float(grad_norm)
        values["step_ms"] = (time.perf_counter() - start) * 1e3
        peak = measure.peak_memory_bytes(self.device)
        values["peak_bytes"] = peak
        values["step_extra_bytes"] = None if peak is None else peak - allocated_before
        return values

    def main_grad_scale(self, scale: float) -> Optional[float]:
        """``scale``, what the loss will be multiplied by, for the run that adds the head's weight
        gradient into ``main_grad`` in the forward; ``None`` for the others."""
        return scale if self.loss_path == "main-grad" else None

    # SFT
    def sft_forward_step(self, iterator, model):
        batch = next(iterator)
        if self.loss_path in ("three-gemm", "main-grad"):
            # sft_loss's sum over the token count, which the schedule divides by the micro-batches.
            scale = 1.0 / (self.num_microbatches * batch["tokens"])
            self.head.declare_loss_weights(batch["loss_mask"], main_grad_scale=self.main_grad_scale(scale))
        per_token = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        return per_token, functools.partial(sft_loss, batch["loss_mask"])

    @torch.no_grad()
    def evaluate(self, batch: Dict) -> Dict[str, float]:
        """The held-out mean token loss and the fraction of tokens above probability 0.9 and 0.999."""
        output = self.model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        logprob = self.head.logprobs(output, batch["labels"])
        probability = logprob.exp()
        return {
            "held_out_loss": -logprob.mean().item(),
            "p_over_0.9": (probability > 0.9).float().mean().item(),
            "p_over_0.999": (probability > 0.999).float().mean().item(),
        }

    # RL
    def rl_forward_step(self, iterator, model):
        batch = next(iterator)
        output = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        response = batch["loss_mask"].bool()
        inputs = {
            "old_logprob": batch["old_logprob"],
            "ref_logprob": batch["ref_logprob"],
            "advantages": batch["advantages"],
            "weight": losses.token_mean_weights(response),
        }
        if self.loss_path == "recompute":  # four GEMMs: the log-probs, then the loss by hand
            logprob, entropy = self.head.logprobs(
                output, batch["labels"], return_entropy=True, mask=response, entropy_grad=True
            )
            loss = response_policy_loss(logprob, entropy, inputs, response)
        else:  # head.loss: three GEMMs when fused, the logits' loss when stock
            result = self.head.loss(
                output, batch["labels"], POLICY_LOSS, loss_inputs=inputs, mask=response,
                main_grad_scale=self.main_grad_scale(1.0 / self.num_microbatches),
            )  # fmt: skip
            loss, logprob, entropy = result.loss, result.logprob.detach(), result.entropy.detach()
        log_ratio = (logprob.detach() - batch["old_logprob"])[response]
        kl = losses.kl_penalty(logprob.detach()[response], batch["ref_logprob"][response], "k3")
        clipped = (log_ratio.exp() < 1 - CLIP_LOW) | (log_ratio.exp() > 1 + CLIP_HIGH)
        reported = {
            "loss": loss.detach().clone(),
            "entropy": entropy.detach()[response].mean(),
            "kl": kl.mean(),
            "clipped_fraction": clipped.float().mean(),
        }
        return loss, lambda output_tensor: (output_tensor, reported)

    @torch.no_grad()
    def logprobs(self, head, model, batch: Dict) -> torch.Tensor:
        """``head``'s forward-only log-probs of the batch's labels, 0 off the response."""
        output = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        return head.logprobs(output, batch["labels"], mask=batch["loss_mask"].bool())

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor, vocab: int, generator: torch.Generator) -> torch.Tensor:
        """Completions of ``prompts [B, Lp]`` (completion_tokens each) sampled at temperature 1
        from the stock logits of the trained vocabulary (the padding rows are never sampled)."""
        tokens = prompts.to(self.device)
        with self.head.stock_logits():
            for _ in range(self.size.completion_tokens):
                length = tokens.shape[1]
                batch = micro_batches(torch.cat([tokens, tokens[:, -1:]], dim=1), self.device)
                logits = self.model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])[:, -1]
                probabilities = torch.softmax(logits[:, :vocab].float(), dim=-1)
                next_token = torch.multinomial(probabilities, 1, generator=generator)
                tokens = torch.cat([tokens, next_token], dim=1)
                assert tokens.shape[1] == length + 1
        return tokens


def response_policy_loss(logprob, entropy, inputs: Dict[str, torch.Tensor], response) -> torch.Tensor:
    """The recompute path's RL loss by hand: ``POLICY_LOSS`` summed over the response rows of the
    ``[b, s]`` log-probs, entropy and per-token inputs."""
    rows = {name: value[response] for name, value in inputs.items()}
    return POLICY_LOSS(logprob[response], entropy[response], **rows).sum()


def longest_common_prefix(first: str, second: str) -> int:
    count = 0
    for left, right in zip(first, second, strict=False):
        if left != right:
            break
        count += 1
    return count


def prompt_set(corpus: Corpus, size: Size) -> tuple[torch.Tensor, List[str]]:
    """The RL prompts ``[P, Lp]``, cut from held-out code in mid-line, and each line's true rest
    (at least 8 characters); the same for every run."""
    stream, tokenizer, eos = corpus.held_out, corpus.tokenizer, corpus.tokenizer.token_to_id(EOS)
    generator = torch.Generator().manual_seed(1000)
    prompts, truths = [], []
    while len(prompts) < size.prompts:
        position = int(torch.randint(size.prompt_tokens, stream.numel() - 64, (1,), generator=generator))
        window = stream[position - size.prompt_tokens : position + 64]
        if (window == eos).any():
            continue
        prefix = tokenizer.decode(stream[position - size.prompt_tokens : position].tolist())
        rest = tokenizer.decode(stream[position : position + 64].tolist()).split("\n")[0]
        if "\n" in prefix[-1:] or len(rest.strip()) < 8:
            continue
        prompts.append(stream[position - size.prompt_tokens : position])
        truths.append(rest)
    return torch.stack(prompts), truths


def rewards(corpus: Corpus, completions: torch.Tensor, truths: List[str], size: Size) -> torch.Tensor:
    """The share of each line's true rest reproduced, as the longest common prefix of the first
    line of the completion and the truth."""
    values = []
    for index, completion in enumerate(completions[:, size.prompt_tokens :].tolist()):
        truth = truths[index // size.samples]
        line = corpus.tokenizer.decode(completion).split("\n")[0]
        values.append(longest_common_prefix(line, truth) / len(truth))
    return torch.tensor(values)


def run_sft(name, fused, loss_path, perturbed, size, corpus, device) -> tuple[dict, dict]:
    """One SFT run: its record, and its final weights (on the CPU)."""
    training = Training(size, device, fused, loss_path, perturbed=perturbed)
    windows = sequences(corpus.train, size.shape.seq, seed=0)
    per_step = size.micro_batches * size.shape.micro_batch
    held_out = micro_batches(sequences(corpus.held_out, size.shape.seq, None)[: size.eval_sequences], device)
    curves: Dict[str, list] = {}
    evaluations: Dict[str, list] = {"step": []}
    for step in range(size.sft_steps):
        learning_rate = cosine(step, size.sft_steps, size.sft_learning_rate)
        set_learning_rate(training.optimizer, learning_rate)
        rows = torch.arange(step * per_step, (step + 1) * per_step) % windows.shape[0]
        batches = [micro_batches(part, device) for part in windows[rows].split(size.shape.micro_batch)]
        for key, value in training.step(training.sft_forward_step, batches).items():
            curves.setdefault(key, []).append(value)
        if step % size.eval_every == 0 or step == size.sft_steps - 1:
            evaluations["step"].append(step)
            for key, value in training.evaluate(held_out).items():
                evaluations.setdefault(key, []).append(value)
    record = phase_record(curves)
    record["eval"] = evaluations
    record["head_ms"] = head_ms(training, loss_path, size, device, "sft")
    record["head_share"] = record["head_ms"] * size.micro_batches / record["median_step_ms"]
    state = {  # Megatron's extra-state entries are not tensors
        key: value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
        for key, value in training.gpt.state_dict().items()
    }
    distributed.log(
        f"sft {name}: loss {curves['loss'][0]:.3f} -> {curves['loss'][-1]:.3f}, held-out "
        f"{evaluations['held_out_loss'][-1]:.3f}, p>0.9 {evaluations['p_over_0.9'][-1]:.2f}, "
        f"{record['median_step_ms']:.1f} ms/step, head {record['head_share']:.0%}"
    )
    return record, state


def run_rl(name, fused, loss_path, perturbed, size, corpus, device, state) -> dict:
    """One RL run from the SFT weights ``state``."""
    training = Training(size, device, fused, loss_path, state=state, perturbed=perturbed)
    set_learning_rate(training.optimizer, size.rl_learning_rate)
    reference_gpt = build_bf16_gpt(size.shape, device, tied=False, sequence_parallel=False, seed=1234)
    reference_gpt.load_state_dict(state)
    reference_head = wrap_model(reference_gpt, FusedLMConfig(enabled=fused, backend="auto"))
    vocab = corpus.stats["tokenizer_vocab"]
    curves: Dict[str, list] = {}
    batches: List[Dict] = []
    reward = torch.zeros(())
    prompts, truths = prompt_set(corpus, size)
    for step in range(size.rl_steps):
        rollout = step % size.updates_per_rollout == 0
        if rollout:
            measure.reset_peak_memory(device)
            start = time.perf_counter()
            generator = torch.Generator(device=device).manual_seed(2000 + step)
            completions = training.sample(prompts.repeat_interleave(size.samples, dim=0), vocab, generator).cpu()
            reward = rewards(corpus, completions, truths, size)
            grouped = reward.view(size.prompts, size.samples)
            advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
            batches = rollout_batches(training, reference_gpt, reference_head, completions, advantages, size, device)
            measure.synchronize(device)
            rollout_ms = (time.perf_counter() - start) * 1e3
            rollout_peak = measure.peak_memory_bytes(device)
            sampled = torch.cat([batch["old_logprob"][batch["loss_mask"].bool()] for batch in batches]).exp()
        values = training.step(training.rl_forward_step, batches)
        values["reward"] = reward.mean().item()
        for threshold in (0.9, 0.999):  # how peaked the policy is on what it samples
            values[f"sampled_p_over_{threshold}"] = (sampled > threshold).float().mean().item()
        values["rollout_ms"] = rollout_ms if rollout else 0.0
        values["rollout_peak_bytes"] = rollout_peak if rollout else None
        for key, value in values.items():
            curves.setdefault(key, []).append(value)
    record = phase_record(curves)
    record["head_ms"] = head_ms(training, loss_path, size, device, "rl")
    record["head_share"] = record["head_ms"] * len(batches) / record["median_step_ms"]
    distributed.log(
        f"rl {name}: reward {curves['reward'][0]:.3f} -> {curves['reward'][-1]:.3f}, entropy "
        f"{curves['entropy'][0]:.3f} -> {curves['entropy'][-1]:.3f}, {record['median_step_ms']:.1f} ms/update"
    )
    return record


def rollout_batches(training, reference_gpt, reference_head, completions, advantages, size, device) -> List[Dict]:
    """The update's micro-batches: the completions as inputs, the completion tokens as the
    response, the old log-probs (the policy before the updates) and the SFT weights' log-probs,
    each from a forward-only head of the run's kind."""
    response = torch.zeros(completions.shape[0], completions.shape[1] - 1)
    response[:, size.prompt_tokens - 1 :] = 1.0  # position t scores token t + 1
    batches = []
    for rows in torch.arange(completions.shape[0]).split(size.prompts * size.samples // size.micro_batches):
        batch = micro_batches(completions[rows], device, response[rows])
        batch["old_logprob"] = training.logprobs(training.head, training.model, batch)
        batch["ref_logprob"] = training.logprobs(reference_head, reference_gpt, batch)
        batch["advantages"] = advantages[rows].to(device).unsqueeze(1).expand_as(batch["labels"]).float()
        batches.append(batch)
    return batches


def phase_record(curves: Dict[str, list]) -> dict:
    """A phase's curves and summary: the median step time past the warm-up, the most bytes one
    training step allocated beyond what it started with, and the phase's peak allocation (for RL
    the rollouts' too: sampling and two forward-only passes); ``None`` on the CPU."""
    key = "step_ms"

    def largest(*names: str) -> Optional[int]:
        return max((value for name in names for value in curves.get(name, []) if value is not None), default=None)

    return {
        "curves": curves,
        "median_step_ms": statistics.median(curves[key][WARMUP_STEPS:] or curves[key]),
        "step_extra_bytes": largest("step_extra_bytes"),
        "peak_bytes": largest("peak_bytes", "rollout_peak_bytes"),
    }


def head_ms(training: Training, loss_path: str, size: Size, device: torch.device, phase: str) -> float:
    """Forward + backward of the head alone on one micro-batch of the phase's shape, by the ops the
    run's step takes: stock, the output layer's product and Megatron's cross-entropy (SFT) or
    ``logits_loss`` on the response rows (RL); fused, ``fused_linear_cross_entropy`` or
    ``fused_linear_loss`` (three GEMMs), or ``fused_linear_logprob`` and the loss (recompute), on
    the same rows (the main_grad run's ops are the three-GEMM ones)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    loss_path = "three-gemm" if loss_path == "main-grad" else loss_path

    if phase == "sft":
        rows, length = size.shape.micro_batch, size.shape.seq
    else:
        rows, length = (
            size.prompts * size.samples // size.micro_batches,
            size.prompt_tokens + size.completion_tokens - 1,
        )
    weight = training.gpt.output_layer.weight.detach().requires_grad_()
    generator = torch.Generator(device=device).manual_seed(7)
    hidden = torch.randn(rows, length, weight.shape[1], device=device, generator=generator)
    hidden = hidden.to(weight.dtype).requires_grad_()
    targets = torch.randint(0, weight.shape[0], (rows, length), device=device, generator=generator)
    response = torch.zeros(rows, length, dtype=torch.bool, device=device)
    response[:, size.prompt_tokens - 1 :] = True
    inputs = {
        "old_logprob": torch.full((rows, length), -1.0, device=device),
        "ref_logprob": torch.full((rows, length), -1.0, device=device),
        "advantages": torch.randn(rows, length, device=device, generator=generator),
        "weight": losses.token_mean_weights(response),
    }

    def step():
        if phase == "sft" and loss_path == "stock":
            loss = vocab_parallel_cross_entropy(hidden @ weight.t(), targets).sum()  # upcasts inside
        elif phase == "sft" and loss_path == "three-gemm":
            loss = fused_linear_cross_entropy(
                hidden, weight, targets, torch.ones(rows, length, device=device), backend="auto"
            ).sum()
        elif phase == "sft":
            loss = -fused_linear_logprob(hidden, weight, targets, backend="auto").sum()
        elif loss_path == "stock":
            loss = logits_loss(hidden @ weight.t(), targets, POLICY_LOSS, loss_inputs=inputs, mask=response).loss
        elif loss_path == "three-gemm":
            loss = fused_linear_loss(
                hidden, weight, targets, POLICY_LOSS, loss_inputs=inputs, mask=response, backend="auto"
            ).loss
        else:
            logprob, entropy = fused_linear_logprob(
                hidden, weight, targets, return_entropy=True, mask=response, backend="auto"
            )
            loss = response_policy_loss(logprob, entropy, inputs, response)
        loss.backward()

    for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
        step()
    return statistics.median(measure.elapsed_ms(step, device) for _ in range(5))


def cosine(step: int, steps: int, peak: float) -> float:
    """A tenth of the steps of linear warm-up, then a cosine decay to a tenth of the peak."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item()))


def series(record: dict, name: str) -> torch.Tensor:
    """A run's per-step curve, or its per-evaluation one."""
    return torch.tensor(record["curves"][name] if name in record["curves"] else record["eval"][name])


def compare(records: Dict[str, dict], phase: str, names: List[str]) -> tuple[dict, List[str]]:
    """Per curve: each fused run's largest distance from stock against the noise reference's."""
    summary, failures = {}, []
    for name in names:
        stock = series(records["stock"], name)
        noise = (series(records["reference"], name) - stock).abs().max().item()
        tolerance = NOISE_FACTOR * noise + NOISE_FLOOR
        entry = {"reference_max_difference": noise, "tolerance": tolerance}
        for run in (run for run in records if run not in REQUIRED_RUNS):
            difference = (series(records[run], name) - stock).abs().max().item()
            entry[f"{run}_max_difference"] = difference
            if not difference <= tolerance:
                failures.append(f"{phase} {name}: {run} differs from stock by {difference:.3g} > {tolerance:.3g}")
        summary[name] = entry
    return summary, failures


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default="real_training.json")
    parser.add_argument("--sft-steps", type=int, help="override the size's")
    parser.add_argument("--rl-steps", type=int, help="override the size's")
    parser.add_argument(
        "--runs",
        default=",".join(name for name, *_ in RUNS),
        help=f"a comma-separated subset of the runs; {' and '.join(REQUIRED_RUNS)} always run",
    )
    args = parser.parse_args()
    chosen = set(args.runs.split(",")) | set(REQUIRED_RUNS)
    unknown = chosen - {name for name, *_ in RUNS}
    if unknown:
        parser.error(f"--runs: unknown {', '.join(sorted(unknown))}")
    runs = [run for run in RUNS if run[0] in chosen]
    size = SIZES[args.size]
    overrides = {key: value for key, value in (("sft_steps", args.sft_steps), ("rl_steps", args.rl_steps)) if value}
    size = dataclasses.replace(size, **overrides)
    for name, value in dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    ).items():
        os.environ.setdefault(name, value)
    device = distributed.init_distributed(1)
    recompute = RecomputeCounter()
    try:
        corpus = build_corpus(size)
        distributed.log(f"corpus: {corpus.stats}")
        sft, states = {}, {}
        for name, fused, loss_path, perturbed in runs:
            sft[name], states[name] = run_sft(name, fused, loss_path, perturbed, size, corpus, device)
            measure.release_memory()
        # What SFT measured, kept should the RL phase not finish.
        distributed.write_json(
            args.json, {"size": dict(dataclasses.asdict(size), name=args.size), "corpus": corpus.stats, "sft": sft}
        )
        rl = {}
        for name, fused, loss_path, perturbed in runs:
            rl[name] = run_rl(name, fused, loss_path, perturbed, size, corpus, device, states["stock"])
            measure.release_memory()
        sft_summary, sft_failures = compare(sft, "sft", ["loss", "held_out_loss"])
        rl_summary, rl_failures = compare(rl, "rl", ["reward", "entropy", "kl", "loss"])
        failures = sft_failures + rl_failures
        if recompute.count:
            failures.append("a backward of a three-GEMM run recomputed the logits or corrected main_grad")
        distributed.write_json(
            args.json,
            {
                "size": dict(dataclasses.asdict(size), name=args.size),
                "corpus": corpus.stats,
                "sft": sft,
                "rl": rl,
                "comparison": {
                    "sft": sft_summary,
                    "rl": rl_summary,
                    "noise_factor": NOISE_FACTOR,
                    "noise_floor": NOISE_FLOOR,
                },
                "failures": failures,
                "environment": distributed.environment(device),
            },
        )
        for line in failures:
            distributed.log(f"not within noise: {line}")
        distributed.log("real_training: " + ("PASS" if not failures else "FAIL"))
        if failures:
            raise SystemExit(1)
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
