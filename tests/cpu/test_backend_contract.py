"""The backend interface is written down once (``backends.contract.Backend``) and holds for every
backend: each has every member the ops call, with the Protocol's parameters in its order, and a
backend object that lacks one is refused by name before any work, not with an AttributeError deep
in a pass."""

import ast
import inspect
from pathlib import Path

import pytest
import torch

import megatron_fused_lm.ops
from megatron_fused_lm.ops import fused_linear_logprob
from megatron_fused_lm.ops.backends.contract import BACKEND_MEMBERS, Backend
from megatron_fused_lm.ops.backends.cute import CuteBackend
from megatron_fused_lm.ops.backends.registry import TorchBackend, missing_members
from megatron_fused_lm.ops.backends.triton import TritonBackend
from megatron_fused_lm.ops.backends.triton_tuning import TritonTuning

BACKENDS = [TorchBackend(), TritonBackend(), TritonBackend(TritonTuning(reference_rows=4)), CuteBackend()]


def called_on_backends() -> set:
    """Every attribute the ops' modules outside ``backends/`` read of a backend object: a name bound
    to one (``backend``, ``resolved``, ``torch_backend``) or ``by_name(...)``'s result, read from the
    source."""
    ops = Path(megatron_fused_lm.ops.__file__).parent
    found = set()
    for path in ops.rglob("*.py"):
        if "backends" in path.parts or "kernels" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            named = isinstance(owner, ast.Name) and owner.id in ("backend", "resolved", "torch_backend")
            looked_up = (
                isinstance(owner, ast.Call) and getattr(owner.func, "id", getattr(owner.func, "attr", "")) == "by_name"
            )
            if named or looked_up:
                found.add(node.attr)
    return found


def test_the_protocol_lists_what_the_ops_call():
    # A member the ops call but the Protocol leaves out would go unchecked by resolve().
    called = called_on_backends()
    assert len(called) >= 10, called  # the scan does see the calls
    assert called <= set(BACKEND_MEMBERS), called - set(BACKEND_MEMBERS)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda backend: type(backend).__name__)
def test_every_backend_has_every_member_with_the_protocols_parameters(backend):
    assert missing_members(backend) == []
    assert isinstance(backend.name, str) and isinstance(backend.gates_on_device, bool)
    for name in BACKEND_MEMBERS:
        declared = getattr(Backend, name, None)
        if not callable(declared):
            continue
        wanted = list(inspect.signature(declared).parameters)[1:]  # without self
        assert list(inspect.signature(getattr(backend, name)).parameters) == wanted, name


class Partial:
    """A backend object with the four-GEMM path only."""

    name = "partial"
    gates_on_device = False

    def local_statistics(self, problem, options):
        raise AssertionError("a backend without the rest must not run")

    def local_gradients(self, problem, saved, upstream, needed, options):
        raise AssertionError("a backend without the rest must not run")


def test_a_backend_object_that_lacks_members_is_refused_by_name():
    hidden, weight = torch.randn(3, 8), torch.randn(10, 8)
    with pytest.raises(TypeError, match="lacks allocate, chunk_statistics, summarize, chunk_gradients"):
        fused_linear_logprob(hidden, weight, torch.tensor([1, 2, 3]), backend=Partial())
    broken = TorchBackend()
    broken.summarize = None  # an attribute where a method belongs
    with pytest.raises(TypeError, match="lacks summarize"):
        fused_linear_logprob(hidden, weight, torch.tensor([1, 2, 3]), backend=broken)
    renamed = TorchBackend()
    renamed.scaled_copy = lambda source, factor, out: out  # the ops pass `scale=` by name
    with pytest.raises(TypeError, match=r"lacks scaled_copy\(source, scale, out\)"):
        fused_linear_logprob(hidden, weight, torch.tensor([1, 2, 3]), backend=renamed)
    unnamed = TorchBackend()
    unnamed.name = 3  # an instance attribute over the class's
    with pytest.raises(TypeError, match=r"lacks name \(a string\)"):
        fused_linear_logprob(hidden, weight, torch.tensor([1, 2, 3]), backend=unnamed)


class Doubled(TorchBackend):
    """A backend of its own behaviour that keeps the torch backend's name."""

    def summarize(self, parts, target_column, out):
        super().summarize(parts, target_column, out)
        out.logprob.mul_(2.0)


def test_a_backend_object_under_a_taken_name_is_refused_not_swapped():
    hidden, weight, targets = torch.randn(3, 8), torch.randn(10, 8), torch.tensor([1, 2, 3])
    expected = fused_linear_logprob(hidden, weight, targets)
    # An equal object of the registered class runs as the registered one does.
    assert torch.equal(fused_linear_logprob(hidden, weight, targets, backend=TorchBackend()), expected)
    # Another class under the name "torch" would have been looked up as the torch backend, silently.
    with pytest.raises(ValueError, match="named 'torch', the name of another backend object"):
        fused_linear_logprob(hidden, weight, targets, backend=Doubled())
    stateful = TorchBackend()
    stateful.extra = 1  # state the registered object lacks
    with pytest.raises(ValueError, match="named 'torch'"):
        fused_linear_logprob(hidden, weight, targets, backend=stateful)


class Tabled(TorchBackend):
    """A backend of its own name holding a tensor, which ``==`` cannot compare to a bool."""

    name = "tabled"

    def __init__(self):
        self.table = torch.arange(4.0)


def test_registered_names_resolve_without_crashing_or_swapping(monkeypatch):
    from megatron_fused_lm.ops.backends import registry
    from megatron_fused_lm.ops.backends.registry import by_name, resolve

    first = Tabled()
    assert resolve(first, torch.device("cpu")) is first
    assert resolve(first, torch.device("cpu")) is first  # the same object again: no comparison
    with pytest.raises(ValueError, match="named 'tabled'.*another class or state"):
        resolve(Tabled(), torch.device("cpu"))  # an equal-looking copy: its state is not known alike
    # A subclass under a built-in's name, met before the built-in was first used, does not take it
    # (where Triton runs: elsewhere a Triton-based object runs as the torch backend).
    monkeypatch.setattr(registry, "resolved_backend", lambda backend, device: "triton")
    Subclassed = type("Subclassed", (CuteBackend,), {})
    with pytest.raises(ValueError, match="named 'cute'"):
        resolve(Subclassed(), torch.device("cpu"))
    assert type(by_name("cute")) is CuteBackend
    # An object that runs no Triton kernel cannot take a built-in's name either.
    named_triton = type("NamedTriton", (TorchBackend,), {"name": "triton"})
    with pytest.raises(ValueError, match="a built-in's name"):
        resolve(named_triton(), torch.device("cpu"))
