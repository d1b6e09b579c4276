"""The CuTe forward-statistics kernel against the Triton one and the cuBLAS logits product, on the
same inputs in one run: first each configuration's merged statistics against float64 (log-prob and
entropy on sampled rows), then each one's time over the product's, at the reference shapes.

    PYTHONPATH=.:benchmarks python benchmarks/bench_cute_forward.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from harness import REFERENCE_SHAPES, make_inputs, parse_shapes

from devkit.measure import median_ms
from megatron_fused_lm.ops.backends.contract import ShardProblem
from megatron_fused_lm.ops.backends.cute import CuteBackend
from megatron_fused_lm.ops.backends.triton import TritonBackend
from megatron_fused_lm.ops.cute_kernels import statistics_kernel as cute_stats
from megatron_fused_lm.ops.kernels.merge_kernel import merge_parts
from megatron_fused_lm.ops.softmax import summarize

CHECK_SHAPES = "300x256x1000,1000x2048x5003,4096x4096x151936,2500x3072x32000"


def problem_of(inputs, temperature):
    target_column = inputs.targets.contiguous()
    return ShardProblem(
        inputs.hidden.detach(), inputs.weight.detach(), target_column, temperature, torch.empty(0, dtype=torch.int32)
    )


def cute_statistics(problem, config):
    parts = cute_stats.cute_split_statistics(
        problem.hidden, problem.weight, problem.target_column, problem.temperature, **config
    )
    return merge_parts(parts)


def float64_summary(inputs, rows, temperature):
    logits = inputs.hidden.detach()[rows].double() @ inputs.weight.detach().double().t()
    logits = logits / temperature[rows].double()[:, None]
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, inputs.targets[rows][:, None])[:, 0], entropy


def check(configs, device):
    rows_out = []
    for shape in parse_shapes(CHECK_SHAPES):
        inputs = make_inputs(*shape, torch.bfloat16, device)
        gen = torch.Generator(device=device).manual_seed(3)
        for per_row in (False, True):
            if per_row:
                temperature = 0.5 + torch.rand(shape[0], device=device, generator=gen)
            else:
                temperature = torch.full((1,), 0.7, device=device).expand(shape[0])
            problem = problem_of(inputs, temperature)
            rows = torch.randperm(shape[0], device=device, generator=gen)[:256]
            exact_logp, exact_entropy = float64_summary(inputs, rows, temperature)
            methods = {"triton": lambda: TritonBackend().local_statistics(problem, None)}
            for name, config in configs.items():
                methods[name] = lambda config=config: cute_statistics(problem, config)
            for name, run in methods.items():
                try:
                    summary = summarize(run(), problem.target_column)
                    logp_error = (summary.logprob[rows].double() - exact_logp).abs().max().item()
                    entropy_error = (summary.entropy[rows].double() - exact_entropy).abs().max().item()
                    row = dict(shape="x".join(map(str, shape)), per_row_temperature=per_row, method=name,
                               logprob_error=logp_error, entropy_error=entropy_error)  # fmt: skip
                except Exception as error:  # noqa: BLE001 - a failing configuration is a result
                    row = dict(shape="x".join(map(str, shape)), method=name, error=repr(error)[:400])
                print(json.dumps(row), flush=True)
                rows_out.append(row)
    return rows_out


def timing(configs, shapes, device, warmup, repeats):
    rows_out = []
    for shape in shapes:
        inputs = make_inputs(*shape, torch.bfloat16, device)
        temperature = torch.ones(1, device=device).expand(shape[0])
        problem = problem_of(inputs, temperature)
        hidden, weight = problem.hidden, problem.weight
        methods = {"cublas_logits": lambda: hidden @ weight.t()}
        methods["triton"] = lambda: TritonBackend().local_statistics(problem, None)
        methods["cute_backend"] = lambda: CuteBackend().local_statistics(problem, None)
        for name, config in configs.items():
            methods[name] = lambda config=config: cute_statistics(problem, config)
        times, host = {}, {}
        for name, run in methods.items():
            try:
                times[name] = median_ms(run, device, warmup, repeats)
                torch.cuda.synchronize()
                begin = time.perf_counter()
                run()  # the host's share: the call returns once its launches are queued
                host[name] = (time.perf_counter() - begin) * 1e6
                torch.cuda.synchronize()
            except Exception as error:  # noqa: BLE001
                times[name] = None
                print(json.dumps(dict(shape="x".join(map(str, shape)), method=name, error=repr(error)[:400])))
            torch.cuda.empty_cache()
        floor = times["cublas_logits"]
        flops = 2 * shape[0] * shape[1] * shape[2]
        for name, ms in times.items():
            row = dict(shape="x".join(map(str, shape)), method=name, ms=ms,
                       ratio=None if ms is None else ms / floor,
                       tflops=None if ms is None else flops / ms / 1e9, host_us=host.get(name))  # fmt: skip
            print(json.dumps(row), flush=True)
            rows_out.append(row)
        torch.cuda.empty_cache()
    return rows_out


def parse_configs(text):
    configs = {}
    for item in text.split(";"):
        fields = dict(part.split("=") for part in item.split(","))
        name = "cute:" + item.replace(",", " ")
        configs[name] = {key: int(value) for key, value in fields.items()}
    return configs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=REFERENCE_SHAPES)
    parser.add_argument("--configs", default="tiles_per_split=8,cluster_m=2,group_m=6,stages=6")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda")
    configs = parse_configs(args.configs)
    began = time.time()
    for name, config in configs.items():  # compile each configuration once, timed
        start = time.time()
        inputs = make_inputs(256, 256, 1000, torch.bfloat16, device)
        try:
            cute_statistics(problem_of(inputs, torch.ones(1, device=device).expand(256)), config)
            torch.cuda.synchronize()
            print(json.dumps(dict(method=name, compile_s=time.time() - start)), flush=True)
        except Exception as error:  # noqa: BLE001
            print(json.dumps(dict(method=name, compile_error=repr(error)[:2000])), flush=True)
    record = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    record["check"] = [] if args.skip_check else check(configs, device)
    record["timing"] = timing(configs, parse_shapes(args.shapes), device, args.warmup, args.repeats)
    record["seconds"] = time.time() - began
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=1)


if __name__ == "__main__":
    main()
