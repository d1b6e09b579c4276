"""What a trainer's own chunk size does to the fused head: the head's settings read from a trainer
section with SkyRL's defaults (``trainer.logprobs_chunk_size: 1024``, the fused head on, the Triton
backend), as the SkyRL recipe reads them, against the ops' own choice and against that 1024 handed
to the head as its ``token_chunk`` (what the recipes did before the key was the head's own).

For each shape and each path the SkyRL recipe runs (``head.logprobs`` with entropy, the recompute
op; ``head.loss`` with the SFT cross-entropy and with the clipped policy loss, with and without an
entropy bonus: the three-GEMM pass), forward + backward with ``token_chunk`` as each setting gives
it, every setting in the same process on the same inputs, ``--runs`` times over. The ops' own
choice is timed under two names ("default" and "recipe", which reads it from the SkyRL section), so
the table shows the noise beside the difference.

    PYTHONPATH=. python benchmarks/bench_chunk_hints.py --json chunk_hints.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from harness import GIB, make_inputs, parse_shapes, shape_name, try_measure
from methods import FUSED_BACKEND, policy_loss, policy_loss_inputs, rl_loss_step, sft_step

from megatron_fused_lm import FusedLMConfig
from megatron_fused_lm.recipes import skyrl


@dataclass
class SkyRLTrainerDefaults:
    """The field of SkyRL 0.3.0's ``TrainerConfig`` that collided with the head's old key, at SkyRL's
    default (``skyrl/train/config/config.py``)."""

    logprobs_chunk_size: Optional[int] = 1024


@dataclass
class SkyRLSection(SkyRLTrainerDefaults, skyrl.FusedLMSettings):
    """A SkyRL trainer section with the recipe's settings mixed in, as a SkyRL user declares it."""


def recipe_token_chunk() -> Optional[int]:
    """The ``token_chunk`` the SkyRL recipe hands the head for a section with SkyRL's defaults."""
    section = SkyRLSection(fused_linear_logprob=True, fused_linear_logprob_backend=FUSED_BACKEND)
    config = FusedLMConfig.from_trainer_config(section)
    assert config.enabled and config.backend == FUSED_BACKEND
    return config.token_chunk


def steps(path, inputs, token_chunk, loss_inputs):
    """The forward + backward of ``path`` with ``token_chunk``."""
    if path == "recompute (head.logprobs)":
        return lambda: chunked_rl_step(inputs, token_chunk)
    if path == "SFT (head.loss)":
        return sft_step("ours", {}, inputs, token_chunk)
    entropy_coef = 0.01 if path == "RL loss, entropy 0.01 (head.loss)" else 0.0
    return rl_loss_step("ours", inputs, policy_loss(entropy_coef=entropy_coef), loss_inputs, token_chunk)


def chunked_rl_step(inputs, token_chunk):
    from megatron_fused_lm import fused_linear_logprob

    logprob, entropy = fused_linear_logprob(
        inputs.hidden, inputs.weight, inputs.targets, return_entropy=True, backend=FUSED_BACKEND,
        token_chunk=token_chunk,
    )  # fmt: skip
    torch.autograd.backward([logprob, entropy], [inputs.grad_logprob, inputs.grad_entropy])


PATHS = (
    "recompute (head.logprobs)",
    "SFT (head.loss)",
    "RL loss, entropy 0.01 (head.loss)",
    "RL loss, no entropy (head.loss)",
)


def measure_shape(shape, settings, device, args):
    """Every path with every setting, ``args.runs`` times interleaved, on one shape's inputs."""
    inputs = make_inputs(*shape, torch.bfloat16, device)
    loss_inputs = policy_loss_inputs(inputs)
    rows = []
    for run in range(args.runs):
        for path in PATHS:
            for setting, token_chunk in settings.items():
                measured, failure = try_measure(
                    lambda: steps(path, inputs, token_chunk, loss_inputs), inputs, args.warmup, args.repeats
                )
                row = dict(shape=shape_name(shape), path=path, setting=setting, token_chunk=token_chunk, run=run)
                if failure is None:
                    peak = measured.peak_extra_bytes
                    row.update(ms=measured.ms, peak_extra_gib=None if peak is None else peak / GIB)
                else:
                    row["failure"] = failure
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default="8192x4096x151936,4096x2048x151936,32768x4096x151936")
    parser.add_argument("--runs", type=int, default=2, help="passes over every setting, interleaved")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="chunk_hints.json")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the logic on tiny shapes")
    args = parser.parse_args()
    device = torch.device(args.device)
    settings = {"default": None, "recipe": recipe_token_chunk(), "1024 (SkyRL's, as before)": 1024}
    rows = [row for shape in args.shapes for row in measure_shape(shape, settings, device, args)]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)"
    versions = dict(torch=torch.__version__, triton=__import__("triton").__version__)
    Path(args.json).write_text(json.dumps(dict(device=name, versions=versions, rows=rows), indent=1))
    print_table(rows)


def print_table(rows):
    """Per shape and path: the median of each setting's runs, and its ratio to the default's."""
    print(
        "| shape | path | default ms | recipe ms (SkyRL defaults) | 1024 ms (as before) | recipe / default | 1024 / default |"
    )
    print("|---|---|---|---|---|---|---|")
    keys = dict.fromkeys((row["shape"], row["path"]) for row in rows)
    for shape, path in keys:
        medians = {}
        for setting in ("default", "recipe", "1024 (SkyRL's, as before)"):
            times = [row["ms"] for row in rows if (row["shape"], row["path"], row["setting"]) == (shape, path, setting)
                     and "ms" in row]  # fmt: skip
            medians[setting] = statistics.median(times) if times else float("nan")
        base = medians["default"]
        recipe, before = medians["recipe"], medians["1024 (SkyRL's, as before)"]
        print(
            f"| {shape} | {path} | {base:.1f} | {recipe:.1f} | {before:.1f} | {recipe / base:.3f} | {before / base:.3f} |"
        )


if __name__ == "__main__":
    main()
