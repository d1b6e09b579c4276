"""Fused against stock on a real run: Megatron-Core GPTModels trained on real code with a
byte-level BPE of production size, SFT then GRPO-style RL, the LM head stock and fused, with the
spread between stock runs of different initial seeds as the noise band.

    python benchmarks/real_training.py --out runs/ --runs stock_seed0,stock_seed1,stock_seed2,three_gemm
    python benchmarks/real_training.py --out runs2/ --corpus runs/corpus.pt --runs recompute,main_grad  # later
    python benchmarks/real_training.py --compare runs/ runs2/ --json benchmarks/results/real_training_h100.json
    python benchmarks/report_training.py benchmarks/results/real_training_h100.json --out docs/real_training
    python benchmarks/real_training.py --size cpu --out /tmp/runs --compare /tmp/runs --json out.json  # CPU
    python benchmarks/real_training.py --out runs/ --runs ... --sft-steps 2000 --pause-after-s 470  # twice:
    # the first call pauses each run's SFT, saving its state in runs/; the same command resumes it

1. Data: the Python files of the interpreter's installed packages (site-packages: code nobody here
   wrote; the CPU size takes the standard library), split by file: a file whose path hashes to 0
   mod 20 is held out.
2. Tokenizer: a byte-level BPE trained with ``tokenizers`` on a share of the training files chosen
   by path hash, every merge up to the size's target (151936 on a GPU); the head has the target's
   rows (a multiple of 128, as Megatron pads).
3. Runs, each in its own processes on its own GPUs (``--out`` starts them side by side as torchrun
   jobs, the corpus built once; on the CPU each run's gloo ranks are forked from one server that
   imported torch, Megatron and the package once, since a rank's imports take about as long as a CPU
   run trains):
   ``stock_seed<k>``, stock heads from initial seed k, the band; ``three_gemm``,
   ``recompute``, ``main_grad``: fused heads from seed 0 (the labels path with
   ``declare_loss_weights``; the fused head without a declaration, four GEMMs; three GEMMs with the
   weight gradient added into ``main_grad`` at the schedule's declared scale); ``tp2_*``: the same
   at TP=2 with sequence parallelism. Every run sees the same data in the same order.
4. SFT: a bf16 GPTModel (Megatron's local spec) in Float16Module and Megatron-Core's DDP with
   Megatron's Adam, through ``get_forward_backward_func`` on the labels path. Every EVAL_EVERY
   steps: the held-out loss and the share of held-out tokens above probability 0.9 and 0.999.
5. RL, from the run's own SFT weights: GRPO-style on one fixed set of prompts (held-out code cut
   mid-line), several completions per prompt sampled from the policy's stock logits
   (``head.stock_logits()``), the reward the share of the line's true rest a completion reproduces,
   advantages normalized per prompt; ``losses.ClippedPolicyLoss`` with an entropy bonus and a k3
   KL against the run's SFT weights, token mean: ``head.loss`` (three GEMMs when fused; the main_grad
   run declares the schedule's scale), or ``head.logprobs`` and the loss by hand (recompute).
6. Comparison (``--compare``; ``criterion`` has the details). Reported per curve: the band (the
   smallest largest-distance between two stock seeds), each fused and control run's largest
   distance from the stock run of its seed and TP, and whether it lies within the band; the final
   held-out loss and reward (mean of the last FINAL_ROLLOUTS rollouts) against the seeds' range.
   Gates (exit status): every run saw the same tokens; a fused run's head logged no warning (no
   fallback, no correcting pass); over the SFT's first steps (a tenth, at most EARLY_STEPS: before
   the runs decorrelate) a fused run's loss lies within the seeds' band of that window and within
   CONTROL_FACTOR times the control's distance where one ran; its final values lie inside the
   seeds' 95 % prediction interval; its RL reward gain is at least half the least stock gain. The
   gates catch gross errors only (docs/benchmarks/real_training.md says why the band criterion is
   not one). Runs named twice (a replay in another call) are reported bitwise.

7. Checks along a run (docs/benchmarks/real_training.md): ``--audit-every N``, the head's gradients
   against float64 every N SFT steps and every RL update (``gradient_audit``); ``--replay-every
   N``, each path's updates from the run's state every N SFT steps and after every RL rollout
   (``paired_replay``); with either, and for the steps ``--evaluate-steps`` names, ``Excursion``'s
   float64 evaluation of a step's loss on its own weights.

The CPU size runs the same logic at a tiny size (``tests/cpu/test_real_training.py``, in CI).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import itertools
import json
import multiprocessing
import os
import site
import statistics
import subprocess
import sys
import sysconfig
import time
import zlib
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from gradient_audit import (
    HeadLoss,
    audit_point,
    exact_head_loss,
    float64_value,
    fused_sft_loss,
    gather_rows,
    stock_sft_loss,
)
from paired_replay import PATHS as REPLAY_PATHS
from paired_replay import REPLAY_HELD_OUT, REPLAY_UPDATES, replay_point

from devkit import distributed, measure
from devkit.megatron_gpt import GPTShape, build_bf16_gpt, gather_vocabulary, masked_loss, padded_vocab_size
from devkit.megatron_training import (
    RecomputeCounter,
    megatron_training,
    move_by_one_rounding,
    set_learning_rate,
    sft_loss,
)
from devkit.spawn import PRELOADED, rank_environment, rendezvous_store
from megatron_fused_lm import (
    fused_linear_cross_entropy,
    fused_linear_logprob,
    fused_linear_loss,
    logits_logprob,
    logits_loss,
    losses,
    weight_grad_corrections,
)
from megatron_fused_lm.integration import FusedLMConfig, wrap_model

EOS = "<|endoftext|>"
HELD_OUT_MODULUS = 20
INITIAL_SEED = 1234  # seed k initializes the weights from INITIAL_SEED + k


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: its initial seed, its head and loss path, its tensor parallelism; a
    ``moved`` run is the control: stock with every initial weight moved by about one bf16 rounding."""

    name: str
    seed: int
    fused: bool
    loss_path: str  # stock | three-gemm | main-grad | recompute
    tensor_parallel: int = 1
    moved: bool = False


RUNS = {
    run.name: run
    for run in (
        *(Run(f"stock_seed{seed}", seed, False, "stock") for seed in range(5)),
        Run("three_gemm", 0, True, "three-gemm"),
        Run("recompute", 0, True, "recompute"),
        Run("main_grad", 0, True, "main-grad"),
        Run("stock_seed0_moved", 0, False, "stock", moved=True),
        *(Run(f"tp2_stock_seed{seed}", seed, False, "stock", 2) for seed in range(3)),
        Run("tp2_three_gemm", 0, True, "three-gemm", 2),
        Run("tp2_main_grad", 0, True, "main-grad", 2),
        Run("tp2_recompute", 0, True, "recompute", 2),
        Run("tp2_stock_seed0_moved", 0, False, "stock", 2, moved=True),
    )
}
# A small entropy bonus: at 0.01 it outweighs the reward's gradient here and the entropy climbs.
CLIP_LOW, CLIP_HIGH, ENTROPY_COEF, KL_COEF = 0.2, 0.28, 0.001, 0.05
POLICY_LOSS = losses.ClippedPolicyLoss(
    clip_low=CLIP_LOW, clip_high=CLIP_HIGH, entropy_coef=ENTROPY_COEF, kl_coef=KL_COEF, kl_estimator="k3"
)
WARMUP_STEPS = 3
CORPUS_WAIT_S = 600  # --corpus: how long to wait for the other launcher's corpus
FINAL_ROLLOUTS = 4  # the final reward: the mean of the last rollouts' (one rollout's is 128 samples)
CONTROL_FACTOR = 10.0  # the warm-up gate with a control: an order of magnitude past one rounding's effect
# The warm-up gate's window, at most: in every GPU run measured, runs that differ in rounding alone
# stay within 1e-2 of each other's SFT loss for their first 17 (TP=2, 15 warm-up steps) to 43
# steps (the TP=1 control; the TP=1 fused runs 65; 120 warm-up steps), then decorrelate.
EARLY_STEPS = 15
CONFIDENT_SHARE = 0.30  # the GPU size's target: held-out tokens above probability 0.9 before RL
# The curves the criterion covers, per phase.
CURVES = {"sft": ("loss", "held_out_loss", "p_over_0.9"), "rl": ("reward", "entropy", "kl", "loss")}


