"""Plots and Markdown tables from the JSON that bench_logprob.py writes, so that the figures in
docs/ and the numbers in README.md and docs/BENCHMARKS.md come from one file.

    python benchmarks/report.py benchmarks/results/bench_results.json --plots docs/ --markdown

The torch backend's rows are left out of every table and figure: on a GPU it is only the fallback
for a machine without Triton, and the committed rows predate a change to its backward.

In the SFT and RL-loss sections "ours" is ``fused_linear_loss`` (the gradients finished in the
forward: three GEMMs) and "recompute" the per-token op with the loss on its log-probs (four). A
JSON written before the RL-loss section existed (its meta has no ``rl_loss_methods``) called the
per-token op "ours" in the SFT rows; ``upgrade`` renames those rows "recompute" on reading.
"""

from __future__ import annotations

import argparse
import json
import os

GIB = 2**30
HEADLINE_SHAPE = "32768x4096x151936"
SHAPE_AXIS_LABEL = "tokens x hidden x vocabulary"
TIME_AXIS_LABEL = "forward + backward, ms (median)"
MEMORY_AXIS_LABEL = "peak extra memory, GiB"

# The JSON calls our Triton backend "triton" in the RL rows (the per-token op) and "ours" in the SFT
# and RL-loss rows (the loss finished in the forward); both are drawn as one method, ours.
SAME_METHOD = {"triton": "ours"}
# One label, colour and marker per method, the same in every figure.
METHOD_STYLES = {
    "stock": ("stock (bf16 logits)", "tab:blue", "s"),
    "ours": ("ours (Triton)", "tab:orange", "o"),
    "liger": ("liger-kernel", "tab:purple", "^"),
    "liger_flsce": ("liger-kernel CuTe (fused linear scaled CE)", "tab:pink", "P"),
    "liger_native": ("liger-kernel native CUTLASS + NVSHMEM (fused linear scaled CE, TP=1)", "tab:olive", "*"),
    "cute": ("ours (CuTe DSL forward statistics)", "tab:cyan", "h"),
    "cce": ("cut-cross-entropy", "tab:brown", "D"),
    "torch_lce": ("PyTorch linear_cross_entropy (default options)", "tab:gray", "d"),
    "quack": ("quack chunked linear CE (its scaled-exp route)", "gold", "p"),
    "quack_basic": ("quack chunked linear CE (basic route)", "khaki", "8"),
    "recompute": ("recompute (our per-token op, then the loss: 4 GEMMs)", "tab:green", "v"),
    "ours_main_grad": ("ours, weight gradient into Megatron's main_grad", "tab:red", "X"),
    "floor": ("GEMM floor (cuBLAS products alone)", "0.35", None),
    "floor3": ("GEMM floor (the three cuBLAS products alone)", "0.35", None),
    "floor1": ("GEMM floor (the logits product alone)", "0.35", None),
}
SCALING_SERIES = {  # use -> the methods measured for it, in table and legend order
    "sft": ("stock", "ours", "recompute", "liger", "cce"),
    "rl": ("stock", "triton"),
}
USE_TITLES = {"sft": "SFT: mean cross-entropy", "rl": "RL: per-token log-prob + entropy"}
SHORT_NAMES = {
    "stock": "stock",
    "ours": "ours",
    "recompute": "recompute",
    "liger": "liger-kernel",
    "cce": "cut-cross-entropy",
    "torch_lce": "PyTorch's linear_cross_entropy",
    "quack": "quack",
    "quack_basic": "quack (basic route)",
}
# The policy loss of the RL-loss section, for titles.
RL_LOSS_TITLE = "RL loss known in the forward: clipped policy loss + entropy bonus, token mean"


def upgrade(results):
    """``results`` with the rows of a JSON from before the three-GEMM loss renamed: there the SFT
    (and SFT scaling) "ours" was the per-token op, now called "recompute". Such a JSON's meta has
    no ``rl_loss_methods`` (every later run records the option)."""
    if "rl_loss_methods" in results["meta"]:
        return results
    rows = [
        dict(row, method="recompute")
        if row["method"] == "ours" and (row["section"] == "sft" or row.get("use") == "sft")
        else row
        for row in results["rows"]
    ]
    return dict(results, rows=rows)


