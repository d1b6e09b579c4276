"""The table and plot of a gradient audit (a run of ``real_training.py --audit-every``): per phase
and path, the relative error of the head's gradient against float64 (the hidden states' and the
output weight's), the audit points where a fused path's error exceeds stock's, and the entropy
coefficient shift (``gradient_audit``'s metrics) with its mean's 95 % interval over the points
(taken as independent; neighbouring SFT points correlate a little, so read it as a lower bound on
the width), against the run's entropy coefficient.

    python benchmarks/report_audit.py benchmarks/results/gradient_audit_h200/three_gemm.json --plot docs/real_training/audit.png
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

from gradient_audit import PATHS

# The coefficient of the runs whose records predate ``rl.entropy_coef`` (real_training's, 2026-12-01).
RECORDED_BEFORE = 0.001

Z95 = 1.96


def interval(values):
    """The mean and the half-width of its 95 % interval (normal, over independent points)."""
    mean = statistics.mean(values)
    return mean, Z95 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.inf


def entropy_coef(record: dict) -> float:
    return record["rl"].get("entropy_coef", RECORDED_BEFORE)


def table(record: dict) -> str:
    coef = entropy_coef(record)
    rows = [
        "| phase | path | relative error, hidden | relative error, weight | points worse than stock | "
        "entropy coefficient shift: mean [95 %] | largest shift |",
        "|---|---|---|---|---|---|---|",
    ]
    for phase in ("sft", "rl"):
        points = record[phase]["audit"] or []
        for path in PATHS:
            errors = {part: [point["paths"][path][part]["relative_error"] for point in points] for part in
                      ("hidden", "weight")}  # fmt: skip
            worse = sum(
                any(point["paths"][path][part]["relative_error"] > point["paths"]["stock"][part]["relative_error"]
                    for part in ("hidden", "weight"))
                for point in points
            )  # fmt: skip
            shifts = [point["paths"][path]["both"]["entropy_coef_shift"] for point in points]
            mean, half = interval(shifts)
            ranges = " | ".join(f"{min(v):.2e} to {max(v):.2e}" for v in errors.values())
            worse_cell = "" if path == "stock" else f"{worse} of {len(points)}"
            rows.append(
                f"| {phase} | {path} | {ranges} | {worse_cell} | {mean:+.1e} [{mean - half:+.1e}, {mean + half:+.1e}]"
                f" ({100 * max(abs(mean - half), abs(mean + half)) / coef:.1f} % of {coef}) | "
                f"{max(map(abs, shifts)):.1e} |"
            )
    return "\n".join(rows)


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(2, 2, figsize=(12, 7))
    for column, phase in enumerate(("sft", "rl")):
        points = record[phase]["audit"]
        steps = [point["step"] for point in points]
        for name in PATHS:
            axes[0, column].plot(steps, [point["paths"][name]["both"]["relative_error"] for point in points],
                                 label=name, marker=".")  # fmt: skip
            axes[1, column].plot(steps, [point["paths"][name]["both"]["entropy_coef_shift"] for point in points],
                                 label=name, marker=".")  # fmt: skip
        axes[0, column].set_yscale("log")
        axes[0, column].set_title(f"{phase}: relative error of the head's gradient against float64")
        axes[1, column].set_title(f"{phase}: entropy coefficient shift (coefficient {entropy_coef(record)})")
        axes[1, column].set_xlabel("SFT step" if phase == "sft" else "RL update")
        for axis in axes[:, column]:
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
    environment, shape = record["environment"], record["size"]["shape"]
    figure.suptitle(
        f"{record['run']['name']} on {environment['device']}: hidden {shape['hidden']}, vocabulary "
        f"{record['corpus']['model_vocab']}, {shape['micro_batch'] * shape['seq']} tokens per audited micro-batch"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", help="a run's JSON written with --audit-every")
    parser.add_argument("--plot", help="where to write the plot (PNG)")
    args = parser.parse_args()
    with open(args.record) as handle:
        record = json.load(handle)
    print(table(record))
    if args.plot:
        plot(record, args.plot)


if __name__ == "__main__":
    main()