@dataclasses.dataclass(frozen=True)
class Size:
    """A run's sizes: the corpus, the model, the steps and the RL rollouts."""

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
    completion_tokens: int  # prompt + completion - 1 positions, a multiple of the TP size
    corpus: str  # site-packages | stdlib
    max_files: Optional[int]  # training files read (None: all)
    tokenizer_share: int  # the tokenizer trains on the training files whose path hash is 1 mod this
    audit_every: Optional[int] = None  # --audit-every: SFT steps between gradient audits (and every RL update)
    replay_every: Optional[int] = None  # --replay-every: SFT steps between replayed states (and every RL rollout)
    evaluate_steps: tuple = ()  # --evaluate-steps: SFT steps evaluated in float64 on their own weights (Excursion)


SIZES = {
    "gpu": Size(
        GPTShape(hidden=1024, heads=16, layers=6, vocab=151936, seq=1024, micro_batch=8),
        micro_batches=4,
        sft_steps=1200,
        sft_learning_rate=1e-3,
        eval_every=100,
        eval_sequences=64,
        rl_steps=40,
        rl_learning_rate=5e-5,
        updates_per_rollout=2,
        prompts=16,
        samples=8,
        prompt_tokens=96,
        completion_tokens=17,
        corpus="site-packages",
        max_files=None,
        tokenizer_share=4,
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
        completion_tokens=7,
        corpus="stdlib",
        max_files=60,
        tokenizer_share=1,
    ),
}
# The GPU size shortened: the tensor-parallel runs, and a check that finishes in one 10-minute call.
SIZES["gpu-short"] = dataclasses.replace(SIZES["gpu"], sft_steps=150, eval_every=50, rl_steps=10)


@dataclasses.dataclass
class Corpus:
    """The tokenizer and the two token streams (files joined with EOS)."""

    tokenizer: object
    train: torch.Tensor  # [T] int64
    held_out: torch.Tensor  # [T'] int64
    stats: dict


def corpus_roots(kind: str) -> List[Path]:
    """Where the corpus's files lie: the interpreter's package directories, or its standard library."""
    if kind == "stdlib":
        return [Path(sysconfig.get_paths()["stdlib"])]
    found = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    roots = sorted({Path(path).resolve() for path in found if Path(path).is_dir()})
    # A directory inside another would give its files twice.
    return [root for root in roots if not any(other != root and other in root.parents for other in roots)]


