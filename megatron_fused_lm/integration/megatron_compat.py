"""What the integration needs to know about a Megatron-Core model, across megatron-core 0.13-0.20:
its model chunks, their output layers, the tensor-parallel group, and whether the fused head is
provably exact for a chunk (or why not)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel.layers import ColumnParallelLinear


def model_chunks(model: Any) -> List[torch.nn.Module]:
    """The innermost language models of ``model``: a model, a list of virtual-pipeline chunks, or
    either wrapped (DDP, Float16Module, ...) in modules that hold it as ``.module``. A model with
    no output layer of its own that holds a language model as ``.language_model`` (Megatron's
    multimodal models: LLaVAModel, MIMO) stands for that language model."""
    return [chain[-1] for chain in module_chains(model)]


def module_chains(model: Any) -> List[List[torch.nn.Module]]:
    """For each chunk of ``model`` (see ``model_chunks``), the modules a call passes through, from
    the one the caller holds to the innermost language model."""
    chains = []
    for chunk in list(model) if isinstance(model, (list, tuple)) else [model]:
        chain = [chunk]
        while isinstance(getattr(chain[-1], "module", None), torch.nn.Module):
            chain.append(chain[-1].module)
        language_model = getattr(chain[-1], "language_model", None)
        if output_layer_of(chain[-1]) is None and isinstance(language_model, torch.nn.Module):
            chain.append(language_model)
        chains.append(chain)
    return chains


def model_name(chunks: List[torch.nn.Module]) -> str:
    """How messages name a model of ``chunks`` (``model_chunks``): its class and ``id``, which tell
    two wrapped models (a policy and its reference) apart."""
    if not chunks:
        return "a model without language model chunks"
    return f"{type(chunks[0]).__name__} at {id(chunks[0]):#x}"


def output_layer_of(chunk: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The chunk's LM-head projection, or ``None`` on a chunk or stage that has none."""
    layer = getattr(chunk, "output_layer", None)
    return layer if isinstance(layer, torch.nn.Module) else None


def tensor_parallel_group(chunk: torch.nn.Module, layer: torch.nn.Module) -> Optional[dist.ProcessGroup]:
    """The group the output layer's vocabulary is split over.

    Megatron-core 0.19 (and 0.16.1) modules carry it (``layer.tp_group``, ``model.pg_collection.tp``,
    ``model.tp_group``); older releases only have the global ``parallel_state``. ``None`` when
    torch.distributed is not in use.
    """
    collection = getattr(chunk, "pg_collection", None)
    candidates = (getattr(layer, "tp_group", None), getattr(collection, "tp", None), getattr(chunk, "tp_group", None))
    for group in candidates:
        if isinstance(group, dist.ProcessGroup):
            return group
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return None


def labels_ignore_index(layer: torch.nn.Module) -> Optional[int]:
    """The label to which the stock labels path gives a loss of 0 and no gradient: -100, the
    ``ignore_idx`` Megatron passes to TransformerEngine's fused cross-entropy, where the model
    computes its loss with it (``cross_entropy_loss_fusion`` with ``cross_entropy_fusion_impl='te'``);
    ``None`` where Megatron's own vocabulary-parallel cross-entropy (or its native fusion) computes
    it, which scores every label outside the vocabulary as the row's largest logit."""
    config = getattr(layer, "config", None)
    fused = getattr(config, "cross_entropy_loss_fusion", False)
    return -100 if fused and getattr(config, "cross_entropy_fusion_impl", "native") == "te" else None


def _looks_like_transformer_engine(layer_class: type) -> bool:
    # Recognised by name so that TransformerEngine is never imported.
    return layer_class.__name__.startswith("TE") or "transformer_engine" in layer_class.__module__


def output_layers(chains: List[List[torch.nn.Module]]) -> List[Tuple[torch.nn.Module, torch.nn.Module]]:
    """``(chunk, output layer)`` of each chain (``module_chains``) whose chunk has an output layer."""
    return [(chain[-1], output_layer_of(chain[-1])) for chain in chains if output_layer_of(chain[-1]) is not None]


def fallback_reason(layers: List[Tuple[torch.nn.Module, torch.nn.Module]]) -> Optional[str]:
    """Why the fused head cannot be proven exact for one of the ``(chunk, output layer)`` pairs, as a
    sentence; ``None`` if it can for all."""
    return next(filter(None, (_chunk_fallback_reason(chunk, layer) for chunk, layer in layers)), None)


