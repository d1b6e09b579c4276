"""NeMo-RL's own Megatron training functions, imported from a source checkout on a CPU machine
(Python 3.11, CPU torch, megatron-core as pinned, pydantic), for tests that compare the NeMo-RL
recipe with them.

``NEMO_RL_SOURCE`` names the checkout (the directory holding ``nemo_rl/``), for instance one
exported from git: ``git --git-dir=<NVIDIA-NeMo/RL clone>/.git archive <commit> | tar -x -C DIR``.
NeMo-RL is not installed: ``import_nemo_rl`` puts the checkout first on ``sys.path``.

What is imported and runs as NeMo-RL wrote it: ``nemo_rl.models.megatron.train``
(``forward_with_post_processing_fn``, the three post-processors), ``nemo_rl.models.megatron.data``
(``process_microbatch`` and the packing it calls), ``nemo_rl.algorithms.loss`` (``prepare_loss_input``,
the loss wrappers and functions), ``nemo_rl.distributed.model_utils`` (the vocabulary-parallel
log-prob, top-k and distillation functions), ``nemo_rl.algorithms.logits_sampling_utils`` and
``nemo_rl.distributed.batched_data_dict``.

Those modules import, at module level, modules whose own imports need ray, vLLM, transformers,
Megatron-Bridge, wandb and more. ``install_stand_ins`` registers a stand-in for each such module
before the import: a module holding the few names the importers take from it, each a placeholder
that raises if called. None of them is run by the functions the tests call (the stand-ins' names
are used in annotations, ``isinstance`` checks of other code paths, or by code for VLMs, draft
models and router replay that the tests do not reach); a test that reached one would fail loudly,
not compute with it.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Optional

from devkit.checkouts import named_checkout

SOURCE_VARIABLE = "NEMO_RL_SOURCE"


def source_checkout() -> Optional[str]:
    """The checkout ``NEMO_RL_SOURCE`` names, or ``None`` when unset or empty; ``ValueError`` if it
    names a directory without ``nemo_rl/``."""
    return named_checkout(SOURCE_VARIABLE, "nemo_rl/__init__.py")


def _module(name: str, *, package: bool = False, path: Optional[Path] = None, **names) -> types.ModuleType:
    """Register a stand-in module ``name`` holding ``names``: a package if ``package`` (with no
    submodules but the stand-ins registered under it) or given ``path`` (the real directory, so that
    its real submodules still import from the checkout)."""
    module = types.ModuleType(name)
    if package or path is not None:
        module.__path__ = [] if path is None else [str(path)]
    module.__dict__.update(names)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def _placeholder_class(name: str) -> type:
    """A class that only names a type (annotations, ``isinstance``); making one raises."""

    def refuse(self, *args, **kwargs):
        raise RuntimeError(f"{name} is a stand-in of devkit.nemo_rl_source: the tested code should not build one")

    return type(name, (), {"__init__": refuse})


def _placeholder_function(name: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"{name} is a stand-in of devkit.nemo_rl_source: the tested code should not call it")

    refuse.__name__ = name
    return refuse


def install_stand_ins(source: str) -> None:
    """Register the stand-in modules (see the module docstring) for the checkout ``source``; the
    real ``nemo_rl`` package (logging set-up and version only) is imported from it."""
    if source not in sys.path:
        sys.path.insert(0, source)

    # nemo_rl.distributed.batched_data_dict -> nemo_rl.data.multimodal_utils imports these at module
    # level for image, audio and video inputs; the tests' batches hold token ids only.
    _module("requests", package=True)
    _module("PIL", package=True)
    _module("PIL.Image", Image=_placeholder_class("Image"))
    _module(
        "transformers",
        package=True,
        PreTrainedTokenizerBase=_placeholder_class("PreTrainedTokenizerBase"),
        AutoTokenizer=_placeholder_class("AutoTokenizer"),
        AutoProcessor=_placeholder_class("AutoProcessor"),
    )
    _module("transformers.audio_utils", load_audio=_placeholder_function("load_audio"))
    _module("transformers.video_utils", load_video=_placeholder_function("load_video"))

    # Megatron-Bridge (a NeMo-RL submodule, not installed here): type names for annotations, and the
    # CP partition of models that slice context parallelism themselves (not the tests' GPTModel).
    _module("megatron.bridge", package=True)
    _module("megatron.bridge.models", package=True)
    _module("megatron.bridge.models.model_provider", ModelProviderMixin=_placeholder_class("ModelProviderMixin"))
    _module("megatron.bridge.training", package=True)
    _module("megatron.bridge.training.config", ConfigContainer=_placeholder_class("ConfigContainer"))
    _module("megatron.bridge.training.state", GlobalState=_placeholder_class("GlobalState"))
    _module("megatron.bridge.training.utils", package=True)
    _module(
        "megatron.bridge.training.utils.packed_seq_utils",
        get_packed_seq_cp_partition_indices=_placeholder_function("get_packed_seq_cp_partition_indices"),
    )

    # megatron-core before 0.18 has no moe_logging; NeMo-RL's Megatron helpers read MoE metrics from it.
    if importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is None:
        _module(
            "megatron.core.transformer.moe.moe_logging",
            get_moe_metrics_tracker=_placeholder_function("get_moe_metrics_tracker"),
        )
    # megatron-core 0.19 imports triton at module level in paged_stash (MoE paging kernels), which the
    # CPU build of torch lacks; a stand-in triton would convince torch it has one, so stand in for
    # that module instead.
    core = importlib.util.find_spec("megatron.core")
    stash = Path(core.origin).parent / "transformer" / "moe" / "ops" / "paged_stash.py"
    if importlib.util.find_spec("triton") is None and stash.exists():
        _module(
            "megatron.core.transformer.moe.ops.paged_stash",
            GLOBAL_BLOCK_SIZE=0,
            paged_stash_copy_kernel=_placeholder_function("paged_stash_copy_kernel"),
            paged_stash_pop_kernel=_placeholder_function("paged_stash_pop_kernel"),
        )

    import nemo_rl  # the real package: logging set-up and package_info

    package = Path(nemo_rl.__file__).parent
    # Packages whose __init__ imports every generation backend (ray, vLLM, TensorRT-LLM), loggers
    # (wandb, mlflow, tensorboard) or HF model code: stand-ins with the real directory as their path,
    # so the real submodules below them import, holding the few names taken from the __init__s
    # (PolicyConfig and the rest are TypedDicts, plain dicts at run time).
    _module("nemo_rl.models", path=package / "models")
    _module("nemo_rl.models.policy", path=package / "models" / "policy", PolicyConfig=dict, TokenizerConfig=dict)
    _module("nemo_rl.models.generation", path=package / "models" / "generation")
    _module("nemo_rl.models.generation.interfaces", ROUTED_EXPERTS_MISSING_ROUTE_SENTINEL=-1, GenerationConfig=dict)
    _module("nemo_rl.utils", path=package / "utils")
    _module("nemo_rl.utils.logger", Logger=_placeholder_class("Logger"))
    _module("nemo_rl.models.dtensor", path=package / "models" / "dtensor")
    _module("nemo_rl.models.dtensor.parallelize", to_local_if_dtensor=_local_if_dtensor)


def _local_if_dtensor(tensor):
    """``nemo_rl.models.dtensor.parallelize.to_local_if_dtensor`` (the DTensor worker's; imported by
    a loss helper module): the local shard of a DTensor, else the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _packed_seq_params_with_total_tokens(data: types.ModuleType) -> None:
    """NeMo-RL's packing (``_pack_sequences_for_megatron``) passes ``PackedSeqParams(total_tokens=...)``,
    a field of newer megatron-core releases (from which ``PackedSeqParams`` builds Mamba's ``seq_idx``).
    Where the installed release lacks it, ``data`` gets a ``PackedSeqParams`` that also holds
    ``total_tokens`` and is otherwise megatron-core's own (the tests' GPTModel has no Mamba layer)."""
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    if "total_tokens" in {field.name for field in dataclasses.fields(PackedSeqParams)}:
        return

    @dataclasses.dataclass
    class PackedSeqParamsWithTotalTokens(PackedSeqParams):
        total_tokens: Optional[int] = None

    data.PackedSeqParams = PackedSeqParamsWithTotalTokens


def import_nemo_rl(source: str) -> types.SimpleNamespace:
    """NeMo-RL's functions and classes the recipe tests call, imported from the checkout ``source``
    (after ``install_stand_ins``)."""
    if "nemo_rl.models.megatron.train" not in sys.modules:
        install_stand_ins(source)
    from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams
    from nemo_rl.algorithms.loss import loss_functions, utils, wrapper
    from nemo_rl.algorithms.loss.interfaces import LossInputType
    from nemo_rl.distributed import model_utils
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.megatron import data, train

    _packed_seq_params_with_total_tokens(data)
    return types.SimpleNamespace(
        source=source,
        TrainingSamplingParams=TrainingSamplingParams,
        LossInputType=LossInputType,
        BatchedDataDict=BatchedDataDict,
        loss_functions=loss_functions,
        loss_utils=utils,
        loss_wrapper=wrapper,
        model_utils=model_utils,
        data=data,
        train=train,
    )