def corpus_files(size: Size) -> tuple[list, list]:
    """``(train, held_out)``: ``(relative path, path)`` pairs of the corpus's Python files, split by
    the relative path's hash (site-packages' within the standard library are left out of it)."""
    files = []
    for root in corpus_roots(size.corpus):
        for path in root.rglob("*.py"):
            if size.corpus == "stdlib" and "site-packages" in path.parts:
                continue
            if path.is_file():
                files.append((str(path.relative_to(root)), path))
    files.sort()
    held_out = [entry for entry in files if zlib.crc32(entry[0].encode()) % HELD_OUT_MODULUS == 0]
    train = [entry for entry in files if zlib.crc32(entry[0].encode()) % HELD_OUT_MODULUS != 0]
    if size.max_files is not None:
        train, held_out = train[: size.max_files], held_out[: max(4, size.max_files // 10)]
    return train, held_out


def build_corpus(size: Size) -> Corpus:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    train_files, held_out_files = corpus_files(size)
    read = lambda files: [path.read_text(encoding="utf-8", errors="replace") for _, path in files]  # noqa: E731
    train_texts, held_out_texts = read(train_files), read(held_out_files)
    tokenizer_texts = [
        text
        for (name, _), text in zip(train_files, train_texts, strict=True)
        if zlib.crc32(name.encode()) % size.tokenizer_share == 1 % size.tokenizer_share
    ]
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
    tokenizer.train_from_iterator(tokenizer_texts, trainer=trainer)
    trained_s = time.perf_counter() - start
    eos = tokenizer.token_to_id(EOS)

    def stream(texts):
        ids = [torch.tensor(encoding.ids + [eos], dtype=torch.int32) for encoding in tokenizer.encode_batch(texts)]
        return torch.cat(ids).long()

    start = time.perf_counter()
    train, held_out = stream(train_texts), stream(held_out_texts)
    digest = hashlib.sha256(train.int().numpy().tobytes())
    digest.update(held_out.int().numpy().tobytes())
    stats = dict(
        roots=[str(root) for root in corpus_roots(size.corpus)],
        train_files=len(train_files),
        held_out_files=len(held_out_files),
        train_bytes=sum(len(text.encode()) for text in train_texts),
        held_out_bytes=sum(len(text.encode()) for text in held_out_texts),
        tokenizer_bytes=sum(len(text.encode()) for text in tokenizer_texts),
        train_tokens=train.numel(),
        held_out_tokens=held_out.numel(),
        tokenizer_vocab=tokenizer.get_vocab_size(),
        model_vocab=padded_vocab_size(size.shape.vocab, 1),
        tokenizer_seconds=trained_s,
        encode_seconds=time.perf_counter() - start,
        tokens_sha256=digest.hexdigest(),
    )
    return Corpus(tokenizer, train, held_out, stats)


def corpus_key(size: Size) -> dict:
    """What a corpus is built from: a corpus saved for the same key is the same corpus."""
    return dict(
        corpus=size.corpus, max_files=size.max_files, tokenizer_share=size.tokenizer_share, vocab=size.shape.vocab
    )


def save_corpus(corpus: Corpus, path: Path, size: Size) -> None:
    """Written under another name, then renamed: a launcher waiting for ``path`` never reads half a file."""
    partial = path.with_name(path.name + ".partial")
    torch.save(
        {
            "built_for": corpus_key(size),
            "tokenizer": corpus.tokenizer.to_str(),
            "train": corpus.train,
            "held_out": corpus.held_out,
            "stats": corpus.stats,
        },
        partial,
    )
    partial.rename(path)


def load_corpus(path: Path) -> Corpus:
    from tokenizers import Tokenizer

    saved = torch.load(path)
    return Corpus(Tokenizer.from_str(saved["tokenizer"]), saved["train"], saved["held_out"], saved["stats"])


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


def build_model(size: Size, device: torch.device, seed: int):
    """The run's bf16 GPTModel from initial seed ``seed``, sequence parallel under tensor parallelism."""
    from megatron.core import parallel_state

    sequence_parallel = parallel_state.get_tensor_model_parallel_world_size() > 1
    return build_bf16_gpt(size.shape, device, tied=False, sequence_parallel=sequence_parallel, seed=INITIAL_SEED + seed)


class Training:
    """One run: the model, its DDP and optimizer, the head, the schedule."""

    def __init__(
        self, size: Size, device: torch.device, fused: bool, loss_path: str, state=None, seed: int = 0, moved=False
    ):
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.size, self.device, self.loss_path = size, device, loss_path
        self.num_microbatches = 1
        self.tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
        if loss_path == "exact" and self.tensor_parallel > 1:
            raise ValueError("the exact path (a float64 head, the paired replay's) runs at TP=1 only")
        self.gpt = build_model(size, device, seed)
        if state is not None:
            self.gpt.load_state_dict(state)
        if moved:
            move_by_one_rounding(self.gpt)
        self.chunks, self.optimizer = megatron_training([self.gpt], device, size.sft_learning_rate)
        self.model = self.chunks[0]
        # Triton where it runs; on the CPU the torch backend by name (auto would warn of its fallback).
        self.backend = "auto" if device.type == "cuda" else "torch"
        self.head = wrap_model(self.chunks, FusedLMConfig(enabled=fused, backend=self.backend))
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
        # Second passes that corrected the head's weight gradient, read where the step synchronizes
        # anyway (each warns, and a fused run's warnings fail it): none when the declarations hold.
        corrections = weight_grad_corrections()
        values = {name: torch.stack([entry[name] for entry in reported]).float().mean().item() for name in reported[0]}
        values["grad_norm"] = None if grad_norm is None else float(grad_norm)
        values["weight_grad_corrections"] = corrections
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
        if self.loss_path == "exact":  # sft_loss's mean token loss from a float64 head
            hidden = self.output_layer_input_graph(batch).transpose(0, 1)
            loss = exact_head_loss(hidden, self.gpt.output_layer.weight, batch["labels"], self.sft_head_loss(batch))
            return loss, reported_loss
        if self.loss_path in ("three-gemm", "main-grad"):
            # sft_loss's sum over the token count, which the schedule divides by the micro-batches.
            scale = 1.0 / (self.num_microbatches * batch["tokens"])
            self.head.declare_loss_weights(batch["loss_mask"], main_grad_scale=self.main_grad_scale(scale))
        per_token = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        return per_token, functools.partial(sft_loss, batch["loss_mask"])

    @torch.no_grad()
    def evaluate(self, batches: List[Dict]) -> Dict[str, float]:
        """The held-out mean token loss and the share of tokens above probability 0.9 and 0.999,
        measured alike for every run, whatever its head: exact log-probs (float32 accumulation,
        no bf16 logits) of the output layer's input and weight."""
        logprob = torch.cat([self.exact_logprobs(batch).flatten() for batch in batches])
        probability = logprob.exp()
        return {
            "held_out_loss": -logprob.mean().item(),
            "p_over_0.9": (probability > 0.9).float().mean().item(),
            "p_over_0.999": (probability > 0.999).float().mean().item(),
        }

    @torch.no_grad()
    def exact_logprobs(self, batch: Dict, return_entropy: bool = False, gpt=None, model=None):
        """``[b, s]`` log-probs of the batch's labels (and entropies) from the output layer's input
        and weight of ``gpt`` called as ``model`` (the run's own by default): the head's own result,
        bf16 logits on a stock run, is not used."""
        gpt = self.gpt if gpt is None else gpt
        hidden, group = self.output_layer_input(batch, gpt, model)
        return fused_linear_logprob(hidden, gpt.output_layer.weight, batch["labels"], tp_group=group,
                                    return_entropy=return_entropy, backend=self.backend)  # fmt: skip

    @torch.no_grad()
    def stock_logprobs(self, head, model, batch: Dict) -> torch.Tensor:
        """``[b, s]`` forward-only log-probs of the batch's labels as a stock ``head`` computes them
        (bf16 logits), 0 off the loss mask."""
        with head.stock_logits():
            logits = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        return logits_logprob(logits, batch["labels"], mask=batch["loss_mask"].bool(), tp_group=self.tp_group())

    def tp_group(self) -> Optional[torch.distributed.ProcessGroup]:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group() if self.tensor_parallel > 1 else None

    def output_layer_input_graph(self, batch: Dict, gpt=None, model=None) -> torch.Tensor:
        """The output layer's input for ``batch`` as ``gpt`` called as ``model`` computes it (the
        run's own by default), captured by a hook: ``[s, b, h]`` (``[s / TP, b, h]`` under
        sequence parallelism), with its graph where gradients are on (the output layer's own
        product is left unused)."""
        gpt, model = (self.gpt, self.model) if gpt is None else (gpt, model or gpt)
        captured = []
        hook = gpt.output_layer.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
        try:
            model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        finally:
            hook.remove()
        return captured[0]

    @torch.no_grad()
    def output_layer_input(
        self, batch: Dict, gpt=None, model=None
    ) -> tuple[torch.Tensor, Optional[torch.distributed.ProcessGroup]]:
        """The output layer's input ``[b, s, h]`` for ``batch`` (``output_layer_input_graph``'s,
        whole on every rank) and the tensor-parallel group (``None`` at TP=1)."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        hidden = self.output_layer_input_graph(batch, gpt, model)
        if self.tensor_parallel > 1:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return hidden.transpose(0, 1), self.tp_group()

    @staticmethod
    def sft_head_loss(batch: Dict) -> HeadLoss:
        """sft_loss at the head: the cross-entropy's mean over the loss mask."""
        weight = batch["loss_mask"] / batch["loss_mask"].sum()
        return HeadLoss(losses.cross_entropy, {"weight": weight}, None, weight, declared=weight)

    def rl_head_loss(self, batch: Dict, stock_inputs: Optional[Dict[str, torch.Tensor]] = None) -> HeadLoss:
        """POLICY_LOSS at the head over the response."""
        inputs = self.policy_inputs(batch)
        return HeadLoss(POLICY_LOSS, inputs, batch["loss_mask"].bool(), inputs["weight"], stock_inputs=stock_inputs)

    def audit(self, batch: Dict, phase: str) -> dict:
        """The gradient audit (``gradient_audit``) of ``phase``'s loss on ``batch`` and the current
        weights: ``{path: {part: {metric: value}}}``."""
        hidden, group = self.output_layer_input(batch)
        if phase == "sft":
            loss = self.sft_head_loss(batch)
        else:  # each path given the old and reference log-probs a run of its kind would have
            stock_inputs = self.policy_inputs(with_logprobs(batch, "stock"))
            loss = self.rl_head_loss(with_logprobs(batch, "exact"), stock_inputs)
        return audit_point(hidden, self.gpt.output_layer.weight, batch["labels"], loss, group, self.backend)

    # RL
    def rl_forward_step(self, iterator, model):
        batch = next(iterator)
        if self.loss_path == "exact":  # the policy loss from a float64 head
            hidden = self.output_layer_input_graph(batch).transpose(0, 1)
            loss = exact_head_loss(hidden, self.gpt.output_layer.weight, batch["labels"], self.rl_head_loss(batch))
            return loss, reported_loss
        output = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        response = batch["loss_mask"].bool()
        inputs = self.policy_inputs(batch)
        if self.loss_path == "recompute":  # four GEMMs: the log-probs, then the loss by hand
            logprob, entropy = self.head.logprobs(
                output, batch["labels"], return_entropy=True, mask=response, entropy_grad=True
            )
            loss = masked_loss(POLICY_LOSS, logprob, entropy, inputs, response)
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

    @staticmethod
    def policy_inputs(batch: Dict) -> Dict[str, torch.Tensor]:
        """``POLICY_LOSS``'s per-token inputs ``[b, s]`` for an RL micro-batch: the token mean over
        the response."""
        return {
            "old_logprob": batch["old_logprob"],
            "ref_logprob": batch["ref_logprob"],
            "advantages": batch["advantages"],
            "weight": losses.token_mean_weights(batch["loss_mask"].bool()),
        }

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
                # Inputs padded on the right to a multiple of the TP size (sequence parallelism
                # splits them); causal attention keeps the padding out of the last real position.
                padding = -length % self.tensor_parallel + 1
                batch = micro_batches(torch.cat([tokens] + [tokens[:, -1:]] * padding, dim=1), self.device)
                shard = self.model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])[:, length - 1]
                probabilities = torch.softmax(gather_vocabulary(shard)[:, :vocab].float(), dim=-1)
                next_token = torch.multinomial(probabilities, 1, generator=generator)
                tokens = torch.cat([tokens, next_token], dim=1)
                assert tokens.shape[1] == length + 1
        return tokens


def reported_loss(output: torch.Tensor):
    """The exact path's loss function: its loss and a copy reported (the schedule divides the loss
    in place)."""
    return output, {"loss": output.detach().clone()}


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


def held_out_batches(corpus: Corpus, size: Size, device: torch.device) -> List[Dict]:
    """``eval_sequences`` windows spread evenly over the held-out stream, in micro-batches."""
    windows = sequences(corpus.held_out, size.shape.seq, None)
    chosen = torch.linspace(0, windows.shape[0] - 1, min(size.eval_sequences, windows.shape[0])).long()
    return [micro_batches(part, device) for part in windows[chosen].split(size.shape.micro_batch)]


