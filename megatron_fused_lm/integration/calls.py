"""What one output-layer call used, and the fused op calls made with it: shared by the two routes
to the fused head, the patched model (``head``) and Megatron-Core's ``output_processor`` hook
(``output_processor``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from .._logging import logger
from ..ops import (
    KeptTokens,
    LossFn,
    RanksDisagree,
    fused_linear_cross_entropy,
    fused_linear_logprob,
    fused_linear_loss,
    fused_linear_topk,
    logits_logprob,
    logits_loss,
    logits_topk,
    name_weight_grad_into,
    outstanding_weight_grads,
    resolved_backend,
)
from .config import FusedLMConfig
from .megatron_compat import MainGradWritten, float32_main_grad, labels_ignore_index, tensor_parallel_group


@dataclass(frozen=True)
class HeadCall:
    """What one output-layer call used: everything the fused op needs besides the hidden.

    ``weight`` is detached when the call ran without gradients, as the stock logits would carry no
    graph. ``reduce_hidden_grad`` is ``False`` where the stock layer would not all-reduce the hidden
    gradient either (sequence parallelism, ``disable_grad_reduce``).
    """

    weight: torch.Tensor
    tp_group: Optional[dist.ProcessGroup]
    reduce_hidden_grad: bool
    owner: str  # the model, as messages name it
    labels_ignore_index: Optional[int]  # megatron_compat.labels_ignore_index

    def without_graph(self) -> "HeadCall":
        """This call with its weight detached: no gradient into it."""
        return dataclasses.replace(self, weight=self.weight.detach())

    def key(self) -> Tuple:
        """What decides the results without a graph: two calls of one key compute alike."""
        weight = self.weight
        return weight.data_ptr(), tuple(weight.shape), self.tp_group, self.reduce_hidden_grad


def project_input(
    layer: torch.nn.Module,
    tp_group: Optional[dist.ProcessGroup],
    input_: torch.Tensor,
    weight: Optional[torch.Tensor],
    owner: str,
) -> Tuple[torch.Tensor, HeadCall]:
    """What the output layer's projection needs, without projecting: ``input_ [s/TP if sequence
    parallel else s, b, h]`` -> ``hidden [s, b, h]`` (gathered along the sequence when the layer is
    sequence parallel) and the ``HeadCall`` for it. ``weight`` is the tied embedding's, or
    ``None`` for the layer's own; ``owner`` names the model."""
    expected = (layer.output_size_per_partition, layer.input_size)
    if weight is None:
        if layer.weight is None:
            raise RuntimeError("the output layer owns no weight and none was passed as weight=")
        weight = layer.weight
    elif tuple(weight.shape) != expected:
        raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, not {expected} as expected")
    if layer.sequence_parallel:
        # Its backward reduce-scatters the ranks' partial hidden gradients: the one reduction.
        hidden = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=tp_group)
        reduce_hidden_grad = False
    else:
        hidden = input_
        reduce_hidden_grad = not getattr(layer, "disable_grad_reduce", False)
    if not torch.is_grad_enabled():
        weight = weight.detach()
    return hidden, HeadCall(weight, tp_group, reduce_hidden_grad, owner, labels_ignore_index(layer))


@dataclass(frozen=True)
class LogprobRequest:
    """Log-probs (and entropy): the arguments of ``FusedLMHead.logprobs``, also the
    ``output_processor_context`` asking for them. ``targets`` ``[b, s]`` integer global ids; ``None``
    takes the forward's ``labels`` (hook route); ``temperature`` a number or a float ``[b, s]``
    tensor; ``kept_tokens`` each row's kept set (``fused_linear_logprob``; ``head.logprobs`` only).
    The answer: ``logprob [b, s]`` float32, or ``(logprob, entropy)``."""

    targets: Optional[torch.Tensor] = None
    temperature: Union[float, torch.Tensor] = 1.0
    return_entropy: bool = False
    entropy_grad: bool = True
    mask: Optional[torch.Tensor] = None
    max_rows: Optional[int] = None
    kept_tokens: Optional[KeptTokens] = None


