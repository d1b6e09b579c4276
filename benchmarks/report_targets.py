"""The benchmark targets against repeated bench_logprob.py runs: Markdown tables and one PNG.

Reads the JSON files that bench_logprob.py wrote (default ``benchmarks/results/targets_h100/run*_*.json``; a file
named ``runN_PART.json`` belongs to run ``runN``, any other file is a run of its own name). Each
row is one (section, shape, method) of one run; the RL-loss rows of a file whose meta has
``entropy_coef`` 0 are the RL loss without an entropy term (``rl_loss_noent``), and only the RL
rows at temperature 1 are read. A figure is the median over the runs of the row's ``ms`` (two runs:
their mean), and a ratio to the floor is the median method over the median floor.

Prints, per target, a Markdown table (median ratio, each run's own ratio, whether met, the liger
peers' time over ours, whether ours is faster than each; the RL loss without an entropy term is
compared with the entropy run's liger_native row, whose kernel computes the entropy either way), the SFT TFLOP/s at 32768 x 4096 x 151936 (6 N H V / time), the peak extra
memory of ``ours_main_grad`` against liger-kernel's, the max |log-prob error| of every method and
the rows that did not run; draws ``--png`` (default ``docs/targets_h100/targets.png``): for SFT,
the RL loss, the recompute op and the forward, the ratio to the floor per shape, ours against the
liger peers, with the target as a line.

    python3 benchmarks/report_targets.py [JSON ...] [--png PATH | --no-png]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics

from report import GIB, HEADLINE_SHAPE, pretty, provenance, save, style

DEFAULT_GLOB = "benchmarks/results/targets_h100/run*_*.json"
# use -> (section of the rows, floor method, our method, the liger peers computing the same thing)
USES = {
    "sft": ("sft", "floor", "ours", ("liger", "liger_native")),
    "rl_loss": ("rl_loss", "floor3", "ours", ("liger_native",)),
    "rl_loss_noent": ("rl_loss", "floor3", "ours", ("liger_native",)),
    "rl": ("rl", "floor", "triton", ("liger_native",)),
    "forward": ("forward", "floor1", "triton", ("liger_native",)),
}
TITLES = {
    "sft": "SFT: mean cross-entropy (sft: ours / floor, 3 GEMMs)",
    "rl_loss": "RL loss with entropy bonus 0.01 (rl_loss: ours / floor3)",
    "rl_loss_noent": "RL loss without entropy term (rl_loss, entropy_coef 0: ours / floor3)",
    "rl": "Recompute op: log-prob + entropy fwd+bwd (rl: triton / floor, 4 GEMMs)",
    "forward": "Forward only (forward: triton / floor1, 1 GEMM)",
}
# The liger_native RL loss is measured only with the entropy bonus; its kernel computes the entropy
# either way, so the RL loss without one is compared with that row.
PEER_USE = {"rl_loss_noent": "rl_loss"}
PLOTTED = ("sft", "rl_loss", "rl", "forward")
TFLOPS_TARGET = 700.0
Y_CAP = 2.0  # ratios above this are drawn at it, with their value written


def target(use, shape):
    """The ratio-to-floor target of ``use`` at ``shape``."""
    if use == "rl":
        return 1.03
    tokens = int(shape.split("x")[0])
    return 1.05 if tokens >= 8192 else 1.2


def run_name(path):
    match = re.match(r"(run\d+)_", os.path.basename(path))
    return match.group(1) if match else os.path.splitext(os.path.basename(path))[0]


def load(paths):
    """``(rows, runs, meta)``: rows keyed ``(use, shape, method) -> {run: row}``, the run names
    in order, and the first file's meta."""
    rows, runs, meta = {}, [], None
    for path in paths:
        with open(path) as handle:
            results = json.load(handle)
        meta = meta or results["meta"]
        run = run_name(path)
        runs.append(run)
        no_entropy = results["meta"].get("entropy_coef") == 0
        for row in results["rows"]:
            if "shape" not in row or row.get("temperature", 1.0) != 1.0:
                continue
            use = "rl_loss_noent" if row["section"] == "rl_loss" and no_entropy else row["section"]
            rows.setdefault((use, row["shape"], row["method"]), {})[run] = row
    return rows, list(dict.fromkeys(runs)), meta


