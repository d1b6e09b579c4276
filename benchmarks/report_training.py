"""The plots of a real training run (``real_training.py``'s JSON), one colour per method:

- ``training_sft.png``: the SFT loss per step and the held-out loss, every run overlaid;
- ``training_rl.png``: the RL reward and the response entropy per update, every run overlaid;
- ``training_cost.png``: the median step time and the most memory a training step allocated beyond
  what it started with (activations and the head's buffers), per run and phase.

    python benchmarks/report_training.py docs/real_training/real_training_h100.json [--out docs/real_training]
"""

from __future__ import annotations

import argparse
import json
import os

COLOURS = {
    "stock": "#4d4d4d",
    "fused": "#d62728",
    "main_grad": "#ff7f0e",
    "recompute": "#1f77b4",
    "reference": "#bdbdbd",
}
LABELS = {
    "stock": "stock (bf16 logits)",
    "fused": "fused, three GEMMs",
    "main_grad": "fused, three GEMMs, weight gradient into main_grad",
    "recompute": "fused, recompute (four GEMMs)",
    "reference": "stock, weights moved by one rounding (noise)",
}


def curves_figure(pyplot, record: dict, panels: list, title: str):
    """One panel per ``(phase, source, name, y label)``; ``source`` is ``curves`` or ``eval``."""
    figure, axes = pyplot.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for axis, (phase, source, name, label) in zip(axes[0], panels, strict=True):
        for run, data in record[phase].items():
            values = data[source][name]
            steps = data[source]["step"] if source == "eval" else range(len(values))
            axis.plot(steps, values, color=COLOURS[run], label=LABELS[run], linewidth=1.2 if run != "fused" else 1.8)
        axis.set_xlabel("step" if phase == "sft" else "update")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def cost_figure(pyplot, record: dict, title: str):
    figure, axes = pyplot.subplots(1, 2, figsize=(12, 4))
    runs = list(record["sft"])
    width = 0.38
    for offset, phase in ((-width / 2, "sft"), (width / 2, "rl")):
        positions = [index + offset for index in range(len(runs))]
        times = [record[phase][run]["median_step_ms"] for run in runs]
        peaks = [(record[phase][run]["step_extra_bytes"] or 0) / 2**30 for run in runs]
        colours = [COLOURS[run] for run in runs]
        hatch = None if phase == "sft" else "//"
        axes[0].bar(positions, times, width, color=colours, hatch=hatch, edgecolor="white", label=phase.upper())
        axes[1].bar(positions, peaks, width, color=colours, hatch=hatch, edgecolor="white", label=phase.upper())
    for axis, label in zip(
        axes, ("median step time, ms (RL: one update)", "a step's peak memory beyond its start, GiB"), strict=True
    ):
        axis.set_xticks(range(len(runs)), runs)
        axis.set_ylabel(label)
        axis.grid(axis="y", alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def write_plots(record: dict, folder: str) -> list:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    os.makedirs(folder, exist_ok=True)
    environment = record["environment"]
    shape = record["size"]["shape"]
    where = (
        f"{environment.get('device')}, {shape['layers']} layers x hidden {shape['hidden']}, "
        f"vocabulary {record['corpus']['model_vocab']}, {record['size']['micro_batches'] * shape['micro_batch']} x "
        f"{shape['seq']} tokens per SFT step"
    )
    figures = {
        "training_sft.png": curves_figure(
            pyplot,
            record,
            [("sft", "curves", "loss", "SFT loss"), ("sft", "eval", "held_out_loss", "held-out loss")],
            f"SFT on the standard library's sources: {where}",
        ),
        "training_rl.png": curves_figure(
            pyplot,
            record,
            [
                ("rl", "curves", "reward", "reward (share of the line reproduced)"),
                ("rl", "curves", "entropy", "entropy"),
            ],
            "GRPO-style RL from the SFT weights",
        ),
        "training_cost.png": cost_figure(pyplot, record, f"Cost per step: {where}"),
    }
    paths = []
    for name, figure in figures.items():
        path = os.path.join(folder, name)
        figure.savefig(path, dpi=110)
        pyplot.close(figure)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--out", default=None, help="folder for the PNGs (default: the JSON's)")
    args = parser.parse_args()
    with open(args.json) as handle:
        record = json.load(handle)
    for path in write_plots(record, args.out or os.path.dirname(os.path.abspath(args.json))):
        print("wrote", path)


if __name__ == "__main__":
    main()
