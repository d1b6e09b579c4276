"""The fused head through Megatron-Core's own extension point (megatron-core >= 0.18):
``GPTModel.forward(..., output_processor=..., output_processor_context=...)`` hands the final
hidden states and the output layer to a caller's function and returns what it returns. Nothing
is patched: the model stays stock, and a forward without the processor returns the stock logits.

    processor = FusedOutputProcessor(model, config)
    logprob, entropy = model(tokens, positions, mask, output_processor=processor,
                             output_processor_context=LogprobRequest(targets, return_entropy=True))
    result = model(tokens, positions, mask, output_processor=processor,
                   output_processor_context=LossRequest(targets, loss_fn, loss_inputs=inputs, mask=response))
    per_token = model(tokens, positions, mask, labels=labels, loss_mask=loss_mask, output_processor=processor)
    per_token = model(tokens, positions, mask, labels=labels, loss_mask=loss_mask, output_processor=processor,
                      output_processor_context=LabelsRequest(main_grad_scale=scale))

A request gets what ``FusedLMHead.logprobs`` / ``FusedLMHead.loss`` return for the same arguments;
the labels path, the stock per-token loss ``[b, s]``, as the patched model does.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch

from .._logging import warn_once
from .calls import (
    LogprobRequest,
    LossRequest,
    Request,
    TopkRequest,
    answer,
    answer_from_logits,
    call_labels_loss,
    check_labels,
    log_route,
    outstanding_main_grads,
    project_input,
)
from .config import FusedLMConfig
from .megatron_compat import (
    derives_mtp_metrics_from_logits,
    fallback_reason,
    model_chunks,
    model_name,
    module_chains,
    output_layers,
    tensor_parallel_group,
)


@dataclass(frozen=True)
class LabelsRequest:
    """``output_processor_context`` for the labels path (``labels=`` and ``loss_mask=`` given to the
    forward), which returns the stock per-token loss ``[b, s]`` float32 as without a context.

    ``main_grad_scale``: for a processor made with ``declare_loss_mask=True``, the scale ``c`` of
    this step's ``c * sum(losses * loss_mask)`` (it can change every step, hence per call), as
    ``FusedLMHead.declare_loss_weights(loss_mask, main_grad_scale=c)`` takes it."""

    main_grad_scale: Optional[float] = None


def accepts_output_processor(model: Any) -> bool:
    """Whether every language model in ``model`` takes ``output_processor=`` in its forward
    (megatron-core's GPTModel from 0.18): read from the forward's signature, not the release."""
    layers = output_layers(module_chains(model))
    return bool(layers) and all("output_processor" in inspect.signature(type(c).forward).parameters for c, _ in layers)


class FusedOutputProcessor:
    """The function to pass as ``output_processor=`` to a Megatron-Core language model.

    Args:
        model: the model it will be passed to (as ``wrap_model`` takes it), only checked.
        config: ``FusedLMConfig``; disabled, the processor computes the stock way (logits).
        declare_loss_mask: on the labels path (``labels=`` given), declare the forward's
            ``loss_mask`` as the loss weights, as ``FusedLMHead.declare_loss_weights`` does; the
            scale, for the ``main_grad`` route, comes with each call (``LabelsRequest``).

    Attributes:
        fused, fallback_reason: as ``FusedLMHead``'s (not fused: computed from the stock logits).

    Raises:
        RuntimeError: the model's forward takes no ``output_processor`` (megatron-core < 0.18);
            use ``wrap_model`` there.
    """

    def __init__(
        self,
        model: Any,
        config: FusedLMConfig,
        *,
        declare_loss_mask: bool = False,
    ):
        if not isinstance(config, FusedLMConfig):
            raise TypeError(f"config must be a FusedLMConfig, got {type(config).__name__}")
        if not accepts_output_processor(model):
            names = sorted({type(chunk).__name__ for chunk in model_chunks(model)})
            raise RuntimeError(
                f"the model ({', '.join(names)}) takes no output_processor= in its forward (megatron-core's "
                "GPTModel has it from 0.18); use wrap_model(model, config) instead"
            )
        self.config = config
        self.declare_loss_mask = declare_loss_mask
        self.name = model_name(model_chunks(model))
        self._layers = output_layers(module_chains(model))
        self._groups = {id(layer): tensor_parallel_group(chunk, layer) for chunk, layer in self._layers}
        self.fallback_reason = fallback_reason(self._layers) if config.enabled else None
        log_route(
            self.name, "output_processor", config=config, layers=self._layers, fallback_reason=self.fallback_reason
        )
        if self.fallback_reason is not None:
            warn_once(
                f"megatron_fused_lm: the fused output processor computes from the stock logits: {self.fallback_reason}."
            )
        elif config.enabled and any(derives_mtp_metrics_from_logits(chunk) for chunk, _ in self._layers):
            warn_once(
                "megatron_fused_lm: with the fused output processor, Megatron computes the multi-token-prediction "
                "losses (and their metrics) from its own logits before the processor runs."
            )
        self.fused = config.enabled and self.fallback_reason is None

    def __call__(
        self,
        *,
        hidden_states: torch.Tensor,
        output_layer: torch.nn.Module,
        output_weight: Optional[torch.Tensor],
        labels: Optional[torch.Tensor],
        loss_mask: Optional[torch.Tensor],
        context: Any,
        runtime_gather_output: Optional[bool],
        compute_language_model_loss: Callable,
        scale_logits: Callable,
        **_: Any,
    ):
        """Called by the model's forward with its final hidden states ``[s/TP if sequence parallel
        else s, b, h]``; returns what ``context`` asks for (see the request classes), or with
        ``context`` ``None`` or a ``LabelsRequest`` the per-token cross-entropy ``[b, s]`` float32
        of ``labels [b, s]``."""
        if id(output_layer) not in self._groups:
            raise RuntimeError("this FusedOutputProcessor was made for another model; make one for this model")
        if context is not None and not isinstance(context, (LogprobRequest, LossRequest, TopkRequest, LabelsRequest)):
            raise TypeError(
                "output_processor_context must be a LogprobRequest, a LossRequest, a TopkRequest or a LabelsRequest, "
                f"got {type(context).__name__}"
            )
        if getattr(context, "kept_tokens", None) is not None:
            # The sets follow the [b, s] order of the rows; this route works in the hidden states' [s, b].
            raise NotImplementedError(
                "kept_tokens in an output_processor_context: pass them to head.logprobs / head.loss on the model's "
                "output instead"
            )
        labels_path = context is None or isinstance(context, LabelsRequest)
        if labels_path:
            if labels is None:
                raise ValueError(
                    "the fused output processor needs labels= or an output_processor_context (LogprobRequest, "
                    "LossRequest, TopkRequest); for logits, call the model without output_processor"
                )
            main_grad_scale = None if context is None else context.main_grad_scale
            declared = loss_mask if self.declare_loss_mask else None
            if main_grad_scale is not None and declared is None:
                raise ValueError(
                    "LabelsRequest(main_grad_scale=) is the scale of the declared loss mask: make the processor with "
                    "declare_loss_mask=True and pass loss_mask= to the forward"
                )
        elif not isinstance(context, TopkRequest) and context.targets is None:
            if labels is None:
                raise ValueError("the request has no targets and the forward no labels")
            context = dataclasses.replace(context, targets=labels)
        group = self._groups[id(output_layer)]
        if not self.fused:
            logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
            logits = scale_logits(logits)
            if labels_path:
                return compute_language_model_loss(labels, logits)
            return answer_from_logits(
                output_layer, group, config=self.config, logits=logits.transpose(0, 1), request=context
            )
        hidden, call = project_input(output_layer, group, input_=hidden_states, weight=output_weight, owner=self.name)
        hidden = scale_logits(hidden)  # a scalar (MuP), which commutes with the projection
        # [s, b] throughout, the hidden states' layout; the results come back [b, s].
        if labels_path:
            check_labels(labels, hidden, declared)
            losses = call_labels_loss(
                call,
                self.config,
                hidden=hidden,
                targets=_swap(labels),
                declared=_swap(declared),
                main_grad_scale=main_grad_scale,
            )
            return _batch_first(losses)
        result = answer(call, self.config, hidden, _sequence_first(context))
        if isinstance(context, LossRequest):
            return result._replace(logprob=_batch_first(result.logprob), entropy=_batch_first(result.entropy))
        if isinstance(context, TopkRequest) or context.return_entropy:
            return tuple(map(_batch_first, result))
        return _batch_first(result)

    def main_grad_outstanding(self, *, forget_released: bool = False) -> List[str]:
        """As ``FusedLMHead.main_grad_outstanding``, for this processor's main_grad-route losses
        (``LossRequest(main_grad_scale=)``, ``LabelsRequest(main_grad_scale=)``)."""
        return outstanding_main_grads(self._layers, forget_released)


def _sequence_first(request: Request) -> Request:
    """``request`` with its ``[b, s]`` tensors (and those of its dicts: ``loss_inputs``) as
    ``[s, b]`` views, the hidden states' layout; a 0-dim one (a temperature for all rows) as it is."""
    swapped = {}
    for field in dataclasses.fields(request):
        value = getattr(request, field.name)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            swapped[field.name] = _swap(value)
        elif isinstance(value, dict):
            swapped[field.name] = {name: _swap(tensor) for name, tensor in value.items()}
    return dataclasses.replace(request, **swapped)


def _swap(value: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``[b, s, ...]`` <-> ``[s, b, ...]`` as a view; ``None`` kept."""
    return None if value is None else value.transpose(0, 1)


def _batch_first(value: torch.Tensor) -> torch.Tensor:
    """A result ``[s, b]`` as the ``[b, s]`` a caller gets from the stock model."""
    return value.transpose(0, 1).contiguous()
