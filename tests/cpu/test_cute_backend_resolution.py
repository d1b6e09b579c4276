"""``backend="cute"`` where its kernels cannot run (these machines: no Hopper GPU, the ``cute``
extra absent): what it resolves to, the reasons it gives, and which forwards its kernel would
refuse. The kernel itself is checked against float64 on a GPU (``tests/gpu/test_cute_backend.py``)."""

from __future__ import annotations

import sys

import pytest
import torch

from megatron_fused_lm.ops.backends.contract import ShardProblem
from megatron_fused_lm.ops.backends.cute import CuteBackend, statistics_unsupported
from megatron_fused_lm.ops.backends.registry import by_name
from megatron_fused_lm.ops.options import resolved_backend
from megatron_fused_lm.ops.triton_support import cute_unavailable_reason


def problem(dtype=torch.bfloat16, hidden_size=64, kept_words=0, targets_per_row=None, weight_dtype=None):
    hidden = torch.zeros(5, hidden_size, dtype=dtype)
    weight = torch.zeros(40, hidden_size, dtype=weight_dtype or dtype)
    shape = (5,) if targets_per_row is None else (5, targets_per_row)
    kept = torch.zeros(5, kept_words, dtype=torch.int32) if kept_words else torch.empty(0, dtype=torch.int32)
    return ShardProblem(hidden, weight, torch.zeros(shape, dtype=torch.int64), torch.ones(5), kept)


def test_cute_needs_a_cuda_device():
    assert cute_unavailable_reason(torch.device("cpu")) == "it needs a CUDA device, got cpu"


def test_cute_on_the_cpu_runs_torch_or_the_interpreted_triton(monkeypatch, package_warnings):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolved_backend("cute", torch.device("cpu")) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolved_backend("cute", torch.device("cpu")) == "triton"
    warnings = package_warnings()
    assert any("backend='cute' runs the triton backend instead: it needs a CUDA device" in w for w in warnings), (
        warnings
    )


def test_the_registry_names_the_cute_backend_without_importing_cutlass():
    backend = by_name("cute")
    assert isinstance(backend, CuteBackend) and backend.name == "cute"
    assert "cutlass" not in sys.modules  # the kernel module is imported only when a forward runs it


@pytest.mark.parametrize(
    "case, reason",
    [
        (dict(dtype=torch.float32), "bfloat16 or float16"),
        (dict(weight_dtype=torch.float16), "of one dtype"),
        (dict(kept_words=2), "kept_tokens"),
        (dict(targets_per_row=3), "several targets"),
        (dict(hidden_size=60), "multiple of 8"),
    ],
)
def test_the_kernel_names_what_it_does_not_take(case, reason):
    assert reason in statistics_unsupported(problem(**case), None)


def test_a_softcap_is_named_too():
    assert "softcap" in statistics_unsupported(problem(), 30.0)


def test_the_kernel_takes_a_plain_16_bit_forward():
    assert statistics_unsupported(problem(), None) is None
    assert statistics_unsupported(problem(dtype=torch.float16), None) is None
