"""The examples run end to end (the README's first command runs the quickstart)."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_quickstart_fused_matches_the_oracle_and_trains_like_stock():
    output = run_example("quickstart.py")
    stock_error, fused_error = map(float, re.search(r"log-prob max error vs float64\s+(\S+)\s+(\S+)", output).groups())
    assert fused_error <= max(stock_error, 1e-5), output
    assert "never built" in output
    curve = [
        tuple(map(float, line.split()[1:3]))
        for line in output.splitlines()
        if re.match(r"\s+\d+\s+\d+\.\d+\s+\d+\.\d+", line)
    ]
    assert len(curve) >= 5 and curve[-1][0] < 0.5 * curve[0][0], output  # the loss falls...
    assert all(abs(stock - fused) <= 1e-3 * stock for stock, fused in curve), output  # ...together


def test_grpo_example_computes_only_response_rows():
    output = run_example("grpo_policy_loss.py")
    assert "fused head: True" in output
    computed, total = map(int, re.search(r"rows computed: (\d+) of (\d+)", output).groups())
    assert 0 < computed < total / 2
    first_step = next(line for line in output.splitlines() if line.strip().startswith("0 "))
    assert float(first_step.split()[-1]) == 0.0  # old and new policy agree before the first update


def test_loss_in_forward_example_trains_like_stock_without_a_correction():
    output = run_example("loss_in_forward.py")
    difference, largest = map(
        float, re.search(r"largest gradient difference (\S+) \(largest entry (\S+)\)", output).groups()
    )
    assert difference <= 1e-5 * largest, output  # float32 on both sides: summation order only
    curves = [
        tuple(map(float, line.split()[1:3]))
        for line in output.splitlines()
        if re.match(r"\s+\d+\s+-?\d+\.\d+\s+-?\d+\.\d+$", line)
    ]
    assert len(curves) == 9, output  # six SFT steps, three GRPO steps
    assert all(abs(stock - fused) <= 1e-4 * max(1.0, abs(stock)) for stock, fused in curves), output
    assert curves[5][0] < 0.8 * curves[0][0], output  # SFT learns
    assert "corrected a weight gradient: 0" in output  # the declaration matched Megatron's loss


def test_the_readme_first_use_runs_and_its_log_probs_match_the_stock_logits():
    """The README's Python block, as a newcomer pastes it, then a check of what it computed: the
    log-probs against float64 ones from the same model's stock logits."""
    readme = (EXAMPLES.parent / "README.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    check = """
    with head.stock_logits():
        logits = model(tokens, positions, mask)
    expected = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None]).squeeze(-1)
    assert (logprob.double() - expected).abs().max() < 1e-5, (logprob.double() - expected).abs().max()
    assert sft_loss.shape == (2, 128) and model.output_layer.weight.grad is not None
    print("readme first use: ok")
"""
    done = subprocess.run([sys.executable, "-c", block + check], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "readme first use: ok" in done.stdout, done.stderr[-3000:]
