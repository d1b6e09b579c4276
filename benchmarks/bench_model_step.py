"""What the fused head saves on one training step of a model of users' size: a bf16
Megatron-Core GPTModel with a 151936-row head (by default hidden 4096 and ``--layers 2``: the
head's cost does not grow with depth, so its share of a deeper model's step follows from the
figures), in Float16Module, DDP and Megatron's Adam, stepped through ``get_forward_backward_func``
exactly as ``real_training.py`` steps it: ``--micro-batches`` micro-batches of ``--tokens`` tokens
a step, in rows of ``--seq`` tokens (Megatron's local layer spec, the one that runs here,
materializes each layer's attention scores, so longer rows would take the memory the comparison is
about). ``--tensor-parallel N`` runs each case as a torchrun job of N GPUs with sequence
parallelism; every rank draws the same tokens.

- ``--runs``, as ``real_training.py`` names its loss paths: ``stock``; ``fused`` (three GEMMs, the
  loss mask declared in SFT); ``recompute`` (``head.logprobs`` and the loss by hand, four GEMMs);
  ``main_grad`` (three GEMMs, the weight gradient into ``main_grad`` at the declared scale).
- SFT: the labels path, the mean token loss.
- RL: ``head.loss`` with ``losses.ClippedPolicyLoss`` (entropy bonus, k3 KL) on the second half of
  each sequence; stock computes it on the logits.

Per run: the median step time after ``--warmup`` steps, the step's peak allocation beyond what was
allocated before it, and at TP=1 the head alone (``real_training.head_ms``: the same ops on one
micro-batch of the step's shape, forward and backward; ``None`` under tensor parallelism) with its
share of the step (micro-batches times the head's time over the step's). Each run is a process (or
torchrun job) of its own, so that no run's memory (the caching allocator's, Megatron's global
buffers) reaches the next; ``--json`` is rewritten after each, and a run past ``--case-timeout``
seconds is recorded as failed. ``--diagnose DIR`` adds, per phase and after the timing, one
profiled step (a trace per rank in ``DIR/<tokens>_tp<N>/``) and rank 0's count of host
synchronizations in it (``host_syncs``).

    PYTHONPATH=.:benchmarks python benchmarks/bench_model_step.py --json OUT.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from typing import Optional

import torch
from real_training import SIZES, Training, head_ms, micro_batches

from devkit import distributed, measure
from devkit.megatron_gpt import GPTShape
from devkit.spawn import rank_environment, rendezvous_store

RUNS = (
    ("stock", False, "stock"),
    ("fused", True, "three-gemm"),
    ("recompute", True, "recompute"),
    ("main_grad", True, "main-grad"),
)


def step_size(tokens: int, seq: int, layers: int, hidden: int, heads: int, micro_batches: int):
    """``real_training``'s GPU size reshaped to ``micro_batches`` micro-batches of ``tokens`` in rows
    of ``seq``: RL rows of the same length, the second half of each the response."""
    rows = max(1, tokens // seq)
    shape = GPTShape(hidden=hidden, heads=heads, layers=layers, vocab=151936, seq=seq, micro_batch=rows)
    return dataclasses.replace(
        SIZES["gpu"], shape=shape, micro_batches=micro_batches, prompts=rows * micro_batches, samples=1,
        prompt_tokens=seq // 2, completion_tokens=seq - seq // 2 + 1,
    )  # fmt: skip


def measure_run(
    size, device, fused: bool, loss_path: str, warmup: int, repeats: int, diagnose: Optional[str] = None
) -> dict:
    training = Training(size, device, fused, loss_path)
    generator = torch.Generator().manual_seed(0)
    rows = size.shape.micro_batch
    response = torch.zeros(rows, size.shape.seq)
    response[:, size.prompt_tokens - 1 :] = 1.0
    sft_batches, rl_batches = [], []
    for _ in range(size.micro_batches):  # every rank draws the same tokens: the TP group's batch
        windows = torch.randint(0, size.shape.vocab, (rows, size.shape.seq + 1), generator=generator)
        sft_batches.append(micro_batches(windows, device))
        rl_batch = micro_batches(windows, device, response)
        rl_batch["old_logprob"] = training.logprobs(training.head, training.model, rl_batch)
        rl_batch["ref_logprob"] = rl_batch["old_logprob"] - 0.01
        rl_batch["advantages"] = torch.randn(rows, size.shape.seq, generator=generator).to(device)
        rl_batches.append(rl_batch)
    record = {}
    phases = (("sft", training.sft_forward_step, sft_batches), ("rl", training.rl_forward_step, rl_batches))
    for phase, forward_step, batches in phases:
        steps = [training.step(forward_step, batches) for _ in range(warmup + repeats)][warmup:]
        step_ms = statistics.median(values["step_ms"] for values in steps)
        head = head_ms(training, loss_path, size, device, phase)
        record[phase] = dict(
            step_ms=step_ms,
            step_extra_bytes=largest(values["step_extra_bytes"] for values in steps),
            peak_bytes=largest(values["peak_bytes"] for values in steps),
            head_ms=head,  # None under tensor parallelism
            head_share=None if head is None else head * size.micro_batches / step_ms,
        )
    # After all timing: a profiler may slow what runs after it.
    for phase, forward_step, batches in phases if diagnose else ():
        trace = os.path.join(diagnose, f"{loss_path}_{phase}_rank{torch.distributed.get_rank()}.json")
        record[phase]["host_syncs"] = diagnosed_step(training, forward_step, batches, device, trace)
    del training
    measure.release_memory()
    return record


def diagnosed_step(training: Training, forward_step, batches, device, trace: str) -> Optional[int]:
    """One more step under the profiler (its trace written to ``trace``, for Perfetto or
    chrome://tracing); the host synchronizations it made, as CUDA's sync debug mode counts them
    (``None`` on the CPU): the harness's own reads (the reported losses, Megatron's gradient norm)
    included, the same for every run, so the counts compare runs rather than count the head's."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with warnings.catch_warnings(record=True) as caught, profile(activities=activities) as profiler:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            training.step(forward_step, batches)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    os.makedirs(os.path.dirname(trace) or ".", exist_ok=True)
    profiler.export_chrome_trace(trace)
    if device.type != "cuda":
        return None
    return sum("synchronizing" in str(warning.message) for warning in caught)


