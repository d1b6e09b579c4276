"""Training a bf16 GPTModel with Megatron-Core on four GPUs, TP=2 x PP=2 with sequence parallelism
and tied embeddings, with the fused head off and on from the same seed. Started by torchrun:

    torchrun --nproc-per-node 4 tests/gpu/pipeline_training.py [--json pipeline_training.json]

Each run builds the model from the same seed (the embedding on the first stage, its copy as the
output weight on the last), wraps it in Float16Module and Megatron-Core's DistributedDataParallel
with the distributed optimizer (Adam), and trains with Megatron's ``get_forward_backward_func``
schedule (1F1B, several micro-batches, ``finalize_model_grads``):

1. SFT: SFT_STEPS steps through the labels path, ``model(..., labels=labels)``;
2. RL: RL_STEPS steps of a clipped policy loss on the head's log-probs of the response tokens with
   an entropy bonus. Every UPDATES_PER_ROLLOUT steps a rollout (a forward-only pass of the same
   schedule, collecting the head's log-probs) fixes the old log-probs and the advantages, so the
   ratio moves away from 1 and the clip acts.

A third run, the noise reference, is the stock run again with every initial weight moved by
about one bf16 rounding (a sign pattern seeded by the weight's shape, so replicated weights and the
tied copies move alike): how far two equally valid bf16 trainings drift apart here.

Checked (every rank's tied copies, then the last stage's curves on rank 0; the JSON is written
before the verdict):
- the tied copies, the first stage's embedding and the last stage's output weight, are bitwise
  equal at the start, after SFT and after RL, in every run;
- SFT step 0 (identical weights): fused and stock differ only by the stock layer's bf16 rounding
  of the logits, unbiased per token and averaged over every token of the step: STEP0_ATOL;
- every curve (SFT loss, RL policy loss, RL entropy) agrees within bf16 noise: at every step,
  |fused - stock| <= NOISE_FACTOR x the largest |reference - stock| over the phase + NOISE_FLOOR.
  Later steps drift because Adam turns rounding-level gradient differences into
  learning-rate-sized updates for near-zero gradient entries, and the policy ratio
  exp(logprob - old) amplifies log-prob differences; the reference run measures exactly that
  drift. A wrong head gradient (twice reduced, a missing TP reduction, the weight of the wrong
  stage, a lost tied-embedding gradient) moves the curves by far more, or breaks the tied copies.

It also records, per rank and per phase, the median step time (after WARMUP_STEPS) and the peak
memory, fused vs stock. Without CUDA it runs on four gloo CPU ranks at a tiny size.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import zlib
from typing import Dict, List

import torch
import torch.distributed as dist

from devkit import distributed, measure
from devkit.megatron_gpt import GPTShape, build_bf16_gpt
from megatron_fused_lm.integration import FusedLMConfig, wrap_model

TENSOR_PARALLEL, PIPELINE_PARALLEL = 2, 2
GPU_SHAPE = GPTShape(hidden=1024, heads=16, layers=4, vocab=151936, seq=2048, micro_batch=2)
CPU_SHAPE = GPTShape(hidden=64, heads=4, layers=2, vocab=1000, seq=16, micro_batch=2)
MICRO_BATCHES = 4
SFT_STEPS, RL_STEPS, UPDATES_PER_ROLLOUT = 30, 30, 3
WARMUP_STEPS = 3
# At the RL rate 1e-4 the clip acts (up to a third of the response tokens in some updates). At 3e-4
# the policy's entropy collapsed at a different step in each run, the stock run's own noise
# reference included (H200, 2026-11-21): a chaotic regime where no two bf16 runs agree step by step.
SFT_LEARNING_RATE, RL_LEARNING_RATE = 1e-3, 1e-4
TEMPERATURE = 0.8
CLIP_EPSILON, ENTROPY_COEFFICIENT = 0.2, 0.01
# Tokens follow a fixed random bigram map over a sub-vocabulary, so the SFT loss can fall.
DATA_VOCAB = 4096
STEP0_ATOL = 0.01
NOISE_FACTOR, NOISE_FLOOR = 3.0, 0.01
# Each run: (name, fused head, initial weights moved by one bf16 rounding).
RUNS = (("stock", False, False), ("fused", True, False), ("reference", False, True))


def make_dataset(shape: GPTShape, steps: int, seed: int) -> torch.Tensor:
    """Token walks ``[steps, MICRO_BATCHES, micro_batch, seq + 1]`` of a fixed random bigram map
    over DATA_VOCAB tokens (each from a random start), the same on every rank."""
    vocab = min(DATA_VOCAB, shape.vocab)
    bigram = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (steps, MICRO_BATCHES, shape.micro_batch), generator=generator)
    walks = [starts]
    for _ in range(shape.seq):
        walks.append(bigram[walks[-1]])
    return torch.stack(walks, dim=-1)


def step_microbatches(shape: GPTShape, tokens: torch.Tensor, device: torch.device) -> List[Dict]:
    """One step's micro-batches from its ``tokens [MICRO_BATCHES, micro_batch, seq + 1]``: the
    inputs, the next-token labels, positions, the causal mask, the response mask (second half of
    each sequence, for RL) and the micro-batch's index."""
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
            response=response,
        )
        batch = {key: value.to(device) for key, value in batch.items()}
        batch["index"] = index
        batches.append(batch)
    return batches


