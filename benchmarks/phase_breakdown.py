"""Where each path's time goes: every kernel of one forward + backward, grouped into phases, each
against its own floor (issue: at the GEMM floor on Hopper).

    PYTHONPATH=. python benchmarks/phase_breakdown.py [--shapes 8192x4096x151936] [--json phases.json]
    python benchmarks/phase_breakdown.py --markdown phases.json    # the table of docs/benchmarks/phases.md

Paths, on the inputs of ``bench_logprob.py`` (random bf16, logits of standard deviation about 4):
``sft`` (the three-GEMM mean cross-entropy), ``rl_loss`` (the three-GEMM clipped policy loss with
an entropy bonus: the float16 offsets block), ``recompute`` (the four-GEMM log-prob + entropy op with
random upstream gradients) and ``forward`` (log-prob + entropy without gradients). Floors: each
bare cuBLAS product the path cannot avoid, timed alone at the full shape (``logits`` [T, V],
``grad_hidden`` [T, H], ``grad_weight`` [V, H]).

Phases (kernels matched by name): the Triton kernels by what they do; ``cuBLAS`` the vendor's
products (the per-chunk ``grad_hidden`` and ``grad_weight`` products and, in the three-GEMM
path, their float32 accumulation); ``small ops`` every other kernel (PyTorch's elementwise ops,
reductions, copies, fills); ``idle`` the timed step's milliseconds less the profiled run's kernel
time: launch gaps and host work. (The profiled run's own gaps, ``profiled_idle_ms``, are wider:
the profiler's host work stalls the launches.)
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from harness import REFERENCE_SHAPES, kernel_timeline, make_inputs, parse_shapes
from methods import FUSED_BACKEND, policy_loss, policy_loss_inputs, rl_loss_step, rl_step, sft_step

from devkit.measure import elapsed_ms, environment, release_memory
from megatron_fused_lm import fused_linear_logprob

# Kernel name fragments -> phase, first match wins.
PHASES = (
    ("softmax_stats_kernel", "forward kernel (logits, statistics, stored block)"),
    ("logit_grad_kernel", "recompute kernel (logits again, dz)"),
    ("stored_grad_kernel", "stored-block pass (dz from the block)"),
    ("add_chosen_rows_kernel", "chosen-token and finishing kernels"),
    ("finish_hidden_grad_kernel", "chosen-token and finishing kernels"),
    ("scale_kernel", "chosen-token and finishing kernels"),
    ("gemm", "cuBLAS"),
    ("nvjet", "cuBLAS"),
    ("xmma", "cuBLAS"),
    ("cutlass", "cuBLAS"),
)
SMALL_OPS, IDLE = "small ops", "idle"
# The floor products each path cannot avoid (its forward kernel replaces `logits`).
FLOORS = {
    "sft": ("logits", "grad_hidden", "grad_weight"),
    "rl_loss": ("logits", "grad_hidden", "grad_weight"),
    "recompute": ("logits", "logits", "grad_hidden", "grad_weight"),
    "forward": ("logits",),
}


def phase_of(kernel: str) -> str:
    lowered = kernel.lower()
    return next((phase for fragment, phase in PHASES if fragment in lowered), SMALL_OPS)


def median_ms(step, device, repeats: int = 5) -> float:
    step()
    return statistics.median(elapsed_ms(step, device) for _ in range(repeats))


def floor_products(inputs) -> dict:
    """Milliseconds of each bare bf16 product, its output allocated beforehand."""
    hidden, weight = inputs.hidden.detach(), inputs.weight.detach()
    logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.empty_like(weight)
    device = hidden.device
    products = {
        "logits": lambda: torch.mm(hidden, weight.t(), out=logits),
        "grad_hidden": lambda: torch.mm(logits, weight, out=grad_hidden),
        "grad_weight": lambda: torch.mm(logits.t(), hidden, out=grad_weight),
    }
    return {name: median_ms(product, device) for name, product in products.items()}


def path_steps(inputs) -> dict:
    loss_fn = policy_loss()
    loss_inputs = policy_loss_inputs(inputs)

    def forward():
        with torch.no_grad():
            fused_linear_logprob(
                inputs.hidden, inputs.weight, inputs.targets, return_entropy=True, backend=FUSED_BACKEND
            )

    return {
        "sft": sft_step("ours", {}, inputs),
        "rl_loss": rl_loss_step("ours", inputs, loss_fn, loss_inputs),
        "recompute": rl_step(FUSED_BACKEND, inputs, 1.0),
        "forward": forward,
    }


def breakdown(step, inputs) -> dict:
    """The step's median milliseconds, and one profiled run's kernel time by phase, idle time
    and kernel launches."""

    def run():
        inputs.clear_grads()
        step()

    device = inputs.hidden.device
    total = median_ms(run, device)
    kernels = kernel_timeline(run)
    phases: dict = {}
    launches: dict = {}
    for start, end, name in kernels:
        phase = phase_of(name)
        phases[phase] = phases.get(phase, 0.0) + (end - start) / 1e3
        launches[phase] = launches.get(phase, 0) + 1
    span = (kernels[-1][1] - kernels[0][0]) / 1e3
    busy = sum(phases.values())
    # The profiler's own host work widens the gaps of the profiled run; the timed run has none.
    phases[IDLE] = max(total - busy, 0.0)
    inputs.clear_grads()
    return {
        "ms": total,
        "profiled_span_ms": span,
        "profiled_idle_ms": span - busy,
        "phase_ms": phases,
        "launches": launches,
    }


def markdown(record: dict) -> str:
    """One line per shape and path: time against the floor, then each phase against its own."""
    forward, recompute = PHASES[0][1], PHASES[1][1]
    lines = [
        "| tokens x hidden x vocab | path | ms | x floor | forward kernel ms (x logits) | recompute kernel ms (x logits) "
        "| cuBLAS ms (x grad_hidden + grad_weight) | stored-block pass ms | chosen-token, finishing ms | small ops ms "
        "(launches) | idle ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        phase, floors = row["phase_ms"], row["floor_products_ms"]
        backward_floor = floors["grad_hidden"] + floors["grad_weight"]

        def against(name: str, floor: float) -> str:
            return f"{phase[name]:.2f} ({phase[name] / floor:.2f})" if name in phase else ""

        cells = [
            "x".join(str(size) for size in row["shape"]),
            row["path"],
            f"{row['ms']:.2f}",
            f"{row['ms'] / row['floor_ms']:.3f}",
            against(forward, floors["logits"]),
            against(recompute, floors["logits"]),
            against("cuBLAS", backward_floor),
            f"{phase.get(PHASES[2][1], 0.0):.2f}",
            f"{phase.get(PHASES[3][1], 0.0):.2f}",
            f"{phase.get(SMALL_OPS, 0.0):.2f} ({row['launches'].get(SMALL_OPS, 0)})",
            f"{phase[IDLE]:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=REFERENCE_SHAPES)
    parser.add_argument("--paths", default=",".join(FLOORS), help="a comma-separated subset of " + ",".join(FLOORS))
    parser.add_argument("--json", default="phase_breakdown.json")
    parser.add_argument("--markdown", metavar="JSON", help="print the table of a finished run's JSON and stop")
    args = parser.parse_args()
    if args.markdown:
        with open(args.markdown) as handle:
            print(markdown(json.load(handle)))
        return
    device = torch.device("cuda")
    rows = []
    for shape in args.shapes:
        inputs = make_inputs(*shape, torch.bfloat16, device)
        floors = floor_products(inputs)
        steps = path_steps(inputs)
        for path in args.paths.split(","):
            row = breakdown(steps[path], inputs)
            row.update(shape=list(shape), path=path, floor_products_ms=floors)
            row["floor_ms"] = sum(floors[name] for name in FLOORS[path])
            rows.append(row)
            parts = ", ".join(f"{phase} {ms:.2f}" for phase, ms in sorted(row["phase_ms"].items(), key=lambda x: -x[1]))
            print(f"{shape} {path}: {row['ms']:.2f} ms = {row['ms'] / row['floor_ms']:.3f}x floor; {parts}", flush=True)
        del steps, inputs
        release_memory()
    with open(args.json, "w") as handle:
        json.dump({"rows": rows, "environment": environment(device, torch.bfloat16)}, handle, indent=1)


if __name__ == "__main__":
    main()
