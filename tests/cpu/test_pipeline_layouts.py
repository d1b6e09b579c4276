"""The CPU dry run of ``tests/gpu/pipeline_training.py``: each two-rank layout, the four-rank
``tp2_pp2`` and ``tp2_dp2`` and the eight-rank ``tp2_pp2_dp2``, on gloo ranks at the script's tiny
CPU size, 5 SFT and 4 RL steps (4 and 4 on four and eight ranks; the script's medians skip 3
warm-up steps). The ranks run the script as torchrun
would start it, forked from a server that imported torch and Megatron once
(``devkit.spawn.run_script_on_ranks``), and one launch per layout runs each of its loss paths in
turn: about 20 s a two-rank layout alone on two cores (60 s on eight ranks).

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
- ``tp2_pp2`` and ``tp2_dp2``: the four-GPU layouts, tensor parallelism with sequence parallelism
  under a pipeline (1F1B, tied embeddings, the distributed optimizer) and under data parallelism
  (untied, both overlaps), on the three-GEMM and main-grad paths;
- ``tp2_pp2_dp2``: TP=2 x PP=2 x DP=2 at once, with sequence parallelism, tied embeddings and
  both overlaps;
- the loss paths: ``head.logprobs`` with the policy loss by hand, the three-GEMM path
  (``declare_loss_weights`` before the labels-path forward, ``head.loss`` with
  ``ClippedPolicyLoss``), and the main-grad path (the same with the schedule's scale declared: the
  head's weight gradient added into ``main_grad`` in the forward, before the bucket reduction and
  the embedding group's sum of the tied copies), each on every two-rank layout; on eight ranks the
  three-GEMM path, whose pieces the two-rank layouts cover one by one with every path.

Only the GPU run covers: NCCL, and the overlapped collectives running concurrently with CUDA
compute; the Triton backend (the CPU runs the torch backend); Megatron's gradient clipping (it
asserts CUDA gradients); the real sizes (hidden 1024, vocabulary 151936, sequence 2048, 30 + 30
steps), where bf16 noise, step time and peak memory mean something.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devkit.spawn import run_script_on_ranks

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "gpu" / "pipeline_training.py"
# Ranks, SFT and RL steps, the loss paths (one launch runs them all), and the expected parallel
# sizes of each layout: every path on the two-rank layouts, the three-GEMM path on eight ranks.
EVERY_PATH = ("logprobs", "three-gemm", "main-grad")
LAYOUTS = {
    "pp2_tied": (2, 5, 4, EVERY_PATH, {"pp": 2, "vpp": 1, "dp": 1, "tied": True}),
    "pp2_vpp2_tied": (2, 5, 4, EVERY_PATH, {"pp": 2, "vpp": 2, "dp": 1, "tied": True}),
    "dp2_overlap": (2, 5, 4, EVERY_PATH, {"pp": 1, "vpp": 1, "dp": 2, "overlap_param_gather": True, "tied": False}),
    "tp2_pp2": (4, 4, 4, ("three-gemm", "main-grad"), {"tp": 2, "pp": 2, "dp": 1, "sequence_parallel": True}),
    "tp2_dp2": (
        4, 4, 4, ("three-gemm", "main-grad"), {"tp": 2, "pp": 1, "dp": 2, "sequence_parallel": True, "tied": False}
    ),
    "tp2_pp2_dp2": (
        8, 4, 4, ("three-gemm",), {"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True, "overlap_param_gather": True}
    ),
}  # fmt: skip


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_trains_fused_like_stock(layout, tmp_path):
    json_path = tmp_path / "pipeline_training.json"
    ranks, sft_steps, rl_steps, loss_paths, expected = LAYOUTS[layout]
    arguments = [
        "--layout", layout, "--loss-path", *loss_paths, "--sft-steps", str(sft_steps), "--rl-steps", str(rl_steps),
        "--json", str(json_path),
    ]  # fmt: skip
    # Its checks fail on rank 0 with an AssertionError naming them, which fails this call.
    run_script_on_ranks(SCRIPT, ranks, arguments, env={"CUDA_VISIBLE_DEVICES": ""})  # the dry run, GPUs or not
    record = json.loads(json_path.read_text())
    assert {key: record["layout"][key] for key in expected} == expected
    assert record["layout"]["loss_paths"] == list(loss_paths) == list(record["loss_paths"])
    for path, checked in record["loss_paths"].items():
        assert len(checked["ranks"]) == ranks, path
        fused = [run for rank in checked["ranks"] for run in rank["runs"] if run["name"] == "fused"]
        assert any(run["head_fused"] for run in fused), f"{path}: no rank ran the fused head"