@dataclass(frozen=True)
class LossRequest:
    """A loss known in the forward: the arguments of ``FusedLMHead.loss`` (``loss_inputs`` a dict
    of ``[b, s]`` or ``[b, s, ...]`` tensors, ``mask`` bool ``[b, s]`` with ``max_rows`` a bound on
    the positions it selects, ``main_grad_scale`` the upstream gradient the loss will receive, to
    add the weight gradient into ``main_grad`` in the forward; ``kept_tokens`` as for
    ``LogprobRequest``), also the ``output_processor_context`` asking for it. The answer:
    ``FusedLoss(loss, logprob, entropy)``."""

    targets: Optional[torch.Tensor]
    loss_fn: LossFn
    loss_inputs: Optional[Dict[str, torch.Tensor]] = None
    mask: Optional[torch.Tensor] = None
    temperature: Union[float, torch.Tensor] = 1.0
    main_grad_scale: Optional[float] = None
    kept_tokens: Optional[KeptTokens] = None
    max_rows: Optional[int] = None


@dataclass(frozen=True)
class TopkRequest:
    """Each position's ``k`` most likely tokens: the arguments of ``FusedLMHead.topk``, also the
    ``output_processor_context`` asking for them. The answer: ``(logprobs [b, s, k] float32, ids
    [b, s, k] int64)``, forward only."""

    k: int
    temperature: Union[float, torch.Tensor] = 1.0


Request = Union[LogprobRequest, LossRequest, TopkRequest]


def _op_arguments(call: HeadCall, config: FusedLMConfig) -> Dict[str, Any]:
    # What every fused op takes from the projection call and the config.
    return dict(
        tp_group=call.tp_group,
        backend=config.backend,
        token_chunk=config.token_chunk,
        reduce_hidden_grad=call.reduce_hidden_grad,
        vocab_size=config.vocab_size,
        softcap=config.softcap,
    )


def answer(call: HeadCall, config: FusedLMConfig, hidden: torch.Tensor, request: Request):
    """``request`` by the fused op, for one projection ``call``; its tensors are laid out as
    ``hidden.shape[:-1]``."""
    if isinstance(request, TopkRequest):
        return fused_linear_topk(
            hidden,
            call.weight,
            request.k,
            tp_group=call.tp_group,
            temperature=request.temperature,
            backend=config.backend,
            token_chunk=config.token_chunk,
            vocab_size=config.vocab_size,
            softcap=config.softcap,
        )
    arguments = dict(
        _op_arguments(call, config),
        temperature=request.temperature,
        mask=request.mask,
        max_rows=request.max_rows,
        batch_invariant=config.batch_invariant,
        kept_tokens=request.kept_tokens,
    )
    if isinstance(request, LogprobRequest):
        return fused_linear_logprob(
            hidden,
            call.weight,
            request.targets,
            return_entropy=request.return_entropy,
            entropy_grad=request.entropy_grad,
            **arguments,
        )
    weight, accumulation = main_grad_route(call.weight, request.main_grad_scale, call.owner)
    return fused_linear_loss(
        hidden, weight, request.targets, request.loss_fn, loss_inputs=request.loss_inputs, **accumulation, **arguments
    )


