"""What every benchmark script here shares: shapes, inputs, the float64 oracle, timing, peak memory.

Measuring rule (docs/BENCHMARKS.md): warm up (Triton compiles on first call), time each
forward+backward with CUDA events and take the median; peak extra memory is
``max_memory_allocated`` after ``reset_peak_memory_stats`` during one more step, minus what was
allocated before it (the returned gradients count). On the CPU (a dry run of the scripts' logic)
times come from the host clock and there is no memory figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from devkit.measure import elapsed_ms, environment, peak_memory_bytes, release_memory, reset_peak_memory
from devkit.oracle import logprob_entropy, max_abs_error

REFERENCE_SHAPES = (
    "4096x2048x151936,8192x4096x151936,16384x2048x151936,16384x5120x152064,16384x3072x262144,32768x4096x151936"
)
GIB = 2**30


def parse_shapes(text):
    """``"TxHxV,..."`` -> list of ``(tokens, hidden, vocab)``."""
    return [tuple(int(part) for part in item.lower().split("x")) for item in text.split(",") if item]


def timing_parser(description: str, shapes: str, warmup: int, repeats: int) -> argparse.ArgumentParser:
    """The options of a timing script: ``--shapes`` (TOKENSxHIDDENxVOCAB, comma-separated),
    ``--warmup``, ``--repeats`` and ``--json``, with these defaults."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shapes", default=shapes)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--json")
    return parser


def shape_name(shape):
    return "x".join(map(str, shape))


@dataclass
class BenchInputs:
    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    grad_logprob: torch.Tensor
    grad_entropy: torch.Tensor

    def clear_grads(self):
        self.hidden.grad = self.weight.grad = None


def make_inputs(tokens, hidden_size, vocab, dtype, device, seed=0):
    """Random hidden states, weight, targets and upstream gradients; the same for a given seed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, device=device, generator=gen).to(dtype).requires_grad_()
    # Logits with standard deviation about 4: a realistic, fairly peaky softmax.
    weight = torch.randn(vocab, hidden_size, device=device, generator=gen) * (4.0 / hidden_size**0.5)
    weight = weight.to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    grad_logprob = torch.randn(tokens, device=device, generator=gen)
    grad_entropy = torch.randn(tokens, device=device, generator=gen)
    return BenchInputs(hidden, weight, targets, grad_logprob, grad_entropy)


def sample_rows(candidates, size, seed=1):
    """At most ``size`` rows drawn at random from the 1-D index tensor ``candidates``."""
    gen = torch.Generator(device=candidates.device).manual_seed(seed)
    order = torch.randperm(candidates.numel(), device=candidates.device, generator=gen)
    return candidates[order[:size]]


def oracle(inputs, sample, temperature=1.0):
    """Float64 log-prob and entropy of the rows ``sample``."""
    hidden = inputs.hidden.detach()[sample].double()
    return logprob_entropy(hidden @ inputs.weight.detach().double().t(), inputs.targets[sample], temperature)


def sample_error(values, sample, reference):
    """Largest |error| of ``values`` on the rows ``sample`` against the oracle's ``reference``."""
    return max_abs_error(values[sample], reference)


@dataclass
class Measurement:
    ms: float
    peak_extra_bytes: Optional[int]
    outputs: object  # what the step returned on its last (memory-measuring) call


def measure(step, inputs, warmup, repeats):
    """Median milliseconds of ``step()`` and its peak extra memory."""
    device = inputs.hidden.device
    for _ in range(warmup):
        inputs.clear_grads()
        step()
    times = []
    for _ in range(repeats):
        inputs.clear_grads()
        times.append(elapsed_ms(step, device))
    inputs.clear_grads()
    allocated_before = reset_peak_memory(device)
    outputs = step()
    peak = peak_memory_bytes(device)
    return Measurement(statistics.median(times), None if peak is None else peak - allocated_before, outputs)


def try_measure(make_step: Callable[[], Callable], inputs, warmup, repeats):
    """``(Measurement, None)``, or ``(None, "oom")`` / ``(None, "error: ...")`` when the method
    ran out of memory or failed; the memory it held is released either way."""
    try:
        result = measure(make_step(), inputs, warmup, repeats), None
    except torch.OutOfMemoryError:
        result = None, "oom"
    except Exception as error:  # one method failing (a competitor's kernel, say) must not lose the run
        traceback.print_exc()
        result = None, f"error: {type(error).__name__}: {error}"
    inputs.clear_grads()
    release_memory()
    return result


def result_row(measurement, failure, **fields):
    """One JSON row: the identifying ``fields`` plus status, time and memory."""
    row = dict(fields, status="ok" if failure is None else failure.split(":")[0])
    if failure is None:
        row.update(ms=measurement.ms, peak_extra_bytes=measurement.peak_extra_bytes)
    elif failure != "oom":
        row["note"] = failure
    return row


def write_rows(path: Optional[str], device: str, rows: list, dtype: torch.dtype = torch.bfloat16) -> None:
    """The rows, under the environment of ``device`` (``dtype`` inputs), as the JSON record at ``path`` (``None``: none)."""
    if path:
        with open(path, "w") as handle:
            json.dump({"meta": environment(torch.device(device), dtype), "rows": rows}, handle, indent=1)


def kernel_timeline(run: Callable[[], object]) -> list:
    """The GPU kernels of one ``run()`` after a warm-up, as ``(start us, end us, name)`` in start
    order, from the PyTorch profiler."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        run()
        torch.cuda.synchronize()
    return sorted(
        (event.time_range.start, event.time_range.end, event.name)
        for event in profile.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    )


def op_steps(inputs: BenchInputs, **options) -> dict:
    """``{use: step}`` of the fused ops on ``inputs`` with ``options`` (Triton backend): the forward
    (``no_grad``, log-prob and entropy), the recompute op's forward + backward (the inputs' random
    upstream gradients) and the three-GEMM SFT loss (a token mean)."""
    from megatron_fused_lm import fused_linear_logprob, fused_linear_loss, losses

    hidden, weight, targets = inputs.hidden, inputs.weight, inputs.targets
    options = dict(options, backend="triton")

    def forward():
        with torch.no_grad():
            return fused_linear_logprob(hidden, weight, targets, return_entropy=True, **options)

    def recompute():
        logprob, entropy = fused_linear_logprob(hidden, weight, targets, return_entropy=True, **options)
        torch.autograd.backward([logprob, entropy], [inputs.grad_logprob, inputs.grad_entropy])

    weights = torch.full_like(inputs.grad_logprob, 1.0 / targets.numel())

    def sft():
        fused_linear_loss(
            hidden, weight, targets, losses.cross_entropy, loss_inputs={"weight": weights}, **options
        ).loss.backward()

    return {"forward": forward, "recompute": recompute, "sft": sft}
