"""``backend="cute"`` on a Hopper GPU against the float64 oracle: its forward statistics kernel
(``cute_kernels.statistics_kernel``) through the public op and through the backend alone, and the
passes it leaves to Triton. Skipped where the CuTe kernels cannot run (no Hopper GPU, or the
``cute`` extra not installed).

Bounds, as ``test_triton_parity``'s: the logits are accumulated in float32 and never rounded to 16
bits, so a log-prob or entropy may err by at most ``VALUE_BOUND * |z|max``; and the CuTe kernel may
not be less precise than the Triton kernel on the same inputs (``PEER_SLACK`` times its error, plus
a float32 rounding of the largest logit). A misplaced column or a lost split is off by O(1).
"""

from __future__ import annotations

import pytest
import torch

from devkit.oracle import max_abs_error, reference, relative_error
from megatron_fused_lm import fused_linear_logprob
from megatron_fused_lm.ops.backends.contract import ShardProblem
from megatron_fused_lm.ops.backends.registry import by_name
from megatron_fused_lm.ops.softmax import summarize
from megatron_fused_lm.ops.triton_support import cute_unavailable_reason

REASON = cute_unavailable_reason(torch.device("cuda")) if torch.cuda.is_available() else "needs a CUDA device"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

VALUE_BOUND = 2e-5  # times the largest |logit|
PEER_SLACK = 1.25
FLOAT32_ULP = 2.0**-23


@pytest.fixture(autouse=True)
def own_kernel_cache(tmp_path_factory, monkeypatch):
    # The tests' compiled kernels in a folder of their own, not in the host user's cache.
    monkeypatch.setenv("MEGATRON_FUSED_LM_CUTE_CACHE", str(tmp_path_factory.getbasetemp() / "cute_cache"))


def make_inputs(num_tokens, hidden_size, vocab, dtype, logit_scale, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=gen)
    weight = torch.randn(vocab, hidden_size, device="cuda", generator=gen) * (logit_scale / hidden_size**0.5)
    targets = torch.randint(0, vocab, (num_tokens,), device="cuda", generator=gen)
    return hidden.to(dtype), weight.to(dtype), targets


def largest_logit(hidden, weight, temperature):
    logits = hidden.double() @ weight.double().t()
    return (logits / temperature.double()[:, None]).abs().max().item()


def shard_summary(backend, hidden, weight, target_column, temperature):
    problem = ShardProblem(hidden, weight, target_column, temperature, torch.empty(0, dtype=torch.int32))
    return summarize(by_name(backend).local_statistics(problem, None), target_column)


