"""Per-rank time and memory of per-token log-prob + entropy under tensor parallelism (NCCL, one
process per GPU), stock vs fused, at the reference shapes; TP=1 on each GPU alone beside it.

    torchrun --nproc-per-node 2 benchmarks/bench_tensor_parallel.py --json tp_bench.json

For each ``TOKENSxHIDDENxVOCAB`` shape every rank makes the same inputs (``harness.make_inputs``,
bf16, random upstream gradients) and measures, forward + backward:

- TP=1, each GPU on its own with the whole weight: ``stock`` and ``triton``;
- TP=N over all ranks, rank ``r`` holding vocabulary rows ``[r V/N, (r+1) V/N)``:
  ``stock`` as Megatron's output layer does it (the hidden enters through
  ``copy_to_tensor_model_parallel_region``, whose backward all-reduces its gradient; bf16 logits
  shard; ``logits_logprob`` over the group) and ``triton`` (``fused_linear_logprob`` with the
  group: one all-gather of four numbers per token forward, one all-reduce of the hidden gradient
  backward), and ``loss``: the same gradients through the three-GEMM path (``fused_linear_loss``
  with the per-token loss ``g_lp * logprob + g_ent * entropy``, the random upstream gradients as
  its inputs): one all-gather of four numbers per token per chunk, the hidden gradient reduced
  once. For ``loss`` at TP=N the NCCL all-gather kernels' GPU time of one step is profiled too.

Time, peak extra memory and the float64-oracle errors are measured as ``harness.py`` says, on
every rank; rank 0 prints a table and writes the JSON (every rank's rows). Without CUDA it runs
on gloo CPU ranks (a dry run: give tiny ``--shapes``).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from harness import (
    GIB,
    REFERENCE_SHAPES,
    BenchInputs,
    make_inputs,
    oracle,
    parse_shapes,
    result_row,
    sample_error,
    sample_rows,
    shape_name,
    try_measure,
)

from devkit import distributed  # NCCL with NVLink multicast off, Megatron's groups
from devkit.measure import release_memory
from megatron_fused_lm import fused_linear_logprob, fused_linear_loss, logits_logprob

METHODS = ("stock", "triton", "loss")


def linear_loss(logprob, entropy, *, grad_logprob, grad_entropy):
    """The per-token loss whose gradients are the RL use's random upstream gradients."""
    return grad_logprob * logprob + grad_entropy * entropy


def shard_inputs(inputs: BenchInputs, rank: int, size: int) -> BenchInputs:
    """The same inputs with this rank's vocabulary rows of the weight, as a leaf of its own."""
    rows = inputs.weight.shape[0] // size
    shard = inputs.weight.detach()[rank * rows : (rank + 1) * rows].clone().requires_grad_()
    return BenchInputs(inputs.hidden, shard, inputs.targets, inputs.grad_logprob, inputs.grad_entropy)


def step_function(method: str, inputs: BenchInputs, tp_group):
    """One forward + backward of log-prob + entropy with the random upstream gradients."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    def step():
        if method == "stock":
            hidden = inputs.hidden
            if tp_group is not None:  # as the stock layer: the backward all-reduces the hidden gradient
                hidden = copy_to_tensor_model_parallel_region(hidden, tp_group)
            logprob, entropy = logits_logprob(
                hidden @ inputs.weight.t(), inputs.targets, tp_group=tp_group, return_entropy=True
            )
        elif method == "loss":
            loss, logprob, entropy = fused_linear_loss(
                inputs.hidden, inputs.weight, inputs.targets, linear_loss, tp_group=tp_group, backend="triton",
                loss_inputs={"grad_logprob": inputs.grad_logprob, "grad_entropy": inputs.grad_entropy},
            )  # fmt: skip
            loss.backward()
            return logprob, entropy
        else:
            logprob, entropy = fused_linear_logprob(
                inputs.hidden, inputs.weight, inputs.targets, tp_group=tp_group, return_entropy=True, backend=method
            )
        torch.autograd.backward([logprob, entropy], [inputs.grad_logprob, inputs.grad_entropy])
        return logprob.detach(), entropy.detach()

    return step


def all_gather_ms(step) -> float:
    """GPU time of the NCCL all-gather kernels in one ``step()`` (after the measured runs)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        step()
        torch.cuda.synchronize()
    return (
        sum(
            event.time_range.elapsed_us()
            for event in profile.events()
            if event.device_type == torch.autograd.DeviceType.CUDA
            and "allgather" in event.name.lower().replace("_", "")
        )
        / 1e3
    )


