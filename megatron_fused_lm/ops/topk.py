"""Each row's ``k`` most likely tokens and their log-probs (top-k distillation's teacher side), from
one pass over the vocabulary shard, one chunk of rows' float32 logits at a time; forward only.

1. Per chunk of rows: the float32 logits ``[rows, vocab_shard]``, their softmax statistics, the
   ``k + MARGIN`` largest logits, and of those the ``k`` largest keys (``logit_keys``: by logit,
   then lower id). Rows whose ``k``-th logit ties every candidate past it (more than ``MARGIN``
   equal logits at the boundary) take their keys from the whole shard instead. No ``[tokens,
   vocab]`` tensor exists.
2. Under tensor parallelism: every rank's keys and statistics gathered (two all-gathers of
   ``[n, k]`` and ``[n, 4]``), the ``k`` largest keys of all ranks kept, the statistics merged.
3. Log-probs ``z - lse`` of the kept logits, read back from their keys with their global ids.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .boundary import autocast_off
from .chunking import chunk_rows
from .contract import token_chunks
from .distributed import all_gather_stacked, group_rank, group_size, merge_across_group
from .inputs import RowSelection, check_linear_inputs, check_logits, row_temperatures
from .options import HeadOptions, checked_number
from .products import float32_product
from .softmax import NUM_STATISTICS, block_statistics, summarize

Tensor = torch.Tensor
_LOW_BITS = 2**32 - 1
_MAX_ID = 2**31 - 1
_NO_KEY = torch.iinfo(torch.int64).min  # a shard narrower than k pads its candidates with it
# Candidates past the k-th logit that settle ties at the boundary without sorting the whole shard.
MARGIN = 16


def logit_keys(logits: Tensor, ids: Tensor) -> Tensor:
    """int64 keys (``logits``' shape) that order ``(logit, -id)``: the float32 logit's bits made
    order-preserving (negative floats' magnitude bits flipped; -0 counted as +0) in the high 32
    bits, ``2^31 - 1 - id`` in the low ones, so that of equal logits the lower id ranks first.
    ``ids``: int64, broadcast against ``logits``."""
    bits = (logits + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    ordered = bits ^ ((bits >> 31) & _MAX_ID)
    return (ordered.long() << 32) | (_MAX_ID - ids)


def chunk_top_keys(logits: Tensor, first_id: int, k: int) -> Tensor:
    """The ``k`` largest keys ``[n, k]`` of a chunk's logits ``[n, v]`` (column ``j`` is id
    ``first_id + j``), descending. Reads one flag on the host: whether a row needs the whole shard."""
    width = min(logits.shape[1], k + MARGIN)
    values, columns = logits.topk(width, dim=1)
    keys = logit_keys(values, columns + first_id).topk(k, dim=1).values
    if width < logits.shape[1]:
        # Every candidate past the k-th equal to it: an equal logit may be missing, with a lower id.
        unsettled = (values[:, k - 1] == values[:, -1]).nonzero().squeeze(1)
        if unsettled.numel():
            ids = torch.arange(first_id, first_id + logits.shape[1], device=logits.device)
            keys[unsettled] = logit_keys(logits[unsettled], ids).topk(k, dim=1).values
    return keys


def keyed_logits(keys: Tensor) -> Tuple[Tensor, Tensor]:
    """``(float32 logits, int64 ids)`` of keys made by ``logit_keys``."""
    ordered = (keys >> 32).to(torch.int32)
    bits = ordered ^ ((ordered >> 31) & _MAX_ID)
    return bits.view(torch.float32), _MAX_ID - (keys & _LOW_BITS)


def fused_linear_topk(
    hidden: Tensor,
    weight: Tensor,
    k: int,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: Union[float, Tensor] = 1.0,
    backend: str = "torch",
    token_chunk: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """Each row's ``k`` largest log-probs under ``softmax(hidden @ weight.T / temperature)`` (the
    whole vocabulary's, spread over ``tp_group``) and their global vocabulary ids, without
    materializing the logits. Forward only: the results carry no gradient. Every row is
    computed (no mask), and padded vocabulary rows count as tokens, as in the stock logits.

    Args:
        hidden: ``[..., H]`` float32, bfloat16 or float16, the same on every rank; cast to
            ``weight``'s dtype for the product.
        weight: ``[vocab_shard, H]``, this rank's vocabulary rows, as many on every rank (Megatron
            pads the vocabulary so): rank ``r`` owns global ids ``[r * vocab_shard, (r + 1) *
            vocab_shard)``.
        k: how many tokens per row, from 1 to the whole vocabulary (``vocab_shard * tp_size``).
        tp_group, temperature: as for ``fused_linear_logprob``.
        backend: checked as for ``fused_linear_logprob``; every backend runs the same cuBLAS
            products and torch selection (no Triton kernel selects the top k yet).
        token_chunk: rows per chunk; ``None`` keeps a chunk's float32 logits within 256 MiB
            (``chunking.chunk_rows``; the
            selection's temporaries take about three times that again; a row whose boundary ties
            more than ``MARGIN`` candidates, frequent for bfloat16 logits at ``k`` in the hundreds,
            takes int64 keys of its whole shard). The merge under tensor parallelism gathers
            ``[tp_size, n, k]`` int64 keys at once.

    Returns:
        ``(logprobs [..., k] float32, ids [..., k] int64)``, each row in descending order of
        logit, equal float32 logits in ascending order of id (two logits that differ can round to
        the same log-prob: the larger comes first), the same on every rank. Two all-gathers under
        tensor parallelism; one flag read on the host per chunk (``chunk_top_keys``).
    """
    check_linear_inputs(hidden, weight)
    options = HeadOptions.checked(token_chunk=token_chunk, tp_group=tp_group, device=hidden.device, backend=backend)
    temperature = row_temperatures(temperature, RowSelection(hidden.shape[:-1], None, None, None), hidden.device)
    rows, shard = hidden.reshape(-1, hidden.shape[-1]).detach().to(weight.dtype), weight.detach().t()
    logprobs, ids = _topk_pass(
        lambda chunk: float32_product(rows[chunk], shard).div_(temperature[chunk, None]),
        rows.shape[0], weight.shape[0], k, options, rows.device,
    )  # fmt: skip
    return logprobs.view(*hidden.shape[:-1], k), ids.view(*hidden.shape[:-1], k)


def logits_topk(
    logits: Tensor,
    k: int,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: Union[float, Tensor] = 1.0,
    token_chunk: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """``fused_linear_topk`` on a materialized logits shard ``[..., vocab_shard]`` (float32,
    bfloat16 or float16; rank ``r`` owns global ids ``[r * vocab_shard, (r + 1) * vocab_shard)``):
    the same results, forward only."""
    check_logits(logits)
    options = HeadOptions.checked(token_chunk=token_chunk, tp_group=tp_group, device=logits.device)
    temperature = row_temperatures(temperature, RowSelection(logits.shape[:-1], None, None, None), logits.device)
    flat = logits.detach().reshape(-1, logits.shape[-1])
    logprobs, ids = _topk_pass(
        lambda chunk: flat[chunk].float() / temperature[chunk, None], flat.shape[0], flat.shape[1], k, options,
        flat.device,
    )  # fmt: skip
    return logprobs.view(*logits.shape[:-1], k), ids.view(*logits.shape[:-1], k)


def _topk_pass(
    block_logits: Callable[[slice], Tensor],
    num_rows: int,
    vocab_shard: int,
    k: int,
    options: HeadOptions,
    device: torch.device,
) -> Tuple[Tensor, Tensor]:
    """Steps 1-3 above over ``block_logits(rows)``, a chunk's float32 logits ``[rows, vocab_shard]``
    already divided by the temperature: ``(logprobs [n, k], ids [n, k])``."""
    group = options.tp_group
    vocab = vocab_shard * group_size(group)
    if not 1 <= checked_number("k", k, integral=True) <= vocab:
        raise ValueError(f"k must be between 1 and the vocabulary size {vocab}, got {k}")
    if vocab > _MAX_ID:
        raise ValueError(f"a vocabulary of {vocab} ids does not fit the keys' 31 bits")
    local_k = min(k, vocab_shard)
    keys = torch.full((num_rows, k), _NO_KEY, dtype=torch.int64, device=device)
    stats = torch.empty(num_rows, NUM_STATISTICS, dtype=torch.float32, device=device)
    no_target = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    first_id = group_rank(group) * vocab_shard
    rows_per_chunk = chunk_rows(options.token_chunk, vocab_shard)
    with torch.no_grad(), autocast_off(device):
        for chunk in token_chunks(num_rows, rows_per_chunk):
            logits = block_logits(chunk)
            stats[chunk] = block_statistics(logits, no_target[chunk])
            keys[chunk, :local_k] = chunk_top_keys(logits, first_id, local_k)
        if group_size(group) > 1 and num_rows > 0:
            # Every rank's candidates side by side, then the k largest of all: the same on every rank.
            candidates = all_gather_stacked(keys, group).permute(1, 0, 2).reshape(num_rows, -1)
            keys = candidates.topk(k, dim=1).values
            stats = merge_across_group(stats, group)
        logits, ids = keyed_logits(keys)
        return logits - summarize(stats).lse.unsqueeze(1), ids