def _chunk_fallback_reason(chunk: torch.nn.Module, layer: torch.nn.Module) -> Optional[str]:
    layer_class = type(layer)
    class_name = f"{layer_class.__module__}.{layer_class.__qualname__}"
    if _looks_like_transformer_engine(layer_class):
        return f"the output layer is a TransformerEngine layer ({class_name}), not Megatron's ColumnParallelLinear"
    if not isinstance(layer, ColumnParallelLinear):
        return f"the output layer ({class_name}) is not Megatron's ColumnParallelLinear"
    if getattr(layer, "bias", None) is not None:
        return "the output layer has a bias"
    configs = (getattr(layer, "config", None), getattr(chunk, "config", None))
    if any(getattr(config, "defer_embedding_wgrad_compute", False) for config in configs):
        return "defer_embedding_wgrad_compute is on (the embedding weight gradient is computed at pipeline flush)"
    if getattr(layer, "gather_output", False) and (getattr(layer, "output_size", 0) != layer.output_size_per_partition):
        return (
            "the output layer gathers the vocabulary on every rank (GPTModel(parallel_output=False)): its logits are "
            "not a vocabulary shard"
        )
    if getattr(layer, "gtp_remat_size", 1) > 1:
        return "the output weight is sharded over a GTP rematerialization group"
    if not callable(getattr(chunk, "compute_language_model_loss", None)):
        return f"the model ({type(chunk).__name__}) has no compute_language_model_loss"
    if not _scale_logits_is_stock(chunk):
        return f"the model ({type(chunk).__name__}) overrides _scale_logits, so its logit scaling may not be a scalar multiply"
    return _probe_projection(chunk, layer)