def benchmark_shape(shape, args, device, tp_group) -> list:
    """This rank's rows for one shape: TP=1 then TP=N, each method."""
    rank, size = dist.get_rank(), dist.get_world_size()
    inputs = make_inputs(*shape, getattr(torch, args.dtype), device)
    sample = sample_rows(torch.arange(shape[0], device=device), args.sample)
    ref_logprob, ref_entropy = oracle(inputs, sample)
    rows = []
    for tp, method in [(1, method) for method in METHODS] + [(size, method) for method in METHODS]:
        measured_inputs = inputs if tp == 1 else shard_inputs(inputs, rank, size)
        group = None if tp == 1 else tp_group
        dist.barrier()
        measurement, failure = try_measure(
            lambda: step_function(method, measured_inputs, group), measured_inputs, args.warmup, args.repeats
        )
        row = result_row(measurement, failure, shape=shape_name(shape), tp=tp, rank=rank, method=method)
        if measurement is not None:
            logprob, entropy = measurement.outputs
            if method == "loss" and tp > 1 and device.type == "cuda":
                row["all_gather_ms"] = all_gather_ms(step_function(method, measured_inputs, group))
            row["logprob_max_error"] = sample_error(logprob, sample, ref_logprob)
            row["entropy_max_error"] = sample_error(entropy, sample, ref_entropy)
        rows.append(row)
    del inputs
    release_memory()
    return rows


def print_table(rows) -> None:
    """Per shape and method: each rank's ms / peak GiB at TP=1 and TP=N, the TP=N / TP=1 ratios,
    and the per-rank time against the ideal ``TP=1 ms / N`` (``vs ideal``: 1 is perfect scaling;
    issue 52's targets are 1.15 at TP=4 and 1.25 at TP=8)."""
    print(
        f"{'shape':>22} {'method':>7} {'rank':>4} {'TP=1 ms':>9} {'TP=N ms':>9} {'ratio':>6} {'vs ideal':>8} "
        f"{'TP=1 GiB':>9} {'TP=N GiB':>9} {'ratio':>6} {'lp err TP=N':>11}"
    )
    keyed = {(row["shape"], row["method"], row["rank"], row["tp"]): row for row in rows}
    for (shape, method, rank, tp), row in keyed.items():
        single = keyed.get((shape, method, rank, 1))
        if tp == 1 or single is None or "ms" not in row or "ms" not in single:
            continue
        memory = (single["peak_extra_bytes"], row["peak_extra_bytes"])
        memory_text = (
            f"{memory[0] / GIB:9.3f} {memory[1] / GIB:9.3f} {memory[1] / memory[0]:6.3f}"
            if None not in memory
            else f"{'':>9} {'':>9} {'':>6}"
        )
        print(
            f"{shape:>22} {method:>7} {rank:>4} {single['ms']:9.2f} {row['ms']:9.2f} {row['ms'] / single['ms']:6.3f} "
            f"{tp * row['ms'] / single['ms']:8.3f} "
            f"{memory_text} {row.get('logprob_max_error', float('nan')):11.2e}"
            + (f"  all-gathers {row['all_gather_ms']:.2f} ms" if "all_gather_ms" in row else "")
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=REFERENCE_SHAPES)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sample", type=int, default=256, help="tokens checked against the float64 oracle")
    parser.add_argument("--json", default="tp_bench.json")
    args = parser.parse_args()

    from megatron.core import parallel_state

    device = distributed.init_distributed(tensor_parallel=int(os.environ["WORLD_SIZE"]))
    tp_group = parallel_state.get_tensor_model_parallel_group()
    try:
        rows = []
        for shape in args.shapes:
            rows += benchmark_shape(shape, args, device, tp_group)
        ranks_rows = distributed.gather_to_rank0(rows)
        if ranks_rows is not None:
            rows = [row for rank_rows in ranks_rows for row in rank_rows]
            meta = distributed.environment(device)
            meta.update(vars(args), dtype=args.dtype)
            distributed.write_json(args.json, {"meta": meta, "rows": rows})
            print(json.dumps({key: meta[key] for key in ("device", "date", "versions")}))
            print_table(rows)
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
