"""The CPU dry run of ``tests/gpu/pipeline_training.py``: each two-rank layout, and the eight-rank
``tp2_pp2_dp2``, with both loss paths, on gloo ranks (torchrun) at the script's tiny CPU size, 8
SFT and 6 RL steps (4 and 4 on eight ranks, about half a minute each on two cores).

What the dry run covers, with the script's own checks (tied copies and DP replicas bitwise equal,
the head's gradient on the right parameters, no recomputed logits on the three-GEMM path, fused
and stock curves within the noise of the perturbed reference run):

- ``pp2_tied``: Megatron's 1F1B schedule over two stages, the tied embedding's copies and the
  embedding-group reduction of their gradients, the mixed-precision optimizer (fp32 main weights);
- ``pp2_vpp2_tied``: the interleaved schedule over two chunks per stage, built with ``vp_stage``,
  the embedding in the first stage's first chunk and the output layer in the last stage's last;
- ``dp2_overlap``: DDP with the gradient reduction overlapped bucket by bucket, the distributed
  optimizer with the parameter all-gather overlapped (asynchronous gloo all-gathers that
  Megatron's forward pre-hooks wait for, the untied output weight in a bucket of its own), four
  micro-batches of gradient accumulation;
- ``tp2_pp2_dp2``: TP=2 x PP=2 x DP=2 at once, with sequence parallelism, tied embeddings and
  both overlaps;
- both loss paths: ``head.logprobs`` with the policy loss by hand, and the three-GEMM path
  (``declare_loss_weights`` before the labels-path forward, ``head.loss`` with
  ``ClippedPolicyLoss``); on the two-rank layouts also the main-grad path (the same with the
  schedule's scale declared: the head's weight gradient added into ``main_grad`` in the forward,
  before the bucket reduction and the embedding group's sum of the tied copies).

Only the GPU run covers: NCCL, and the overlapped collectives running concurrently with CUDA
compute; the Triton backend (the CPU runs the torch backend); Megatron's gradient clipping (it
asserts CUDA gradients); the real sizes (hidden 1024, vocabulary 151936, sequence 2048, 30 + 30
steps), where bf16 noise, step time and peak memory mean something. The four-rank ``tp2_pp2``
layout is the eight-rank one without data parallelism; its dry run runs by hand
(``torchrun --nproc-per-node 4 tests/gpu/pipeline_training.py --sft-steps 6 --rl-steps 6``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "gpu" / "pipeline_training.py"
# Ranks, SFT and RL steps, and the expected parallel sizes of each layout.
LAYOUTS = {
    "pp2_tied": (2, 8, 6, {"pp": 2, "vpp": 1, "dp": 1, "tied": True}),
    "pp2_vpp2_tied": (2, 8, 6, {"pp": 2, "vpp": 2, "dp": 1, "tied": True}),
    "dp2_overlap": (2, 8, 6, {"pp": 1, "vpp": 1, "dp": 2, "overlap_param_gather": True, "tied": False}),
    "tp2_pp2_dp2": (8, 4, 4, {"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True, "overlap_param_gather": True}),
}


# Every layout on both loss paths; the main-grad path (the three-GEMM one with the schedule's scale
# declared, the head's weight gradient added into main_grad in the forward) on the two-rank ones.
CASES = [(layout, path) for layout in sorted(LAYOUTS) for path in ("logprobs", "three-gemm")] + [
    (layout, "main-grad") for layout in sorted(LAYOUTS) if LAYOUTS[layout][0] == 2
]


@pytest.mark.parametrize(("layout", "loss_path"), CASES)
def test_layout_trains_fused_like_stock(layout, loss_path, tmp_path):
    json_path = tmp_path / "pipeline_training.json"
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",  # the dry run, even on a machine with GPUs
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    ranks, sft_steps, rl_steps, expected = LAYOUTS[layout]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(SCRIPT),
        "--layout", layout, "--loss-path", loss_path, "--sft-steps", str(sft_steps), "--rl-steps", str(rl_steps),
        "--json", str(json_path),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "pipeline_training: PASS" in output, output[-6000:]
    record = json.loads(json_path.read_text())
    assert {key: record["layout"][key] for key in expected} == expected
    assert record["layout"]["loss_path"] == loss_path
    fused = [run for rank in record["ranks"] for run in rank["runs"] if run["name"] == "fused"]
    assert any(run["head_fused"] for run in fused), "no rank ran the fused head"