# The probe's logits reach PROBE_LOGIT with a float32 product; each may differ from it by a few
# roundings in the weight's dtype (float32 allows for TF32 products), far less than a soft cap,
# a scale or a bias changes them at that size.
PROBE_LOGIT = 64.0
PROBE_ROUNDING = {torch.float32: 2.0**-8, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _probe_projection(chunk: torch.nn.Module, layer: torch.nn.Module) -> Optional[str]:
    """Check on a small random input that the layer's own forward returns this rank's vocabulary
    shard of ``input @ weight.T`` (releases differ in private methods, so what the fused head
    replaces is checked by what it computes); every tensor-parallel rank runs it. ``None`` when it
    matches."""
    weight = layer.weight
    if weight is None:
        shared = getattr(chunk, "shared_embedding_or_output_weight", None)
        weight = shared() if callable(shared) else None
        if weight is None:
            return "the output layer owns no weight and the model shares none with it"
    if weight.device.type == "meta" or weight.dtype not in PROBE_ROUNDING:
        return (
            f"the output weight ({weight.dtype} on {weight.device.type}) cannot be probed; wrap the materialized model"
        )
    group = tensor_parallel_group(chunk, layer)
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
    sequence_parallel = bool(getattr(layer, "sequence_parallel", False)) and world > 1
    # The same probe on every rank (a fixed seed); under sequence parallelism each passes its part.
    probe = torch.randn(
        world if sequence_parallel else 1, 1, weight.shape[1], generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        probe = probe.to(device=weight.device, dtype=torch.float32)
        largest = _float32_logits(probe, weight).abs().max().clamp(min=torch.finfo(torch.float32).tiny)
        if world > 1:  # one scale for the whole vocabulary: the ranks' probe rows must agree
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        probe = (probe * (PROBE_LOGIT / largest)).to(weight.dtype)
        expected = _float32_logits(probe, weight)
        local = probe[rank : rank + 1] if sequence_parallel else probe
        output = type(layer).forward(layer, local, weight=None if layer.weight is not None else weight)
        logits = output[0] if isinstance(output, tuple) else output
        if not isinstance(logits, torch.Tensor) or logits.shape != expected.shape:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            return (
                f"the output layer ({type(layer).__qualname__}) returned {got} for a probe where a vocabulary shard "
                f"{tuple(expected.shape)} was expected"
            )
        tolerance = 4 * PROBE_ROUNDING[weight.dtype] * (expected.abs() + PROBE_LOGIT / 16)
        if bool(((logits.float() - expected).abs() > tolerance).any()):
            return (
                f"the output layer ({type(layer).__qualname__}) does not compute input @ weight.T on its vocabulary "
                "shard (a probe differed)"
            )
    return None


def _float32_logits(probe: torch.Tensor, weight: torch.Tensor, rows: int = 8192) -> torch.Tensor:
    # A float32 copy of a whole weight shard can take gigabytes; a few thousand rows at a time do not.
    return torch.cat([probe.float() @ part.float().t() for part in weight.split(rows)], dim=-1)


def _scale_logits_is_stock(chunk: torch.nn.Module) -> bool:
    # megatron-core >= 0.17 multiplies what the output layer returns by config.mup_output_mult in
    # LanguageModule._scale_logits; a scalar commutes with the projection, anything else may not.
    if "_scale_logits" in vars(chunk):
        return False
    method = getattr(type(chunk), "_scale_logits", None)
    return method is None or method is getattr(LanguageModule, "_scale_logits", None)


# The arguments of a language model's forward that make it an inference forward (a generation
# engine's, with its KV cache), whose output layer must produce the logits the engine samples from.
INFERENCE_ARGUMENTS = ("inference_context", "inference_params")


def stock_logits_reason(forward: inspect.Signature, args: tuple, kwargs: dict) -> Optional[str]:
    """Why a forward of a language model, called with ``args`` and ``kwargs`` (its ``self`` not
    among them) and ``forward`` its signature, needs the stock logits from its output layer, as a
    phrase; ``None`` where what the forward returns is for the fused head."""
    positions = [name for name in forward.parameters if name != "self"]
    given = {**{name: value for name, value in zip(positions, args, strict=False)}, **kwargs}
    for name in INFERENCE_ARGUMENTS:
        if given.get(name) is not None:
            return f"an inference forward ({name}=)"
    if given.get("output_processor") is not None:
        return "a forward with output_processor= (the processor owns the output layer)"
    if _inference_mode_active():
        return "an inference forward (megatron.core's InferenceMode is active)"
    return None


def _inference_mode_active() -> bool:
    mode = _inference_mode()
    return mode is not None and mode.is_active()


@functools.lru_cache(maxsize=None)
def _inference_mode() -> Optional[type]:
    # megatron-core 0.20 marks a running inference engine process-wide; older releases have no mark.
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        return None
    return InferenceMode


def derives_mtp_metrics_from_logits(chunk: torch.nn.Module) -> bool:
    """Whether the chunk has multi-token-prediction heads and this megatron-core logs an MTP
    acceptance rate computed from what the output layer returns (0.19 on): read from the public
    tracker's signature, which takes the acceptance counts (``correct``) where it does."""
    if not getattr(getattr(chunk, "config", None), "mtp_num_layers", None):
        return False
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = getattr(MTPLossLoggingHelper, "save_metrics_to_tracker", None)
    return tracker is not None and "correct" in inspect.signature(tracker).parameters


def float32_main_grad(weight: torch.Tensor) -> torch.Tensor:
    """The float32 ``main_grad`` Megatron's DistributedDataParallel gives ``weight`` (a view into
    its gradient buffer), or ``ValueError`` saying why there is none to add into."""
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor):
        raise ValueError(
            "main_grad_scale adds the head's weight gradient into the weight's main_grad, and this weight has none: "
            "wrap the model in megatron.core's DistributedDataParallel first"
        )
    if main_grad.dtype != torch.float32:
        raise ValueError(
            f"main_grad_scale needs a float32 main_grad (DistributedDataParallelConfig(grad_reduce_in_fp32=True)); "
            f"this one is {main_grad.dtype}"
        )
    return main_grad


class MainGradWritten(torch.autograd.Function):
    """``weight`` as it is, for an op that adds the weight's gradient into ``weight.main_grad``
    itself. The backward does what Megatron's linear layers do after writing ``main_grad``: sets
    ``weight.grad_added_to_main_grad`` and hands DDP's hook a dummy gradient (zeros where
    ``zero_out_wgrad``), so the hook still fires and adds nothing twice."""

    @staticmethod
    def forward(ctx, weight):
        ctx.set_materialize_grads(False)
        ctx.weight = weight
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        weight = ctx.weight
        if grad is not None:  # another use of the view: its gradient joins main_grad, as the op's did
            weight.main_grad.add_(grad)
        weight.grad_added_to_main_grad = True
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        return make(weight.shape, dtype=weight.dtype, device=weight.device)
