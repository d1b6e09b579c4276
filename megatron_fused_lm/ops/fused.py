"""Per-token log-probs and entropy straight from hidden states and a vocabulary shard of the
LM-head weight, without building the ``[tokens, vocab_shard]`` logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from .backends import resolve_backend
from .contract import Backend, NeededGrads, ShardProblem, ShardTargets
from .distributed import all_reduce_sum
from .inputs import check_float, check_options, select_rows
from .plumbing import finish_forward, open_backward


@dataclass(frozen=True)
class FusedOptions:
    """Everything ``FusedLinearLogprob`` needs besides its tensors (``fused_linear_logprob``
    documents each)."""

    backend: Backend
    temperature: float = 1.0
    tp_group: Optional[dist.ProcessGroup] = None
    entropy_grad: bool = True
    reduce_hidden_grad: bool = True


class FusedLinearLogprob(torch.autograd.Function):
    """Autograd function behind ``fused_linear_logprob`` (flat rows, checks already done).

    ``forward(hidden [n, H], weight [vocab_shard, H] (hidden's dtype), local_target [n] int64,
    owned [n] bool, options: FusedOptions) -> (logprob [n], entropy [n])``, both float32 (the two
    target tensors are a ``contract.ShardTargets``). Saves only O(n) statistics besides its inputs;
    the backward recomputes the logits.
    """

    @staticmethod
    def forward(ctx, hidden, weight, local_target, owned, options: FusedOptions):
        problem = ShardProblem(hidden, weight, ShardTargets(local_target, owned), options.temperature)
        stats = options.backend.local_statistics(problem)
        return finish_forward(ctx, stats, options, hidden, weight, local_target, owned)

    @staticmethod
    def backward(ctx, grad_logprob: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]):
        opened = open_backward(ctx, grad_logprob, grad_entropy)
        if opened is None:
            return None, None, None, None, None
        (hidden, weight, local_target, owned), saved, upstream = opened
        options: FusedOptions = ctx.options
        problem = ShardProblem(hidden, weight, ShardTargets(local_target, owned), options.temperature)
        grads = options.backend.local_gradients(problem, saved, upstream, NeededGrads(*ctx.needs_input_grad[:2]))
        if grads.hidden is not None and options.reduce_hidden_grad:
            all_reduce_sum(grads.hidden, options.tp_group)
        return grads.hidden, grads.weight, None, None, None


def check_linear_inputs(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """``TypeError`` / ``ValueError`` unless ``hidden [..., H]`` and ``weight [vocab_shard >= 1, H]``
    are float32, bfloat16 or float16 tensors of matching hidden size."""
    check_float("hidden", hidden)
    check_float("weight", weight)
    if weight.dim() != 2 or weight.shape[0] == 0:
        raise ValueError(f"weight must be 2-D [vocab_shard >= 1, H], got shape {tuple(weight.shape)}")
    if hidden.dim() == 0 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size {tuple(hidden.shape)[-1:]} does not match weight's {weight.shape[1]}")


def fused_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    options: FusedOptions,
    mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(logprob [...], entropy [...])`` with an explicit backend: what ``fused_linear_logprob``
    runs once it has checked its inputs and resolved ``backend=`` (tests pass backends they built)."""
    selection = select_rows(targets, hidden.shape[:-1], mask, weight.shape[0], options.tp_group)
    rows = selection.take(hidden).to(weight.dtype)
    logprob, entropy = FusedLinearLogprob.apply(rows, weight, *selection.targets, options)
    return selection.place(logprob), selection.place(entropy)


def fused_linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    entropy_grad: bool = True,
    backend: str = "torch",
    chunk_size: Optional[int] = None,
    reduce_hidden_grad: bool = True,
    mask: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Log-probs (and entropy) of ``targets`` under ``softmax(hidden @ weight.T / temperature)``,
    the vocabulary spread over ``tp_group``, without materializing the logits.

    Args:
        hidden: ``[..., H]`` float32, bfloat16 or float16; the same on every rank of ``tp_group``.
            It is cast to ``weight``'s dtype for the product; its gradient comes back in its own.
        weight: ``[vocab_shard, H]``, this rank's vocabulary rows (padded rows included): rank
            ``r`` owns global ids ``[r * vocab_shard, (r + 1) * vocab_shard)``.
        targets: ``[...]`` (``hidden.shape[:-1]``) integer global vocabulary ids.
        tp_group: the tensor-parallel group the vocabulary is split over; ``None`` for no split.
        temperature: divides the logits.
        return_entropy: also return the entropy of the distribution.
        entropy_grad: with ``False`` the entropy is a metric: no graph, no backward term.
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (Triton on CUDA when available; otherwise
            the torch backend, with one logged warning).
        chunk_size: rows per chunk (the torch backend's chunks; the Triton backward's token
            chunks); ``None`` picks one that bounds the working set.
        reduce_hidden_grad: ``True`` (default) gives the full gradient w.r.t. ``hidden`` on every
            rank (one all-reduce, in the gradient's dtype). ``False`` gives this rank's partial,
            for a caller whose own backward sums partials across ranks (a sequence-parallel
            gather's reduce-scatter).
        mask: optional bool ``[...]`` (``targets``' shape): only rows where it is True are
            computed (their hidden rows are gathered before the product, so time and memory follow
            the number selected); the others are 0 with zero gradient, and their targets are not
            read. Under tensor parallelism every rank must pass the same mask.

    Returns:
        ``logprob [...]`` float32, or ``(logprob, entropy)`` with ``return_entropy=True``.
        Gradients: w.r.t. ``hidden`` in hidden's dtype, w.r.t. ``weight`` (this shard's rows) in
        the weight's dtype.
    """
    check_linear_inputs(hidden, weight)
    check_options(temperature, chunk_size)
    options = FusedOptions(
        backend=resolve_backend(backend, hidden.device, chunk_size),
        temperature=float(temperature),
        tp_group=tp_group,
        entropy_grad=entropy_grad,
        reduce_hidden_grad=reduce_hidden_grad,
    )
    logprob, entropy = fused_logprob_entropy(hidden, weight, targets, options, mask)
    return (logprob, entropy) if return_entropy else logprob