def move_by_one_rounding(model: torch.nn.Module) -> None:
    """Multiply every weight entry by 1 + s 2^-7, s in {-1, 0, 1} (about one bf16 spacing, so the
    stored value moves by a rounding or two), with a sign pattern seeded by the weight's shape:
    TP-replicated weights and the two stages' tied copies move alike."""
    with torch.no_grad():
        for parameter in model.parameters():
            generator = torch.Generator().manual_seed(zlib.crc32(str(tuple(parameter.shape)).encode()))
            sign = torch.randint(-1, 2, parameter.shape, generator=generator).to(parameter.device)
            parameter.mul_(1 + sign.to(parameter.dtype) * 2.0**-7)


class Run:
    """One training run (fused head on or off; for the noise reference, initial weights moved by a
    rounding): the model, its DDP and optimizer, the schedule."""

    def __init__(self, shape: GPTShape, device: torch.device, name: str, fused: bool, perturbed: bool):
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.module import Float16Module

        self.shape, self.device, self.name, self.fused = shape, device, name, fused
        self.first_stage = parallel_state.is_pipeline_first_stage()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        gpt = build_bf16_gpt(
            shape,
            device,
            tied=True,
            sequence_parallel=True,
            seed=1234,
            pre_process=self.first_stage,
            post_process=self.last_stage,
        )
        if perturbed:
            move_by_one_rounding(gpt)
        self.gpt = gpt
        config = gpt.config
        # Megatron's distributed optimizer and gradient clipping accept only CUDA tensors: the CPU
        # dry run takes its plain optimizer, which steps the bf16 weights with their bf16
        # gradients directly, unclipped.
        on_gpu = device.type == "cuda"
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=on_gpu, use_distributed_optimizer=on_gpu)
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, gpt))
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=SFT_LEARNING_RATE,
                weight_decay=0.0,
                adam_beta2=0.95,
                clip_grad=1.0 if on_gpu else 0.0,
                bf16=on_gpu,
                use_distributed_optimizer=on_gpu,
            ),
            [self.model],
        )
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model.no_sync
        self.head = wrap_model(self.model, FusedLMConfig(enabled=fused, backend="auto"))
        assert self.head.fused == (fused and self.last_stage), (fused, self.last_stage)
        self.forward_backward = get_forward_backward_func()
        self.rollout_batches: List[Dict] = []
        self.old_logprobs: List[torch.Tensor] = []
        self.advantages: List[torch.Tensor] = []

    def tied_weight(self) -> torch.Tensor:
        """This stage's copy of the tied embedding (first: embedding, last: output weight)."""
        return self.gpt.shared_embedding_or_output_weight()

    def schedule(self, forward_step, batches, forward_only=False, collect_non_loss_data=False):
        return self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[self.model],
            num_microbatches=len(batches),
            seq_length=self.shape.seq,
            micro_batch_size=self.shape.micro_batch,
            forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data,
        )

    def train_step(self, forward_step, batches) -> Dict[str, float]:
        """One optimizer step over the micro-batches ``batches``; on the last stage, the mean over
        them of what the loss function reported (``{}`` elsewhere)."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reported = self.schedule(forward_step, batches)
        updated, _, _ = self.optimizer.step()
        assert updated, "the optimizer skipped a step"
        if not self.last_stage:
            return {}
        return {name: torch.stack([entry[name] for entry in reported]).mean().item() for name in reported[0]}

    # Forward-step functions for the schedule: (batch iterator, model) -> (output, loss function).
    def sft_forward_step(self, iterator, model):
        batch = next(iterator)
        inputs = (batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        per_token_loss = model(*inputs, labels=batch["labels"])
        return per_token_loss, sft_loss

    def rollout_forward_step(self, iterator, model):
        batch = next(iterator)
        output = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        return output, functools.partial(self.rollout_logprobs, batch)

    def rl_forward_step(self, iterator, model):
        batch = next(iterator)
        output = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        return output, functools.partial(self.policy_loss, batch)

    def rollout_logprobs(self, batch, output, non_loss_data=False):
        with torch.no_grad():
            return self.head.logprobs(output, batch["labels"], temperature=TEMPERATURE, mask=batch["response"])

    def policy_loss(self, batch, output):
        """PPO-style clipped policy loss on the response tokens minus an entropy bonus."""
        response = batch["response"]
        logprob, entropy = self.head.logprobs(
            output, batch["labels"], temperature=TEMPERATURE, return_entropy=True, mask=response
        )
        ratio = torch.exp(logprob - self.old_logprobs[batch["index"]])
        advantage = self.advantages[batch["index"]].unsqueeze(-1)
        surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - CLIP_EPSILON, 1 + CLIP_EPSILON) * advantage)
        per_token = -surrogate - ENTROPY_COEFFICIENT * entropy
        loss = per_token[response].mean()
        clipped = (ratio - 1).abs() > CLIP_EPSILON
        return loss, {
            "loss": loss.detach().clone(),
            "entropy": entropy.detach()[response].mean(),
            "clipped_fraction": clipped[response].float().mean(),
        }

    def rollout(self, batches, iteration: int) -> None:
        """Old log-probs of the response tokens (a forward-only schedule) and advantages (+-1 per
        sequence, seeded), kept on the last stage for the next updates."""
        collected = self.schedule(self.rollout_forward_step, batches, forward_only=True, collect_non_loss_data=True)
        self.rollout_batches = batches
        self.old_logprobs = list(collected) if self.last_stage else []
        generator = torch.Generator().manual_seed(5000 + iteration)
        self.advantages = [
            (torch.randint(0, 2, (self.shape.micro_batch,), generator=generator) * 2 - 1).float().to(self.device)
            for _ in batches
        ]

    def tied_copies_equal(self) -> bool:
        """Whether the first stage's embedding and the last stage's output weight (the same TP
        shard) are bitwise equal; the same answer on every rank."""
        from megatron.core import parallel_state

        group = parallel_state.get_embedding_group()
        weight = self.tied_weight().detach()
        copies = [torch.empty_like(weight) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, weight, group=group)
        equal = torch.tensor([int(all(torch.equal(copies[0], copy) for copy in copies))], device=self.device)
        dist.all_reduce(equal, op=dist.ReduceOp.MIN)
        return bool(equal.item())

    def train(self) -> dict:
        record = {
            "name": self.name,
            "fused": self.fused,
            "head_fused": self.head.fused,
            "tied_equal": {"start": self.tied_copies_equal()},
        }
        phases = (
            ("sft", SFT_STEPS, self.sft_step, 0, SFT_LEARNING_RATE),
            ("rl", RL_STEPS, self.rl_step, 1, RL_LEARNING_RATE),
        )
        for phase, steps, step_function, data_seed, learning_rate in phases:
            for group in self.optimizer.param_groups:  # as Megatron's learning-rate scheduler sets it
                group["lr"] = learning_rate
            dataset = make_dataset(self.shape, steps, data_seed)
            reported, times = [], []
            allocated_before = measure.reset_peak_memory(self.device)
            for step in range(steps):
                batches = step_microbatches(self.shape, dataset[step], self.device)
                measure.synchronize(self.device)
                start = time.perf_counter()
                reported.append(step_function(step, batches))
                measure.synchronize(self.device)
                times.append((time.perf_counter() - start) * 1e3)
            peak = measure.peak_memory_bytes(self.device)
            record[phase] = {
                "curves": {name: [values[name] for values in reported] for name in reported[0]},
                "median_step_ms": statistics.median(times[WARMUP_STEPS:]),
                "peak_bytes": peak,
                "peak_extra_bytes": None if peak is None else peak - allocated_before,
            }
            record["tied_equal"][phase] = self.tied_copies_equal()
        return record

    def sft_step(self, step: int, batches) -> Dict[str, float]:
        return self.train_step(self.sft_forward_step, batches)

    def rl_step(self, step: int, batches) -> Dict[str, float]:
        """A rollout on this step's micro-batches every UPDATES_PER_ROLLOUT steps, then an update
        on the rollout's micro-batches (the old log-probs belong to them)."""
        if step % UPDATES_PER_ROLLOUT == 0:
            self.rollout(batches, step // UPDATES_PER_ROLLOUT)
        return self.train_step(self.rl_forward_step, self.rollout_batches)


def sft_loss(per_token_loss: torch.Tensor):
    """Mean per-token loss of a micro-batch (Megatron's schedule divides by the micro-batch count)."""
    loss = per_token_loss.float().mean()
    # A copy: the schedule divides the returned loss in place by the number of micro-batches.
    return loss, {"loss": loss.detach().clone()}


def compare_runs(ranks: List[dict]) -> tuple:
    """Check every run's tied copies and the fused curves of the last stage against the stock
    ones (tolerances in the module docstring). Returns ``(summary, failures)`` (rank 0): the
    curves and their differences, and a sentence for each check that failed."""
    failures = [
        f"rank {record['rank']} run {run['name']}: tied copies differ at {moment}"
        for record in ranks
        for run in record["runs"]
        for moment, equal in run["tied_equal"].items()
        if not equal
    ]
    last_stage = [record for record in ranks if record["last_stage"]]
    curves = {run["name"]: {phase: run[phase]["curves"] for phase in ("sft", "rl")} for run in last_stage[0]["runs"]}
    for record in last_stage[1:]:  # the TP ranks of the last stage must report the same values
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="where rank 0 writes curves, times and memory")
    args = parser.parse_args()
    device = distributed.init_distributed(TENSOR_PARALLEL, PIPELINE_PARALLEL)
    shape = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    from megatron.core import parallel_state

    try:
        runs = []
        for name, fused, perturbed in RUNS:
            run = Run(shape, device, name, fused, perturbed)
            runs.append(run.train())
            distributed.log(
                f"{name}: "
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
        record = {
            "rank": dist.get_rank(),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "last_stage": parallel_state.is_pipeline_last_stage(),
            "runs": runs,
        }
        ranks = distributed.gather_to_rank0(record)
        failures = []
        if dist.get_rank() == 0:
            summary, failures = compare_runs(ranks)
            distributed.write_json(
                args.json,
                {
                    "shape": distributed.shape_record(shape),
                    "tensor_parallel": TENSOR_PARALLEL,
                    "pipeline_parallel": PIPELINE_PARALLEL,
                    "micro_batches": MICRO_BATCHES,
                    "summary": summary,
                    "ranks": ranks,
                    "environment": distributed.environment(device),
                },
            )
            for key, value in summary.items():
                if isinstance(value, dict):
                    distributed.log(
                        f"{key}: fused-stock max {value['fused_max_difference']:.3g}, reference-stock max "
                        f"{value['reference_max_difference']:.3g}, tolerance {value['tolerance']:.3g}, "
                        f"step 0 {value['step0_difference']:.3g}"
                    )
            assert not failures, "pipeline_training: FAIL: " + "; ".join(failures)
            distributed.log("pipeline_training: PASS")
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