def answer_from_logits(
    layer: torch.nn.Module,
    tp_group: Optional[dist.ProcessGroup],
    config: FusedLMConfig,
    logits: torch.Tensor,
    request: Request,
):
    """``request`` computed the stock way, from ``layer``'s logits ``[..., vocab/TP]`` (split over
    ``tp_group``) or ``[..., vocab]`` (gathered); a ``main_grad_scale`` does not apply."""
    full_vocab = getattr(layer, "output_size", None)
    if full_vocab is not None and logits.dim() > 0 and logits.shape[-1] == full_vocab:
        tp_group = None  # gathered: nothing to merge across ranks
    if isinstance(request, TopkRequest):
        return logits_topk(
            logits,
            request.k,
            tp_group=tp_group,
            temperature=request.temperature,
            token_chunk=config.token_chunk,
            vocab_size=config.vocab_size,
            softcap=config.softcap,
        )
    arguments = dict(
        tp_group=tp_group,
        temperature=request.temperature,
        mask=request.mask,
        max_rows=request.max_rows,
        token_chunk=config.token_chunk,
        kept_tokens=request.kept_tokens,
        vocab_size=config.vocab_size,
        softcap=config.softcap,
    )
    if isinstance(request, LogprobRequest):
        return logits_logprob(
            logits,
            request.targets,
            return_entropy=request.return_entropy,
            entropy_grad=request.entropy_grad,
            **arguments,
        )
    return logits_loss(logits, request.targets, request.loss_fn, loss_inputs=request.loss_inputs, **arguments)


def main_grad_route(
    weight: torch.Tensor, main_grad_scale: Optional[float], owner: str
) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """``(weight, arguments)`` for a three-GEMM op: with a ``main_grad_scale`` and a weight gradient
    to compute, the weight behind ``MainGradWritten`` and its ``main_grad`` (named after ``owner``
    in the ops' reports) as ``weight_grad_into``; otherwise the weight as it is and none."""
    if main_grad_scale is None or not (weight.requires_grad and torch.is_grad_enabled()):
        return weight, {}
    into = float32_main_grad(weight)
    name_weight_grad_into(into, f"the main_grad of {owner}'s output weight")
    return MainGradWritten.apply(weight), dict(weight_grad_into=into, weight_grad_scale=main_grad_scale)


def output_weight(chunk: torch.nn.Module, layer: torch.nn.Module) -> torch.Tensor:
    """The weight an output ``layer`` of model ``chunk`` projects with: its own, or the tied embedding's."""
    return layer.weight if layer.weight is not None else chunk.shared_embedding_or_output_weight()


def outstanding_main_grads(layers: List[Tuple[torch.nn.Module, torch.nn.Module]], forget_released: bool) -> List[str]:
    """``outstanding_weight_grads`` of the ``main_grad`` of each ``(chunk, output layer)``'s weight
    (the tied embedding's where the layer owns none), where Megatron's DDP gave it one."""
    outstanding = []
    for chunk, layer in layers:
        weight = output_weight(chunk, layer)
        main_grad = getattr(weight, "main_grad", None)
        if isinstance(main_grad, torch.Tensor):
            outstanding += outstanding_weight_grads(main_grad, forget_released=forget_released)
    return outstanding


def check_labels(labels: torch.Tensor, hidden: torch.Tensor, declared: Optional[torch.Tensor]) -> None:
    """``labels [b, s]``, one id per position of the hidden states ``[s, b, h]`` (the model's layout,
    so the error names the labels' own), and declared loss weights of the labels' shape."""
    positions = (hidden.shape[1], hidden.shape[0]) if hidden.dim() == 3 else None
    if labels.dim() != 2 or (positions is not None and tuple(labels.shape) != positions):
        raise ValueError(
            f"labels {tuple(labels.shape)} must be [b, s]{'' if positions is None else f' = {positions}'}: the "
            "labels path takes one id per position (several ids per position, [b, s, k], are for head.logprobs "
            "and head.loss)"
        )
    if declared is not None and declared.shape != labels.shape:
        raise ValueError(
            f"the declared loss weights have shape {tuple(declared.shape)} but the labels {tuple(labels.shape)}; "
            "declare this batch's weights before its forward, or clear them with declare_loss_weights(None)"
        )


