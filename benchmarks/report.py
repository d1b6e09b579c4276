"""Plots and Markdown tables from the JSON that bench_logprob.py writes, so that the figures in
docs/ and the numbers in README.md come from one file.

    python3 benchmarks/report.py docs/bench_results.json --plots docs/ --markdown
"""

from __future__ import annotations

import argparse
import json
import os

GIB = 2**30
HEADLINE_SHAPE = "32768x4096x151936"
LABELS = {
    "stock": "stock (logits + fp32 softmax)",
    "torch": "ours, torch backend",
    "triton": "ours, Triton backend",
    "ours": "ours (Triton backend)",
    "liger": "liger-kernel",
    "cce": "cut-cross-entropy",
    "floor": "GEMM floor",
}
SCALING_LABELS = {
    ("sft", "stock"): "SFT stock",
    ("sft", "ours"): "SFT ours",
    ("sft", "liger"): "SFT liger-kernel",
    ("sft", "cce"): "SFT cut-cross-entropy",
    ("rl", "stock"): "RL stock",
    ("rl", "triton"): "RL ours",
}


def select(rows, **fields):
    return [row for row in rows if all(row.get(key) == value for key, value in fields.items())]


def find(rows, **fields):
    found = select(rows, **fields)
    return found[0] if found else None


def shapes_of(rows, section):
    return list(dict.fromkeys(row["shape"] for row in rows if row["section"] == section and "shape" in row))


def pretty(shape):
    return shape.replace("x", " x ")


def peak_gib(row):
    """Peak extra memory in GiB; NaN where none was measured (a CPU dry run)."""
    return float("nan") if row["peak_extra_bytes"] is None else row["peak_extra_bytes"] / GIB


def log_scale(axis):
    """Log y scale where the axis shows some positive value (a CPU dry run measures no memory)."""
    if any(value > 0 for line in axis.lines for value in line.get_ydata()) or any(
        patch.get_height() > 0 for patch in axis.patches
    ):
        axis.set_yscale("log")


def cell(row, memory=True):
    """``"ms / GiB"`` of a measured row, else its status."""
    if row is None:
        return "-"
    if row["status"] != "ok":
        return {"oom": "OOM", "missing": "not installed"}.get(row["status"], row["status"])
    text = f"{row['ms']:.1f}"
    return f"{text} / {peak_gib(row):.2f}" if memory else text


def error_cell(rows):
    return " / ".join(f"{row['logprob_max_error']:.1e}" if row and "logprob_max_error" in row else "-" for row in rows)


def floor_table(rows, section, methods, ours, header, **filters):
    """One row per shape: the floor, each method's cell, ours against the floor, the errors."""
    lines = [header, "|" + "---|" * (len(methods) + 4)]
    for shape in shapes_of(rows, section):
        floor = find(rows, section=section, shape=shape, method="floor")
        measured = [find(rows, section=section, shape=shape, method=method, **filters) for method in methods]
        ours_row = measured[methods.index(ours)]
        ratio = f"{ours_row['vs_floor']:.3f}" if ours_row and "vs_floor" in ours_row else "-"
        lines.append(
            f"| {pretty(shape)} | {cell(floor, memory=False)} | "
            + " | ".join(cell(row) for row in measured)
            + f" | {ratio} | {error_cell(measured)} |"
        )
    return "\n".join(lines)


def rl_table(rows, temperature):
    header = (
        "| tokens x hidden x vocab | floor (4 GEMMs) | stock | torch backend | Triton backend | Triton / floor "
        "| log-prob err stock / torch / Triton |"
    )
    return floor_table(rows, "rl", ("stock", "torch", "triton"), "triton", header, temperature=temperature)


def sft_table(rows):
    header = (
        "| tokens x hidden x vocab | floor (3 GEMMs) | stock | ours (Triton) | liger-kernel | cut-cross-entropy "
        "| ours / floor | log-prob err stock / ours / liger / cce |"
    )
    return floor_table(rows, "sft", ("stock", "ours", "liger", "cce"), "ours", header)