def is_floor(method):
    return method.startswith("floor")


def style(method):
    """``(label, colour, marker)`` of ``method`` (``"triton"`` and ``"ours"`` are one method)."""
    return METHOD_STYLES[SAME_METHOD.get(method, method)]


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


def cell(row, memory=True):
    """``"ms / GiB"`` of a measured row, else its status."""
    if row is None:
        return "-"
    if row["status"] != "ok":
        return {"oom": "OOM", "missing": "not installed"}.get(row["status"], row["status"])
    text = f"{row['ms']:.1f}"
    return f"{text} / {peak_gib(row):.2f}" if memory else text


def error_cell(rows, key="logprob_max_error"):
    return " / ".join(f"{row[key]:.1e}" if row and key in row else "-" for row in rows)


def ratio_cell(row):
    return f"{row['vs_floor']:.3f}" if row and "vs_floor" in row else "-"


def floor_table(rows, section, methods, header, ratios=None, floor="floor", grad_errors=False, **filters):
    """One row per shape: the floor, each method's cell, the ``ratios`` methods (default: the last
    one, ours) against the floor, the log-prob errors and, with ``grad_errors``, the hidden
    gradient's errors."""
    ratios = methods[-1:] if ratios is None else ratios
    columns = len(methods) + len(ratios) + 3 + bool(grad_errors)
    lines = [header, "|" + "---|" * columns]
    for shape in shapes_of(rows, section):
        floor_row = find(rows, section=section, shape=shape, method=floor)
        measured = {method: find(rows, section=section, shape=shape, method=method, **filters) for method in methods}
        errors = [error_cell(measured.values())]
        if grad_errors:
            errors.append(error_cell(measured.values(), "grad_hidden_error"))
        lines.append(
            f"| {pretty(shape)} | {cell(floor_row, memory=False)} | "
            + " | ".join([cell(row) for row in measured.values()] + [ratio_cell(measured[m]) for m in ratios] + errors)
            + " |"
        )
    return "\n".join(lines)


# The per-token methods of the RL and forward tables, in column order, with their column titles.
PER_TOKEN_COLUMNS = {
    "stock": "stock",
    "liger_flsce": "liger-kernel CuTe",
    "liger_native": "liger-kernel native",
    "triton": "ours (Triton)",
    "cute": "ours (CuTe)",
}


def per_token_table(rows, section, floor, floor_title, **filters):
    """``floor_table`` of the per-token methods this run measured in ``section``: each one's cell,
    its time over the floor's, and the log-prob errors."""
    methods = [method for method in PER_TOKEN_COLUMNS if select(rows, section=section, method=method, **filters)]
    ratios = [method for method in methods if method != "stock"]
    titles = [PER_TOKEN_COLUMNS[method] for method in methods]
    header = (
        f"| tokens x hidden x vocab | floor ({floor_title}) | "
        + " | ".join(titles + [f"{PER_TOKEN_COLUMNS[method]} / floor" for method in ratios])
        + f" | log-prob err {' / '.join(titles)} |"
    )
    return floor_table(rows, section, tuple(methods), header, ratios=ratios, floor=floor, **filters)


def rl_table(rows, temperature):
    return per_token_table(rows, "rl", "floor", "4 GEMMs", temperature=temperature)


def forward_table(rows):
    return per_token_table(rows, "forward", "floor1", "1 GEMM")


def sft_table(rows):
    header = (
        "| tokens x hidden x vocab | floor (3 GEMMs) | stock | liger-kernel | cut-cross-entropy "
        "| recompute (4 GEMMs) | ours (3 GEMMs) | ours into main_grad | recompute / floor | ours / floor "
        "| ours into main_grad / floor | log-prob err stock / liger / cce / recompute / ours / ours into main_grad "
        "| grad_hidden err stock / liger / cce / recompute / ours / ours into main_grad |"
    )
    methods = ("stock", "liger", "cce", "recompute", "ours", "ours_main_grad")
    ratios = ("recompute", "ours", "ours_main_grad")
    return floor_table(rows, "sft", methods, header, ratios=ratios, grad_errors=True)


