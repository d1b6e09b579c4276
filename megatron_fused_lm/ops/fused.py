"""Per-token log-probs and entropy straight from hidden states and a vocabulary shard of the
LM-head weight, without building the ``[tokens, vocab_shard]`` logits."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from .backends import check_backend
from .distributed import group_name
from .inputs import check_linear_inputs, check_options, select_rows
from .library import fused_forward


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
    max_rows: Optional[int] = None,
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
            read. Under tensor parallelism every rank must pass the same mask. The number of
            selected rows is read on the host (one synchronization) unless ``max_rows`` is given.
        max_rows: with ``mask``, an upper bound on the rows it selects: the computation then
            has the static shape ``[max_rows]`` (no host synchronization, so CUDA graphs can
            capture it and ``torch.compile(fullgraph=True)`` can trace it); time and memory
            follow ``max_rows``. A mask selecting more rows is an error.

    Returns:
        ``logprob [...]`` float32, or ``(logprob, entropy)`` with ``return_entropy=True``.
        Gradients: w.r.t. ``hidden`` in hidden's dtype, w.r.t. ``weight`` (this shard's rows) in
        the weight's dtype. Computed by the custom operators ``torch.ops.megatron_fused_lm.fused_*``
        in float32 whatever the autocast context; no host synchronization without a mask (or
        with ``max_rows``): an out-of-range target raises ``ValueError`` on the CPU and trips a
        device-side assertion on a GPU.
    """
    check_linear_inputs(hidden, weight)
    check_options(temperature, chunk_size)
    check_backend(backend)
    selection = select_rows(targets, hidden.shape[:-1], mask, max_rows, weight.shape[0], tp_group)
    logprob, entropy, _, _ = fused_forward(
        selection.take(hidden).to(weight.dtype), weight, *selection.targets, float(temperature), backend,
        chunk_size, group_name(tp_group), entropy_grad, reduce_hidden_grad,
    )  # fmt: skip
    logprob = selection.place(logprob)
    return (logprob, selection.place(entropy)) if return_entropy else logprob