class Results:
    def __init__(self, rows, runs):
        self.rows, self.runs = rows, runs

    def shapes(self, use):
        return list(dict.fromkeys(shape for (u, shape, _), _ in self.rows.items() if u == use))

    def per_run(self, use, shape, method):
        """``{run: ms}`` of the runs where the method ran."""
        found = self.rows.get((use, shape, method), {})
        return {run: row["ms"] for run, row in found.items() if row["status"] == "ok"}

    def ms(self, use, shape, method):
        values = list(self.per_run(use, shape, method).values())
        return statistics.median(values) if values else None

    def failure(self, use, shape, method):
        """Why the method has no time here (``"not run"``, ``"oom"``, ``"error"``...), else None."""
        found = self.rows.get((use, shape, method))
        if not found:
            return "not run"
        failed = [row["status"] for row in found.values() if row["status"] != "ok"]
        return None if len(failed) < len(found) else failed[0]

    def ratio(self, use, shape, method, floor):
        """``(median ratio, {run: that run's ratio})`` of the method over the floor."""
        ours, base = self.ms(use, shape, method), self.ms(use, shape, floor)
        runs_ours, runs_floor = self.per_run(use, shape, method), self.per_run(use, shape, floor)
        per_run = {run: runs_ours[run] / runs_floor[run] for run in runs_ours if run in runs_floor}
        return (ours / base if ours and base else None), per_run


def runs_text(per_run, runs, digits=3):
    return " / ".join(f"{per_run[run]:.{digits}f}" if run in per_run else "-" for run in runs)


def target_table(results, use):
    """The Markdown table of one use and its verdicts ``[(shape, met, miss text)]``."""
    _, floor, ours, peers = USES[use]
    peer_use = PEER_USE.get(use, use)
    runs = results.runs
    header = (
        f"| shape | floor ms | ours ms ({' / '.join(runs)}) | ours / floor | per run | target | met | faster than liger | "
        + " | ".join(f"{peer} ms; {peer} / ours" for peer in peers)
        + " |"
    )
    lines = [f"### {TITLES[use]}", "", header, "|---" * (8 + len(peers)) + "|"]
    verdicts = []
    for shape in results.shapes(use):
        ratio, per_run = results.ratio(use, shape, ours, floor)
        limit = target(use, shape)
        ours_ms = results.ms(use, shape, ours)
        ratio_met = ratio is not None and ratio <= limit
        ratio_miss = (
            "" if ratio_met else (f"{ratio:.3f} > {limit} (+{ratio - limit:.3f})" if ratio else "ours did not run")
        )
        peer_cells, misses, notes = [], [], []
        for peer in peers:
            peer_ms = results.ms(peer_use, shape, peer)
            if peer_ms is None:
                peer_cells.append(f"{results.failure(peer_use, shape, peer)} (no time)")
                notes.append(f"{peer} not compared: {results.failure(peer_use, shape, peer)}")
                continue
            peer_runs = results.per_run(peer_use, shape, peer)
            ours_runs = results.per_run(use, shape, ours)
            spread = {run: peer_runs[run] / ours_runs[run] for run in peer_runs if run in ours_runs}
            peer_cells.append(f"{peer_ms:.2f}; {peer_ms / ours_ms:.3f}x ({runs_text(spread, runs)})")
            if ours_ms is not None and peer_ms <= ours_ms:
                misses.append(f"{peer} faster ({peer_ms:.2f} <= {ours_ms:.2f} ms)")
            elif any(value <= 1 for value in spread.values()):
                notes.append(f"{peer} faster in {', '.join(run for run, value in spread.items() if value <= 1)}")
        verdicts.append((f"{use} / floor", shape, ratio_met, ratio_miss))
        verdicts.append((f"{use} faster than liger", shape, not misses, "; ".join(misses + notes)))
        peer_text = ("yes" if not misses else "NO: " + "; ".join(misses)) + "".join(f" ({note})" for note in notes)
        lines.append(
            f"| {pretty(shape)} | {fmt(results.ms(use, shape, floor))} | "
            f"{fmt(ours_ms)} ({runs_text(results.per_run(use, shape, ours), runs, 2)}) | "
            f"{fmt(ratio, 3)} | {runs_text(per_run, runs)} | <= {limit} | "
            f"{'yes' if ratio_met else 'NO: ' + ratio_miss} | {peer_text} | " + " | ".join(peer_cells) + " |"
        )
    return "\n".join(lines), verdicts


def fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def tflops_table(results):
    tokens, hidden, vocab = map(int, HEADLINE_SHAPE.split("x"))
    flop = 6 * tokens * hidden * vocab
    lines = [
        f"### SFT throughput at {pretty(HEADLINE_SHAPE)} (6 N H V / time; target >= {TFLOPS_TARGET:.0f} TFLOP/s for ours)",
        "",
        f"| method | ms (median) | TFLOP/s (median) | per run ({' / '.join(results.runs)}) |",
        "|---|---|---|---|",
    ]
    for method in ("floor", "ours", "ours_main_grad", "liger", "cce", "liger_native"):
        ms = results.ms("sft", HEADLINE_SHAPE, method)
        per_run = {run: flop / value / 1e9 for run, value in results.per_run("sft", HEADLINE_SHAPE, method).items()}
        rate = flop / ms / 1e9 if ms else None
        lines.append(f"| {method} | {fmt(ms)} | {fmt(rate, 1)} | {runs_text(per_run, results.runs, 1)} |")
    ms = results.ms("sft", HEADLINE_SHAPE, "ours")
    rate = flop / ms / 1e9 if ms else None
    met = rate is not None and rate >= TFLOPS_TARGET
    miss = "" if met else f"{fmt(rate, 1)} < {TFLOPS_TARGET:.0f} TFLOP/s"
    return "\n".join(lines), [("sft TFLOP/s >= 700", HEADLINE_SHAPE, met, miss)]


def memory_table(results):
    """Peak extra memory (PyTorch's allocator) of sft ours_main_grad against sft liger: the larger
    of the runs' peaks."""
    lines = [
        "### Peak extra memory, SFT: ours_main_grad <= liger (GiB, max over runs)",
        "",
        "| shape | ours | ours_main_grad | liger | liger_native (allocator; + native workspace) | met |",
        "|---|---|---|---|---|---|",
    ]
    verdicts = []
    for shape in results.shapes("sft"):
        peaks = {}
        for method in ("ours", "ours_main_grad", "liger", "liger_native"):
            found = [row for row in results.rows.get(("sft", shape, method), {}).values() if row["status"] == "ok"]
            peaks[method] = max((row["peak_extra_bytes"] or 0 for row in found), default=None)
            if method == "liger_native" and found:
                peaks["workspace"] = found[0].get("native_workspace_bytes")
        mine, theirs = peaks["ours_main_grad"], peaks["liger"]
        met = mine is not None and theirs is not None and mine <= theirs
        miss = "" if met else ("a row is missing" if None in (mine, theirs) else f"{(mine - theirs) / GIB:+.3f} GiB")
        verdicts.append(("sft memory: ours_main_grad <= liger", shape, met, miss))
        native = (
            "-" if peaks["liger_native"] is None else f"{gib(peaks['liger_native'])} + {gib(peaks.get('workspace'))}"
        )
        lines.append(
            f"| {pretty(shape)} | {gib(peaks['ours'])} | {gib(mine)} | {gib(theirs)} | {native} | "
            f"{'yes' if met else 'NO: ' + miss} |"
        )
    return "\n".join(lines), verdicts


def gib(value):
    return "-" if value is None else f"{value / GIB:.3f}"