def rl_loss_table(rows):
    header = (
        "| tokens x hidden x vocab | floor (3 GEMMs) | stock | recompute (4 GEMMs) | ours (3 GEMMs) "
        "| ours into main_grad | recompute / floor | ours / floor | ours into main_grad / floor "
        "| log-prob err stock / recompute / ours / ours into main_grad "
        "| grad_hidden err stock / recompute / ours / ours into main_grad |"
    )
    methods = ("stock", "recompute", "ours", "ours_main_grad")
    ratios = ("recompute", "ours", "ours_main_grad")
    return floor_table(rows, "rl_loss", methods, header, ratios=ratios, floor="floor3", grad_errors=True)


def scaling_table(rows):
    scaling = select(rows, section="scaling")
    # A series with no row at all (one this JSON's run did not measure) gets no column.
    series = [
        (use, method)
        for use, methods in SCALING_SERIES.items()
        for method in methods
        if select(scaling, use=use, method=method)
    ]
    lines = [
        "| tokens | "
        + " | ".join(f"{use.upper()} {SHORT_NAMES[SAME_METHOD.get(method, method)]}" for use, method in series)
        + " |",
        "|---" * (len(series) + 1) + "|",
    ]
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
        "| tokens x hidden x vocab | response fraction | selected tokens | stock | ours (Triton) "
        "| log-prob err stock / ours |",
        "|---|---|---|---|---|---|",
    ]
    for row in select(rows, section="fractions", method="triton"):
        stock = find(rows, section="fractions", shape=row["shape"], fraction=row["fraction"], method="stock")
        lines.append(
            f"| {pretty(row['shape'])} | {row['fraction']:g} | {row['selected_tokens']} | {cell(stock)} "
            f"| {cell(row)} | {error_cell([stock, row])} |"
        )
    return "\n".join(lines)


def fit_cell(rows, use, method):
    """The most tokens ``method`` ran in the scaling section, and where it ran out of memory."""
    series = select(rows, section="scaling", use=use, method=method)
    fitted = [row["tokens"] for row in series if row["status"] == "ok"]
    stopped = [row["tokens"] for row in series if row["status"] == "oom"]
    if not fitted:
        return cell(series[0] if series else None)
    return f"{max(fitted)} (OOM at {min(stopped)})" if stopped else f">= {max(fitted)} (no OOM)"


def summary_table(results):
    """The README's summary rows, all read from the JSON."""
    rows, meta = results["rows"], results["meta"]
    cap = meta["scaling_max_tokens"]
    # (RL method, SFT method) per column; the loss-only libraries have no RL method. The RL-loss
    # row reads the RL method's column name in the rl_loss section (stock, ours).
    columns = (("stock", "stock"), ("triton", "ours"), (None, "liger"), (None, "cce"))
    rl = [
        cell(find(rows, section="rl", shape=HEADLINE_SHAPE, method=method, temperature=1.0)) if method else "n/a"
        for method, _ in columns
    ]
    rl_loss = [
        cell(find(rows, section="rl_loss", shape=HEADLINE_SHAPE, method=method)) if rl_method else "n/a"
        for rl_method, method in columns
    ]
    sft = [find(rows, section="sft", shape=HEADLINE_SHAPE, method=method) for _, method in columns]
    return "\n".join(
        [
            f"| {pretty(HEADLINE_SHAPE)}, ms / peak extra GiB | stock | ours (Triton) "
            "| liger-kernel | cut-cross-entropy |",
            "|---|---|---|---|---|",
            "| RL: per-token log-prob + entropy | " + " | ".join(rl) + " |",
            "| RL: clipped policy loss known in the forward | " + " | ".join(rl_loss) + " |",
            "| SFT: mean cross-entropy | " + " | ".join(cell(row) for row in sft) + " |",
            f"| SFT: most tokens that fit (run stopped at {cap}) | "
            + " | ".join(fit_cell(rows, "sft", method) for _, method in columns)
            + " |",
        ]
    )