def largest(values) -> Optional[int]:
    """The largest of the steps' byte counts; ``None`` where the device counts none (the CPU)."""
    return max((value for value in values if value is not None), default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,16384", help="tokens per micro-batch, comma-separated")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per row")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096, help="a smaller one for a CPU dry run")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default: hidden / 128)")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="GPUs per run (sequence parallel when > 1)")
    parser.add_argument("--runs", default="stock,fused", help=f"comma-separated, of: {', '.join(r[0] for r in RUNS)}")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--diagnose",
        metavar="DIR",
        help="after timing, one more step per phase profiled (traces here), its host syncs counted",
    )
    parser.add_argument("--case-timeout", type=float, default=None, help="seconds one run may take")
    parser.add_argument("--case", default=None, help="TOKENS:RUN, one run in this process (what main starts)")
    args = parser.parse_args()
    if args.case is not None:
        tokens, name = args.case.split(":")
        record = run_case(int(tokens), name, args)
        if record is not None:
            print(json.dumps(record))
        return
    rows = []
    meta = measure.environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16)
    for tokens in args.tokens.split(","):
        for name in args.runs.split(","):
            launcher = [sys.executable]
            if args.tensor_parallel > 1:
                launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.tensor_parallel}"]
            command = [*launcher, __file__, *sys.argv[1:], "--case", f"{tokens}:{name}"]
            env = dict(os.environ, **distributed.MULTICAST_OFF)
            rows.append(run_command(command, env, args.case_timeout, dict(tokens=int(tokens), run=name)))
            print(json.dumps(rows[-1])[:600], flush=True)
            if args.json:  # after each run: a call cut short keeps the rows it finished
                with open(args.json, "w") as handle:
                    json.dump({"meta": meta, "rows": rows}, handle, indent=1)
    if any("failed" in row for row in rows):
        sys.exit(1)


def run_command(command, env, timeout: Optional[float], case: dict) -> dict:
    """The record a case's process printed (its stdout's one line that is a JSON object), or
    ``case`` with ``failed``: what went wrong. Past ``timeout`` the process gets SIGTERM, on which
    torchrun stops its workers (they run in sessions of their own), then SIGKILL; its output goes to
    files, which a straggling worker cannot hold open as it could a pipe."""
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, env=env)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            return dict(case, failed=f"over --case-timeout {timeout} s")
        stdout.seek(0)
        stderr.seek(0)
        out, err = stdout.read(), stderr.read()
    records = [line for line in out.splitlines() if line.startswith('{"tokens"')]
    if process.returncode != 0 or len(records) != 1:
        return dict(case, failed=err[-2000:] or out[-2000:])
    return json.loads(records[0])


def run_case(tokens: int, name: str, args) -> Optional[dict]:
    """One run's record, on rank 0 (``None`` on the others), in this process or, under tensor
    parallelism, in this torchrun job (Megatron's groups set up and torn down here)."""
    if "RANK" not in os.environ:  # not a torchrun rank: a job of one, on a store held until we return
        store = rendezvous_store()
        os.environ.update(rank_environment(0, 1, store.port))
    device = distributed.init_distributed(args.tensor_parallel)
    try:
        fused, loss_path = {run: (fused, path) for run, fused, path in RUNS}[name]
        heads = args.heads or max(1, args.hidden // 128)
        size = step_size(tokens, args.seq, args.layers, args.hidden, heads, args.micro_batches)
        # One folder per shape and TP size: the traces of other cases do not overwrite these.
        diagnose = args.diagnose and os.path.join(args.diagnose, f"{tokens}_tp{args.tensor_parallel}")
        record = measure_run(size, device, fused, loss_path, args.warmup, args.repeats, diagnose)
        if torch.distributed.get_rank() != 0:
            return None
        return dict(
            tokens=tokens, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=heads,
            micro_batches=args.micro_batches, tensor_parallel=args.tensor_parallel, run=name, **record,
        )  # fmt: skip
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
