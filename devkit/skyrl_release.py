"""SkyRL's released Megatron code (PyPI ``skyrl``), imported on a CPU machine for the tests that run it.

Two stand-ins, for modules the tested code never runs:

- ``skyrl.backends`` as a bare package over SkyRL's own directory: its ``__init__`` only re-exports
  the Tinker engine's ``AbstractBackend``, whose pydantic models do not build on Python 3.11 (a
  ``typing.TypedDict`` field); every module imported below is SkyRL's file, unchanged.
- ``megatron.bridge.peft.utils``: SkyRL's ``MegatronModelWrapper`` imports two helpers from
  Megatron-Bridge that synchronize expert-parallel adapter gradients; a model without experts or
  adapters needs neither, so they do nothing here (the real package imports every model bridge).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

SKYRL_VERSION = "0.4.0"


def skyrl_module(name: str) -> types.ModuleType:
    """``skyrl.<name>``, with the two stand-ins of the module docstring registered first."""
    if "skyrl.backends" not in sys.modules:
        backends = types.ModuleType("skyrl.backends")
        backends.__path__ = [os.path.join(os.path.dirname(importlib.util.find_spec("skyrl").origin), "backends")]
        sys.modules["skyrl.backends"] = backends
    if "megatron.bridge.peft.utils" not in sys.modules and importlib.util.find_spec("megatron.bridge") is None:
        for package in ("megatron.bridge", "megatron.bridge.peft"):
            sys.modules[package] = types.ModuleType(package)
            sys.modules[package].__path__ = []
        utils = types.ModuleType("megatron.bridge.peft.utils")
        utils.enable_expert_parallel_grad_sync_in_finalize = lambda modules: None
        utils.finalize_model_grads_with_expert_adapter_sync = lambda modules, num_tokens=None: None
        sys.modules["megatron.bridge.peft.utils"] = utils
    return importlib.import_module(f"skyrl.{name}")