def markdown(results):
    results = upgrade(results)
    rows = results["rows"]
    parts = []
    for temperature in results["meta"]["temperatures"]:
        parts += [f"### RL, temperature {temperature:g}", rl_table(rows, temperature)]
    if select(rows, section="forward"):
        parts += ["### Forward only (no gradients)", forward_table(rows)]
    parts += ["### SFT", sft_table(rows)]
    if select(rows, section="rl_loss"):
        parts += ["### RL loss (three-GEMM)", rl_loss_table(rows)]
    parts += [
        "### Scaling",
        scaling_table(rows),
        "### Response fractions",
        fractions_table(rows),
        "### README summary",
        summary_table(results),
    ]
    return "\n\n".join(parts)


# Plots.


def log_y_axis(axis, label):
    """Label the y axis and make it a log scale with plain-number ticks at 1, 2 and 5 times each
    power of 10; where the axis shows no positive value (a CPU dry run measures no memory), say so
    instead."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    values = [value for line in axis.lines for value in line.get_ydata()]
    values += [patch.get_height() for patch in axis.patches]
    if not any(value > 0 for value in values):
        axis.set_ylabel(label)
        axis.text(0.5, 0.5, "not measured on this device", transform=axis.transAxes, ha="center", va="center")
        return
    axis.set_yscale("log")
    axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.yaxis.set_minor_formatter(NullFormatter())
    axis.set_ylabel(label + " (log scale)")


def mark_out_of_memory(axis, points, where):
    """An ``x`` on the top edge of ``axis``, off the data, at each ``(x, method)`` of ``points`` in
    the method's colour, with one legend entry per method: ``where(xs)`` says at which x."""
    by_method = {}
    for x, method in points:
        by_method.setdefault(SAME_METHOD.get(method, method), []).append(x)
    edge = axis.get_xaxis_transform()  # x in data, y in axes fraction: 1 is the top edge
    for method, xs in by_method.items():
        axis.plot(
            xs,
            [1.0] * len(xs),
            "x",
            transform=edge,
            clip_on=False,
            color=style(method)[1],
            markersize=10,
            markeredgewidth=2.5,
            label=f"{SHORT_NAMES.get(method, method)}: out of memory{where(xs)}\n(marked on the top edge)",
        )


def provenance(meta):
    """The second title line of every figure: where and when the JSON was measured."""
    return f"{meta['device']}, {meta['dtype']}, measured {meta['date'][:10]}"


def save(pyplot, figure, path):
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def bar_panels(pyplot, results, section, methods, title, path, temperature=None):
    """Time and peak extra memory per shape, one bar per method that ran (the floor's buffers are
    allocated beforehand, so it has no memory bar)."""
    rows, meta = results["rows"], results["meta"]
    shapes = shapes_of(rows, section)

    def rows_of(method):
        fields = dict(section=section, method=method)
        if temperature is not None and not is_floor(method):
            fields["temperature"] = temperature
        return [find(rows, shape=shape, **fields) for shape in shapes]

    # A method that is not installed gets no bars, no slot and no legend entry.
    ran = {method: rows_of(method) for method in methods}
    ran = {method: found for method, found in ran.items() if any(row and row["status"] != "missing" for row in found)}
    figure, (time_axis, memory_axis) = pyplot.subplots(1, 2, figsize=(14, 5.2))
    for axis, shown, value in (
        (time_axis, list(ran), lambda row: row["ms"]),
        (memory_axis, [method for method in ran if not is_floor(method)], peak_gib),
    ):
        width = 0.8 / len(shown)
        out_of_memory = []
        for index, method in enumerate(shown):
            positions = [number + (index - (len(shown) - 1) / 2) * width for number in range(len(shapes))]
            placed = list(zip(positions, ran[method], strict=True))
            ok = [(x, value(row)) for x, row in placed if row and row["status"] == "ok"]
            label, colour, _ = style(method)
            axis.bar(
                [x for x, _ in ok],
                [height for _, height in ok],
                width,
                label=label,
                color=colour,
                hatch="//" if is_floor(method) else None,
                edgecolor="white" if is_floor(method) else None,
            )
            out_of_memory += [(x, method) for x, row in placed if row and row["status"] == "oom"]
        mark_out_of_memory(axis, out_of_memory, lambda xs: "")
        axis.set_xticks(range(len(shapes)), [pretty(shape) for shape in shapes], fontsize=8)
        pyplot.setp(axis.get_xticklabels(), rotation=20, ha="right", rotation_mode="anchor")
        axis.set_xlabel(SHAPE_AXIS_LABEL)
        axis.grid(axis="y", alpha=0.3, which="major")
        axis.legend(fontsize=8, loc="upper left")
    time_axis.set_ylabel(TIME_AXIS_LABEL)
    log_y_axis(memory_axis, MEMORY_AXIS_LABEL)
    figure.suptitle(f"{title}\n{provenance(meta)}")
    save(pyplot, figure, path)