def run_sft(
    run: Run,
    size: Size,
    corpus: Corpus,
    device: torch.device,
    resume: Path,
    pause_after_s: Optional[float],
    warnings: List[str],
    replay_paths: Optional[Dict[str, "Training"]],
) -> Optional[tuple[dict, dict]]:
    """One SFT run: its record, and its final weights (this rank's shard, on the CPU). It starts
    from ``resume`` where that file exists; past ``pause_after_s`` seconds it saves its state there
    at the end of a step and returns ``None`` (a later call resumes; the steps are the same). The
    package's ``warnings`` so far travel in the same file. The clock starts at the first step: leave
    the call room for start-up, RL, and runs queued behind others. The file stays until the run's
    record is written (``worker``), so a call cut short in RL resumes from it. ``replay_paths``: the
    paired replay's trainings (``--replay-every``), else None."""
    training = Training(size, device, run.fused, run.loss_path, seed=run.seed, moved=run.moved)
    windows = sequences(corpus.train, size.shape.seq, seed=0)
    held_out = held_out_batches(corpus, size, device)
    curves: Dict[str, list] = {}
    evaluations: Dict[str, list] = {"step": []}
    trace = {"audit": [], "replay": [], "excursion": None, "evaluated": []}
    first = 0
    if on_every_rank(resume.exists(), device):
        first, curves, evaluations, trace, earlier = load_resume(resume, training, run, size, device)
        warnings.extend(earlier)
        distributed.log(f"sft {run.name}: resumed at step {first}")
    excursion = Excursion(training, trace) if size.audit_every or size.replay_every or size.evaluate_steps else None
    start = time.perf_counter()
    for step in range(first, size.sft_steps):
        learning_rate = cosine(step, size.sft_steps, size.sft_learning_rate)
        set_learning_rate(training.optimizer, learning_rate)
        batches = sft_batches(windows, step, size, device)
        if size.audit_every and step % size.audit_every == 0:  # the step's weights, its first micro-batch
            trace["audit"].append(audit_entry(training, batches[0], "sft", run, step))
        if replay_paths and step % size.replay_every == 0 and step + REPLAY_UPDATES <= size.sft_steps:
            updates = [(sft_batches(windows, later, size, device), cosine(later, size.sft_steps, size.sft_learning_rate))
                       for later in range(step, step + REPLAY_UPDATES)]  # fmt: skip
            trace["replay"].append(
                replay_entry(training, replay_paths, "sft", lambda path: updates, held_out, run, step)
            )
        if excursion:
            excursion.keep()
        for key, value in training.step(training.sft_forward_step, batches).items():
            curves.setdefault(key, []).append(value)
        if excursion:
            excursion.consider(training, step, curves["loss"], batches, held_out, run)
        if step % size.eval_every == 0 or step == size.sft_steps - 1:
            evaluations["step"].append(step)
            for key, value in training.evaluate(held_out).items():
                evaluations.setdefault(key, []).append(value)
            distributed.log(
                f"sft {run.name} step {step}: loss {curves['loss'][-1]:.3f}, held-out "
                f"{evaluations['held_out_loss'][-1]:.3f}, p>0.9 {evaluations['p_over_0.9'][-1]:.3f}, "
                f"{curves['step_ms'][-1]:.0f} ms"
            )
        if step + 1 < size.sft_steps and past(start, pause_after_s, device):
            save_resume(resume, training, run, size, step + 1, curves, evaluations, trace, warnings)
            distributed.log(f"sft {run.name}: paused after step {step}")
            return None
    record = phase_record(curves)
    record["eval"] = evaluations
    record["audit"] = trace["audit"] if size.audit_every else None
    record["replay"] = trace["replay"] if replay_paths else None
    record["excursion"] = trace["excursion"]
    record["evaluated"] = trace["evaluated"]
    record["head_ms"] = head_ms(training, run.loss_path, size, device, "sft")
    record["head_share"] = (
        None if record["head_ms"] is None else record["head_ms"] * size.micro_batches / record["median_step_ms"]
    )
    state = {  # Megatron's extra-state entries are not tensors
        key: value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
        for key, value in training.gpt.state_dict().items()
    }
    distributed.log(
        f"sft {run.name}: loss {curves['loss'][0]:.3f} -> {curves['loss'][-1]:.3f}, held-out "
        f"{evaluations['held_out_loss'][-1]:.3f}, p>0.9 {evaluations['p_over_0.9'][-1]:.3f}, "
        f"{record['median_step_ms']:.1f} ms/step"
    )
    return record, state


def largest_on_ranks(values: List[float], device: torch.device) -> List[float]:
    """Each of ``values``' largest value over the run's ranks (negate a value for its smallest)."""
    gathered = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(gathered, op=torch.distributed.ReduceOp.MAX)
    return gathered.tolist()


def past(start: float, seconds: Optional[float], device: torch.device) -> bool:
    """Whether ``seconds`` have passed since ``start`` on any rank of the run (the ranks pause at
    the same step)."""
    if seconds is None:
        return False
    return bool(largest_on_ranks([time.perf_counter() - start > seconds], device)[0])


def on_every_rank(found: bool, device: torch.device) -> bool:
    """Whether ``found`` holds on the run's ranks; ``ValueError`` where it holds on some only (a
    call cut short between two ranks' writes)."""
    somewhere, missing_somewhere = (bool(flag) for flag in largest_on_ranks([found, not found], device))
    if somewhere and missing_somewhere:
        raise ValueError("some ranks hold a saved SFT state and others not; remove the run's .resume*.pt files")
    return somewhere


def save_resume(
    path: Path, training: Training, run: Run, size: Size, step: int, curves, evaluations, trace, warnings
) -> None:
    """This rank's SFT state before ``step``: the weights, the optimizer (its float32 weights and
    Adam's moments), the curves, the trace (gradient audits, replays, the excursion) and the
    package's warnings so far; written under another name, then renamed."""
    partial = path.with_name(path.name + ".partial")
    torch.save(
        {
            "run": dataclasses.asdict(run),
            "size": dataclasses.asdict(size),
            "step": step,
            "curves": curves,
            "evaluations": evaluations,
            "trace": trace,
            "model": training.gpt.state_dict(),
            "optimizer": training.optimizer.state_dict(),
            "warnings": list(warnings),
        },
        partial,
    )
    torch.distributed.barrier()  # every rank's state written before any takes the place of the last
    partial.rename(path)


def load_resume(path: Path, training: Training, run: Run, size: Size, device: torch.device):
    """``(step, curves, evaluations, trace, warnings)`` of the state ``save_resume`` wrote, loaded
    into ``training``; ``ValueError`` for another run's or size's state."""
    # On the CPU: load_state_dict moves each tensor where its parameter lives, and keeps Adam's step
    # counts on the host as a fresh optimizer does.
    saved = torch.load(path, map_location="cpu", weights_only=False)
    if saved["run"] != dataclasses.asdict(run) or saved["size"] != dataclasses.asdict(size):
        raise ValueError(f"{path} holds the state of another run or size ({saved['run']['name']}); remove it")
    latest, earliest = largest_on_ranks([saved["step"], -saved["step"]], device)
    if latest != -earliest:
        raise ValueError(f"the ranks' saved SFT states are of different steps; remove {run.name}'s .resume*.pt files")
    training.gpt.load_state_dict(saved["model"])
    training.optimizer.load_state_dict(saved["optimizer"])
    return saved["step"], saved["curves"], saved["evaluations"], saved["trace"], saved["warnings"]


def run_rl(
    run: Run,
    size: Size,
    corpus: Corpus,
    device: torch.device,
    state: dict,
    replay_paths: Optional[Dict[str, "Training"]],
    so_far: Callable[[dict], None],
) -> dict:
    """One RL run from the SFT weights ``state``, the KL term against them; ``replay_paths`` as for
    ``run_sft``, each rollout a replayed state. After each update ``so_far`` is given the curves,
    audits and replays until then."""
    training = Training(size, device, run.fused, run.loss_path, state=state, seed=run.seed)
    set_learning_rate(training.optimizer, size.rl_learning_rate)
    reference_gpt = build_model(size, device, run.seed)
    reference_gpt.load_state_dict(state)
    reference_head = wrap_model(reference_gpt, FusedLMConfig(enabled=run.fused, backend=training.backend))
    vocab = corpus.stats["tokenizer_vocab"]
    curves: Dict[str, list] = {}
    audits: List[dict] = []
    replays: List[dict] = []
    held_out = held_out_batches(corpus, size, device) if replay_paths else None
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
            if replay_paths:  # the rollout's updates, each path with its own kind's log-probs
                updates = functools.partial(rl_replay_updates, batches, size)
                replays.append(replay_entry(training, replay_paths, "rl", updates, held_out, run, step))
        if size.audit_every:
            audits.append(audit_entry(training, batches[0], "rl", run, step))
        values = training.step(training.rl_forward_step, batches)
        values["reward"] = reward.mean().item()
        for threshold in (0.9, 0.999):  # how peaked the policy is on what it samples
            values[f"sampled_p_over_{threshold}"] = (sampled > threshold).float().mean().item()
        values["rollout_ms"] = rollout_ms if rollout else 0.0
        values["rollout_peak_bytes"] = rollout_peak if rollout else None
        for key, value in values.items():
            curves.setdefault(key, []).append(value)
        so_far({"curves": curves, "audit": audits, "replay": replays})
    record = phase_record(curves)
    record["audit"] = audits if size.audit_every else None
    record["replay"] = replays if replay_paths else None
    record["entropy_coef"] = POLICY_LOSS.entropy_coef  # what the audit's shifts are read against
    record["head_ms"] = head_ms(training, run.loss_path, size, device, "rl")
    record["head_share"] = (
        None if record["head_ms"] is None else record["head_ms"] * len(batches) / record["median_step_ms"]
    )
    distributed.log(
        f"rl {run.name}: reward {curves['reward'][0]:.3f} -> {curves['reward'][-1]:.3f}, entropy "
        f"{curves['entropy'][0]:.3f} -> {curves['entropy'][-1]:.3f}, {record['median_step_ms']:.1f} ms/update"
    )
    return record


