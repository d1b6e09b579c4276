"""The paired replay of ``real_training.py --replay-every N``: from states of a run (its weights and
optimizer before an SFT step, or after an RL rollout), ``REPLAY_UPDATES`` updates by each path on
the same micro-batches, learning rates and optimizer state, and what each path's updates change.

1. At a state, the run's weights and optimizer state are copied (``snapshot``).
2. For each path of ``PATHS`` in turn (each its own model, optimizer and head, built once), the copy
   is loaded into it (``restore``) and it takes the updates: SFT, the run's next ``REPLAY_UPDATES``
   steps' batches at their learning rates; RL, the rollout's micro-batches as many times as the
   run takes them, with the old and reference log-probs a run of the path's kind computes (stock's
   from bf16 logits, the others' exact), so that each path's first ratio is 1 as in its own run.
3. After each update, ``METRICS`` are measured alike for every path (exact log-probs, float32
   accumulation, of the output layer's input and weight): the held-out loss on the first
   ``REPLAY_HELD_OUT`` held-out sequences, the mean log-prob and the mean entropy of the first
   update's trained tokens (the loss mask).
4. ``paired_differences``: per path and update, the difference of its metric from the ``exact``
   path's at each state, the same as the difference of the changes the two made, and the mean's
   95 % t-interval over the states (``report_audit.py`` tabulates them).

``exact`` is the stock model with a float64 head (``gradient_audit.exact_head_loss``), its
gradients rounded once to bf16: what a path can at best give the rest of the model. Its own
difference from float64 is bf16's, which every path shares.
"""

from __future__ import annotations

import copy
import math
import statistics
from typing import Callable, Dict, List, Sequence

import torch

from devkit.megatron_training import set_learning_rate

PATHS = {"exact": "exact", "stock": "stock", "three_gemm": "three-gemm", "main_grad": "main-grad",
         "recompute": "recompute"}  # fmt: skip
REPLAY_UPDATES = 2  # from an SFT state (an RL state: the run's updates per rollout)
REPLAY_HELD_OUT = 16  # sequences
METRICS = ("held_out_loss", "logprob", "entropy")


def snapshot(training) -> dict:
    """A copy of ``training``'s weights and optimizer state (float32 weights, Adam's moments)."""
    return copy.deepcopy({"model": training.gpt.state_dict(), "optimizer": training.optimizer.state_dict()})


def restore(training, state: dict) -> None:
    """``state`` (``snapshot``'s) loaded into ``training``, which leaves it as it was: the optimizer
    would keep the state's moments as its own (torch's ``load_state_dict`` keeps tensors already of
    the right device and dtype) and update them in place."""
    training.gpt.load_state_dict(state["model"])
    training.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))


@torch.no_grad()
def measure_state(training, trained: Sequence[Dict], held_out: Sequence[Dict]) -> Dict[str, float]:
    """``METRICS`` at ``training``'s weights: the held-out loss of ``held_out`` and the mean log-prob
    and entropy over ``trained``'s loss masks."""
    logprobs, entropies = [], []
    for batch in trained:
        logprob, entropy = training.exact_logprobs(batch, return_entropy=True)
        chosen = batch["loss_mask"].bool()
        logprobs.append(logprob[chosen].double())
        entropies.append(entropy[chosen].double())
    held = torch.cat([training.exact_logprobs(batch).flatten().double() for batch in held_out])
    return {"held_out_loss": -held.mean().item(), "logprob": torch.cat(logprobs).mean().item(),
            "entropy": torch.cat(entropies).mean().item()}  # fmt: skip


def replay_point(
    trajectory,
    paths: Dict[str, object],
    forward_step: Callable,
    updates: Callable[[str], List[tuple]],
    held_out: Sequence[Dict],
) -> dict:
    """One state's replay: ``{"before": metrics, "paths": {path: [{"loss": the update's reported
    loss, **metrics after it}, ...]}}``. ``trajectory``: the run's ``Training`` at the state;
    ``paths``: a ``Training`` per path; ``forward_step(training)``: the phase's forward step of a
    training; ``updates(path)``: ``(micro-batches, learning rate)`` per update of that path (the
    same batches for every path, each with its own kind's RL inputs), the first update's
    micro-batches the trained tokens measured."""
    state = snapshot(trajectory)
    trained = updates("exact")[0][0]
    record = {"before": measure_state(trajectory, trained, held_out), "paths": {}}
    for name, training in paths.items():
        restore(training, state)
        record["paths"][name] = []
        for batches, learning_rate in updates(name):
            set_learning_rate(training.optimizer, learning_rate)
            values = training.step(forward_step(training), batches)
            record["paths"][name].append(dict(loss=values["loss"], **measure_state(training, trained, held_out)))
    return record


def t_quantile(degrees: int) -> float:
    """The two-sided 95 % quantile of Student's t (the Cornish-Fisher series in 1 / degrees to the
    third term: within 1e-3 of the table from 8 degrees on, 0.1 % low at 5)."""
    z = 1.959964
    terms = ((z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96, (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384)
    return z + sum(term / degrees ** (index + 1) for index, term in enumerate(terms))


def paired_differences(points: List[dict], path: str, update: int, metric: str, against: str = "exact") -> dict:
    """Over the replay ``points``: ``path``'s metric after update ``update`` (0-based) minus
    ``against``'s at each state, summarized by ``summarize``."""
    return summarize([p["paths"][path][update][metric] - p["paths"][against][update][metric] for p in points])


def median_change(points: List[dict], path: str, update: int, metric: str) -> float:
    """The median over ``points`` of the absolute change in ``metric`` that ``path``'s updates up to
    ``update`` made (a median: the first state's change, from the initial weights, is tens of times
    the others')."""
    return statistics.median(abs(p["paths"][path][update][metric] - p["before"][metric]) for p in points)


def summarize(differences: List[float]) -> dict:
    """``{"mean", "low", "high", "rms", "count"}``: the mean with its 95 % t-interval (the states
    taken as independent) and the root mean square."""
    mean = statistics.mean(differences)
    half = t_quantile(len(differences) - 1) * statistics.stdev(differences) / math.sqrt(len(differences))
    rms = math.sqrt(statistics.mean(value**2 for value in differences))
    return {"mean": mean, "low": mean - half, "high": mean + half, "rms": rms, "count": len(differences)}
