"""Training a bf16 GPTModel with Megatron-Core in a chosen parallel layout, with the fused head off
and on from the same seed. Started by torchrun, one process per GPU:

    torchrun --nproc-per-node 2 tests/gpu/pipeline_training.py --layout pp2_tied [--loss-path three-gemm ...]
        [--backend triton] [--json pipeline_training.json]

Layouts (``--layout NAME``; the flags ``--tp``, ``--pp``, ``--vpp``, ``--micro-batches``,
``--[no-]tied``, ``--[no-]sequence-parallel``, ``--[no-]overlap-grad-reduce``,
``--[no-]distributed-optimizer`` and ``--[no-]overlap-param-gather`` override a preset; data
parallel = world size / (TP x PP); sequence parallelism is on by default exactly when TP > 1):

- ``tp2_pp2`` (4 GPUs, the default): TP=2 x PP=2, sequence parallel, tied embeddings, 1F1B, the
  distributed optimizer;
- ``tp2_dp2`` (4 GPUs): TP=2 x DP=2, sequence parallel, untied, the gradient reduction and the
  parameter all-gather overlapped as in ``dp2_overlap``: the head's shard and its all-reduces
  under a data-parallel reduction of the main_grad route's buffers;
- ``tp2_pp2_dp2`` (8 GPUs): ``tp2_pp2`` with DP=2, the gradient reduction and the parameter
  all-gather overlapped as in ``dp2_overlap``: all three parallelisms at once;
- ``pp2_tied`` (2 GPUs): PP=2, tied embeddings, 1F1B, Megatron's mixed-precision optimizer;
- ``pp2_vpp2_tied`` (2 GPUs): PP=2 with two virtual chunks per stage (``vp_stage``), Megatron's
  interleaved schedule, tied embeddings: the first chunk of the first stage holds the embedding,
  the last chunk of the last stage the output layer. Megatron needs the layers divisible by
  PP x VPP and, with its default of PP micro-batches per group, a number of micro-batches that is
  a multiple of PP;
- ``dp2_overlap`` (2 GPUs): DP=2, each replica on its own micro-batches, 4 micro-batches of
  gradient accumulation, the gradient reduction overlapped with the backward
  (``overlap_grad_reduce``), the distributed optimizer with the parameter all-gather overlapped with
  the next forward (``overlap_param_gather``: Megatron's forward pre-hooks wait for each module's
  parameters as the module runs, so a head must read the output weight through the output layer's
  forward, as the patched forward does). Untied, so that the output weight is a parameter of its
  own that only the output layer's pre-hook gathers.

Each run builds the model from the same seed (tied: the embedding on the first stage, its copy as
the output weight on the last), wraps each chunk in Float16Module and Megatron-Core's
DistributedDataParallel (Megatron-LM's settings: fp32 gradient reduction, buckets on the first
chunk only, the no-sync and grad-sync functions in the config), takes Megatron's Adam, and trains
with ``get_forward_backward_func`` and ``finalize_model_grads``, the learning rate set as
Megatron's scheduler sets it:

1. SFT: ``--sft-steps`` steps (default SFT_STEPS) through the labels path,
   ``model(..., labels=labels)``, the mean token loss; with ``--loss-path three-gemm`` each
   forward step first declares the loss mask (``head.declare_loss_weights``), so the fused head
   finishes its gradients in the forward;
2. RL: ``--rl-steps`` steps (default RL_STEPS) of a clipped policy loss on the response tokens'
   log-probs with an entropy bonus: by hand from ``head.logprobs`` (``--loss-path logprobs``), or
   ``head.loss`` with ``losses.ClippedPolicyLoss``, the same loss (``three-gemm``). With
   ``--loss-path main-grad`` both phases run as ``three-gemm`` with the schedule's scale declared
   (``main_grad_scale``: the SFT declaration ``1 / (micro-batches x tokens)``, the RL loss
   ``1 / micro-batches``), so that the fused head adds the output weight's gradient straight into
   its ``main_grad`` in the forward, before Megatron's DDP reduces the buckets and the embedding
   group sums the tied copies. Every
   UPDATES_PER_ROLLOUT steps a rollout (a forward-only pass of the same schedule, collecting the
   head's log-probs) fixes the old log-probs and the advantages, so the ratio moves away from 1
   and the clip acts.

The loss path applies to every run (a stock head ignores the declaration and computes ``head.loss``
from the logits), so fused and stock curves compare. A third run, the noise reference, is the
stock run again with every initial weight moved by about one bf16 rounding (a sign pattern seeded
by the weight's shape, so replicated weights and the tied copies move alike): how far two equally
valid bf16 trainings drift apart here. Several paths (``--loss-path logprobs three-gemm``) run one
after another in the same processes, each with its own three runs and checks (the JSON's
``loss_paths``): the ranks start once.

Checked (every rank's checks, then the last stage's curves on rank 0; the JSON is written before
the verdict):
- tied layouts: the tied copies, the first stage's embedding and the last stage's output weight,
  are bitwise equal at the start, after SFT and after RL, in every run; with DP > 1 every
  parameter is bitwise equal across the DP replicas at those moments;
- the head's gradient reaches the right parameters. After the backward of the first SFT step (the
  same weights in every run but the reference) each head weight (each tied copy, or the untied
  output weight) has a ``main_grad`` that is non-zero on the vocabulary rows no input token of the
  step uses: only the head's gradient reaches those rows, so a head gradient lost or sent to
  another tensor leaves them zero on the last stage, and on the first stage unless the
  embedding-group reduction carried it over. The tied copies' gradients are bitwise equal across
  the embedding group. Each head weight's gradient differs from the stock run's by at most
  GRAD_NOISE_FACTOR x the reference run's difference + GRAD_NOISE_FLOOR (relative Frobenius
  norms: a gradient reduced twice, or missing a reduction, is off by order 1);
- with ``three-gemm`` and ``main-grad``, no backward of the fused run had to recompute the logits
  or correct ``main_grad`` (every upstream gradient was the declared one), and at every optimizer
  step no main_grad-route loss was without its backward (``head.main_grad_outstanding``);
- SFT step 0 (identical weights): fused and stock differ only by the stock layer's bf16 rounding
  of the logits, unbiased per token and averaged over every token of the step: STEP0_ATOL;
- every curve (SFT loss, RL policy loss, RL entropy) agrees within bf16 noise: at every step,
  |fused - stock| <= NOISE_FACTOR x the largest |reference - stock| over the phase + NOISE_FLOOR.
  Later steps drift because Adam turns rounding-level gradient differences into
  learning-rate-sized updates for near-zero gradient entries, and the policy ratio
  exp(logprob - old) amplifies log-prob differences; the reference run measures exactly that
  drift. A head gradient lost or sent to the wrong stage's weight moves the curves by far more,
  or breaks the tied copies; one off by a factor (reduced twice, a missing TP reduction) fails
  the gradient check even where Adam's near scale invariance hides it in the curves.

It also records, per rank and per phase, the median step time (after WARMUP_STEPS) and the peak
memory, fused vs stock, and the layout.

Without CUDA it runs on gloo CPU ranks at a tiny size (more layers where the chunks need them): a
dry run of the same schedules, DDP settings, overlaps and optimizers, Megatron's optimizers built
as if the weights were on a GPU (``cpu_tensors_named_cuda``), with the torch backend and without
gradient clipping (Megatron's clipping asserts CUDA gradients at every step).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import statistics
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from devkit import distributed, measure
from devkit.megatron_gpt import GPTShape, build_bf16_gpt
from devkit.megatron_training import (
    RecomputeCounter,
    megatron_training,
    move_by_one_rounding,
    set_learning_rate,
    sft_loss,
)
from megatron_fused_lm import _logging, losses, weight_grad_corrections
from megatron_fused_lm.integration import FusedLMConfig, wrap_model

GPU_SHAPE = GPTShape(hidden=1024, heads=16, layers=4, vocab=151936, seq=2048, micro_batch=2)
CPU_SHAPE = GPTShape(hidden=64, heads=4, layers=2, vocab=1000, seq=16, micro_batch=2)
SFT_STEPS, RL_STEPS, UPDATES_PER_ROLLOUT = 30, 30, 3
WARMUP_STEPS = 3
# At the RL rate 1e-4 the clip acts (up to a third of the response tokens in some updates). At 3e-4
# the policy's entropy collapsed at a different step in each run, the stock run's own noise
# reference included (H200, 2026-11-21): a chaotic regime where no two bf16 runs agree step by step.
SFT_LEARNING_RATE, RL_LEARNING_RATE = 1e-3, 1e-4
TEMPERATURE = 0.8
CLIP_EPSILON, ENTROPY_COEFFICIENT = 0.2, 0.01
POLICY_LOSS = losses.ClippedPolicyLoss(clip_low=CLIP_EPSILON, clip_high=CLIP_EPSILON, entropy_coef=ENTROPY_COEFFICIENT)
# Tokens follow a fixed random bigram map over a sub-vocabulary, so the SFT loss can fall.
DATA_VOCAB = 4096
STEP0_ATOL = 0.01
NOISE_FACTOR, NOISE_FLOOR = 3.0, 0.01
GRAD_NOISE_FACTOR, GRAD_NOISE_FLOOR = 3.0, 0.01
COMPARE_BLOCK = 1 << 22  # elements per all-gather of the bitwise checks
# Each run: (name, fused head, initial weights moved by one bf16 rounding).
RUNS = (("stock", False, False), ("fused", True, False), ("reference", False, True))
LOSS_PATHS = ("logprobs", "three-gemm", "main-grad")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The parallel layout and Megatron's DDP / optimizer switches of a run."""

    name: str
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    micro_batches: int = 4
    tied: bool = True
    sequence_parallel: Optional[bool] = None  # None: on exactly when tp > 1
    overlap_grad_reduce: bool = False
    distributed_optimizer: bool = False
    overlap_param_gather: bool = False