def audit_entry(training: Training, batch: Dict, phase: str, run: Run, step: int) -> dict:
    """One audit point's record, logged with each path's relative error of the whole gradient."""
    paths = training.audit(batch, phase)
    errors = ", ".join(f"{path} {paths[path]['both']['relative_error']:.3g}" for path in paths)
    distributed.log(f"audit {phase} {run.name} step {step}: relative error {errors}")
    return {"step": step, "paths": paths}


def replay_entry(training: Training, paths, phase: str, updates, held_out, run: Run, step: int) -> dict:
    """One replayed state's record (``paired_replay``), logged with each path's held-out loss after
    the last update less the exact path's."""
    forward_step = (lambda path: path.sft_forward_step) if phase == "sft" else (lambda path: path.rl_forward_step)
    point = replay_point(training, paths, forward_step, updates, held_out[: replay_held_out_batches(training.size)])
    after = {name: values[-1]["held_out_loss"] for name, values in point["paths"].items()}
    differences = ", ".join(f"{name} {after[name] - after['exact']:+.2e}" for name in after if name != "exact")
    distributed.log(f"replay {phase} {run.name} step {step}: held-out loss against exact: {differences}")
    return dict(step=step, **point)


def replay_held_out_batches(size: Size) -> int:
    """How many of the held-out micro-batches the replay measures: ``REPLAY_HELD_OUT`` sequences."""
    return max(1, REPLAY_HELD_OUT // size.shape.micro_batch)


def rl_replay_updates(batches: List[Dict], size: Size, path: str) -> List[tuple]:
    """A rollout's updates for the replay's ``path``: its micro-batches, as the run takes them, with
    the log-probs a run of the path's kind computes."""
    kind = "stock" if path == "stock" else "exact"
    return [([with_logprobs(batch, kind) for batch in batches], size.rl_learning_rate)] * size.updates_per_rollout


def replay_trainings(size: Size, device: torch.device, run: Run) -> Dict[str, Training]:
    """The paired replay's trainings, one per path of ``paired_replay.PATHS`` (weights and optimizer
    state are loaded into them at each replayed state); ``ValueError`` under tensor parallelism."""
    fused = {"exact": False, "stock": False}
    return {name: Training(size, device, fused.get(name, True), loss_path, seed=run.seed)
            for name, loss_path in REPLAY_PATHS.items()}  # fmt: skip


def sft_batches(windows: torch.Tensor, step: int, size: Size, device: torch.device) -> List[Dict]:
    """SFT step ``step``'s micro-batches: the next windows of the shuffled training stream."""
    per_step = size.micro_batches * size.shape.micro_batch
    rows = torch.arange(step * per_step, (step + 1) * per_step) % windows.shape[0]
    return [micro_batches(part, device) for part in windows[rows].split(size.shape.micro_batch)]


EXCURSION_WINDOW = 20  # steps: an excursion is a loss above the median of this many before it


class Excursion:
    """SFT steps evaluated on their own weights (kept before each step) and micro-batches: the step
    whose loss lies furthest above (or least below) the median of the ``EXCURSION_WINDOW`` steps
    before it (``trace["excursion"]``, the largest so far), and the steps ``size.evaluate_steps``
    names (``trace["evaluated"]``: where a fused run lay far from a stock one, say). For each: the
    reported loss beside the stock head's (bf16 logits), the fused ops'
    (``fused_linear_cross_entropy``, the labels path's; ``fused_linear_logprob``, recompute's) and
    float64's, each the mean over the micro-batches of the mean token loss, and the held-out loss
    there. Float64 agreeing with the reported loss says the loss is the weights', not the head's
    arithmetic."""

    def __init__(self, training: Training, trace: dict):
        self.parameters = list(training.gpt.parameters())
        self.before = [parameter.detach().clone() for parameter in self.parameters]
        self.trace = trace

    @torch.no_grad()
    def keep(self) -> None:
        for kept, parameter in zip(self.before, self.parameters, strict=True):
            kept.copy_(parameter)

    @torch.no_grad()
    def consider(self, training: Training, step: int, losses_so_far: List[float], batches, held_out, run: Run) -> None:
        if step in training.size.evaluate_steps:
            entry = dict(step=step, reported=losses_so_far[-1], **self.evaluate(training, batches, held_out))
            self.trace["evaluated"].append(entry)
            self.log(run, "evaluated", entry)
        if len(losses_so_far) <= EXCURSION_WINDOW:
            return
        median = statistics.median(losses_so_far[-EXCURSION_WINDOW - 1 : -1])
        excess = losses_so_far[-1] - median
        largest = self.trace["excursion"]
        if largest is not None and excess <= largest["excess"]:
            return
        self.trace["excursion"] = dict(step=step, reported=losses_so_far[-1], median_before=median, excess=excess,
                                       **self.evaluate(training, batches, held_out))  # fmt: skip
        self.log(run, f"excursion ({excess:+.4f} over the median before)", self.trace["excursion"])

    def evaluate(self, training: Training, batches, held_out) -> Dict[str, float]:
        after = [parameter.detach().clone() for parameter in self.parameters]
        self.swap_in(self.before)
        try:
            return dict(excursion_losses(training, batches), held_out_loss=training.evaluate(held_out)["held_out_loss"])
        finally:
            self.swap_in(after)

    @staticmethod
    def log(run: Run, what: str, entry: dict) -> None:
        losses = ", ".join(f"{name} {entry[name]:.6f}" for name in ("stock", "fused_cross_entropy", "float64"))
        distributed.log(f"{what} {run.name} step {entry['step']}: loss {entry['reported']:.6f}; {losses}")

    def swap_in(self, values: List[torch.Tensor]) -> None:
        for value, parameter in zip(values, self.parameters, strict=True):
            parameter.copy_(value)


def excursion_losses(training: Training, batches: List[Dict]) -> Dict[str, float]:
    """``Excursion``'s losses of ``batches`` on ``training``'s current weights."""
    totals = {"stock": 0.0, "fused_cross_entropy": 0.0, "fused_logprob": 0.0, "float64": 0.0}
    shard = training.gpt.output_layer.weight
    for batch in batches:
        hidden, group = training.output_layer_input(batch)
        loss = training.sft_head_loss(batch)
        declared, targets = loss.declared, batch["labels"]
        common = dict(tp_group=group, backend=training.backend)
        values = {
            "stock": stock_sft_loss(hidden, shard, targets, declared),
            "fused_cross_entropy": fused_sft_loss(hidden, shard, targets, declared, **common),
            "fused_logprob": -(fused_linear_logprob(hidden, shard, targets, **common) * declared).sum(),
            "float64": float64_value(hidden, gather_rows(shard, group), targets, loss),
        }
        for name, value in values.items():
            totals[name] += float(value) / len(batches)
    return totals


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
        if size.audit_every or size.replay_every:  # the log-probs of both kinds of run (with_logprobs)
            if training.head.fused:
                batch["exact_old_logprob"], batch["exact_ref_logprob"] = batch["old_logprob"], batch["ref_logprob"]
                batch["stock_old_logprob"] = training.stock_logprobs(training.head, training.model, batch)
                batch["stock_ref_logprob"] = training.stock_logprobs(reference_head, reference_gpt, batch)
            else:
                batch["stock_old_logprob"], batch["stock_ref_logprob"] = batch["old_logprob"], batch["ref_logprob"]
                batch["exact_old_logprob"] = training.exact_logprobs(batch) * batch["loss_mask"]
                batch["exact_ref_logprob"] = training.exact_logprobs(batch, gpt=reference_gpt) * batch["loss_mask"]
        batch["advantages"] = advantages[rows].to(device).unsqueeze(1).expand_as(batch["labels"]).float()
        batches.append(batch)
    return batches


def with_logprobs(batch: Dict, kind: str) -> Dict:
    """``batch`` with the old and reference log-probs a run of ``kind`` computes: ``stock`` (bf16
    logits) or ``exact`` (a fused head's, float32 accumulation), from ``rollout_batches``."""
    return dict(batch, old_logprob=batch[f"{kind}_old_logprob"], ref_logprob=batch[f"{kind}_ref_logprob"])


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


def head_ms(training: Training, loss_path: str, size: Size, device: torch.device, phase: str) -> Optional[float]:
    """Forward + backward of the head alone on one micro-batch of the phase's shape, by the ops the
    run's step takes: stock, the output layer's product and Megatron's cross-entropy (SFT) or
    ``logits_loss`` on the response rows (RL); fused, ``fused_linear_cross_entropy`` or
    ``fused_linear_loss`` (three GEMMs), or ``fused_linear_logprob`` and the loss (recompute), on
    the same rows (the main_grad run's ops are the three-GEMM ones). ``None`` under tensor
    parallelism (the ops would need the TP group; the step times say what the head costs there)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if training.tensor_parallel > 1:
        return None

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
                hidden, weight, targets, torch.ones(rows, length, device=device), backend=training.backend
            ).sum()
        elif phase == "sft":
            loss = -fused_linear_logprob(hidden, weight, targets, backend=training.backend).sum()
        elif loss_path == "stock":
            loss = logits_loss(hidden @ weight.t(), targets, POLICY_LOSS, loss_inputs=inputs, mask=response).loss
        elif loss_path == "three-gemm":
            loss = fused_linear_loss(
                hidden, weight, targets, POLICY_LOSS, loss_inputs=inputs, mask=response, backend=training.backend
            ).loss
        else:
            logprob, entropy = fused_linear_logprob(
                hidden, weight, targets, return_entropy=True, mask=response, backend=training.backend
            )
            loss = masked_loss(POLICY_LOSS, logprob, entropy, inputs, response)
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


# Student's t, its 97.5 % quantile for 1 to 10 degrees of freedom.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def prediction_interval(values: List[float]) -> tuple[float, float]:
    """The 95 % prediction interval of one more draw from the normal distribution ``values`` (2 to
    11 of them) were drawn from: mean +- t s sqrt(1 + 1/n)."""
    count, mean = len(values), statistics.mean(values)
    half = T_975[count - 2] * statistics.stdev(values) * (1 + 1 / count) ** 0.5
    return mean - half, mean + half


def final_values(record: dict, size: dict) -> Dict[str, float]:
    """A run's final held-out loss (its last evaluation) and final reward (the mean over its last
    FINAL_ROLLOUTS rollouts)."""
    return {
        "held_out_loss": record["sft"]["eval"]["held_out_loss"][-1],
        "reward": reward_window(record, size, last=True),
    }


def reward_window(record: dict, size: dict, last: bool) -> float:
    """The mean reward over a run's last (or first) FINAL_ROLLOUTS rollouts."""
    rewards = record["rl"]["curves"]["reward"]
    window = FINAL_ROLLOUTS * size["updates_per_rollout"]
    chosen = rewards[-window:] if last else rewards[:window]
    return sum(chosen) / len(chosen)