def call_labels_loss(
    call: HeadCall,
    config: FusedLMConfig,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    declared: Optional[torch.Tensor],
    main_grad_scale: Optional[float] = None,
) -> torch.Tensor:
    """The labels path's per-token cross-entropy for one projection ``call``: ``-logprob`` (four
    GEMMs), or ``fused_linear_cross_entropy`` for the ``declared`` weights (three; with a
    ``main_grad_scale``, into ``main_grad``) unless the config asks for batch invariance, which
    that op's one scale fitted over all rows cannot keep. A label outside the vocabulary (``-100`` padding)
    scores as the stock loss scores it (``megatron_compat.labels_ignore_index``): the row's largest
    logit, or under TransformerEngine's fused cross-entropy 0 with no gradient for its
    ``ignore_idx`` and an error for any other id."""
    kept, out_of_vocab = None, "max_logit"
    if call.labels_ignore_index is not None:
        kept, out_of_vocab = targets != call.labels_ignore_index, "error"
        targets = torch.where(kept, targets, 0)  # any id: its loss is multiplied by 0 below
        declared = None if declared is None else declared * kept
    arguments = dict(_op_arguments(call, config), out_of_vocab=out_of_vocab)
    try:
        if declared is None or config.batch_invariant:
            losses = -fused_linear_logprob(
                hidden, call.weight, targets, batch_invariant=config.batch_invariant, **arguments
            )
        else:
            weight, accumulation = main_grad_route(call.weight, main_grad_scale, call.owner)
            losses = fused_linear_cross_entropy(hidden, weight, targets, declared, **accumulation, **arguments)
    except RanksDisagree as error:
        if not error.differing:
            raise
        # The op names its own arguments; what the trainer gave differently is the labels path's batch.
        given = sorted({LABELS_PATH_INPUTS.get(name, name) for name in error.differing})
        raise RanksDisagree(
            f"model(..., labels=) (the labels path of {call.owner}): the ranks of its tensor-parallel group were "
            f"given different {', '.join(given)}; every rank of the group must get the same labels [b, s] (and "
            "declared loss weights)",
            error.differing,
        ) from None
    return losses if kept is None else losses * kept


# What the labels path's op inputs are to its caller, by the rank check's names (``rank_check.NAMES``).
LABELS_PATH_INPUTS = {
    "targets": "labels",
    "the rows' shape": "batch shapes",
    "loss_inputs": "declared loss weights (declare_loss_weights)",
}


def running_backend(config: FusedLMConfig, layers: List[Tuple[torch.nn.Module, torch.nn.Module]]) -> str:
    """The backend the fused ops run for the output weight of ``layers`` (``(chunk, output layer)``
    pairs): ``config.backend`` resolved for the weight's device, as each op call resolves it (so
    ``"torch"`` where ``"triton"`` or ``"auto"`` cannot run there)."""
    return resolved_backend(config.backend, output_weight(*layers[-1]).device)


def log_route(
    owner: str,
    route: str,
    config: FusedLMConfig,
    layers: List[Tuple[torch.nn.Module, torch.nn.Module]],
    fallback_reason: Optional[str],
) -> None:
    """One INFO line saying whether the fused head computes for ``owner`` (a model's name) through
    ``route``, and why not, or with which backend at which tensor-parallel size."""
    if not config.enabled:
        outcome = "stays stock: the config leaves the fused head off (fused_linear_logprob, FusedLMConfig.enabled)"
    elif not layers:
        outcome = "stays stock: no output layer on this pipeline stage"
    elif fallback_reason is not None:
        outcome = f"stays stock: {fallback_reason}"
    else:
        chunk, layer = layers[-1]
        group = tensor_parallel_group(chunk, layer)
        size = dist.get_world_size(group) if group is not None else 1
        weight = output_weight(chunk, layer)
        # Triton runs on CUDA only: elsewhere the torch backend, said without resolving (and warning) now for
        # a model that may move to a GPU before its first call.
        backend = running_backend(config, layers) if weight.device.type == "cuda" else "torch"
        outcome = (
            f"computes with the fused head: backend {backend!r} on {weight.device.type} (asked: {config.backend!r}), "
            f"TP={size}, {len(layers)} chunk{'s' if len(layers) > 1 else ''}; its forward returns the hidden states "
            f"[..., {layer.input_size}] where the stock model returns logits: hand them to the head, not to "
            "log_softmax or a cross-entropy"
        )
    logger.info(f"megatron_fused_lm: {owner}, {route}, {outcome}.")
