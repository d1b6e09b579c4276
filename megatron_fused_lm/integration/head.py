"""Patching a Megatron-Core language model so that its LM head never builds the logits, and the
``FusedLMHead`` that turns what the model returns into per-token log-probs and entropy.

While a model is wrapped, its output layer returns ``(hidden [s, b, h], None)`` in the model's own
forward (``_Patch.output_layer_forward``), so the model returns ``hidden [b, s, h]`` where the stock
model returns ``logits [b, s, vocab/TP]``; ``model(..., labels=labels)`` still returns the stock
per-token loss (``_Patch.compute_language_model_loss``). Every other use of the output layer gets
what the stock layer returns (``_Patch.stock_reason``): a call from outside the model's forward
(an MTP adapter, a trainer's probe), an inference forward (a generation engine's), a forward with
an ``output_processor`` of the caller's, and ``head.stock_logits()``. The patches are instance
attributes, which ``unwrap_model`` deletes; ``copy.deepcopy`` of a patched module gives a stock copy.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import inspect
import logging
import os
import sys
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, Union

import torch

from .._logging import log_once, warn_once
from ..ops import FusedLoss, KeptTokens, LossFn
from . import provenance
from .calls import (
    HeadCall,
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
    running_backend,
)
from .config import FusedLMConfig
from .megatron_compat import (
    derives_mtp_metrics_from_logits,
    fallback_reason,
    model_chunks,
    model_name,
    module_chains,
    output_layer_of,
    output_layers,
    stock_logits_reason,
    tensor_parallel_group,
)

# Instance attribute set on a patched output layer and on a patched model chunk; holds the
# `_Patch` that owns them.
PATCH_ATTRIBUTE = "_megatron_fused_lm_patch"
_NOT_SET = object()
# Why the output layer returns the stock logits to a caller that is not the model's forward.
OUTSIDE_FORWARD = "a call from outside the model's forward"
# The keyword arguments of Megatron's LinearCrossEntropyModule (its dev branch's output layer under
# cross_entropy_fusion_impl="linear") and their stock defaults: the labels path in the output layer.
LINEAR_CROSS_ENTROPY_OPTIONS = {
    "output_cross_entropy_loss": False,
    "labels": None,
    "reduction": "none",
    "ignore_index": -100,
}
# Where the frames between the output layer and whoever called it come from: torch's module call.
_TORCH_MODULES = os.path.join("torch", "nn", "modules", "")


class _Patch:
    """The patches of one model chunk, and how to take them off. ``chain``: the modules a call of
    the chunk passes through (``module_chains``), the chunk last."""

    def __init__(self, head: "FusedLMHead", chain: List[torch.nn.Module], layer: torch.nn.Module):
        self.head = head
        self.chain = chain
        self.chunk = chain[-1]
        self.layer = layer
        self.tp_group = tensor_parallel_group(self.chunk, layer)

    def apply(self) -> None:
        replacements = [
            (self.layer, "forward", self.output_layer_forward),
            (self.chunk, "compute_language_model_loss", self.compute_language_model_loss),
            # copy.deepcopy looks __deepcopy__ up on the instance: without these it would copy the
            # patch (its head, its sentinel) into the copy, which then computes neither way.
            (self.layer, "__deepcopy__", functools.partial(self.copy_stock, self.layer)),
            (self.layer, PATCH_ATTRIBUTE, self),
            (self.chunk, PATCH_ATTRIBUTE, self),
        ]
        replacements += [(module, "__deepcopy__", functools.partial(self.copy_stock, module)) for module in self.chain]
        # An instance attribute that was there before (someone else's patch) comes back on remove.
        self.replaced = [(owner, name, owner.__dict__.get(name, _NOT_SET)) for owner, name, _ in replacements]
        for owner, name, patched in replacements:
            setattr(owner, name, patched)
        # What each module on the way out returns is tied to the forward that made it (``provenance``).
        self.hooks = [
            hook
            for module in self.chain
            for hook in (
                module.register_forward_pre_hook(self.before_module),
                module.register_forward_hook(self.after_module, always_call=True),
            )
        ]
        # Which forward of the chunk is running, and whether its output layer returns hidden states.
        self.forward_signature = inspect.signature(self.chunk.forward)
        self.hooks += [
            self.chunk.register_forward_pre_hook(self.enter_chunk, with_kwargs=True),
            self.chunk.register_forward_hook(self.leave_chunk, always_call=True),
        ]

    def remove(self) -> None:
        for owner, name, previous in self.replaced:
            if previous is _NOT_SET:
                del owner.__dict__[name]
            else:
                setattr(owner, name, previous)
        for hook in self.hooks:
            hook.remove()
        self.head._detached = True
        _fused_heads.discard(self.head)

    def stock(self, owner: torch.nn.Module, name: str) -> Callable:
        """``owner.name`` as ``unwrap_model`` would leave it: the instance attribute this patch
        replaced, else the class's method bound to ``owner``."""
        for patched_owner, patched_name, previous in self.replaced:
            if patched_owner is owner and patched_name == name and previous is not _NOT_SET:
                return previous
        return getattr(type(owner), name).__get__(owner, type(owner))

    def copy_stock(self, owner: torch.nn.Module, memo: Dict[int, Any]) -> torch.nn.Module:
        """``copy.deepcopy(owner)`` as if it were not patched: what ``copy`` does for a module
        (``__getstate__``, then ``__setstate__`` of the deep-copied state) on its state with this
        patch's attributes taken out and the ones they replaced put back."""
        state = dict(owner.__getstate__())
        for patched_owner, name, previous in self.replaced:
            if patched_owner is owner:
                state.pop(name, None)
                if previous is not _NOT_SET:
                    state[name] = previous
        ours = {hook.id for hook in self.hooks}
        for name in (
            "_forward_pre_hooks",
            "_forward_pre_hooks_with_kwargs",
            "_forward_hooks",
            "_forward_hooks_always_called",
        ):
            if name in state:
                state[name] = type(state[name])((key, value) for key, value in state[name].items() if key not in ours)
        clone = type(owner).__new__(type(owner))
        memo[id(owner)] = clone  # before the state, as copy does: references back to owner get the clone
        clone.__setstate__(copy.deepcopy(state, memo))
        return clone

    def stock_reason(self) -> Optional[str]:
        """Why this call of the output layer gets what the stock layer returns, as a phrase; ``None``
        where it returns the hidden states, which the fused head consumes: inside the chunk's own
        forward (``enter_chunk``), unless that is an inference forward or one with a caller's
        ``output_processor``, and outside ``head.stock_logits()``."""
        if self.head._stock_logits_on():
            return "head.stock_logits()"
        calls = getattr(self.head._thread, "chunk_calls", None)
        if not calls or calls[-1][0] is not self.chunk:
            return OUTSIDE_FORWARD
        return calls[-1][1]

    def output_layer_forward(
        self,
        input_: torch.Tensor,
        weight: Optional[torch.Tensor] = None,
        runtime_gather_output: Optional[bool] = None,
        **options: Any,
    ) -> Tuple[torch.Tensor, None]:
        """``input_ [s/TP if sequence parallel else s, b, h]`` -> ``(hidden [s, b, h], None)`` in the
        chunk's own forward; elsewhere the stock layer's result (``stock_reason``), bitwise.

        ``runtime_gather_output`` has nothing to gather: the hidden is the same on every rank.
        ``options``: those of Megatron's ``LinearCrossEntropyModule``; with
        ``output_cross_entropy_loss=True`` and ``labels [b, s]`` the layer returns the labels path's
        per-token loss ``[b, s]`` float32 (``reduction="none"``, ``ignore_index`` scoring 0).
        """
        reason = self.stock_reason()
        if reason is not None:
            return self.stock_output(
                reason, input_, weight=weight, runtime_gather_output=runtime_gather_output, options=options
            )
        unknown = sorted(set(options) - set(LINEAR_CROSS_ENTROPY_OPTIONS))
        if unknown:
            raise TypeError(f"the fused head's output layer takes no {', '.join(unknown)}")
        options = {**LINEAR_CROSS_ENTROPY_OPTIONS, **options}
        hidden, call = project_input(self.layer, self.tp_group, input_=input_, weight=weight, owner=self.head.name)
        if options["output_cross_entropy_loss"]:
            return self.linear_cross_entropy(hidden, call, options)
        origin = provenance.Origin(weakref.ref(self.head), self.head.name, call, hidden.shape[-1], hidden.device)
        self.head._thread.origin, self.head._thread.returned = origin, provenance.HIDDEN_STATES
        return provenance.traced(hidden, call.weight, origin), None

    def stock_output(
        self,
        reason: str,
        input_: torch.Tensor,
        weight: Optional[torch.Tensor],
        runtime_gather_output: Optional[bool],
        options: Dict[str, Any],
    ) -> Any:
        """The stock layer's result for a call that ``stock_reason`` gives to it, marked (and what the
        model makes of it on the way out), so that the head refuses it as hidden states whatever its
        shape."""
        output = self.stock(self.layer, "forward")(
            input_, weight=weight, runtime_gather_output=runtime_gather_output, **options
        )
        tensor = output[0] if isinstance(output, tuple) else output
        returned = provenance.PER_TOKEN_LOSS if options.get("output_cross_entropy_loss") else provenance.STOCK_LOGITS
        origin = provenance.Origin(weakref.ref(self.head), self.head.name, None, input_.shape[-1], tensor.device)
        provenance.register(tensor, origin, returned)
        if reason == OUTSIDE_FORWARD:
            log_once(
                logging.INFO,
                f"megatron_fused_lm: {_caller_site()} called the output layer of {self.head.name} outside the "
                "model's forward; it gets the stock logits (the fused head computes from what the model's own "
                "forward returns).",
            )
        else:
            self.head._thread.origin, self.head._thread.returned = origin, returned
        return output

    def linear_cross_entropy(self, hidden: torch.Tensor, call: HeadCall, options: Dict[str, Any]) -> torch.Tensor:
        """``LinearCrossEntropyModule``'s ``output_cross_entropy_loss=True``: the labels path's loss
        of ``options["labels"] [b, s]`` on ``hidden [s, b, h]``, a label ``ignore_index`` scoring 0
        with no gradient, as that module's fused cross-entropy scores it."""
        if options["labels"] is None:
            raise ValueError("output_cross_entropy_loss=True needs labels=")
        if options["reduction"] != "none":
            raise NotImplementedError(
                f"the fused head's output layer computes output_cross_entropy_loss with reduction='none' only, "
                f"got reduction={options['reduction']!r}: reduce the per-token loss it returns"
            )
        call = dataclasses.replace(call, labels_ignore_index=options["ignore_index"])
        return self.labels_loss(options["labels"], hidden, call)

    def labels_loss(self, labels: torch.Tensor, hidden: torch.Tensor, call: HeadCall) -> torch.Tensor:
        """``labels [b, s]``, ``hidden [s, b, h]`` -> the per-token cross-entropy ``[b, s]`` float32 by
        the fused op for ``call`` (with the declared loss weights), marked as the labels path's loss,
        so that the head refuses it as hidden states even where ``s`` equals the hidden size."""
        head, declared = self.head, self.head._declared_weights
        check_labels(labels, hidden, declared)
        losses = call_labels_loss(
            call,
            head.config,
            hidden=hidden,
            targets=labels.transpose(0, 1),
            declared=None if declared is None else declared.transpose(0, 1),
            main_grad_scale=head._declared_main_grad_scale,
        )
        origin = provenance.Origin(weakref.ref(head), head.name, call, hidden.shape[-1], hidden.device)
        return provenance.traced(losses.transpose(0, 1).contiguous(), call.weight, origin, provenance.PER_TOKEN_LOSS)

    # The two hooks around the forward of each module on the call's way out: what it returns is tied
    # to the fused forward that ran inside it, if one did (the model's own copies of the hidden
    # states, GPTModel's ``.contiguous()`` and Float16Module's ``.float()``, have no graph under
    # ``no_grad``). A compiled model runs them eagerly, between its graphs.

    @torch.compiler.disable
    def before_module(self, module: torch.nn.Module, args: tuple) -> None:
        thread = self.head._thread
        thread.__dict__.setdefault("outer", []).append(getattr(thread, "origin", None))

    @torch.compiler.disable
    def after_module(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        thread = self.head._thread
        before, origin = thread.outer.pop(), getattr(thread, "origin", None)
        if origin is not None and origin is not before:
            provenance.register(output, origin, thread.returned)

    # The two hooks around the chunk's own forward: while it runs, its output layer returns hidden
    # states unless the call needs the stock logits (``stock_logits_reason``).

    @torch.compiler.disable
    def enter_chunk(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        calls = self.head._thread.__dict__.setdefault("chunk_calls", [])
        calls.append((self.chunk, stock_logits_reason(self.forward_signature, args, kwargs)))

    @torch.compiler.disable
    def leave_chunk(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self.head._thread.chunk_calls.pop()

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``labels [b, s]`` global ids, ``logits``: what the patched output layer returned,
        ``hidden [s, b, h]`` (possibly scaled by MuP) -> per-token cross-entropy ``[b, s]`` float32.
        Where the output layer returned the stock logits (``stock_reason``): the stock loss.

        The model calls this right after its output layer: where nothing establishes the origin
        of ``logits`` (MuP's scaling under ``no_grad`` copies them), this thread's latest call made
        them."""
        head = self.head
        if self.stock_reason() is None:
            latest, head._thread.origin = getattr(head._thread, "origin", None), None
            return self.labels_loss(labels, logits, head._call_for(logits, "the labels path", fallback=latest))
        if fused_head_of(logits) is head:  # called directly on the model's own output (its hidden states)
            return self.labels_loss(labels, logits, head._call_for(logits, "compute_language_model_loss"))
        return self.stock(self.chunk, "compute_language_model_loss")(labels, logits)


def _caller_site() -> str:
    """``file:line (function)`` of the code that called the output layer, past torch's module call."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__ or _TORCH_MODULES in frame.f_code.co_filename):
        frame = frame.f_back
    return (
        "an unknown caller"
        if frame is None
        else f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
    )


class _Found(enum.IntEnum):
    """What a rank finds among the live forwards for a tensor nothing links
    (``FusedLMHead._only_candidate``): none, one of this head's, one of another (or a gone) head's,
    several; ordered so that the most over the ranks is the worst."""

    NONE = 0
    OWN = 1
    OTHER = 2
    SEVERAL = 3


class FusedLMHead:
    """Per-token log-probs and entropy from what a wrapped model returns; made by ``wrap_model``.

    Attributes:
        fused: ``True`` when the model's output layer returns hidden states (the fused path);
            ``False`` when the model is stock (disabled config, a fallback, or no output layer
            on this pipeline stage) and returns logits.
        fallback_reason: ``None``, or the sentence saying why the fused path was not taken.
        name: the model, as messages name it (its class and ``id``).
        backend: the backend that computes (``config.backend`` as resolved for the model's device).

    When fused, the head computes each output with the forward that made it, whatever ran since
    (``provenance``), and refuses an output it cannot trace to one forward of its own model.
    """

    def __init__(self, config: FusedLMConfig, fallback_reason: Optional[str] = None, name: str = "the model"):
        self.config = config
        self.fallback_reason = fallback_reason
        self.name = name
        self.fused = False
        self._patches: List[_Patch] = []
        self._stock_layers: List[Tuple[torch.nn.Module, torch.nn.Module]] = []
        self._declared_weights: Optional[torch.Tensor] = None
        self._declared_main_grad_scale: Optional[float] = None
        self._detached = False
        # Per thread: the depth of stock_logits() contexts and the latest fused forward's origin.
        self._thread = threading.local()

    def logprobs(
        self,
        output: torch.Tensor,
        targets: torch.Tensor,
        *,
        temperature: Union[float, torch.Tensor] = 1.0,
        return_entropy: bool = False,
        entropy_grad: bool = True,
        mask: Optional[torch.Tensor] = None,
        max_rows: Optional[int] = None,
        kept_tokens: Optional[KeptTokens] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Log-probs (and entropy) of ``targets`` under the model's next-token distribution.

        Args:
            output: what the wrapped model returned for this batch: ``hidden [b, s, h]`` when
                ``fused``, else the logits ``[b, s, vocab/TP]`` (or ``[b, s, vocab]`` when the
                model gathered them).
            targets: ``[b, s]`` integer global vocabulary ids, or ``[b, s, k]`` for ``k`` ids per
                position (a teacher's top-k, say), whose log-probs come back ``[b, s, k]``.
            temperature: divides the logits: a positive number, or a float tensor ``[b, s]`` (each
                position its own, e.g. the temperature each rollout was sampled at; no gradient),
                the same on every tensor-parallel rank.
            return_entropy: also return the entropy.
            entropy_grad: ``False`` makes the entropy a metric (no graph, no backward term).
            mask: optional bool ``[b, s]``: only these positions are computed (e.g. the response
                tokens, see ``megatron_fused_lm.packing``); the others are 0 with zero gradient.
                With the fused head the hidden rows are selected before the projection, so the
                head's cost follows the number of selected positions.
            max_rows: with ``mask``, an upper bound on the positions it selects, for a static
                shape (no host synchronization; see ``fused_linear_logprob``).
            kept_tokens: ``KeptTokens(offsets=[rows + 1], token_ids=[nnz])`` integer (int32 or int64; also the pair
                ``(offsets, token_ids)`` or vLLM's ``SamplingMask``, read by name), each computed position's
                kept set (the ids the rollout's top-k / top-p sampler kept), the positions in
                ``[b, s]`` order (with ``mask``, the selected ones): log-prob and entropy over the
                set, renormalized (``fused_linear_logprob``). Its target must be in it.

        Returns:
            ``logprob [b, s]`` (or ``[b, s, k]``) float32, or ``(logprob, entropy)``, the entropy
            ``[b, s]`` float32.

        Raises:
            ValueError: a target id outside the vocabulary (``-100`` padding) at a selected
                position (leave it out with ``mask``); on a GPU a device-side assertion.
            RuntimeError: ``output`` is not traceable to one forward of this model.
        """
        request = LogprobRequest(targets, temperature, return_entropy, entropy_grad, mask, max_rows, kept_tokens)
        return self._answer(output, request, "head.logprobs")

    def loss(
        self,
        output: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: LossFn,
        *,
        loss_inputs: Optional[Dict[str, torch.Tensor]] = None,
        mask: Optional[torch.Tensor] = None,
        max_rows: Optional[int] = None,
        temperature: Union[float, torch.Tensor] = 1.0,
        main_grad_scale: Optional[float] = None,
        kept_tokens: Optional[KeptTokens] = None,
    ) -> FusedLoss:
        """``sum_t loss_fn(logprob_t, entropy_t, inputs_t)``, its gradients finished in the forward
        when fused (``fused_linear_loss``, three GEMMs), else by the backward (``logits_loss``).

        Args:
            output, targets, mask, max_rows, temperature, kept_tokens: as for ``logprobs`` (``mask`` selects the
                summed rows).
            loss_fn: a per-token loss ``loss_fn(logprob [rows], entropy [rows], **inputs) ->
                [rows]`` (``logprob [rows, k]`` for ``targets [b, s, k]``); it must not reduce across
                rows (``fused_linear_loss`` says why). Ready-made: ``megatron_fused_lm.losses``.
            loss_inputs: per-token inputs of ``loss_fn``, a dict of ``[b, s]`` tensors (or with
                trailing dimensions, ``[b, s, k]``).
            main_grad_scale: inside Megatron's DistributedDataParallel, the upstream gradient this
                loss will receive (``1 / num_microbatches``, times any loss scale): the fused head
                then adds that multiple of the output weight's gradient straight into its float32
                ``main_grad`` in the forward (``fused_linear_loss``'s ``weight_grad_into``); another
                upstream gradient is corrected exactly by a second pass, with one warning. ``None``:
                the gradient goes to autograd. The stock head ignores it.

        Returns:
            ``FusedLoss(loss, logprob, entropy)``: ``loss`` a float32 scalar to call ``backward``
            on (once); ``logprob`` (``[b, s]``, or ``[b, s, k]``) and ``entropy`` (``[b, s]``)
            detached float32 metrics. A
            main_grad-route loss released without its backward is logged and listed by
            ``main_grad_outstanding``.
        """
        request = LossRequest(targets, loss_fn, loss_inputs, mask, temperature, main_grad_scale, kept_tokens, max_rows)
        return self._answer(output, request, "head.loss")

    def topk(
        self, output: torch.Tensor, k: int, *, temperature: Union[float, torch.Tensor] = 1.0
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each position's ``k`` most likely tokens under the model's next-token distribution (a
        top-k distillation teacher's side), forward only: ``fused_linear_topk`` when fused, else
        ``logits_topk`` on the logits.

        Args:
            output: what the wrapped model returned, as for ``logprobs``.
            k: tokens per position, from 1 to the vocabulary size.
            temperature: as for ``logprobs``.

        Returns:
            ``(logprobs [b, s, k] float32, ids [b, s, k] int64)``, descending, equal logits by
            ascending id, the same on every tensor-parallel rank.
        """
        return self._answer(output, TopkRequest(k, temperature), "head.topk")

    def declare_loss_weights(self, weights: Optional[torch.Tensor], main_grad_scale: Optional[float] = None) -> None:
        """Declare the per-token weights of the labels-path loss, so that ``model(...,
        labels=labels)`` finishes the gradients in its forward (three GEMMs instead of four).

        Megatron's SFT loss is ``c * sum(losses * loss_mask)`` with ``c`` known only later: declare
        ``loss_mask [b, s]`` (float or bool, the labels' shape, the same on every tensor-parallel
        rank) before the forward; it holds until replaced or cleared with ``None``. The backward
        checks that it receives ``c * weights`` and corrects any other upstream gradient exactly by
        a second pass (``fused_linear_cross_entropy``). ``main_grad_scale``: ``c`` itself, for the
        ``main_grad`` route (as ``loss``'s). A stock head ignores the declaration. The labels path
        takes no temperature (Megatron's has none); ``loss(..., losses.cross_entropy,
        temperature=)`` is SFT at one.
        """
        if weights is not None:
            if not isinstance(weights, torch.Tensor):
                raise TypeError(f"loss weights must be a tensor or None, got {type(weights).__name__}")
            if weights.dim() != 2:
                raise ValueError(f"loss weights must be [b, s] like the labels, got shape {tuple(weights.shape)}")
            weights = weights.detach()
        self._declared_weights = weights
        self._declared_main_grad_scale = None if weights is None else main_grad_scale

    @contextlib.contextmanager
    def stock_logits(self) -> Iterator[None]:
        """Inside ``with head.stock_logits():`` the wrapped model computes as if unwrapped, bitwise
        the stock logits and loss with the stock backward (declared loss weights do not apply), for
        generation and evaluation::

            with head.stock_logits():
                logits = model(input_ids, position_ids, attention_mask)

        It holds for the thread that entered it and nests. ``RuntimeError`` if the model was
        unwrapped or wrapped again since."""
        self._check_attached()
        state = self._thread
        state.depth = getattr(state, "depth", 0) + 1
        try:
            yield
        finally:
            state.depth -= 1

    @property
    def backend(self) -> Optional[str]:
        """The backend the fused ops run for this model: ``config.backend`` resolved for the output
        weight's device (``"torch"`` where the Triton one cannot run there; ``"auto"`` made
        ``"triton"`` or ``"torch"``); ``None`` when the head is not fused (the stock logits path)."""
        return running_backend(self.config, self._stock_layers) if self.fused else None

    def _stock_logits_on(self) -> bool:
        return getattr(self._thread, "depth", 0) > 0

    def _check_attached(self) -> None:
        if self._detached:
            raise RuntimeError("this FusedLMHead's model was unwrapped or wrapped again; use the newest head")

    def main_grad_outstanding(self, *, forget_released: bool = False) -> List[str]:
        """One sentence for each main_grad-route loss of this head whose forward added the output
        weight's gradient into ``main_grad`` and whose backward has not run (waiting, or released
        without it). Empty before the optimizer step means ``main_grad`` holds no gradient without
        its backward. Released losses stay listed until ``forget_released=True`` (after the step
        is skipped or the buffers zeroed)."""
        return outstanding_main_grads(self._stock_layers, forget_released)

    # Eager under torch.compile (one graph break): it walks the output's autograd graph, which Dynamo
    # cannot trace.
    @torch.compiler.disable
    def _call_for(self, output: torch.Tensor, caller: str, fallback: Optional[provenance.Origin] = None) -> HeadCall:
        """The output-layer call to compute ``output`` with (``provenance``): that of the forward its
        graph leads back to; else, without gradients into the weight (the stock logits of such a
        tensor have none), that of the forward whose output shares its storage, ``fallback``, or
        the one live forward that could have made it."""
        self._check_attached()
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{caller} expected the wrapped model's output, a tensor; got {type(output).__name__}")
        # Where it comes from first: a per-token loss or logits is named as such whatever its shape.
        marks = provenance.graph_marks(output) if output.grad_fn is not None else set()
        self._refuse_other_returns({mark.returned for mark in marks}, output, caller)
        mark = None if marks else provenance.storage_mark(output)  # a graph that names its forward decides
        if mark is not None:
            self._refuse_other_returns({mark.returned}, output, caller)
        self._check_hidden(output, caller)
        traced = {mark.origin for mark in marks}
        if len(traced) > 1:
            raise RuntimeError(
                f"{caller}: this tensor derives from the hidden states of {len(traced)} forwards; the head computes "
                "the log-probs of one forward's at a time"
            )
        if traced:
            return self._own(traced.pop(), caller).call
        origin = (mark.origin if mark is not None else None) or fallback or self._only_candidate(output, caller)
        return self._own(origin, caller).call.without_graph()

    @staticmethod
    def _refuse_other_returns(returned: Set[str], output: torch.Tensor, caller: str) -> None:
        """An error naming what ``output`` is, where a forward returned it (or what it derives from)
        instead of hidden states."""
        others = sorted(returned - {provenance.HIDDEN_STATES})
        if others:
            from_logits = (
                "; megatron_fused_lm.logits_logprob computes from logits" if provenance.STOCK_LOGITS in others else ""
            )
            raise ValueError(
                f"{caller} expected the hidden states that the wrapped model returns with the fused head on; got a "
                f"tensor of shape {tuple(output.shape)} made from {' and '.join(others)}. Run the forward without "
                f"labels= (and outside head.stock_logits()) for the hidden states{from_logits}"
            )

    def _own(self, origin: provenance.Origin, caller: str) -> provenance.Origin:
        """``origin`` if this head's forward made it, else an error naming both models."""
        if origin.head is None:
            raise RuntimeError(
                f"{caller}: this tensor was made by a forward of {origin.head_name}, whose head is gone (the model "
                "was dropped): no other head computes it"
            )
        if origin.head is not self and origin.head_name == self.name:
            raise RuntimeError(
                f"{caller}: this tensor was made by a forward of {self.name} under an earlier wrap_model of it, "
                "whose head no longer computes: run the forward again"
            )
        if origin.head is not self:
            raise RuntimeError(
                f"{caller}: this tensor was made by a forward of {origin.head_name}, another wrapped model, not of "
                f"{self.name}, whose head this is: give it to the head of the model that made it"
            )
        return origin

    def _check_hidden(self, output: torch.Tensor, caller: str) -> None:
        """``output`` has the last dimension of the hidden states, or an error naming what it has."""
        layer = self._stock_layers[-1][1]
        if output.dim() > 0 and output.shape[-1] == layer.input_size:
            return
        got = f"a tensor of shape {tuple(output.shape)}"
        if output.dim() > 0 and output.shape[-1] in (layer.output_size_per_partition, layer.output_size):
            got += (
                ", which looks like logits (the model returns them inside head.stock_logits(), or unwrapped); "
                "megatron_fused_lm.logits_logprob computes from logits"
            )
        raise ValueError(
            f"{caller} expected the hidden states [..., {layer.input_size}] that the wrapped model returns with the "
            f"fused head on; got {got}"
        )

    def _only_candidate(self, output: torch.Tensor, caller: str) -> provenance.Origin:
        """A live forward that could have made ``output``, whose origin nothing establishes, where
        every such forward computes alike without a graph (one model, one output weight).

        The ranks of the tensor-parallel group decide together, at one all-reduce and one host read
        on this path only: a collective's pending work (gloo's worker threads, NCCL's watchdog) can
        hold a freed output's memory a moment longer on some ranks, and ranks that decided alone
        could part, one raising while the others wait in the op's collectives."""
        candidates = provenance.live_origins(output.shape[-1], output.device)
        # The weak reference, not the head: one whose head is gone could still have made the tensor.
        forwards = len({(id(origin.head_ref), *origin.call.key()) for origin in candidates})
        # What this rank found: none, one of this head's forwards, one of another (or gone) head's, several.
        if forwards != 1:
            found = _Found.SEVERAL if forwards else _Found.NONE
        else:
            found = _Found.OWN if candidates[-1].head is self else _Found.OTHER
        fewest, most = self._range_over_ranks(found, output)
        if fewest == most == _Found.OWN:
            return candidates[-1]
        if found == _Found.OTHER:
            self._own(candidates[-1], caller)  # raises, naming whose forward it is
        unlinked = (
            f"{caller}: nothing links this tensor (shape {tuple(output.shape)}) to the forward that made it: no graph "
            "leads back to one and it shares no forward's memory (a copy made without gradients, such as .float() "
            "or .contiguous() under no_grad, keeps neither)"
        )
        copy_advice = "pass the output itself or a view of it, or copy it with gradients on"
        if found == _Found.SEVERAL:
            names = sorted({origin.head_name for origin in candidates})
            raise RuntimeError(
                f"{unlinked}, and forwards of {', '.join(names)} whose outputs are alive could have made it; {copy_advice}"
            )
        elsewhere = f"{unlinked}, and on another rank of the tensor-parallel group"
        if most == _Found.SEVERAL:
            raise RuntimeError(
                f"{elsewhere} several forwards whose outputs are alive could have made it; {copy_advice}"
            )
        if most == _Found.OTHER:
            raise RuntimeError(
                f"{elsewhere} the one live forward that could have made it is not {self.name}'s; {copy_advice}"
            )
        where = "" if most == _Found.NONE else " on some ranks of the tensor-parallel group"
        raise RuntimeError(f"{unlinked}, and no forward's output is alive{where}; pass what the wrapped model returned")

    def _range_over_ranks(self, value: int, output: torch.Tensor) -> Tuple[int, int]:
        """The least and the most of ``value`` over the ranks of the head's tensor-parallel group;
        ``value`` itself while a CUDA graph is captured (no host read there: each rank decides alone)."""
        chunk, layer = self._stock_layers[-1]
        group = tensor_parallel_group(chunk, layer)
        # The model's device, which the group's backend serves (a CPU copy handed over under NCCL too).
        device = next(chunk.parameters(), output).device
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if group is None or capturing or torch.distributed.get_world_size(group) == 1:
            return value, value
        both = torch.tensor([value, -value], device=device)
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=group)
        most, negated_fewest = both.tolist()
        return -negated_fewest, most

    def _answer(self, output: torch.Tensor, request: Request, caller: str):
        """``request`` for the output of this head's model: fused, or from the stock logits."""
        if self.fused:
            return answer(self._call_for(output, caller), self.config, output, request)
        if not self._stock_layers:
            raise RuntimeError("this pipeline stage has no output layer, so there are no log-probs to compute")
        chunk, layer = self._stock_layers[-1]
        return answer_from_logits(
            layer, tensor_parallel_group(chunk, layer), config=self.config, logits=output, request=request
        )


def fused_head_of(output: Any) -> Optional[FusedLMHead]:
    """The fused head whose wrapped model's forward returned ``output`` (its hidden states, or a view
    or copy of them with gradients, or one tied to them with ``tie_to_forward``), or ``None`` for a
    tensor no fused model returned: the stock logits, an unwrapped model's output, a loss. What lets
    a trainer's own log-prob code hand the fused model's output to its head and compute anything else
    the stock way; it decides by where the tensor comes from (its autograd graph, its storage), as
    the head does.

    Raises:
        RuntimeError: ``output`` has a fused model's hidden size but nothing tells where it comes
            from (a copy made without gradients, whose original is gone): computing it the stock
            way could read hidden states as logits.
    """
    origin = _hidden_origin(output)
    if origin is not None and origin.head is None:
        raise RuntimeError(
            f"this tensor was made by a forward of {origin.head_name}, whose head is gone (the model was dropped)"
        )
    return None if origin is None else origin.head


def tie_to_forward(copy: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Mark ``copy``, a tensor made from a wrapped model's output ``source`` without gradients (its rows
    laid out anew, as SkyRL's ``recover_left_padding`` does under ``no_grad``), as coming from the
    forward that made ``source``, so that the head and ``fused_head_of`` take it as they take
    ``source``; returns ``copy``. Nothing happens where ``source`` is not a fused model's hidden
    states."""
    origin = _hidden_origin(source)
    if origin is not None:
        provenance.register(copy, origin, provenance.HIDDEN_STATES)
    return copy


def _hidden_origin(output: Any) -> Optional[provenance.Origin]:
    """The forward of a fused model whose hidden states ``output`` holds, by where it comes from; see
    ``fused_head_of``, which raises as this does."""
    if not isinstance(output, torch.Tensor) or output.dim() == 0:
        return None
    heads = [head for head in _fused_heads if head._stock_layers[-1][1].input_size == output.shape[-1]]
    if not heads:  # no fused model returns tensors of this size: nothing to walk
        return None
    marks = provenance.graph_marks(output) if output.grad_fn is not None else set()
    if not marks:
        mark = provenance.storage_mark(output)
        marks = set() if mark is None else {mark}
    if marks:
        if any(mark.returned != provenance.HIDDEN_STATES for mark in marks):
            return None
        origins = {mark.origin for mark in marks}
        if len(origins) > 1:
            raise RuntimeError("this tensor derives from the hidden states of several forwards")
        return origins.pop()
    if output.grad_fn is not None:  # a graph that leads to no fused forward
        return None
    names = ", ".join(sorted({head.name for head in heads}))
    raise RuntimeError(
        f"a tensor of shape {tuple(output.shape)} has the hidden size of {names}, fused, and nothing tells whether "
        "it holds its hidden states or logits (a copy made without gradients keeps no link to its forward): hand "
        "over the model's output itself, or tie a copy to it with tie_to_forward(copy, output)"
    )


# The heads whose models are wrapped and fused: the models whose hidden states ``fused_head_of`` tells.
_fused_heads: "weakref.WeakSet[FusedLMHead]" = weakref.WeakSet()


def wrap_model(model: Any, config: FusedLMConfig) -> FusedLMHead:
    """Patch every output layer of ``model`` for the fused head (when ``config.enabled``) and
    return the head that computes log-probs from the model's outputs.

    ``model``: a Megatron-Core language model (GPTModel or the same ``output_layer`` /
    ``compute_language_model_loss`` API), possibly wrapped (``.module``: DDP, Float16Module), or a
    list of virtual-pipeline chunks. A model wrapped before is unwrapped first. Where an output
    layer cannot be fused exactly the model stays stock, with one warning and
    ``head.fallback_reason``.
    """
    if not isinstance(config, FusedLMConfig):
        raise TypeError(f"config must be a FusedLMConfig, got {type(config).__name__}")
    unwrap_model(model)
    chains = [chain for chain in module_chains(model) if output_layer_of(chain[-1]) is not None]
    head = FusedLMHead(config, name=model_name(model_chunks(model)))
    head._stock_layers = output_layers(chains)
    if config.enabled and chains:
        head.fallback_reason = fallback_reason(head._stock_layers)
    log_route(
        head.name,
        "wrap_model (the patched output layer)",
        config=config,
        layers=head._stock_layers,
        fallback_reason=head.fallback_reason,
    )
    if not config.enabled or not chains:
        return head
    if head.fallback_reason is not None:
        warn_once(f"megatron_fused_lm: the fused LM head falls back to the stock logits path: {head.fallback_reason}.")
        return head
    for chain, (chunk, layer) in zip(chains, head._stock_layers, strict=True):
        patch = _Patch(head, chain, layer)
        patch.apply()
        head._patches.append(patch)
        if derives_mtp_metrics_from_logits(chunk):
            warn_once(
                "megatron_fused_lm: multi-token-prediction losses stay exact with the fused LM head, but "
                "Megatron's MTP acceptance-rate metric (an argmax over the output layer's result) is meaningless."
            )
    head.fused = True
    _fused_heads.add(head)
    return head


def unwrap_model(model: Any) -> None:
    """Take the fused-head patches off every chunk of ``model`` (a no-op where there are none);
    the model computes logits and losses the stock way again."""
    for chunk in model_chunks(model):
        patch = getattr(chunk, PATCH_ATTRIBUTE, None)
        if patch is not None:
            patch.remove()
