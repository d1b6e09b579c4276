"""The tables and plot of a run of ``real_training.py --audit-every`` / ``--replay-every``:

- the gradient audit: per phase and path (and the bf16 floor), the relative error of the head's
  gradient against float64 (the hidden states' and the output weight's), its largest ratio to the
  floor at the same point, the points where a fused path's error exceeds stock's, and the entropy
  coefficient shift (``gradient_audit``'s metrics) with its mean's 95 % interval over the points
  (taken as independent; neighbouring SFT points correlate a little, so read it as a lower bound on
  the width), against the run's entropy coefficient;
- the excursion (``real_training.Excursion``);
- the paired replay (``paired_replay``): per phase, metric and update, each path's difference from
  the exact path (mean, 95 % t-interval, root mean square over the states), and whether each fused
  path's interval contains 0 or lies within the stock path's root mean square difference. Replays
  of RL rollouts that a call cut short before its record was written can be read from the run's log
  (``--replay-log``: the held-out loss after the last update, as logged to three digits).

    python benchmarks/report_audit.py benchmarks/results/gradient_audit_h200/three_gemm.json --plot docs/real_training/audit.png
    python benchmarks/report_audit.py benchmarks/results/paired_replay_h200/stock_seed0.json \
        --replay-log benchmarks/results/paired_replay_h200/stock_seed0.log
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from typing import Dict, List, Optional

import paired_replay
from gradient_audit import FLOOR, PATHS

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
        "| phase | path | relative error, hidden | relative error, weight | at most x floor: whole, hidden | "
        "points worse than stock | "
        "entropy coefficient shift: mean [95 %] | largest shift |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for phase in ("sft", "rl"):
        points = record[phase]["audit"] or []
        for path in (*PATHS, FLOOR):
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
            floor = ", ".join(f"{max(ratio_to_floor(point, path, part) for point in points):.2f}"
                              for part in ("both", "hidden"))  # fmt: skip
            worse_cell = "" if path in ("stock", FLOOR) else f"{worse} of {len(points)}"
            rows.append(
                f"| {phase} | {path} | {ranges} | {floor} | {worse_cell} | "
                f"{mean:+.1e} [{mean - half:+.1e}, {mean + half:+.1e}]"
                f" ({100 * max(abs(mean - half), abs(mean + half)) / coef:.1f} % of {coef}) | "
                f"{max(map(abs, shifts)):.1e} |"
            )
    return "\n".join(rows)


def ratio_to_floor(point: dict, path: str, part: str) -> float:
    return point["paths"][path][part]["relative_error"] / point["paths"][FLOOR][part]["relative_error"]


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(2, 2, figsize=(12, 7))
    for column, phase in enumerate(("sft", "rl")):
        points = record[phase]["audit"]
        steps = [point["step"] for point in points]
        for name in (*PATHS, FLOOR):
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


def excursion(record: dict) -> str:
    """The excursion's line: its step, reported loss and excess, and each evaluation's loss."""
    found = record["sft"].get("excursion")
    if found is None:
        return "no excursion evaluated"
    losses = ", ".join(f"{name} {found[name]:.6f}" for name in ("stock", "fused_cross_entropy", "fused_logprob",
                                                                 "float64"))  # fmt: skip
    return (
        f"excursion at SFT step {found['step']}: loss {found['reported']:.6f}, {found['excess']:+.4f} over the median "
        f"of the steps before; on its weights and batch: {losses}; held-out loss there {found['held_out_loss']:.4f}"
    )


LOGGED = re.compile(r"replay (sft|rl) \S+ step (\d+): held-out loss against exact: (.*)$")


def logged_replays(lines, phase: str) -> Dict[str, List[float]]:
    """``{path: [difference, ...]}``: the held-out loss differences from exact after the last update
    that ``real_training`` logged for ``phase``'s replays."""
    found: Dict[str, List[float]] = {}
    for line in lines:
        match = LOGGED.search(line.strip())
        if match and match.group(1) == phase:
            for item in match.group(3).split(", "):
                path, value = item.split(" ")
                found.setdefault(path, []).append(float(value))
    return found


def cell(summary: dict) -> str:
    return f"{summary['mean']:+.1e} [{summary['low']:+.1e}, {summary['high']:+.1e}], rms {summary['rms']:.1e}"


def criterion(summaries: Dict[str, dict]) -> str:
    """The issue's criterion per fused path: its interval contains 0 or is narrower than stock's
    root mean square difference; and the stricter reading, that it then lies within ``±`` that."""
    stock = summaries["stock"]["rms"]
    fused = {path: summary for path, summary in summaries.items() if path != "stock"}
    excludes = {path for path, summary in fused.items() if summary["low"] * summary["high"] > 0}
    wide = [path for path in excludes if fused[path]["high"] - fused[path]["low"] >= stock]
    outside = [path for path in excludes if max(abs(fused[path]["low"]), abs(fused[path]["high"])) >= stock]
    return " | ".join("met" if not failing else "not met: " + ", ".join(sorted(failing)) for failing in (wide, outside))


def replay_table(record: dict, log_lines: Optional[List[str]] = None) -> str:
    compared = [path for path in paired_replay.PATHS if path != "exact"]
    rows = [
        "| phase | states | metric | after update | exact's change (median abs) | "
        + " | ".join(f"{path} - exact: mean [95 %], rms" for path in compared)
        + " | contains 0 or narrower than stock's rms | contains 0 or within ±stock's rms |",
        "|---|---|---|---|---|" + "---|" * len(compared) + "---|---|",
    ]
    for phase in ("sft", "rl"):
        points = (record.get(phase) or {}).get("replay") or ((record.get(f"{phase}_so_far") or {}).get("replay"))
        if points:
            for metric in paired_replay.METRICS:
                for update in range(len(points[0]["paths"]["exact"])):
                    summaries = {path: paired_replay.paired_differences(points, path, update, metric)
                                 for path in compared}  # fmt: skip
                    change = paired_replay.median_change(points, "exact", update, metric)
                    rows.append(
                        f"| {phase} | {len(points)} | {metric} | {update + 1} | {change:.1e} | "
                        + " | ".join(cell(summaries[path]) for path in compared)
                        + f" | {criterion(summaries)} |"
                    )
        elif log_lines:
            logged = logged_replays(log_lines, phase)
            if logged:
                summaries = {path: paired_replay.summarize(logged[path]) for path in compared}
                rows.append(
                    f"| {phase} (log) | {summaries['stock']['count']} | held_out_loss | last | | "
                    + " | ".join(cell(summaries[path]) for path in compared)
                    + f" | {criterion(summaries)} |"
                )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", help="a run's JSON written with --audit-every or --replay-every")
    parser.add_argument("--plot", help="where to write the audit's plot (PNG)")
    parser.add_argument("--replay-log", help="the run's log, for replays its record lacks")
    args = parser.parse_args()
    with open(args.record) as handle:
        record = json.load(handle)
    if record["sft"].get("audit"):
        print(table(record))
        print()
        print(excursion(record))
    log_lines = None
    if args.replay_log:
        with open(args.replay_log) as handle:
            log_lines = handle.readlines()
    if record["sft"].get("replay") or log_lines:
        print()
        print(replay_table(record, log_lines))
    if args.plot:
        plot(record, args.plot)


if __name__ == "__main__":
    main()
