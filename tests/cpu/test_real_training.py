"""The real-text training run (``benchmarks/real_training.py``) at its CPU size: a tokenizer trained
on standard-library files, a tiny GPTModel through Megatron's schedule and optimizer, SFT then
GRPO-style RL, stock, fused (three GEMMs), fused with the weight gradient into ``main_grad``,
recompute and the noise reference from one seed. The script itself checks that the fused runs
stay within NOISE_FACTOR x the reference run's distance from stock (plus NOISE_FLOOR) on every
curve, and fails otherwise; here the JSON is checked to say what it measured: the SFT loss fell
the same way in every run, RL ran from one set of weights, and nothing was recomputed or corrected
(the main_grad run's declared scales were the ones its losses received)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fused_runs_train_like_stock_on_real_text(tmp_path):
    path = tmp_path / "real_training.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "real_training.py"), "--size", "cpu", "--json", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert "real_training: PASS" in done.stdout
    record = json.loads(path.read_text())
    assert record["failures"] == []
    assert record["corpus"]["tokenizer_vocab"] == record["corpus"]["model_vocab"] == 512
    for run, sft in record["sft"].items():
        loss = sft["curves"]["loss"]
        assert loss[-1] < loss[0] - 0.5, (run, loss[0], loss[-1])
        assert len(sft["eval"]["held_out_loss"]) == len(sft["eval"]["step"]) >= 2
    first_rl_entropy = {run: rl["curves"]["entropy"][0] for run, rl in record["rl"].items() if run != "reference"}
    assert max(first_rl_entropy.values()) - min(first_rl_entropy.values()) < 1e-3, first_rl_entropy
    for run, rl in record["rl"].items():
        peaked = rl["curves"]["sampled_p_over_0.9"]
        assert len(peaked) == len(rl["curves"]["reward"]) and all(0.0 <= value <= 1.0 for value in peaked), run
    for name in ("loss", "held_out_loss"):
        assert set(record["comparison"]["sft"][name]) >= {
            "fused_max_difference",
            "main_grad_max_difference",
            "recompute_max_difference",
        }