def reward_gain(record: dict, size: dict) -> float:
    """The mean reward of a run's last FINAL_ROLLOUTS rollouts less that of its first."""
    return reward_window(record, size, last=True) - reward_window(record, size, last=False)


def criterion(records: Dict[str, dict]) -> tuple[dict, List[str]]:
    """The comparison of ``records`` (run name: the run's JSON), per tensor-parallel size.

    Per curve: the band (the smallest largest-distance between two stock seeds), each fused or
    control run's largest distance from the stock run of its seed, and whether it lies within the
    band (reported: once the runs decorrelate, a run that differs from stock in one rounding lies
    past it as often as not; docs/benchmarks/real_training.md). Gates: over the SFT's first steps (a
    tenth, at most EARLY_STEPS) each fused run's SFT loss lies within that window's band, and within
    CONTROL_FACTOR times the control's distance where a control ran; each fused run's final
    held-out loss and reward lie inside the 95 % prediction interval of the stock seeds' (their
    range is reported too); its RL reward gained at least half the least a stock seed gained.
    Returns the summary and the failures."""
    failures = []
    if len({record["corpus"]["tokens_sha256"] for record in records.values()}) > 1:
        failures.append("the runs did not all see the same tokens")
    for name, record in records.items():
        # A fused run's head must stay fused: no fallback to stock or torch, no correcting pass.
        if record["run"]["fused"] and record["package_warnings"]:
            failures.append(f"{name}: the package warned: {'; '.join(record['package_warnings'])}")
    if not any(record["run"]["fused"] for record in records.values()):
        failures.append("no fused run to compare")
    summary = {}
    for tensor_parallel in sorted({record["run"]["tensor_parallel"] for record in records.values()}):
        group = {
            name: record for name, record in records.items() if record["run"]["tensor_parallel"] == tensor_parallel
        }
        label = f"tp{tensor_parallel}"
        stock = {
            record["run"]["seed"]: name
            for name, record in group.items()
            if record["run"]["loss_path"] == "stock" and not record["run"]["moved"]
        }
        fused = [name for name, record in group.items() if record["run"]["loss_path"] != "stock"]
        controls = [name for name, record in group.items() if record["run"]["moved"]]
        sizes = {json.dumps(record["size"], sort_keys=True) for record in group.values()}
        if len(sizes) > 1:
            failures.append(f"{label}: the runs' sizes differ")
            continue
        if len(stock) < 2:
            failures.append(f"{label}: a band needs two stock seeds, got {sorted(stock)}")
            continue
        size = next(iter(group.values()))["size"]
        entry: dict = {
            "runs": list(group),
            "stock_seeds": sorted(stock),
            "fused": fused,
            "controls": controls,
            "curves": {},
            "final": {},
        }
        for phase, names in CURVES.items():
            for curve in names:
                values = {name: series(group[name][phase], curve) for name in group}
                pairs = {
                    f"{first}-{second}": (values[first] - values[second]).abs().max().item()
                    for first, second in itertools.combinations(stock.values(), 2)
                }
                distance = {}
                for name in fused + controls:
                    same_seed = stock.get(group[name]["run"]["seed"])
                    if same_seed is None:
                        failures.append(f"{label} {name}: no stock run of its seed")
                        continue
                    distance[name] = (values[name] - values[same_seed]).abs().max().item()
                band = min(pairs.values())
                entry["curves"][f"{phase}/{curve}"] = {
                    "band": band,
                    "stock_pairs": pairs,
                    "distance": distance,
                    "within_band": {name: value <= band for name, value in distance.items()},
                }
        # Before the runs decorrelate, a fused run tracks the stock run of its seed more closely
        # than two seeds track each other: a wrong gradient shows here at once. After, a rounding
        # alone puts it as far from its seed as seeds lie apart: a longer window is a coin flip.
        early = slice(0, max(1, min(size["sft_steps"] // 10, EARLY_STEPS)))
        losses = {name: series(group[name]["sft"], "loss")[early] for name in group}
        early_band = min(
            (losses[first] - losses[second]).abs().max().item()
            for first, second in itertools.combinations(stock.values(), 2)
        )
        early_distance = {}
        for name in fused + controls:
            same_seed = stock.get(group[name]["run"]["seed"])
            if same_seed is not None:
                early_distance[name] = (losses[name] - losses[same_seed]).abs().max().item()
        # The seeds' early band is mostly their different starting losses; a control, stock moved
        # by one rounding, measures what a rounding-sized change does before decorrelation.
        control_scale = max((early_distance[name] for name in controls if name in early_distance), default=None)
        early_limit = early_band if control_scale is None else min(early_band, CONTROL_FACTOR * control_scale)
        entry["early_sft_loss"] = {
            "steps": early.stop,
            "band": early_band,
            "limit": early_limit,
            "distance": early_distance,
        }
        for name in fused:
            if name in early_distance and not early_distance[name] <= early_limit:
                failures.append(
                    f"{label} SFT loss over the first {early.stop} steps: {name} "
                    f"{early_distance[name]:.4g} from stock > {early_limit:.4g}"
                )
        finals = {name: final_values(record, size) for name, record in group.items()}
        for quantity in ("held_out_loss", "reward"):
            seeds = [finals[name][quantity] for name in stock.values()]
            low, high = prediction_interval(seeds)
            row = {
                "values": {name: finals[name][quantity] for name in group},
                "stock_range": [min(seeds), max(seeds)],
                "prediction_interval": [low, high],
                "inside_range": {name: min(seeds) <= finals[name][quantity] <= max(seeds) for name in fused + controls},
            }
            for name in fused:
                if not low <= finals[name][quantity] <= high:
                    failures.append(
                        f"{label} final {quantity}: {name} {finals[name][quantity]:.4g} outside [{low:.4g}, {high:.4g}]"
                    )
            entry["final"][quantity] = row
        # Three seeds make the interval wide: RL must also have gained what the stock runs gained,
        # at least half the smallest of their gains (a policy that never improved fails here).
        gains = {name: reward_gain(record, size) for name, record in group.items()}
        least = min(gains[name] for name in stock.values())
        entry["reward_gain"] = {"values": gains, "least_stock_gain": least}
        for name in fused:
            if least > 0 and not gains[name] >= least / 2:
                failures.append(f"{label} RL reward gain: {name} {gains[name]:.4g} < half of stock's least {least:.4g}")
        entry["p_over_0.9_before_rl"] = {
            name: record["sft"]["eval"]["p_over_0.9"][-1] for name, record in group.items()
        }
        summary[label] = entry
    return summary, failures


def run_records(sources: List[str]):
    """``(name, record, where)`` of each run in ``sources``: folders of ``<run>.json`` files, or an
    earlier ``--compare`` JSON (its ``runs``), in the order given."""
    for source in sources:
        path = Path(source)
        if path.is_file():
            for name, record in json.loads(path.read_text())["runs"].items():
                yield name, record, f"{path}:{name}"
            continue
        for file in sorted(path.glob("*.json")):
            if file.stem in RUNS:
                yield file.stem, json.loads(file.read_text()), str(file)


def merge(directories: List[str]) -> tuple[Dict[str, dict], dict, List[str]]:
    """The run records of ``directories`` (see ``run_records``); for a run found twice (a replay in a
    later call) whether the replay's curves equal the first's bit for bit and their largest
    distance; and the records of runs that stopped before the end."""
    records: Dict[str, dict] = {}
    replays, incomplete = {}, []
    for source in directories:
        for state in sorted(Path(source).glob("*.resume0.pt")) if Path(source).is_dir() else []:
            incomplete.append(f"{state}: the run paused in SFT; the command that started it resumes it")
    for name, record, source in run_records(directories):
        if record["rl"] is None:
            incomplete.append(f"{source}: the run stopped before its RL phase ended")
            continue
        if name not in records:
            records[name] = record
            continue
        first = records[name]
        if json.dumps(first["size"], sort_keys=True) != json.dumps(record["size"], sort_keys=True):
            replays[name] = {"identical": False, "sizes_differ": True}
            continue
        distances = {
            f"{phase}/{curve}": (series(record[phase], curve) - series(first[phase], curve)).abs().max().item()
            for phase, names in CURVES.items()
            for curve in names
        }
        replays[name] = {
            "identical": all(value == 0 for value in distances.values()),
            "max_difference": distances,
            "devices": [first["environment"].get("device"), record["environment"].get("device")],
        }
    return records, replays, incomplete


def print_summary(summary: dict) -> None:
    for label, entry in summary.items():
        print(
            f"{label}: stock seeds {entry['stock_seeds']}; fused {', '.join(entry['fused'])}; controls {entry['controls']}"
        )
        for curve, row in entry["curves"].items():
            distances = ", ".join(
                f"{name} {value:.4g}{'' if row['within_band'][name] else ' (past the band)'}"
                for name, value in row["distance"].items()
            )
            print(f"  {curve:<18} band {row['band']:.4g}: {distances}")
        for quantity, row in entry["final"].items():
            values = ", ".join(f"{name} {value:.4g}" for name, value in row["values"].items())
            low, high = row["prediction_interval"]
            print(
                f"  final {quantity:<12} stock range {row['stock_range']}, 95 % interval [{low:.4g}, {high:.4g}]: {values}"
            )
        gain = entry["reward_gain"]
        values = ", ".join(f"{name} {value:.4g}" for name, value in gain["values"].items())
        print(f"  RL reward gain, least stock {gain['least_stock_gain']:.4g}: {values}")
        early = entry["early_sft_loss"]
        distances = ", ".join(f"{name} {value:.4g}" for name, value in early["distance"].items())
        print(
            f"  SFT loss, first {early['steps']} steps: band {early['band']:.4g}, limit {early['limit']:.4g}: {distances}"
        )
        confident = ", ".join(f"{name} {value:.3f}" for name, value in entry["p_over_0.9_before_rl"].items())
        print(f"  p>0.9 before RL: {confident}")


def code_revision() -> str:
    """The checkout's commit (``+`` when its tracked files differ from it; absent outside git) and
    ``sources <digest>`` (``code_digest``): a GPU host's copy of the tree may carry a ``.git`` that
    lags the files it runs, and the digest names those files whatever git says."""
    root = Path(__file__).resolve().parents[1]
    sources = f"sources {code_digest(root)}"
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        )
        changed = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD"], capture_output=True).returncode
    except (OSError, subprocess.CalledProcessError):
        return sources
    return f"{commit.stdout.strip()}{'+' if changed else ''} {sources}"


def code_digest(root: Path) -> str:
    """The first 16 hex digits of a SHA-256 over the relative paths and bytes of the Python files
    under ``root``'s ``megatron_fused_lm``, ``devkit`` and ``benchmarks``, in path order (a clean
    checkout of a commit gives that commit's)."""
    digest = hashlib.sha256()
    for folder in ("megatron_fused_lm", "devkit", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def worker(run: Run, size_name: str, size: Size, out: Path, pause_after_s: Optional[float]) -> None:
    """One run (``run.tensor_parallel`` processes: a torchrun job, or ``ForkedRanks``): SFT, then RL
    from its weights; writes ``out/<run>.json``, or pauses SFT (``run_sft``) in
    ``out/<run>.resume<rank>.pt``."""
    device = distributed.init_distributed(run.tensor_parallel)
    recompute = RecomputeCounter()
    path = out / f"{run.name}.json"
    if torch.distributed.get_rank() == 0:
        path.unlink(missing_ok=True)  # a record of an earlier run here must not pass for this one's
    try:
        corpus = load_corpus(out / "corpus.pt")
        resume = resume_path(out, run, torch.distributed.get_rank())
        replay_paths = replay_trainings(size, device, run) if size.replay_every else None
        done = run_sft(run, size, corpus, device, resume, pause_after_s, recompute.messages, replay_paths)
        if done is None:
            return
        sft, state = done
        record = {
            "run": dataclasses.asdict(run),
            "size": dict(dataclasses.asdict(size), name=size_name),
            "corpus": corpus.stats,
            "sft": sft,
            "rl": None,  # what SFT measured is kept should RL not finish
            "rl_so_far": None,  # and RL's updates so far (a call cut short keeps them)
            "package_warnings": recompute.messages,
            "environment": dict(distributed.environment(device), code_revision=code_revision()),
        }
        distributed.write_json(str(path), record)
        measure.release_memory()

        def rl_so_far(partial: dict) -> None:
            record["rl_so_far"] = partial
            distributed.write_json(str(path), record)

        record["rl"] = run_rl(run, size, corpus, device, state, replay_paths, rl_so_far)
        record["rl_so_far"] = None
        # Every rank's: a warning on one rank alone (a fallback, a correction) counts too.
        record["package_warnings"] = sorted(
            {m for ms in distributed.gather_to_rank0(recompute.messages) or [] for m in ms}
        )
        distributed.write_json(str(path), record)
        resume.unlink(missing_ok=True)  # only now: a call cut short in RL resumes from the saved SFT
    finally:
        distributed.shutdown()


def resume_path(out: Path, run: Run, rank: int) -> Path:
    return out / f"{run.name}.resume{rank}.pt"


def finished(out: Path, run: Run, size: Size) -> bool:
    """Whether ``out`` holds ``run``'s complete record at ``size`` (and no saved state to resume)."""
    path = out / f"{run.name}.json"
    if not path.exists() or resume_path(out, run, 0).exists():
        return False
    record = json.loads(path.read_text())
    recorded = {key: value for key, value in record["size"].items() if key != "name"}
    return record["rl"] is not None and recorded == json.loads(json.dumps(dataclasses.asdict(size)))


class ForkedRanks:
    """A CPU run's gloo ranks, forked from a server process that imported torch, Megatron and the
    package once (each rank then imports this script alone); each rank writes to the run's log. ``poll()`` as
    ``subprocess.Popen``'s: ``None`` while a rank runs, then the first non-zero exit code, or 0.
    A rank that fails ends the others, as torchrun does (they would wait in a collective)."""

    def __init__(self, run: Run, size_name: str, size: Size, out: Path, pause_after_s: Optional[float], log: Path):
        context = multiprocessing.get_context("forkserver")
        # By name: Python 3.11's forkserver drops a preloaded "__main__" (it passes the script's
        # path under a key its server does not read), so each rank imported the script, torch and
        # Megatron anew, about 5 s per run; a rank still imports this script, but finds the rest.
        context.set_forkserver_preload([*PRELOADED, "devkit.megatron_training"])
        self.store = rendezvous_store()  # held while the ranks run: they join it as clients
        arguments = (run, size_name, size, out, pause_after_s, log, self.store.port)
        self.ranks = [
            context.Process(target=forked_rank, args=(rank, *arguments)) for rank in range(run.tensor_parallel)
        ]
        for rank in self.ranks:
            rank.start()

    def poll(self) -> Optional[int]:
        failed = [rank.exitcode for rank in self.ranks if rank.exitcode]
        if failed:
            for rank in self.ranks:
                rank.terminate()
            for rank in self.ranks:
                rank.join()
            return failed[0]
        return None if any(rank.exitcode is None for rank in self.ranks) else 0


def forked_rank(
    rank: int, run: Run, size_name: str, size: Size, out: Path, pause_after_s: Optional[float], log: Path, port: int
) -> None:
    """One rank of ``ForkedRanks``: what torchrun would set, the output into ``log``, the worker."""
    descriptor = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    sys.stdout.reconfigure(line_buffering=True)  # made over a pipe: a rank ended by poll() keeps its lines
    os.environ.update(rank_environment(rank, run.tensor_parallel, port))
    worker(run, size_name, size, out, pause_after_s)


def launch(
    runs: List[Run],
    size_name: str,
    size: Size,
    out: Path,
    overrides: List[str],
    corpus_path: Optional[Path],
    pause_after_s: Optional[float],
) -> tuple[List[str], List[str]]:
    """Build the corpus into ``out`` (or keep the one an earlier call built there, or link the one
    at ``corpus_path``, which another launcher of the same corpus may still be writing), then start
    the runs side by side, each on GPUs of its own (torchrun), or on the CPU on as many cores as it
    has ranks (``ForkedRanks``), each logging to ``out/<run>.log``; returns the failures and the
    runs that paused. With ``pause_after_s`` the
    runs pause (``run_sft``), and a run whose record of this size is complete here is not run
    again: the same command, repeated, finishes every run."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    own = out / "corpus.pt"
    if corpus_path is None and own.exists() and torch.load(own, mmap=True).get("built_for") == corpus_key(size):
        print(f"corpus: {own}, built by an earlier call for this size", flush=True)  # paused runs resume on it
    elif corpus_path is None:
        corpus = build_corpus(size)
        save_corpus(corpus, own, size)
        print(f"corpus in {time.perf_counter() - start:.0f} s: {corpus.stats}", flush=True)
    else:
        if corpus_path.resolve() == (out / "corpus.pt").resolve():
            return [f"--corpus {corpus_path} is this launcher's own corpus.pt"], []
        while not corpus_path.exists():  # the other launcher renames it into place when written
            if time.perf_counter() - start > CORPUS_WAIT_S:
                return [f"--corpus {corpus_path} did not appear within {CORPUS_WAIT_S} s"], []
            time.sleep(1)
        (out / "corpus.pt").unlink(missing_ok=True)
        (out / "corpus.pt").symlink_to(corpus_path.resolve())
    gpus = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))).split(",")
    # A CPU rank computes on one thread (distributed.init_distributed): as many ranks at once as cores.
    free = visible[:gpus] if gpus else ["cpu"] * (os.cpu_count() or 1)
    capacity = len(free)
    pending, running, failures = list(runs), {}, []
    if pause_after_s is not None:
        overrides = [*overrides, "--pause-after-s", str(pause_after_s)]
        for run in [run for run in runs if finished(out, run, size)]:
            print(f"{run.name}: finished in an earlier call", flush=True)
            pending.remove(run)
    for run in list(pending):
        if gpus and run.tensor_parallel > gpus:
            failures.append(f"{run.name}: needs {run.tensor_parallel} GPUs, {gpus} visible")
            pending.remove(run)
    while pending or running:
        for run in list(pending):
            needed = min(run.tensor_parallel, capacity)
            if len(free) < needed:
                continue
            devices, free = free[:needed], free[needed:]
            log_path = out / f"{run.name}.log"
            mode = "a" if resume_path(out, run, 0).exists() else "w"  # a resumed run's log goes on
            log = open(log_path, mode)  # noqa: SIM115 (closed when the run ends)
            if gpus:
                env = dict(
                    os.environ,
                    PYTHONUNBUFFERED="1",
                    CUDA_VISIBLE_DEVICES=",".join(devices),
                    **distributed.MULTICAST_OFF,
                )
                command = [
                    sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={run.tensor_parallel}", __file__,
                    "--worker", run.name, "--size", size_name, "--out", str(out), *overrides,
                ]  # fmt: skip
                process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            else:
                process = ForkedRanks(run, size_name, size, out, pause_after_s, log_path)
            running[run.name] = (process, devices, log)
            print(f"started {run.name} on {','.join(devices)}", flush=True)
            pending.remove(run)
        for name, (process, devices, log) in list(running.items()):
            returncode = process.poll()
            if returncode is None:
                continue
            log.close()
            free += devices
            del running[name]
            elapsed = time.perf_counter() - start
            print(f"{name} exited {returncode} at {elapsed:.0f} s", flush=True)
            if returncode != 0:
                failures.append(f"{name} exited {returncode}; see {out / (name + '.log')}")
        time.sleep(0.5)
    paused = [run.name for run in runs if resume_path(out, run, 0).exists()]
    return failures, paused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="start the runs, writing <run>.json and <run>.log here")
    parser.add_argument("--runs", help=f"comma-separated, of: {', '.join(RUNS)}")
    parser.add_argument(
        "--compare", nargs="+", metavar="DIR", help="compare the runs in DIRs (folders, or earlier --compare JSONs)"
    )
    parser.add_argument("--json", help="where --compare writes the runs and the comparison")
    parser.add_argument("--corpus", type=Path, help="a corpus.pt that another launcher of this corpus writes")
    parser.add_argument("--sft-steps", type=int, help="override the size's")
    parser.add_argument("--rl-steps", type=int, help="override the size's")
    parser.add_argument(
        "--audit-every", type=int, help="audit the head's gradients every this many SFT steps and every RL update"
    )
    parser.add_argument(
        "--replay-every",
        type=int,
        help="replay each path's updates (paired_replay) from the state every this many SFT steps and every RL rollout",
    )
    parser.add_argument(
        "--evaluate-steps",
        type=lambda text: tuple(int(step) for step in text.split(",")),
        help="comma-separated SFT steps to evaluate in float64 on their own weights and batches",
    )
    parser.add_argument(
        "--pause-after-s",
        type=float,
        help="each run pauses its SFT after this many seconds; the same command resumes it",
    )
    parser.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)  # one run, started by --out
    args = parser.parse_args()
    overrides = {
        key: value
        for key, value in (
            ("sft_steps", args.sft_steps),
            ("rl_steps", args.rl_steps),
            ("audit_every", args.audit_every),
            ("replay_every", args.replay_every),
            ("evaluate_steps", args.evaluate_steps),
        )
        if value
    }
    size = dataclasses.replace(SIZES[args.size], **overrides)
    if args.worker:
        worker(RUNS[args.worker], args.size, size, Path(args.out), args.pause_after_s)
        return
    if not (args.out or args.compare):
        parser.error("give --out (start runs), --compare (compare runs) or both")
    failures, paused = [], []
    if args.out:
        if not args.runs:
            parser.error("--out needs --runs")
        unknown = set(args.runs.split(",")) - set(RUNS)
        if unknown:
            parser.error(f"--runs: unknown {', '.join(sorted(unknown))}")
        forwarded = [
            item
            for key, value in overrides.items()
            for item in (
                f"--{key.replace('_', '-')}",
                ",".join(map(str, value)) if isinstance(value, tuple) else str(value),
            )
        ]
        runs = [RUNS[name] for name in args.runs.split(",")]
        failed, paused = launch(runs, args.size, size, Path(args.out), forwarded, args.corpus, args.pause_after_s)
        failures += failed
        if paused:
            print(f"paused: {', '.join(paused)} (the same command resumes them; compare after)", flush=True)
    if args.compare and not paused:
        records, replays, incomplete = merge(args.compare)
        summary, compared = criterion(records)
        failures += incomplete + compared
        print_summary(summary)
        for name, replay in replays.items():
            outcome = "identical" if replay["identical"] else replay.get("max_difference", "another size")
            print(f"replay of {name}: {outcome}")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as handle:
                payload = {"runs": records, "comparison": summary, "replays": replays, "failures": failures}
                json.dump(payload, handle, indent=1)
    for line in failures:
        print(f"FAILED: {line}")
    print("real_training: " + ("FAIL" if failures else "PAUSED" if paused else "PASS"), flush=True)
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
