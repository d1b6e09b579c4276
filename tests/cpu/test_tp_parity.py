"""The CPU dry run of ``tests/gpu/tp_parity.py`` on two and four gloo ranks (TP=2 and TP=4, with
sequence parallelism): its checks of every path against stock and float64, on the script's tiny CPU
size, the ranks forked from a server that imported torch and Megatron once. The GPU run covers the
Triton kernels and the real sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devkit.spawn import run_script_on_ranks

SCRIPT = Path(__file__).resolve().parents[2] / "tests" / "gpu" / "tp_parity.py"
PATHS = ("recompute_logprobs", "recompute_labels", "recompute_policy", "three_gemm_labels", "three_gemm_policy",
         "main_grad_labels", "main_grad_policy")  # fmt: skip


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_path_against_stock_and_float64(ranks, tmp_path):
    json_path = tmp_path / "tp_parity.json"
    # Its checks fail on rank 0 with an AssertionError naming them, which fails this call.
    run_script_on_ranks(SCRIPT, ranks, ["--json", str(json_path)], env={"CUDA_VISIBLE_DEVICES": ""})
    record = json.loads(json_path.read_text())
    assert record["tensor_parallel"] == ranks and len(record["ranks"]) == ranks
    for mode in record["ranks"][0]["modes"]:
        checked = mode["float64"]["torch"]
        assert set(checked) == {*PATHS, "stock_largest_error"}, mode["tied"]
        # The float64 reference sees the bf16 paths' errors: stock's are those of bf16 layers and
        # logits, far above float64 rounding and below an unrelated gradient's 1 (up to 0.7 for
        # the policy loss, whose clipped, advantage-weighted gradient is small against its terms).
        for name, error in checked["stock_largest_error"].items():
            assert 1e-4 < error < 1.0, (mode["tied"], name, error)
        for name in PATHS:
            assert checked[name]["largest_ratio_to_stock"] <= 1.5, (mode["tied"], name, checked[name])