# The named layouts (the module docstring says why each, and on how many GPUs).
LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("tp2_pp2", tp=2, pp=2, distributed_optimizer=True),
        Layout(
            "tp2_dp2", tp=2, tied=False, overlap_grad_reduce=True, distributed_optimizer=True, overlap_param_gather=True
        ),
        Layout(
            "tp2_pp2_dp2", tp=2, pp=2, overlap_grad_reduce=True, distributed_optimizer=True, overlap_param_gather=True
        ),
        Layout("pp2_tied", pp=2),
        Layout("pp2_vpp2_tied", pp=2, vpp=2),
        Layout(
            "dp2_overlap", tied=False, overlap_grad_reduce=True, distributed_optimizer=True, overlap_param_gather=True
        ),
    )
}


def check_layout(layout: Layout, world_size: int, layers: int) -> None:
    """Megatron's requirements on the layout, each as a readable error before any model is built."""
    problems = []
    if world_size % (layout.tp * layout.pp):
        problems.append(f"{world_size} processes do not split into TP={layout.tp} x PP={layout.pp}")
    if layout.sequence_parallel and layout.tp == 1:
        problems.append("sequence parallelism needs TP > 1")
    if layout.overlap_param_gather and not layout.distributed_optimizer:
        problems.append("overlap_param_gather needs the distributed optimizer")
    if layout.vpp > 1:
        if layout.pp == 1:
            problems.append("a virtual pipeline needs PP > 1")
        # The interleaved schedule runs micro-batches in groups of PP per chunk.
        if layout.micro_batches % layout.pp:
            problems.append(f"the interleaved schedule needs micro-batches ({layout.micro_batches}) a multiple of PP")
    if layers % (layout.pp * layout.vpp):
        problems.append(f"{layers} layers do not split into PP x VPP = {layout.pp * layout.vpp} chunks")
    if problems:
        raise SystemExit(f"layout {layout.name}: " + "; ".join(problems))


