"""The CPU dry run of ``benchmarks/bench_tensor_parallel.py`` on four gloo ranks (TP=4) at a tiny
shape: every method's row at TP=1 and TP=4 on every rank, its log-probs against the float64
oracle, and the table's per-rank time against the ideal (``TP=1 ms / N``). The times mean nothing
here; the GPU run's are issue 52's table."""

from __future__ import annotations

import json
from pathlib import Path

from devkit.spawn import run_script_on_ranks

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_tensor_parallel.py"
RANKS = 4


def test_every_method_at_tp1_and_tp4(tmp_path):
    json_path = tmp_path / "tp_bench.json"
    arguments = ["--shapes", "64x32x512", "--warmup", "0", "--repeats", "1", "--sample", "16", "--json", str(json_path)]
    run_script_on_ranks(SCRIPT, RANKS, arguments, env={"CUDA_VISIBLE_DEVICES": ""})
    rows = json.loads(json_path.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    found = {(row["method"], row["tp"], row["rank"]) for row in rows}
    methods = {row["method"] for row in rows}
    assert {"stock", "triton", "loss"} <= methods
    for method in methods:
        tps = {tp for (name, tp, _) in found if name == method}
        assert RANKS in tps, (method, tps)
        assert {rank for (name, tp, rank) in found if name == method and tp == RANKS} == set(range(RANKS))
    for row in rows:
        # Against float64 on the same bf16 inputs: the fused ops round nothing but float32 sums;
        # stock rounds its logits to bf16 (2^-8 of the largest |logit| a token has, a few here).
        bound = 0.1 if row["method"] == "stock" else 1e-4
        assert row["logprob_max_error"] < bound, row


def test_the_table_reads_each_rank_against_the_ideal(capsys):
    # 10 ms alone, 3 ms at TP=4: 0.3 of the TP=1 time, 1.2 times the ideal 2.5 ms.
    import bench_tensor_parallel

    rows = [
        dict(shape="8x4x16", method="loss", rank=0, tp=tp, ms=ms, peak_extra_bytes=None)
        for tp, ms in ((1, 10.0), (4, 3.0))
    ]
    bench_tensor_parallel.print_table(rows)
    header, line = capsys.readouterr().out.splitlines()
    assert header.split()[8:10] == ["vs", "ideal"]
    assert line.split()[3:7] == ["10.00", "3.00", "0.300", "1.200"]
