"""The gradient audit of ``benchmarks/real_training.py --audit`` (``benchmarks/gradient_audit.py``):
its chunked float64 reference against devkit's float64 oracle, its metrics on errors of known
direction and size, and every path's gradient as the audit gathers it (shards, the stock path's
hidden all-reduce, the main_grad buffer) within float32 rounding of the reference, at TP=1 and on two
gloo ranks. The end-to-end audit along a run is ``test_real_training.py``'s resume test."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from devkit import megatron_gpt as harness
from devkit.oracle import loss_reference, make_case, policy_loss_inputs
from megatron_fused_lm import losses

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gradient_audit  # noqa: E402
from gradient_audit import HeadLoss, audit_point, compare, float64_gradients, gather_rows  # noqa: E402

B, S, H, V = 3, 7, 16, 42  # V even: two equal shards
POLICY = losses.ClippedPolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01, kl_coef=0.05, kl_estimator="k3")


def rl_case(seed=0, dtype=torch.float32):
    """Peaked rows (hidden scale 4), a response mask, policy inputs near the true log-probs."""
    hidden, weight, targets = make_case((B, S), H, V, dtype, peaky=False, seed=seed)
    hidden = hidden * 4
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[:, 2:] = True
    exact = loss_reference(hidden, weight, targets, lambda lp, ent: lp).logprob
    generator = torch.Generator().manual_seed(seed)
    inputs = policy_loss_inputs(exact, losses.token_mean_weights(mask), generator)
    return hidden, weight, targets, HeadLoss(POLICY, inputs, mask, inputs["weight"])


def sft_case(seed=1, dtype=torch.float32):
    hidden, weight, targets = make_case((B, S), H, V, dtype, peaky=False, seed=seed)
    weight_per_token = torch.full((B, S), 1.0 / (B * S))
    return hidden, weight, targets, HeadLoss(losses.cross_entropy, {"weight": weight_per_token}, None,
                                             weight_per_token, declared=weight_per_token)  # fmt: skip


@pytest.mark.parametrize("case", [rl_case, sft_case], ids=["rl", "sft"])
def test_the_chunked_reference_is_the_oracles(case, monkeypatch):
    # Chunks of 5 rows (an uneven last one), against devkit's one-piece float64 oracle: the loss's
    # gradients and those of its weighted entropy, to float64 rounding.
    monkeypatch.setattr(gradient_audit, "REFERENCE_CHUNK_ELEMENTS", 5 * V)
    hidden, weight, targets, loss = case()
    (grad_hidden, grad_weight), (entropy_hidden, entropy_weight) = float64_gradients(hidden, weight, targets, loss)
    want = loss_reference(hidden, weight, targets, loss.loss_fn, loss.inputs, mask=loss.mask)
    entropy = loss_reference(hidden, weight, targets, lambda lp, ent, w: w * ent, {"w": loss.entropy_weight},
                             mask=loss.mask)  # fmt: skip
    for got, expected in ((grad_hidden, want.grad_hidden), (grad_weight, want.grad_weight),
                          (entropy_hidden, entropy.grad_hidden), (entropy_weight, entropy.grad_weight)):  # fmt: skip
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_metrics_of_errors_of_known_direction():
    # The true gradient g, an entropy gradient g_H orthogonal to it, and an error 3 % along g,
    # 0.002 g_H (an entropy coefficient lowered by 0.002) and noise orthogonal to both: each
    # metric reads its own part, over both parts and within each.
    generator = torch.Generator().manual_seed(0)
    true, entropy, noise = (torch.randn(80, generator=generator, dtype=torch.float64) for _ in range(3))
    entropy = entropy - (entropy @ true) / (true @ true) * true
    basis = torch.stack([true, entropy]).t()
    noise = noise - basis @ torch.linalg.lstsq(basis, noise).solution
    error = 0.03 * true + 0.002 * entropy + 0.01 * noise
    split = lambda flat: (flat[:50], flat[50:])  # noqa: E731 (hidden, weight)
    metrics = compare(split(true + error), split(true), split(entropy))
    assert metrics["both"]["projection"] == pytest.approx(0.03, rel=1e-9)
    assert metrics["both"]["entropy_coef_shift"] == pytest.approx(-0.002, rel=1e-9)
    assert metrics["both"]["relative_error"] == pytest.approx(float(error.norm() / true.norm()), rel=1e-12)
    assert metrics["hidden"]["relative_error"] == pytest.approx(float(error[:50].norm() / true[:50].norm()), rel=1e-12)


# float32 products against float64: a few 1e-7 relative per entry, 1e-5 in norm leaves room for
# other summation orders; a missing all-reduce, shard or scale costs O(1).
FLOAT32_BOUND = 1e-5


def check_every_path(tp_group, rank, world):
    for case in (rl_case, sft_case):
        hidden, weight, targets, loss = case()
        shard = weight[rank * V // world : (rank + 1) * V // world]
        results = audit_point(hidden, shard, targets, loss, tp_group, "torch")
        assert set(results) == set(gradient_audit.PATHS)
        for path, parts in results.items():
            for part, metrics in parts.items():
                assert metrics["relative_error"] <= FLOAT32_BOUND, (case.__name__, path, part, metrics)
                assert abs(metrics["projection"]) <= FLOAT32_BOUND, (case.__name__, path, part, metrics)


def audited_ranks():
    # Megatron's groups: the stock SFT path is Megatron's vocab_parallel_cross_entropy.
    from megatron.core import parallel_state

    harness.tensor_parallel(2)
    group, rank = parallel_state.get_tensor_model_parallel_group(), dist.get_rank()
    assert torch.equal(gather_rows(torch.full((2, 3), float(rank)), group)[2:], torch.ones(2, 3))
    check_every_path(group, rank, 2)
    harness.tensor_parallel(1)
    check_every_path(None, 0, 1)


def test_every_path_within_float32_rounding_at_tp1_and_on_two_ranks():
    harness.spawn(audited_ranks, 2)


def test_the_report_tabulates_each_phase_and_path():
    # report_audit.py's table of a record with known metrics: two points per phase, three_gemm worse
    # than stock at one of them, shifts of 1e-5 and 3e-5 (mean 2e-5, stdev 1.41e-5, 95 % half-width
    # 1.96 * stdev / sqrt(2) = 1.96e-5), against the record's coefficient 0.001.
    import report_audit

    def point(step, stock_error, shift):
        metrics = {"relative_error": 1e-3, "projection": 0.0, "entropy_coef_shift": shift}
        paths = {path: {part: dict(metrics) for part in gradient_audit.PARTS} for path in gradient_audit.PATHS}
        paths["stock"]["weight"]["relative_error"] = stock_error
        return {"step": step, "paths": paths}

    points = [point(0, 2e-3, 1e-5), point(1, 5e-4, 3e-5)]
    record = {"sft": {"audit": points}, "rl": {"audit": points, "entropy_coef": 0.001}}
    rows = report_audit.table(record).splitlines()[2:]
    assert [row.split(" | ")[:2] for row in rows] == [
        [f"| {phase}", path] for phase in ("sft", "rl") for path in gradient_audit.PATHS
    ]
    three_gemm = rows[5].split(" | ")
    assert three_gemm[4] == "1 of 2"
    assert three_gemm[5] == "+2.0e-05 [+4.0e-07, +4.0e-05] (4.0 % of 0.001)"
    assert three_gemm[6] == "3.0e-05 |"