def make_dataset(shape: GPTShape, steps: int, seed: int, micro_batches: int) -> torch.Tensor:
    """Token walks ``[steps, micro_batches, micro_batch, seq + 1]`` of a fixed random bigram map
    over DATA_VOCAB tokens (each from a random start), the same on every rank."""
    vocab = min(DATA_VOCAB, shape.vocab)
    bigram = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (steps, micro_batches, shape.micro_batch), generator=generator)
    walks = [starts]
    for _ in range(shape.seq):
        walks.append(bigram[walks[-1]])
    return torch.stack(walks, dim=-1)


def step_microbatches(shape: GPTShape, tokens: torch.Tensor, device: torch.device) -> List[Dict]:
    """One rank's micro-batches of a step from its ``tokens [micro_batches, micro_batch, seq + 1]``:
    the inputs, the next-token labels, positions, the causal mask, the SFT loss mask (every token),
    the response mask (second half of each sequence, for RL) and the micro-batch's index."""
    position_ids = torch.arange(shape.seq).unsqueeze(0).expand(shape.micro_batch, shape.seq)
    mask = torch.triu(torch.ones(1, 1, shape.seq, shape.seq, dtype=torch.bool), diagonal=1)
    response = (torch.arange(shape.seq) >= shape.seq // 2).expand(shape.micro_batch, shape.seq).contiguous()
    batches = []
    for index, walk in enumerate(tokens):
        batch = dict(
            input_ids=walk[:, :-1],
            labels=walk[:, 1:],
            position_ids=position_ids,
            attention_mask=mask,
            loss_mask=torch.ones(shape.micro_batch, shape.seq),
            response=response,
        )
        batch = {key: value.to(device) for key, value in batch.items()}
        batch["index"] = index
        # The loss mask's token count, known on the host (the main-grad path declares its scale).
        batch["tokens"] = float(shape.micro_batch * shape.seq)
        batches.append(batch)
    return batches


class Run:
    """One training run (fused head on or off; for the noise reference, initial weights moved by a
    rounding): the model chunks, their DDP and optimizer, the schedule."""

    def __init__(
        self,
        layout: Layout,
        shape: GPTShape,
        device: torch.device,
        name: str,
        fused: bool,
        perturbed: bool,
        loss_path: str,
        backend: str,
    ):
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.layout, self.shape, self.device, self.name, self.fused = layout, shape, device, name, fused
        self.loss_path = loss_path
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        virtual = layout.vpp > 1
        # One chunk per virtual stage, as Megatron-LM's model provider builds them.
        self.gpts = []
        for vp_stage in range(layout.vpp) if virtual else (None,):
            gpt = build_bf16_gpt(
                shape,
                device,
                tied=layout.tied,
                sequence_parallel=layout.sequence_parallel,
                seed=1234,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=not virtual, vp_stage=vp_stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=not virtual, vp_stage=vp_stage),
                vp_stage=vp_stage,
            )
            if perturbed:
                move_by_one_rounding(gpt)
            self.gpts.append(gpt)
        self.chunks, self.optimizer = megatron_training(
            self.gpts,
            device,
            SFT_LEARNING_RATE,
            overlap_grad_reduce=layout.overlap_grad_reduce,
            distributed_optimizer=layout.distributed_optimizer,
            overlap_param_gather=layout.overlap_param_gather,
        )
        self.head = wrap_model(self.chunks, FusedLMConfig(enabled=fused, backend=backend))
        assert self.head.fused == (fused and self.last_stage), (fused, self.last_stage)
        self.forward_backward = get_forward_backward_func()
        self.rollout_batches: List[Dict] = []
        self.old_logprobs: List[torch.Tensor] = []
        self.advantages: List[torch.Tensor] = []
        self.first_grads: List[torch.Tensor] = []
        self.outstanding = 0  # main_grad-route losses without their backward at an optimizer step

    def head_weights(self) -> List[torch.nn.Parameter]:
        """This rank's parameters that the head's gradient must reach: the copies of the tied
        embedding (the first chunk's embedding on the first stage, the last chunk's output weight
        on the last; one parameter when a stage has both), or, untied, the output weight."""
        weights = []
        if self.layout.tied and self.gpts[0].pre_process:
            weights.append(self.gpts[0].shared_embedding_or_output_weight())
        last = self.gpts[-1]
        if last.post_process:
            weight = last.shared_embedding_or_output_weight() if self.layout.tied else last.output_layer.weight
            if not any(weight is other for other in weights):
                weights.append(weight)
        return weights

    @contextlib.contextmanager
    def parameters_gathered(self):
        """With overlap_param_gather, the distributed optimizer updates only this rank's shard and
        the next training forward's pre-hooks gather the rest: around anything else that reads
        the weights (a rollout, the checks) gather them now, as Megatron-LM does around its
        evaluation."""
        if not self.layout.overlap_param_gather:
            yield
            return
        for chunk in self.chunks:
            chunk.disable_forward_pre_hook(param_sync=True)
        try:
            yield
        finally:
            for chunk in self.chunks:
                chunk.enable_forward_pre_hook()

    def schedule(self, forward_step, batches, forward_only=False, collect_non_loss_data=False):
        self.num_microbatches = len(batches)  # the schedule divides each micro-batch's loss by it
        return self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in self.chunks],  # each chunk reads every micro-batch
            model=self.chunks,
            num_microbatches=len(batches),
            seq_length=self.shape.seq,
            micro_batch_size=self.shape.micro_batch,
            forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data,
        )

    def train_step(self, forward_step, batches, after_backward=None) -> Dict[str, float]:
        """One optimizer step over the micro-batches ``batches`` (``after_backward()`` runs before
        the optimizer steps); on the last stage, the mean over them and over the DP replicas of
        what the loss function reported (``{}`` elsewhere)."""
        from megatron.core import parallel_state

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reported = self.schedule(forward_step, batches)
        # Before the optimizer step, every main_grad-route loss must have had its backward.
        self.outstanding += len(self.head.main_grad_outstanding())
        if after_backward is not None:
            after_backward()
        updated, _, _ = self.optimizer.step()
        assert updated, "the optimizer skipped a step"
        if not self.last_stage:
            return {}
        names = list(reported[0])
        means = torch.stack([torch.stack([entry[name] for entry in reported]).mean() for name in names]).float()
        dist.all_reduce(means, group=parallel_state.get_data_parallel_group())  # gloo has no AVG
        means /= parallel_state.get_data_parallel_world_size()
        return dict(zip(names, means.tolist(), strict=True))

    def main_grad_scale(self, scale: float) -> Optional[float]:
        """``scale``, what the loss will be multiplied by, on the main-grad path (the fused head adds
        the output weight's gradient into ``main_grad`` in the forward); ``None`` on the others."""
        return scale if self.loss_path == "main-grad" else None

    # Forward-step functions for the schedule: (batch iterator, model chunk) -> (output, loss function).
    def sft_forward_step(self, iterator, model):
        batch = next(iterator)
        if self.loss_path in ("three-gemm", "main-grad"):
            # sft_loss's sum over the token count, which the schedule divides by the micro-batches.
            scale = 1.0 / (self.num_microbatches * batch["tokens"])
            self.head.declare_loss_weights(batch["loss_mask"], main_grad_scale=self.main_grad_scale(scale))
        inputs = (batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        per_token_loss = model(*inputs, labels=batch["labels"])
        return per_token_loss, functools.partial(sft_loss, batch["loss_mask"])

    def rollout_forward_step(self, iterator, model):
        batch = next(iterator)
        output = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        return output, functools.partial(self.rollout_logprobs, batch)

    def rl_forward_step(self, iterator, model):
        batch = next(iterator)
        output = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        loss = self.policy_loss if self.loss_path == "logprobs" else self.head_policy_loss
        return output, functools.partial(loss, batch)

    def rollout_logprobs(self, batch, output, non_loss_data=False):
        with torch.no_grad():
            return self.head.logprobs(output, batch["labels"], temperature=TEMPERATURE, mask=batch["response"])

    def policy_loss(self, batch, output):
        """PPO-style clipped policy loss on the response tokens minus an entropy bonus, by hand
        from the head's log-probs and entropy (four GEMMs when fused)."""
        response = batch["response"]
        logprob, entropy = self.head.logprobs(
            output, batch["labels"], temperature=TEMPERATURE, return_entropy=True, mask=response
        )
        ratio = torch.exp(logprob - self.old_logprobs[batch["index"]])
        advantage = self.advantages[batch["index"]].unsqueeze(-1)
        surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - CLIP_EPSILON, 1 + CLIP_EPSILON) * advantage)
        per_token = -surrogate - ENTROPY_COEFFICIENT * entropy
        loss = per_token[response].mean()
        return loss, policy_metrics(loss, ratio, entropy, response)

    def head_policy_loss(self, batch, output):
        """The same loss from ``head.loss`` (three GEMMs when fused): ``ClippedPolicyLoss`` with
        per-token advantages and weights making it the mean over the response tokens."""
        response = batch["response"]
        old_logprob = self.old_logprobs[batch["index"]]
        inputs = {
            "old_logprob": old_logprob,
            "advantages": self.advantages[batch["index"]].unsqueeze(-1).expand(response.shape),
            "weight": losses.token_mean_weights(response),
        }
        result = self.head.loss(
            output, batch["labels"], POLICY_LOSS, loss_inputs=inputs, mask=response, temperature=TEMPERATURE,
            main_grad_scale=self.main_grad_scale(1.0 / self.num_microbatches),
        )  # fmt: skip
        ratio = torch.exp(result.logprob - old_logprob)
        return result.loss, policy_metrics(result.loss, ratio, result.entropy, response)

    def rollout(self, batches, iteration: int) -> None:
        """Old log-probs of the response tokens (a forward-only schedule) and advantages (+-1 per
        sequence, seeded per DP rank), kept on the last stage for the next updates."""
        with self.parameters_gathered():
            collected = self.schedule(self.rollout_forward_step, batches, forward_only=True, collect_non_loss_data=True)
        self.rollout_batches = batches
        self.old_logprobs = list(collected) if self.last_stage else []
        generator = torch.Generator().manual_seed(5000 + iteration + 10000 * self.dp_rank)
        self.advantages = [
            (torch.randint(0, 2, (self.shape.micro_batch,), generator=generator) * 2 - 1).float().to(self.device)
            for _ in batches
        ]

    def tied_copies_equal(self, gradients: bool = False) -> bool:
        """Whether the tied copies, the first stage's embedding and the last stage's output weight
        (the same TP shard; with ``gradients``, their ``main_grad``), are bitwise equal; the same
        answer on every rank."""
        from megatron.core import parallel_state

        equal = True
        if parallel_state.is_rank_in_embedding_group():
            (weight,) = self.head_weights()  # one per stage in the embedding group
            equal = equal_across(weight.main_grad if gradients else weight, parallel_state.get_embedding_group())
        return all_ranks_agree(equal, self.device)

    def replicas_equal(self) -> bool:
        """Whether every parameter is bitwise equal across the DP replicas; the same answer on
        every rank."""
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
        parameters = [parameter for gpt in self.gpts for parameter in gpt.parameters()]
        return all_ranks_agree(all([equal_across(parameter, group) for parameter in parameters]), self.device)

    def check_parameters(self, record: dict, moment: str) -> None:
        """Record at ``moment`` whether the tied copies and the DP replicas are bitwise equal."""
        with self.parameters_gathered():
            if self.layout.tied:
                record["tied_equal"][moment] = self.tied_copies_equal()
            record["replicas_equal"][moment] = self.replicas_equal()

    def record_head_gradients(self, step_tokens: torch.Tensor, record: dict) -> None:
        """After the first SFT step's backward (``finalize_model_grads`` done): keep each head
        weight's ``main_grad`` (for the comparison across runs) and record whether it is non-zero
        on the vocabulary rows of this TP shard that no input token of the step (``step_tokens``,
        all DP replicas' micro-batches) uses, and whether the tied copies' gradients are equal."""
        from megatron.core import parallel_state

        inputs = step_tokens[..., :-1].flatten()
        head_rows = []
        for weight in self.head_weights():
            rows = weight.shape[0]
            first = parallel_state.get_tensor_model_parallel_rank() * rows
            used = torch.zeros(rows, dtype=torch.bool)
            used[inputs[(inputs >= first) & (inputs < first + rows)] - first] = True
            grad = weight.main_grad.detach()
            self.first_grads.append(grad.float().cpu())
            row_norms = grad.norm(dim=1).cpu()  # no weight-sized temporary inside the measured phase
            head_rows.append({"rows": int((~used).sum()), "norm": row_norms[~used].norm().item()})
        copies_equal = self.tied_copies_equal(gradients=True) if self.layout.tied else None
        record["head_gradient"] = {"head_only_rows": head_rows, "copies_equal": copies_equal}

    def train(self, sft_steps: int, rl_steps: int) -> dict:
        from megatron.core import parallel_state

        record = {
            "name": self.name,
            "fused": self.fused,
            "head_fused": self.head.fused,
            "tied_equal": {},
            "replicas_equal": {},
        }
        self.check_parameters(record, "start")
        phases = (
            ("sft", sft_steps, self.sft_step, 0, SFT_LEARNING_RATE),
            ("rl", rl_steps, self.rl_step, 1, RL_LEARNING_RATE),
        )
        dp_size = parallel_state.get_data_parallel_world_size()
        micro_batches = self.layout.micro_batches
        mine = slice(self.dp_rank * micro_batches, (self.dp_rank + 1) * micro_batches)
        for phase, steps, step_function, data_seed, learning_rate in phases:
            set_learning_rate(self.optimizer, learning_rate)
            dataset = make_dataset(self.shape, steps, data_seed, micro_batches * dp_size)
            reported, times = [], []
            allocated_before = measure.reset_peak_memory(self.device)
            for step in range(steps):
                batches = step_microbatches(self.shape, dataset[step, mine], self.device)
                after_backward = None
                if phase == "sft" and step == 0:
                    after_backward = functools.partial(self.record_head_gradients, dataset[step], record)
                measure.synchronize(self.device)
                start = time.perf_counter()
                reported.append(step_function(step, batches, after_backward))
                measure.synchronize(self.device)
                times.append((time.perf_counter() - start) * 1e3)
            peak = measure.peak_memory_bytes(self.device)
            record[phase] = {
                "curves": {name: [values[name] for values in reported] for name in reported[0]},
                "median_step_ms": statistics.median(times[WARMUP_STEPS:]),
                "peak_bytes": peak,
                "peak_extra_bytes": None if peak is None else peak - allocated_before,
            }
            self.check_parameters(record, phase)
        record["main_grad_outstanding"] = self.outstanding
        # Counted on the device (warned only when read): the backward passes that corrected a
        # three-GEMM weight gradient because the upstream was not the declared one.
        record["weight_grad_corrections"] = weight_grad_corrections()
        return record

    def sft_step(self, step: int, batches, after_backward=None) -> Dict[str, float]:
        return self.train_step(self.sft_forward_step, batches, after_backward)

    def rl_step(self, step: int, batches, after_backward=None) -> Dict[str, float]:
        """A rollout on this step's micro-batches every UPDATES_PER_ROLLOUT steps, then an update
        on the rollout's micro-batches (the old log-probs belong to them)."""
        if step % UPDATES_PER_ROLLOUT == 0:
            self.rollout(batches, step // UPDATES_PER_ROLLOUT)
        return self.train_step(self.rl_forward_step, self.rollout_batches, after_backward)


def equal_across(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether ``tensor`` is bitwise equal on every rank of ``group``, compared COMPARE_BLOCK
    elements at a time so that the check adds little to the measured peak memory."""
    size = dist.get_world_size(group)
    equal = True
    for block in tensor.detach().reshape(-1).split(COMPARE_BLOCK) if size > 1 else ():
        gathered = [torch.empty_like(block) for _ in range(size)]
        dist.all_gather(gathered, block, group=group)
        equal = equal and all(torch.equal(gathered[0], other) for other in gathered[1:])
    return equal


def all_ranks_agree(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank."""
    agreed = torch.tensor([float(flag)], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


def policy_metrics(loss, ratio, entropy, response) -> Dict[str, torch.Tensor]:
    """What the RL loss functions report: the loss, the mean response entropy and the fraction of
    response tokens past the clip."""
    clipped = (ratio - 1).abs() > CLIP_EPSILON
    return {
        "loss": loss.detach().clone(),
        "entropy": entropy.detach()[response].mean(),
        "clipped_fraction": clipped[response].float().mean(),
    }


def gradient_differences(first_grads: Dict[str, List[torch.Tensor]]) -> List[Dict[str, float]]:
    """For each of this rank's head weights, ``||g - g_stock|| / ||g_stock||`` (Frobenius) of its
    first-step gradient in the fused and the reference run."""
    return [
        {name: ((first_grads[name][index] - stock).norm() / stock.norm()).item() for name in ("fused", "reference")}
        for index, stock in enumerate(first_grads["stock"])
    ]


def compare_runs(ranks: List[dict]) -> tuple:
    """Check every run's parameter and gradient checks on every rank and the fused curves of the
    last stage against the stock ones (tolerances in the module docstring). Returns
    ``(summary, failures)`` (rank 0): the curves and their differences, and a sentence for each
    check that failed."""
    failures = []
    for record in ranks:
        if record["recomputed"]:
            failures.append(
                f"rank {record['rank']}: a backward of the fused run recomputed the logits or corrected main_grad"
            )
        for grads in record["gradient_differences"]:
            tolerance = GRAD_NOISE_FACTOR * grads["reference"] + GRAD_NOISE_FLOOR
            if not grads["fused"] <= tolerance:
                failures.append(
                    f"rank {record['rank']}: the fused run's first gradient of a head weight differs from stock by "
                    f"{grads['fused']:.3g} (relative) > {tolerance:.3g}"
                )
        for run in record["runs"]:
            where = f"rank {record['rank']} run {run['name']}"
            if run["weight_grad_corrections"]:
                failures.append(
                    f"{where}: {run['weight_grad_corrections']} backward passes corrected a weight gradient"
                )
            if run["main_grad_outstanding"]:
                failures.append(f"{where}: {run['main_grad_outstanding']} main_grad-route losses lacked their backward")
            for check, sentence in (("tied_equal", "tied copies differ"), ("replicas_equal", "DP replicas differ")):
                failures += [f"{where}: {sentence} at {moment}" for moment, equal in run[check].items() if not equal]
            gradient = run["head_gradient"]
            if gradient["copies_equal"] is False:
                failures.append(f"{where}: the tied copies' gradients differ after the first step")
            for weight in gradient["head_only_rows"]:
                if weight["rows"] == 0:
                    failures.append(
                        f"{where}: every vocabulary row of a head weight is an input token, nothing to check"
                    )
                elif not weight["norm"] > 0:
                    failures.append(f"{where}: no head gradient on the rows no input token uses")
    last_stage = [record for record in ranks if record["last_stage"]]
    curves = {run["name"]: {phase: run[phase]["curves"] for phase in ("sft", "rl")} for run in last_stage[0]["runs"]}
    for record in last_stage[1:]:  # the TP and DP ranks of the last stage must report the same values
        if {run["name"]: {phase: run[phase]["curves"] for phase in ("sft", "rl")} for run in record["runs"]} != curves:
            failures.append(f"rank {record['rank']} reports other curves than rank {last_stage[0]['rank']}")
    summary = {"step0_atol": STEP0_ATOL, "noise_factor": NOISE_FACTOR, "noise_floor": NOISE_FLOOR}
    for phase, name in (("sft", "loss"), ("rl", "loss"), ("rl", "entropy"), ("rl", "clipped_fraction")):
        values = {run: torch.tensor(curves[run][phase][name], dtype=torch.float64) for run in curves}
        fused_difference = (values["fused"] - values["stock"]).abs()
        reference_difference = (values["reference"] - values["stock"]).abs()
        tolerance = NOISE_FACTOR * reference_difference.max().item() + NOISE_FLOOR
        summary[f"{phase}_{name}"] = dict(
            {run: value.tolist() for run, value in values.items()},
            fused_max_difference=fused_difference.max().item(),
            reference_max_difference=reference_difference.max().item(),
            step0_difference=fused_difference[0].item(),
            tolerance=tolerance,
        )
        if name == "clipped_fraction":  # reported, not checked: a count of tokens past the clip
            continue
        if not all(torch.isfinite(value).all() for value in values.values()):
            failures.append(f"{phase} {name}: a value is not finite")
        elif fused_difference.max() > tolerance:
            failures.append(f"{phase} {name}: fused and stock differ by {fused_difference.max():.3g} > {tolerance:.3g}")
    sft = summary["sft_loss"]
    if sft["step0_difference"] > STEP0_ATOL:
        failures.append(f"sft step 0: fused and stock differ by {sft['step0_difference']:.3g} > {STEP0_ATOL}")
    if not all(sft[run][-1] < sft[run][0] for run in curves):
        failures.append("the SFT loss did not fall")
    return summary, failures


def parse_layout(args: argparse.Namespace) -> Layout:
    """The preset named by ``--layout`` with the flags given explicitly on top."""
    preset = LAYOUTS[args.layout]
    overrides = {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(Layout)
        if field.name != "name" and getattr(args, field.name) is not None
    }
    layout = dataclasses.replace(preset, **overrides)
    if layout.sequence_parallel is None:
        layout = dataclasses.replace(layout, sequence_parallel=layout.tp > 1)
    return layout


def train_loss_path(layout: Layout, shape: GPTShape, device, loss_path: str, args, recompute) -> dict:
    """This rank's record of the three runs (stock, fused, reference) on ``loss_path``."""
    from megatron.core import parallel_state

    recompute.count = 0  # the fused run's recomputations of this path alone
    _logging._already_warned.clear()  # a warning an earlier path gave is given again for this one
    runs, first_grads = [], {}
    for name, fused, perturbed in RUNS:
        run = Run(layout, shape, device, name, fused, perturbed, loss_path, args.backend)
        runs.append(run.train(args.sft_steps, args.rl_steps))
        first_grads[name] = run.first_grads
        distributed.log(
            f"{loss_path} {name}: "
            + ", ".join(
                f"{phase} {runs[-1][phase]['median_step_ms']:.1f} ms/step, peak {runs[-1][phase]['peak_bytes']} B"
                + (
                    f", loss {runs[-1][phase]['curves']['loss'][0]:.4f} -> {runs[-1][phase]['curves']['loss'][-1]:.4f}"
                    if runs[-1][phase]["curves"]
                    else ""
                )
                for phase in ("sft", "rl")
            )
        )
        del run
        measure.release_memory()
    return {
        "rank": dist.get_rank(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "last_stage": parallel_state.is_pipeline_last_stage(),
        "gradient_differences": gradient_differences(first_grads),
        "recomputed": recompute.count,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=LAYOUTS, default="tp2_pp2", help="a named layout (flags override it)")
    parser.add_argument("--tp", type=int, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size")
    parser.add_argument("--vpp", type=int, help="virtual pipeline size: model chunks per stage (interleaved schedule)")
    parser.add_argument("--micro-batches", type=int, help="micro-batches per step and DP rank")
    for switch in ("tied", "sequence-parallel", "overlap-grad-reduce", "distributed-optimizer", "overlap-param-gather"):
        parser.add_argument(f"--{switch}", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--sft-steps", type=int, default=SFT_STEPS)
    parser.add_argument("--rl-steps", type=int, default=RL_STEPS)
    parser.add_argument(
        "--loss-path", nargs="+", choices=LOSS_PATHS, default=["logprobs"],
        help="one or more, each checked on its own three runs; see the module docstring",
    )  # fmt: skip
    parser.add_argument("--backend", choices=("torch", "triton", "auto"), default="auto", help="the fused head's")
    parser.add_argument("--json", default=None, help="where rank 0 writes curves, times and memory")
    args = parser.parse_args()
    if min(args.sft_steps, args.rl_steps) <= WARMUP_STEPS:
        parser.error(f"the step times are medians after {WARMUP_STEPS} warm-up steps: run more steps")
    if len(set(args.loss_path)) < len(args.loss_path):
        parser.error("--loss-path: a path named twice")
    layout = parse_layout(args)
    shape = GPU_SHAPE
    if not torch.cuda.is_available():  # the dry run: at least a layer a chunk
        shape = dataclasses.replace(CPU_SHAPE, layers=max(CPU_SHAPE.layers, layout.pp * layout.vpp))
    check_layout(layout, int(os.environ["WORLD_SIZE"]), shape.layers)  # before Megatron's own, less clear checks
    device = distributed.init_distributed(layout.tp, layout.pp, layout.vpp if layout.vpp > 1 else None)
    from megatron.core import parallel_state

    recompute = RecomputeCounter()
    try:
        # One process for every path: the ranks' start-up (imports, process groups) is paid once.
        records = {path: train_loss_path(layout, shape, device, path, args, recompute) for path in args.loss_path}
        gathered = distributed.gather_to_rank0(records)
        if dist.get_rank() == 0:
            failures, paths = [], {}
            for path in args.loss_path:
                ranks = [record[path] for record in gathered]
                summary, path_failures = compare_runs(ranks)
                paths[path] = {"summary": summary, "ranks": ranks}
                failures += [f"{path}: {failure}" for failure in path_failures]
                for key, value in summary.items():
                    if isinstance(value, dict):
                        distributed.log(
                            f"{path} {key}: fused-stock max {value['fused_max_difference']:.3g}, reference-stock "
                            f"max {value['reference_max_difference']:.3g}, tolerance {value['tolerance']:.3g}, "
                            f"step 0 {value['step0_difference']:.3g}"
                        )
            distributed.write_json(
                args.json,
                {
                    "layout": dict(
                        dataclasses.asdict(layout),
                        dp=parallel_state.get_data_parallel_world_size(),
                        loss_paths=args.loss_path,
                        backend=args.backend,
                    ),
                    "shape": distributed.shape_record(shape),
                    "loss_paths": paths,
                    "environment": distributed.environment(device),
                },
            )
            assert not failures, "pipeline_training: FAIL: " + "; ".join(failures)
            distributed.log("pipeline_training: PASS")
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