SHAPES = [
    (1, 4096, 151936),
    (300, 256, 1000),  # partial token and column tiles, one split
    (1000, 2048, 5003),  # a column tile of 11 columns, a half-tile of the cluster out of range
    (2500, 3072, 32000),
    (4096, 4096, 151936),
    (777, 5120, 152064),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("logit_scale", [4.0, 30.0], ids=["mild", "peaky"])
@pytest.mark.parametrize("per_row", [False, True], ids=["uniform", "per_row"])
def test_statistics_match_float64(shape, dtype, logit_scale, per_row):
    num_tokens, _, vocab = shape
    hidden, weight, targets = make_inputs(*shape, dtype, logit_scale)
    if per_row:
        temperature = 0.5 + torch.rand(num_tokens, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    else:
        temperature = torch.full((1,), 0.8, device="cuda").expand(num_tokens)
    # A third of the rows' targets belong to another (simulated) shard.
    target_column = torch.where(torch.arange(num_tokens, device="cuda") % 3 == 0, -1, targets)
    expected = reference(hidden, weight, targets, temperature.contiguous())
    owned = target_column >= 0
    bound = VALUE_BOUND * largest_logit(hidden, weight, temperature)
    errors = {}
    for backend in ("cute", "triton"):
        summary = shard_summary(backend, hidden, weight, target_column, temperature)
        errors[backend] = (
            max_abs_error(summary.logprob[owned], expected.logprob[owned]),
            max_abs_error(summary.entropy, expected.entropy),
        )
    print(shape, dtype, logit_scale, per_row, errors, f"bound {bound:.2e}")
    ulp = FLOAT32_ULP * largest_logit(hidden, weight, temperature)
    for mine, theirs in zip(errors["cute"], errors["triton"], strict=True):
        assert mine <= bound, errors
        assert mine <= PEER_SLACK * theirs + 4 * ulp, errors


def test_a_row_does_not_depend_on_the_other_rows():
    # Splits are set by the vocabulary alone and merged in an order set by their number.
    hidden, weight, targets = make_inputs(3000, 2048, 151936, torch.bfloat16, 8.0)
    temperature = torch.ones(1, device="cuda").expand(3000)
    whole = shard_summary("cute", hidden, weight, targets, temperature)
    rows = slice(1234, 1234 + 77)
    part = shard_summary("cute", hidden[rows], weight, targets[rows], temperature[rows])
    assert torch.equal(whole.logprob[rows], part.logprob) and torch.equal(whole.entropy[rows], part.entropy)


def test_the_public_op_trains_through_the_cute_backend():
    # The forward's statistics are the CuTe kernel's; the backward recomputes with Triton's kernels.
    hidden, weight, targets = make_inputs(2048, 4096, 151936, torch.bfloat16, 6.0, seed=2)
    gen = torch.Generator(device="cuda").manual_seed(5)
    grad_logprob = torch.randn(2048, device="cuda", generator=gen)
    grad_entropy = torch.randn(2048, device="cuda", generator=gen)
    expected = reference(hidden, weight, targets, 0.9, grad_logprob, grad_entropy)
    results = {}
    for backend in ("cute", "triton"):
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        logprob, entropy = fused_linear_logprob(h, w, targets, temperature=0.9, return_entropy=True, backend=backend)
        torch.autograd.backward([logprob, entropy], [grad_logprob, grad_entropy])
        results[backend] = (logprob.detach(), entropy.detach(), h.grad, w.grad)
    bound = VALUE_BOUND * largest_logit(hidden, weight, torch.full((1,), 0.9, device="cuda"))
    cute, triton = results["cute"], results["triton"]
    assert max_abs_error(cute[0], expected.logprob) <= bound
    assert max_abs_error(cute[1], expected.entropy) <= bound
    for mine, theirs, exact in zip(cute[2:], triton[2:], (expected.grad_hidden, expected.grad_weight), strict=True):
        # The gradients are Triton's kernels' from statistics within float32 rounding of Triton's own.
        assert relative_error(mine, exact) <= 1.05 * relative_error(theirs, exact) + 1e-6


def test_a_forward_the_kernel_does_not_take_runs_triton_with_one_warning(caplog):
    hidden, weight, targets = make_inputs(64, 512, 4000, torch.float32, 4.0)
    with caplog.at_level("WARNING", logger="megatron_fused_lm"):
        cute = fused_linear_logprob(hidden, weight, targets, backend="cute")
        again = fused_linear_logprob(hidden, weight, targets, backend="cute")
    triton = fused_linear_logprob(hidden, weight, targets, backend="triton")
    messages = [record.getMessage() for record in caplog.records if "backend='cute'" in record.getMessage()]
    assert len(messages) <= 1 and torch.equal(cute, triton) and torch.equal(cute, again)


def test_a_kernel_loaded_from_the_file_cache_gives_the_same_bits(tmp_path, monkeypatch):
    # The first use compiles and stores the kernel; with the process's copy dropped, the next use
    # loads the stored entry (TVM-FFI's function, called with the same arguments).
    from megatron_fused_lm.ops.cute_kernels import statistics_kernel

    monkeypatch.setenv("MEGATRON_FUSED_LM_CUTE_CACHE", str(tmp_path))
    monkeypatch.setattr(statistics_kernel, "_compiled", {})
    hidden, weight, targets = make_inputs(777, 2048, 32003, torch.bfloat16, logit_scale=20.0)
    temperature = torch.full((1,), 0.7, device="cuda").expand(777)

    def statistics():
        return statistics_kernel.cute_split_statistics(hidden, weight, targets, temperature, tiles_per_split=16)

    compiled = statistics()
    assert len(list(tmp_path.glob("*.o"))) == 1
    statistics_kernel._compiled.clear()
    loaded = statistics()
    assert type(next(iter(statistics_kernel._compiled.values()))).__name__ == "Function"
    assert torch.equal(compiled, loaded)
