"""slime's own code, imported from a source checkout, for the tests that compare the slime recipe with
slime's functions (``tests/cpu/test_trainer_slime.py``).

slime is not installable here (its requirements pull in SGLang, Ray and CUDA builds), but the modules
these tests call, ``slime.backends.megatron_utils.loss``, ``.cp_utils`` and ``.data``, import with
torch and megatron-core alone, but for two things this module supplies:

- ``slime.utils.misc`` imports ``slime.utils.http_utils``, which imports ``httpx`` at module level and
  uses it only in rollout code (an HTTP client to the inference engines). Where httpx is not installed,
  ``import_slime`` puts a stand-in module named ``httpx`` into ``sys.modules``: its three names
  (``AsyncClient``, ``Limits``, ``Timeout``) exist so the import succeeds, and ``AsyncClient`` raises
  if anything constructs one, so a test can never mistake it for a client.
- slime's ``get_batch`` asks slime's accelerator layer for the device of ``cu_seqlens``, and slime
  ships CUDA and MUSA backends only: ``import_slime`` installs a CPU backend through slime's own
  ``set_accelerator``, its interface for backends outside slime's core.

Point ``SLIME_SOURCE`` at a checkout of THUDM/slime, e.g. an exported commit::

    mkdir -p /tmp/slime-src && git --git-dir=<THUDM/slime clone>/.git archive HEAD | tar -x -C /tmp/slime-src
    SLIME_SOURCE=/tmp/slime-src python -m pytest tests/cpu/test_trainer_slime.py

Nothing here copies slime's code: the tests call it where it stands.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Optional

import torch

from devkit.checkouts import named_checkout

SOURCE_VARIABLE = "SLIME_SOURCE"


def source_checkout() -> Optional[str]:
    """The slime checkout ``SLIME_SOURCE`` names (the directory holding ``slime/``), or ``None`` when
    unset or empty; ``ValueError`` if it names a directory without slime's Megatron loss code."""
    return named_checkout(SOURCE_VARIABLE, "slime/backends/megatron_utils/loss.py")


class _AsyncClient:
    """The httpx stand-in's client: the loss code never makes one; rollout code would, and must fail."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("httpx is a stand-in here (devkit.slime_source): slime's rollout HTTP code cannot run")


class _Options:
    """The httpx stand-in's ``Limits`` and ``Timeout``: accept and keep their arguments."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def _httpx_stand_in() -> types.ModuleType:
    module = types.ModuleType("httpx", "a stand-in for httpx (devkit.slime_source): imports, never connects")
    module.AsyncClient, module.Limits, module.Timeout = _AsyncClient, _Options, _Options
    module.HTTPStatusError = type("HTTPStatusError", (Exception,), {})
    module.__megatron_fused_lm_stand_in__ = True
    return module


def _cpu_accelerator(base: type) -> object:
    """A CPU backend of slime's ``Accelerator`` contract (``base``): device ``cpu``, no streams, no
    memory statistics."""

    class CPUAccelerator(base):
        name, device_type, communication_backend_name = "cpu", "cpu", "gloo"

        def is_available(self) -> bool:
            return True

        def device(self, index=None) -> torch.device:
            return torch.device("cpu")

        def device_name(self, index=None) -> str:
            return "cpu"

        def set_device(self, index) -> None:
            pass

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def synchronize(self, device=None) -> None:
            pass

        def current_stream(self, device=None):
            return None

        def empty_cache(self) -> None:
            pass

        def mem_get_info(self, device=None):
            return 0, 0

        def memory_allocated(self, device=None) -> int:
            return 0

        def memory_reserved(self, device=None) -> int:
            return 0

    return CPUAccelerator()


def import_slime(source: str) -> types.SimpleNamespace:
    """slime's ``loss``, ``cp_utils`` and ``data`` modules (``slime.backends.megatron_utils``) from the
    checkout ``source``, put first on ``sys.path``; with the httpx stand-in where httpx is missing and
    slime's accelerator set to the CPU backend. Call it in each process (spawned ranks too), after
    Megatron's process groups exist or before, as slime's modules read them only when called."""
    if source not in sys.path:
        sys.path.insert(0, source)
    try:
        importlib.import_module("httpx")
    except ImportError:
        sys.modules["httpx"] = _httpx_stand_in()
    accelerator = importlib.import_module("slime.utils.accelerator")
    accelerator.set_accelerator(_cpu_accelerator(importlib.import_module("slime.utils.accelerator.base").Accelerator))
    package = "slime.backends.megatron_utils"
    loss, cp_utils, data = (importlib.import_module(f"{package}.{name}") for name in ("loss", "cp_utils", "data"))
    return types.SimpleNamespace(loss=loss, cp_utils=cp_utils, data=data, source=source)


MEGATRON_VARIABLE = "SLIME_MEGATRON_SOURCE"


def megatron_checkout() -> Optional[str]:
    """The Megatron-LM tree ``SLIME_MEGATRON_SOURCE`` names: slime's pinned commit with slime's patches
    applied (``docker/Dockerfile``'s ``MEGATRON_COMMIT``, ``docker/patch/latest/megatron*.patch``), or
    ``None`` when unset or empty; ``ValueError`` if its GPTModel has no ``LinearCrossEntropyModule``
    output layer (not slime's dev-branch Megatron)."""
    return named_checkout(MEGATRON_VARIABLE, "megatron/core/transformer/linear_cross_entropy.py")
