"""The plots of a real training comparison (``real_training.py --compare``'s JSON), per
tensor-parallel size: the stock seeds as a grey band (their range at each step) with a thin line
each, every other run a coloured line.

- ``training_sft<tp>.png``: the SFT loss (a moving average: one step's loss is one batch's), the
  held-out loss and the share of held-out tokens above probability 0.9;
- ``training_rl<tp>.png``: the RL reward, the response entropy and the KL to the SFT weights;
- ``training_distance<tp>.png``: how far each run is from the stock run of its seed, step by step,
  against every two stock seeds (the criterion compares the largest values of the raw curves);
- ``training_cost<tp>.png``: the median step time and the most memory a step allocated beyond what
  it started with, per run and phase.

    python benchmarks/report_training.py benchmarks/results/real_training_h100.json --out docs/real_training
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

COLOURS = {
    "three-gemm": "#d62728",
    "main-grad": "#ff7f0e",
    "recompute": "#1f77b4",
    "moved": "#2ca02c",
}
LABELS = {
    "three-gemm": "fused, three GEMMs",
    "main-grad": "fused, three GEMMs, weight gradient into main_grad",
    "recompute": "fused, recompute (four GEMMs)",
    "moved": "stock, initial weights moved by one bf16 rounding",
}
SMOOTHING = 25  # steps in the SFT loss's moving average


def kind(record: dict) -> str:
    run = record["run"]
    return "moved" if run["moved"] else run["loss_path"]


def series(record: dict, phase: str, name: str) -> list:
    data = record[phase]
    return data["curves"][name] if name in data["curves"] else data["eval"][name]


def steps(record: dict, phase: str, name: str) -> list:
    data = record[phase]
    return list(range(len(data["curves"][name]))) if name in data["curves"] else data["eval"]["step"]


def moving_average(values: list, window: int) -> list:
    averaged, total = [], 0.0
    for index, value in enumerate(values):
        total += value - (values[index - window] if index >= window else 0.0)
        averaged.append(total / min(index + 1, window))
    return averaged


def curves_figure(pyplot, runs: dict, stock: list, panels: list, title: str):
    """One panel per ``(phase, name, y label, smoothed)``."""
    figure, axes = pyplot.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for axis, (phase, name, label, smoothed) in zip(axes[0], panels, strict=True):
        shape = (lambda values: moving_average(values, SMOOTHING)) if smoothed else (lambda values: values)
        x = steps(runs[stock[0]], phase, name)
        seeds = [shape(series(runs[run], phase, name)) for run in stock]
        low = [min(values) for values in zip(*seeds, strict=True)]
        high = [max(values) for values in zip(*seeds, strict=True)]
        axis.fill_between(x, low, high, color="#bdbdbd", alpha=0.6, label=f"stock, {len(stock)} seeds (range)")
        for values in seeds:
            axis.plot(x, values, color="#7f7f7f", linewidth=0.6)
        for run, record in runs.items():
            if run in stock:
                continue
            axis.plot(
                x,
                shape(series(record, phase, name)),
                color=COLOURS[kind(record)],
                label=LABELS[kind(record)],
                linewidth=1.4,
            )
        axis.set_xlabel("step" if phase == "sft" else "update")
        axis.set_ylabel(label + (f" ({SMOOTHING}-step mean)" if smoothed else ""))
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def distance_figure(pyplot, runs: dict, stock: list, panels: list, title: str):
    """Per panel ``(phase, name, label, window)``: the |difference| at each step (a moving average
    over ``window`` steps) between each run and the stock run of its seed, and between every two
    stock seeds; the criterion takes the largest value of each raw curve."""
    figure, axes = pyplot.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    by_seed = {runs[run]["run"]["seed"]: run for run in stock}

    def distance(first: list, second: list, window: int) -> list:
        return moving_average([abs(a - b) for a, b in zip(first, second, strict=True)], window)

    for axis, (phase, name, label, window) in zip(axes[0], panels, strict=True):
        x = steps(runs[stock[0]], phase, name)
        for index, (a, b) in enumerate(itertools.combinations(stock, 2)):
            values = distance(series(runs[a], phase, name), series(runs[b], phase, name), window)
            axis.plot(x, values, color="#7f7f7f", linewidth=0.9, label="two stock seeds" if index == 0 else None)
        for run, record in runs.items():
            if run in stock or record["run"]["seed"] not in by_seed:
                continue
            same = series(runs[by_seed[record["run"]["seed"]]], phase, name)
            values = distance(series(record, phase, name), same, window)
            axis.plot(
                x, values, color=COLOURS[kind(record)], label=LABELS[kind(record)] + ", from its seed's stock run"
            )
        axis.set_xlabel("step" if phase == "sft" else "update")
        axis.set_ylabel(f"|difference|: {label}" + (f" ({window}-step mean)" if window > 1 else ""))
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def cost_figure(pyplot, runs: dict, title: str):
    figure, axes = pyplot.subplots(1, 2, figsize=(12, 4))
    names = list(runs)
    width = 0.38
    for offset, phase in ((-width / 2, "sft"), (width / 2, "rl")):
        positions = [index + offset for index in range(len(names))]
        times = [runs[run][phase]["median_step_ms"] for run in names]
        peaks = [(runs[run][phase]["step_extra_bytes"] or 0) / 2**30 for run in names]
        colours = [COLOURS.get(kind(runs[run]), "#7f7f7f") for run in names]
        hatch = None if phase == "sft" else "//"
        axes[0].bar(positions, times, width, color=colours, hatch=hatch, edgecolor="white", label=phase.upper())
        axes[1].bar(positions, peaks, width, color=colours, hatch=hatch, edgecolor="white", label=phase.upper())
    for axis, label in zip(
        axes, ("median step time, ms (RL: one update)", "a step's peak memory beyond its start, GiB"), strict=True
    ):
        axis.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        axis.set_ylabel(label)
        axis.grid(axis="y", alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def write_plots(comparison: dict, folder: str) -> list:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    os.makedirs(folder, exist_ok=True)
    paths = []
    for label, entry in comparison["comparison"].items():
        runs = {name: comparison["runs"][name] for name in entry["runs"]}
        stock = [name for name in runs if runs[name]["run"]["loss_path"] == "stock" and not runs[name]["run"]["moved"]]
        first = runs[stock[0]]
        shape, size = first["size"]["shape"], first["size"]
        where = (
            f"{first['environment'].get('device')}, TP={first['run']['tensor_parallel']}, {shape['layers']} layers x "
            f"hidden {shape['hidden']}, vocabulary {first['corpus']['model_vocab']}, "
            f"{size['micro_batches'] * shape['micro_batch']} x {shape['seq']} tokens per SFT step"
        )
        suffix = "" if label == "tp1" else f"_{label}"
        figures = {
            f"training_sft{suffix}.png": curves_figure(
                pyplot,
                runs,
                stock,
                [
                    ("sft", "loss", "SFT loss", True),
                    ("sft", "held_out_loss", "held-out loss", False),
                    ("sft", "p_over_0.9", "held-out tokens above p 0.9", False),
                ],
                f"SFT on site-packages' Python sources: {where}",
            ),  # fmt: skip
            f"training_rl{suffix}.png": curves_figure(
                pyplot,
                runs,
                stock,
                [
                    ("rl", "reward", "reward (share of the line reproduced)", False),
                    ("rl", "entropy", "entropy", False),
                    ("rl", "kl", "KL to the SFT weights (k3)", False),
                ],
                "GRPO-style RL from each run's SFT weights",
            ),  # fmt: skip
            f"training_distance{suffix}.png": distance_figure(
                pyplot,
                runs,
                stock,
                [
                    ("sft", "loss", "SFT loss", SMOOTHING),
                    ("sft", "held_out_loss", "held-out loss", 1),
                    ("rl", "entropy", "RL entropy", 4),
                ],
                "How far a run is from the stock run of its seed, against two stock seeds",
            ),
            f"training_cost{suffix}.png": cost_figure(pyplot, runs, f"Cost per step: {where}"),
        }
        for name, figure in figures.items():
            path = os.path.join(folder, name)
            figure.savefig(path, dpi=100)
            pyplot.close(figure)
            paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--out", default=None, help="folder for the PNGs (default: the JSON's)")
    args = parser.parse_args()
    with open(args.json) as handle:
        comparison = json.load(handle)
    for path in write_plots(comparison, args.out or os.path.dirname(os.path.abspath(args.json))):
        print("wrote", path)


if __name__ == "__main__":
    main()