def scaling_plot(pyplot, results, path):
    """Time and memory against tokens, one row of panels per use (SFT, RL); an ``x`` on the top
    edge where a method ran out of memory, and the device's memory as a dotted line."""
    rows, meta = select(results["rows"], section="scaling"), results["meta"]
    uses = [use for use in SCALING_SERIES if select(rows, use=use)]
    figure, axes = pyplot.subplots(len(uses), 2, figsize=(13, 4.6 * len(uses)), squeeze=False)
    tokens_measured = sorted({row["tokens"] for row in rows if "tokens" in row})
    device_gib = meta.get("device_memory_bytes", 0) / GIB
    for (time_axis, memory_axis), use in zip(axes, uses, strict=True):
        out_of_memory = []
        for method in SCALING_SERIES[use]:
            series = [row for row in select(rows, use=use, method=method) if "tokens" in row]
            measured = [row for row in series if row["status"] == "ok"]
            out_of_memory += [(row["tokens"], method) for row in series if row["status"] == "oom"]
            if not measured:
                continue  # not installed, or out of memory from the first size on: no line, no legend entry
            label, colour, marker = style(method)
            tokens = [row["tokens"] for row in measured]
            time_axis.plot(tokens, [row["ms"] for row in measured], "-", marker=marker, color=colour, label=label)
            memory_axis.plot(tokens, [peak_gib(row) for row in measured], "-", marker=marker, color=colour, label=label)
        if device_gib:
            memory_axis.axhline(device_gib, linestyle=":", color="0.4", label=f"device memory ({device_gib:.1f} GiB)")
        for axis, label in ((time_axis, TIME_AXIS_LABEL), (memory_axis, MEMORY_AXIS_LABEL)):
            axis.set_xscale("log", base=2)
            axis.set_xticks(tokens_measured, [str(tokens) for tokens in tokens_measured], fontsize=8)
            axis.minorticks_off()
            log_y_axis(axis, label)
            mark_out_of_memory(axis, out_of_memory, lambda xs: f" at {', '.join(map(str, xs))} tokens")
            axis.set_xlabel("tokens (log scale)")
            axis.set_title(USE_TITLES[use], fontsize=10, pad=12)  # room for the out-of-memory marks
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8, loc="center right" if axis is memory_axis else "upper left")
    hidden_size, vocab = meta["scaling_shape"]
    figure.suptitle(
        f"Tokens doubling at hidden {hidden_size}, vocabulary {vocab}; "
        f"the run stops at {meta['scaling_max_tokens']} tokens\n{provenance(meta)}"
    )
    save(pyplot, figure, path)