def error_table(results):
    """Max |log-prob error| against the float64 oracle, the largest over the runs."""
    uses = [use for use in USES if results.shapes(use)]
    shapes = list(dict.fromkeys(shape for use in uses for shape in results.shapes(use)))
    lines = [
        "### Max |log-prob error| against float64 (largest over runs)",
        "",
        "| use | method | " + " | ".join(pretty(shape) for shape in shapes) + " |",
        "|---" * (2 + len(shapes)) + "|",
    ]
    for use in uses:
        methods = dict.fromkeys(method for (u, _, method) in results.rows if u == use)
        for method in methods:
            cells = []
            for shape in shapes:
                errors = [
                    r["logprob_max_error"]
                    for r in results.rows.get((use, shape, method), {}).values()
                    if "logprob_max_error" in r
                ]
                cells.append(f"{max(errors):.1e}" if errors else "-")
            if any(c != "-" for c in cells):
                lines.append(f"| {use} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def failures(results):
    lines = ["### Rows that did not run", ""]
    for (use, shape, method), found in results.rows.items():
        for run, row in found.items():
            if row["status"] != "ok":
                lines.append(f"- {run} {use} {shape} {method}: {row['status']} {row.get('note', '')[:200]}")
    return "\n".join(lines if len(lines) > 2 else lines + ["- none"])


def draw(results, meta, path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(2, 2, figsize=(15, 10))
    for axis, use in zip(axes.flat, PLOTTED, strict=True):
        _, floor, ours, peers = USES[use]
        shapes = results.shapes(use)
        x = range(len(shapes))
        for method in (ours, *peers):
            points = [(i, results.ratio(use, shape, method, floor)[0]) for i, shape in enumerate(shapes)]
            label, colour, marker = style(method)
            axis.plot(
                [i for i, r in points if r],
                [min(r, Y_CAP) for _, r in points if r],
                marker=marker,
                color=colour,
                label=label,
            )
            for i, r in points:
                if r is not None and r > Y_CAP:  # off the scale: drawn at the cap, its value written
                    axis.annotate(
                        f"{r:.2f}x", (i, Y_CAP), fontsize=8, color=colour, xytext=(6, -4), textcoords="offset points"
                    )
                if r is None:
                    axis.annotate(
                        f"{method}: {results.failure(use, shapes[i], method)}",
                        (i, 1.0),
                        rotation=90,
                        fontsize=7,
                        color=colour,
                        va="bottom",
                        ha="center",
                    )
        axis.step(x, [target(use, shape) for shape in shapes], where="mid", color="red", linestyle="--", label="target")
        axis.axhline(1.0, color="0.5", linewidth=0.8)
        axis.set_xticks(list(x), [pretty(shape).replace(" x ", "x\n", 1) for shape in shapes], fontsize=8)
        axis.set_ylabel(f"time / {floor} (median of runs)")
        axis.set_title(TITLES[use], fontsize=10)
        axis.legend(fontsize=7)
    figure.suptitle(f"Targets: ratio to the GEMM floor, {len(results.runs)} runs\n{provenance(meta)}")
    save(pyplot, figure, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="*", help=f"bench_logprob.py JSON files (default {DEFAULT_GLOB})")
    parser.add_argument("--png", default="docs/targets_h100/targets.png")
    parser.add_argument("--no-png", action="store_true")
    args = parser.parse_args()
    paths = args.json or sorted(glob.glob(DEFAULT_GLOB))
    rows, runs, meta = load(paths)
    results = Results(rows, runs)
    print(f"{len(paths)} files, runs {', '.join(runs)}; {provenance(meta)}; versions {meta.get('versions')}\n")
    summary = []
    for use in USES:
        if results.shapes(use):
            table, verdicts = target_table(results, use)
            print(table + "\n")
            summary += verdicts
    for table, verdicts in (tflops_table(results), memory_table(results)):
        print(table + "\n")
        summary += verdicts
    print(error_table(results) + "\n")
    print(failures(results) + "\n")
    print("### Summary\n")
    for name in dict.fromkeys(item[0] for item in summary):
        checks = [item for item in summary if item[0] == name]
        met = [item for item in checks if item[2]]
        print(f"- {name}: met at {len(met)} of {len(checks)} shapes")
        for _, shape, passed, text in checks:
            if text:
                print(f"  - {pretty(shape)}: {'met, but ' if passed else 'missed: '}{text}")
    if not args.no_png:
        draw(results, meta, args.png)
        print(f"\nwrote {args.png}")


if __name__ == "__main__":
    main()
