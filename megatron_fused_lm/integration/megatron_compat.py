"""What the integration needs to know about a Megatron-Core model, across megatron-core 0.16-0.19:
its model chunks, their output layers, the tensor-parallel group, and whether the fused head is
provably exact for a chunk (or why not)."""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel.layers import ColumnParallelLinear


def model_chunks(model: Any) -> List[torch.nn.Module]:
    """The innermost language models of ``model``: a model, a list of virtual-pipeline chunks, or
    either wrapped (DDP, Float16Module, ...) in modules that hold it as ``.module``."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    innermost = []
    for chunk in chunks:
        while isinstance(getattr(chunk, "module", None), torch.nn.Module):
            chunk = chunk.module
        innermost.append(chunk)
    return innermost


def output_layer_of(chunk: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The chunk's LM-head projection, or ``None`` on a chunk or stage that has none."""
    layer = getattr(chunk, "output_layer", None)
    return layer if isinstance(layer, torch.nn.Module) else None


def tensor_parallel_group(chunk: torch.nn.Module, layer: torch.nn.Module) -> Optional[dist.ProcessGroup]:
    """The group the output layer's vocabulary is split over.

    Megatron-core 0.19 (and 0.16.1) modules carry it (``layer.tp_group``, ``model.pg_collection.tp``,
    ``model.tp_group``); older 0.16 code only has the global ``parallel_state``. ``None`` when
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


def _looks_like_transformer_engine(layer_class: type) -> bool:
    # Recognised by name so that TransformerEngine is never imported.
    return layer_class.__name__.startswith("TE") or "transformer_engine" in layer_class.__module__


def fallback_reason(chunk: torch.nn.Module, layer: torch.nn.Module) -> Optional[str]:
    """Why the fused head cannot be proven exact for this chunk, as a sentence; ``None`` if it can."""
    layer_class = type(layer)
    class_name = f"{layer_class.__module__}.{layer_class.__qualname__}"
    if _looks_like_transformer_engine(layer_class):
        return f"the output layer is a TransformerEngine layer ({class_name}), not Megatron's ColumnParallelLinear"
    is_stock_layer = (
        isinstance(layer, ColumnParallelLinear)
        and layer_class.forward is ColumnParallelLinear.forward
        and layer_class._forward_impl is ColumnParallelLinear._forward_impl
    )
    if not is_stock_layer:
        return f"the output layer ({class_name}) is not Megatron's ColumnParallelLinear or changes its forward"
    if getattr(layer, "bias", None) is not None:
        return "the output layer has a bias"
    configs = (getattr(layer, "config", None), getattr(chunk, "config", None))
    if any(getattr(config, "defer_embedding_wgrad_compute", False) for config in configs):
        return "defer_embedding_wgrad_compute is on (the embedding weight gradient is computed at pipeline flush)"
    if getattr(layer, "gtp_remat_size", 1) > 1:
        return "the output weight is sharded over a GTP rematerialization group"
    if not callable(getattr(chunk, "compute_language_model_loss", None)):
        return f"the model ({type(chunk).__name__}) has no compute_language_model_loss"
    if not _scale_logits_is_stock(chunk):
        return f"the model ({type(chunk).__name__}) overrides _scale_logits, so its logit scaling may not be a scalar multiply"
    return None


def _scale_logits_is_stock(chunk: torch.nn.Module) -> bool:
    # megatron-core >= 0.19 multiplies what the output layer returns by config.mup_output_mult in
    # LanguageModule._scale_logits; a scalar commutes with the projection, anything else may not.
    if "_scale_logits" in vars(chunk):
        return False
    method = getattr(type(chunk), "_scale_logits", None)
    return method is None or method is getattr(LanguageModule, "_scale_logits", None)


def derives_mtp_metrics_from_logits(chunk: torch.nn.Module) -> bool:
    """Whether the chunk has multi-token-prediction heads and this megatron-core (>= 0.19) logs an
    MTP acceptance rate computed from what the output layer returns."""
    if not getattr(getattr(chunk, "config", None), "mtp_num_layers", None):
        return False
    from megatron.core.transformer import multi_token_prediction

    return hasattr(multi_token_prediction, "_compute_mtp_acceptance_counts")