def fractions_plot(pyplot, results, path):
    """Time and memory against the fraction of rows selected with ``mask=``; colour and marker
    name the method, the line style the shape."""
    rows, meta = select(results["rows"], section="fractions"), results["meta"]
    figure, (time_axis, memory_axis) = pyplot.subplots(1, 2, figsize=(13, 5))
    fractions = sorted({row["fraction"] for row in rows})
    for shape, linestyle in zip(shapes_of(rows, "fractions"), ("-", "--", ":", "-."), strict=False):
        for method in ("stock", "triton"):
            measured = [row for row in select(rows, shape=shape, method=method) if row["status"] == "ok"]
            name, colour, marker = style(method)
            options = dict(linestyle=linestyle, marker=marker, color=colour, label=f"{name}, {pretty(shape)}")
            time_axis.plot([row["fraction"] for row in measured], [row["ms"] for row in measured], **options)
            memory_axis.plot([row["fraction"] for row in measured], [peak_gib(row) for row in measured], **options)
    for axis, legend_place in ((time_axis, "upper left"), (memory_axis, "center right")):
        axis.set_xticks(fractions, [f"{fraction:g}" for fraction in fractions])
        axis.set_xlabel("response fraction (rows selected with mask=)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8, loc=legend_place)
    time_axis.set_ylabel(TIME_AXIS_LABEL)
    time_axis.set_ylim(bottom=0)
    log_y_axis(memory_axis, MEMORY_AXIS_LABEL)
    figure.suptitle(f"Log-prob + entropy of the response rows only, temperature 1\n{provenance(meta)}")
    save(pyplot, figure, path)


def write_plots(results, folder):
    """Draw every section present in ``results`` into ``folder``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    os.makedirs(folder, exist_ok=True)
    results = upgrade(results)
    sections = {row["section"] for row in results["rows"]}
    written = []
    if "rl" in sections:
        temperature = results["meta"]["temperatures"][0]
        path = os.path.join(folder, "bench_rl.png")
        title = f"RL: per-token log-prob + entropy, temperature {temperature:g}"
        methods = ("stock", "liger_flsce", "liger_native", "triton", "floor")
        bar_panels(pyplot, results, "rl", methods, title, path, temperature)
        written.append(path)
    if "sft" in sections:
        path = os.path.join(folder, "bench_sft.png")
        title = "SFT: mean cross-entropy"
        methods = ("stock", "liger", "cce", "torch_lce", "quack", "liger_native", "recompute", "ours", "floor")
        bar_panels(pyplot, results, "sft", methods, title, path)
        written.append(path)
    if "rl_loss" in sections:
        path = os.path.join(folder, "bench_rl_loss.png")
        methods = ("stock", "liger_flsce", "liger_native", "recompute", "ours", "floor3")
        bar_panels(pyplot, results, "rl_loss", methods, RL_LOSS_TITLE, path)
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


def compare_table(after, before):
    """RL rows of two runs of the same command on one machine (``before`` from an earlier commit):
    per shape and method, time against the floor of the same run and peak memory, before -> after."""
    lines = [
        "| tokens x hidden x vocab | method | x floor, before -> after | peak extra GiB, before -> after "
        "| log-prob err, after |",
        "|---|---|---|---|---|",
    ]
    for shape in shapes_of(after["rows"], "rl"):
        for method in ("triton", "torch"):
            old, new = (find(run["rows"], section="rl", shape=shape, method=method) for run in (before, after))
            if not (old and new and old["status"] == new["status"] == "ok"):
                continue
            lines.append(
                f"| {pretty(shape)} | {method} | {old['vs_floor']:.3f} -> {new['vs_floor']:.3f} "
                f"| {peak_gib(old):.2f} -> {peak_gib(new):.2f} | {new['logprob_max_error']:.1e} |"
            )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--plots", default=None, help="folder to draw the PNGs into")
    parser.add_argument("--markdown", action="store_true", help="print the tables of docs/benchmarks/scaling.md")
    parser.add_argument("--compare", default=None, help="an earlier run's JSON: print the RL rows before -> after")
    args = parser.parse_args()
    with open(args.json) as handle:
        results = json.load(handle)
    if args.plots:
        for path in write_plots(results, args.plots):
            print("wrote", path)
    if args.compare:
        with open(args.compare) as handle:
            print(compare_table(results, json.load(handle)))
    if args.markdown:
        print(markdown(results))


if __name__ == "__main__":
    main()