def scaling_table(rows):
    series = list(SCALING_LABELS)
    scaling = select(rows, section="scaling")
    lines = ["| tokens | " + " | ".join(SCALING_LABELS[key] for key in series) + " |", "|---" * (len(series) + 1) + "|"]
    for tokens in sorted({row["tokens"] for row in scaling if "tokens" in row}):
        cells = [
            cell(
                find(scaling, tokens=tokens, use=use, method=method)
                or find(scaling, use=use, method=method, status="missing")
            )
            for use, method in series
        ]
        lines.append(f"| {tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fractions_table(rows):
    lines = [
        "| tokens x hidden x vocab | response fraction | selected tokens | Triton backend | stock "
        "| log-prob err Triton / stock |",
        "|---|---|---|---|---|---|",
    ]
    for row in select(rows, section="fractions", method="triton"):
        stock = find(rows, section="fractions", shape=row["shape"], fraction=row["fraction"], method="stock")
        lines.append(
            f"| {pretty(row['shape'])} | {row['fraction']:g} | {row['selected_tokens']} | {cell(row)} "
            f"| {cell(stock)} | {error_cell([row, stock])} |"
        )
    return "\n".join(lines)


def largest_fit(rows, use, method):
    """``(largest token count measured, whether the method ran out of memory after it)``."""
    series = select(rows, section="scaling", use=use, method=method)
    fitted = [row["tokens"] for row in series if row["status"] == "ok"]
    return (max(fitted) if fitted else None), any(row["status"] == "oom" for row in series)


def summary_table(results):
    """The README's three rows, all read from the JSON."""
    rows, meta = results["rows"], results["meta"]
    cap = meta["scaling_max_tokens"]
    columns = (("stock", "stock"), ("triton", "ours"), (None, "liger"), (None, "cce"))

    def fit_cell(method):
        largest, stopped = largest_fit(rows, "sft", method)
        if largest is None:
            return cell(find(rows, section="scaling", use="sft", method=method))
        return f"{largest}" if stopped else f">= {largest} (cap, no OOM)"

    rl = [
        find(rows, section="rl", shape=HEADLINE_SHAPE, method=method, temperature=1.0) if method else None
        for method, _ in columns
    ]
    sft = [find(rows, section="sft", shape=HEADLINE_SHAPE, method=method) for _, method in columns]
    return "\n".join(
        [
            f"| {pretty(HEADLINE_SHAPE)}, forward + backward, ms / peak extra GiB | stock | ours (Triton) "
            "| liger-kernel | cut-cross-entropy |",
            "|---|---|---|---|---|",
            "| RL: per-token log-prob + entropy | " + " | ".join(cell(row) if row else "n/a" for row in rl) + " |",
            "| SFT: mean cross-entropy | " + " | ".join(cell(row) for row in sft) + " |",
            f"| SFT: most tokens that fit (hidden 4096, vocab 151936; cap {cap}) | "
            + " | ".join(fit_cell(method) for _, method in columns)
            + " |",
        ]
    )


def markdown(results):
    rows = results["rows"]
    parts = []
    for temperature in results["meta"]["temperatures"]:
        parts += [f"### RL, temperature {temperature:g}", rl_table(rows, temperature)]
    parts += [
        "### SFT",
        sft_table(rows),
        "### Scaling",
        scaling_table(rows),
        "### Response fractions",
        fractions_table(rows),
        "### README summary",
        summary_table(results),
    ]
    return "\n\n".join(parts)


def bar_panels(pyplot, rows, section, methods, title, path, temperature=None):
    """Time and peak extra memory per shape, one bar per method (the floor has no memory bar)."""
    shapes = shapes_of(rows, section)
    figure, (time_axis, memory_axis) = pyplot.subplots(1, 2, figsize=(14, 4.8))
    width = 0.8 / len(methods)
    for index, method in enumerate(methods):
        fields = dict(section=section, method=method)
        if temperature is not None and method != "floor":
            fields["temperature"] = temperature
        measured = [find(rows, shape=shape, **fields) for shape in shapes]
        positions = [number + (index - (len(methods) - 1) / 2) * width for number in range(len(shapes))]
        times = [row["ms"] if row and row["status"] == "ok" else 0 for row in measured]
        time_axis.bar(positions, times, width, label=LABELS[method])
        if method != "floor":
            memory = [peak_gib(row) if row and row["status"] == "ok" else 0 for row in measured]
            memory_axis.bar(positions, memory, width, label=LABELS[method])
    for axis, label in ((time_axis, "forward + backward, ms (median)"), (memory_axis, "peak extra memory, GiB")):
        axis.set_xticks(range(len(shapes)), [pretty(shape) for shape in shapes], rotation=20, fontsize=8)
        axis.set_ylabel(label)
        axis.grid(axis="y", alpha=0.3)
    log_scale(memory_axis)
    time_axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def scaling_plot(pyplot, results, path):
    """Time and memory against tokens; an X where a method ran out of memory (drawn at its last
    measured value), and the device's memory as a dashed line."""
    rows, meta = select(results["rows"], section="scaling"), results["meta"]
    figure, (time_axis, memory_axis) = pyplot.subplots(1, 2, figsize=(14, 5))
    for (use, method), label in SCALING_LABELS.items():
        series = [row for row in select(rows, use=use, method=method) if "tokens" in row]
        measured = [row for row in series if row["status"] == "ok"]
        if not measured:
            continue
        style = "-o" if use == "sft" else "--s"
        tokens = [row["tokens"] for row in measured]
        for axis, values in (
            (time_axis, [row["ms"] for row in measured]),
            (memory_axis, [peak_gib(row) for row in measured]),
        ):
            (line,) = axis.plot(tokens, values, style, label=label, markersize=4)
            stop = next((row for row in series if row["status"] == "oom"), None)
            if stop is not None:
                axis.plot([stop["tokens"]], [values[-1]], "X", color=line.get_color(), markersize=12)
                axis.annotate(
                    f"OOM at {stop['tokens']}",
                    (stop["tokens"], values[-1]),
                    fontsize=7,
                    xytext=(4, 4),
                    textcoords="offset points",
                )
    if "device_memory_bytes" in meta:
        memory_axis.axhline(meta["device_memory_bytes"] / GIB, linestyle=":", color="gray")
        memory_axis.annotate(
            "device memory",
            (meta["scaling_start"], meta["device_memory_bytes"] / GIB),
            fontsize=7,
            xytext=(0, -10),
            textcoords="offset points",
        )
    for axis, label in ((time_axis, "forward + backward, ms (median)"), (memory_axis, "peak extra memory, GiB")):
        axis.set_xscale("log", base=2)
        log_scale(axis)
        axis.set_xlabel("tokens")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3, which="both")
    time_axis.legend(fontsize=8)
    hidden_size, vocab = meta["scaling_shape"]
    figure.suptitle(
        f"Scaling, hidden {hidden_size}, vocab {vocab}, {meta['device']} "
        f"(X: out of memory; run capped at {meta['scaling_max_tokens']} tokens)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def fractions_plot(pyplot, results, path):
    rows = select(results["rows"], section="fractions")
    figure, (time_axis, memory_axis) = pyplot.subplots(1, 2, figsize=(12, 4.5))
    for index, shape in enumerate(shapes_of(rows, "fractions")):  # one color per shape, one style per method
        for method, style in (("triton", "-o"), ("stock", "--s")):
            measured = [row for row in select(rows, shape=shape, method=method) if row["status"] == "ok"]
            fractions = [row["fraction"] for row in measured]
            label = f"{LABELS[method]}, {pretty(shape)}"
            time_axis.plot(fractions, [row["ms"] for row in measured], style, color=f"C{index}", label=label)
            memory_axis.plot(fractions, [peak_gib(row) for row in measured], style, color=f"C{index}", label=label)
    for axis, label in ((time_axis, "forward + backward, ms (median)"), (memory_axis, "peak extra memory, GiB")):
        axis.set_xlabel("response fraction (rows selected with mask=)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    time_axis.set_ylim(bottom=0)
    log_scale(memory_axis)
    time_axis.legend(fontsize=7)
    figure.suptitle(f"Log-prob + entropy of the response tokens only, {results['meta']['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def write_plots(results, folder):
    """Draw every section present in ``results`` into ``folder``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    os.makedirs(folder, exist_ok=True)
    rows, device = results["rows"], results["meta"]["device"]
    sections = {row["section"] for row in rows}
    written = []
    if "rl" in sections:
        temperature = results["meta"]["temperatures"][0]
        path = os.path.join(folder, "bench_rl.png")
        bar_panels(
            pyplot,
            rows,
            "rl",
            ("stock", "torch", "triton", "floor"),
            f"Per-token log-prob + entropy, temperature {temperature:g}, {device}",
            path,
            temperature,
        )
        written.append(path)
    if "sft" in sections:
        path = os.path.join(folder, "bench_sft.png")
        bar_panels(
            pyplot, rows, "sft", ("stock", "ours", "liger", "cce", "floor"), f"Mean cross-entropy (SFT), {device}", path
        )
        written.append(path)
    if "scaling" in sections:
        path = os.path.join(folder, "bench_scaling.png")
        scaling_plot(pyplot, results, path)
        written.append(path)
    if "fractions" in sections:
        path = os.path.join(folder, "bench_fractions.png")
        fractions_plot(pyplot, results, path)
        written.append(path)
    return written


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--plots", default=None, help="folder to draw the PNGs into")
    parser.add_argument("--markdown", action="store_true", help="print the tables of docs/BENCHMARKS.md")
    args = parser.parse_args()
    with open(args.json) as handle:
        results = json.load(handle)
    if args.plots:
        for path in write_plots(results, args.plots):
            print("wrote", path)
    if args.markdown:
        print(markdown(results))


if __name__ == "__main__":
    main()
