"""The multi-GPU scripts of this folder under pytest: each starts torchrun with one process per GPU
on the first GPUs it needs, and is skipped where fewer are visible.

    python -m pytest tests/gpu/test_multi_gpu.py -v

What each script checks, and its tolerances, is in its docstring; ``run_multi_gpu.sh`` runs the
same scripts (and the tensor-parallel benchmark) outside pytest, keeping their JSON and logs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from devkit.distributed import MULTICAST_OFF

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

pytestmark = pytest.mark.gpu


def needs_gpus(count: int):
    return pytest.mark.skipif(torch.cuda.device_count() < count, reason=f"needs {count} CUDA GPUs")


def run_torchrun(script: str, processes: int, json_path, *arguments: str) -> dict:
    """Run ``script`` (with ``arguments``) under torchrun on the first ``processes`` GPUs; fail with
    its output's tail if any rank fails; return the JSON it wrote."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count()))))
    env = dict(
        os.environ,
        **MULTICAST_OFF,
        CUDA_VISIBLE_DEVICES=",".join(visible.split(",")[:processes]),
        PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        os.path.join(HERE, script),
        *arguments,
        "--json",
        str(json_path),
    ]
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, f"{script} failed:\n{(result.stdout + result.stderr)[-6000:]}"
    with open(json_path) as handle:
        return json.load(handle)


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=needs_gpus(4))])
@needs_gpus(2)
def test_tensor_parallel_sequence_parallel_parity(ranks, tmp_path):
    record = run_torchrun("tp_parity.py", ranks, tmp_path / "tp_parity.json")
    assert record["tensor_parallel"] == ranks
    assert {mode["tied"] for mode in record["ranks"][0]["modes"]} == {False, True}
    for mode in record["ranks"][0]["modes"]:
        assert set(mode["float64"]) == {"triton", "torch"}


@needs_gpus(4)
def test_tp2_dp2_trains_fused_like_stock(tmp_path):
    arguments = ("--layout", "tp2_dp2", "--loss-path", "three-gemm", "main-grad")
    record = run_torchrun("pipeline_training.py", 4, tmp_path / "pipeline_training.json", *arguments)
    assert record["layout"]["name"] == "tp2_dp2" and list(record["loss_paths"]) == ["three-gemm", "main-grad"]


@needs_gpus(4)
def test_pipeline_training_curves_and_tied_copies(tmp_path):
    record = run_torchrun("pipeline_training.py", 4, tmp_path / "pipeline_training.json", "--layout", "tp2_pp2")
    summary = record["loss_paths"]["logprobs"]["summary"]
    assert len(summary["sft_loss"]["stock"]) == len(summary["sft_loss"]["fused"]) > 0


@needs_gpus(2)
@pytest.mark.parametrize("loss_path", ["logprobs", "three-gemm"])
@pytest.mark.parametrize("layout", ["pp2_tied", "pp2_vpp2_tied", "dp2_overlap"])
def test_two_gpu_layouts_train_fused_like_stock(layout, loss_path, tmp_path):
    arguments = ("--layout", layout, "--loss-path", loss_path)
    record = run_torchrun("pipeline_training.py", 2, tmp_path / "pipeline_training.json", *arguments)
    assert (record["layout"]["name"], record["layout"]["loss_paths"]) == (layout, [loss_path])


@needs_gpus(8)
@pytest.mark.parametrize("loss_path", ["logprobs", "three-gemm"])
def test_three_dimensional_layout_trains_fused_like_stock(loss_path, tmp_path):
    arguments = ("--layout", "tp2_pp2_dp2", "--loss-path", loss_path)
    record = run_torchrun("pipeline_training.py", 8, tmp_path / "pipeline_training.json", *arguments)
    assert (record["layout"]["dp"], record["layout"]["loss_paths"]) == (2, [loss_path])
