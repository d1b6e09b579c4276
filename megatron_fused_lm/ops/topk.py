"""Each row's ``k`` most likely tokens and their log-probs (top-k distillation's teacher side),
without a ``[tokens, vocab]`` tensor; forward only.

1. This shard's softmax statistics and each row's ``k`` largest keys (``top_keys.logit_keys``: by
   logit, then lower id): on the Triton backend from two launches of its forward kernel, the
   second keeping each row's logits at or above a threshold the first gave
   (``backends.triton_topk``); on the torch backend from one chunk of rows' float32 logits at a
   time and a torch selection (``top_keys.shard_top_keys``).
2. Under tensor parallelism: every rank's keys and statistics gathered (two all-gathers of
   ``[n, k]`` and ``[n, 4]``), the ``k`` largest keys of all ranks kept, the statistics merged.
3. Log-probs ``z - lse`` of the kept logits, read back from their keys with their global ids.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .backends import registry
from .boundary import autocast_off
from .chunking import chunk_rows, given_logits, product_logits
from .distributed import all_gather_stacked, group_rank, group_size, merge_across_group
from .inputs import RowSelection, check_linear_inputs, check_logits, live_columns, row_temperatures
from .options import HeadOptions, checked_number
from .rank_check import check_across_ranks
from .softmax import summarize
from .top_keys import MAX_ID, NO_KEY, keyed_logits, shard_top_keys

Tensor = torch.Tensor


def fused_linear_topk(
    hidden: Tensor,
    weight: Tensor,
    k: int,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: Union[float, Tensor] = 1.0,
    backend: Union[str, object] = "torch",
    token_chunk: Optional[int] = None,
    vocab_size: Optional[int] = None,
    softcap: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """Each row's ``k`` largest log-probs under ``softmax(hidden @ weight.T / temperature)`` (the
    whole vocabulary's, spread over ``tp_group``) and their global vocabulary ids, without
    materializing the logits. Forward only: the results carry no gradient. Every row is
    computed (no mask), and padded vocabulary rows count as tokens, as in the stock logits, unless
    ``vocab_size`` excludes them.

    Args:
        hidden: ``[..., H]`` float32, bfloat16 or float16, the same on every rank; cast to
            ``weight``'s dtype for the product.
        weight: ``[vocab_shard, H]``, this rank's vocabulary rows, as many on every rank (Megatron
            pads the vocabulary so): rank ``r`` owns global ids ``[r * vocab_shard, (r + 1) *
            vocab_shard)``.
        k: how many tokens per row, from 1 to the whole vocabulary (``vocab_shard * tp_size``, or
            ``vocab_size``).
        tp_group, temperature, vocab_size, softcap: as for ``fused_linear_logprob``.
        backend: as for ``fused_linear_logprob``. Triton: two launches of its forward kernel,
            no logits stored (``backends.triton_topk``; a row whose largest logits crowd into a
            few column tiles, and every row where ``k`` exceeds a quarter of the shard's column
            tiles, 296 of a 151936-id shard's in 16-bit weights and 593 in float32, takes the
            torch form). torch: one chunk of rows' float32 logits at a time (cuBLAS products)
            and a torch selection over them.
        token_chunk: rows per chunk; ``None`` keeps a chunk within 256 MiB: the torch form's
            float32 logits (``chunking.chunk_rows``; the selection's temporaries take about three
            times that again, and a row whose boundary ties more than ``MARGIN`` candidates,
            frequent for bfloat16 logits at ``k`` in the hundreds, takes int64 keys of its whole
            shard), the Triton form's candidate slots. The merge under tensor parallelism gathers
            ``[tp_size, n, k]`` int64 keys at once.

    Returns:
        ``(logprobs [..., k] float32, ids [..., k] int64)``, each row in descending order of
        logit, equal float32 logits in ascending order of id (two logits that differ can round to
        the same log-prob: the larger comes first), the same on every rank. Two all-gathers under
        tensor parallelism; one read on the host per chunk of rows (two more where a chunk has
        rows for the torch form).
    """
    check_linear_inputs(hidden, weight)
    resolved = registry.resolve(backend, hidden.device)
    options = HeadOptions.checked(backend=resolved.name, token_chunk=token_chunk, tp_group=tp_group, softcap=softcap)
    check_across_ranks(
        "fused_linear_topk",
        tp_group,
        hidden,
        weight,
        temperature=temperature,
        vocab_size=vocab_size,
        softcap=options.softcap,
        settings=dict(backend=resolved.name, token_chunk=options.token_chunk, k=k),
    )
    temperature = row_temperatures(temperature, RowSelection(hidden.shape[:-1], None, None, None), hidden.device)
    first_id, vocab = _shard_ids(weight.shape[0], vocab_size, tp_group)
    rows = hidden.reshape(-1, hidden.shape[-1]).detach().to(weight.dtype)
    weight = weight.detach()[: live_columns(weight.shape[0], vocab_size, tp_group)]

    block_logits = product_logits(rows, weight, temperature, options.softcap)

    def local_keys(local_k):
        return resolved.top_keys(
            rows,
            weight,
            temperature=temperature,
            softcap=options.softcap,
            k=local_k,
            first_id=first_id,
            block_logits=block_logits,
            token_chunk=options.token_chunk,
        )

    logprobs, ids = _topk_pass(
        local_keys, rows.shape[0], vocab_shard=weight.shape[0], vocab=vocab, k=k, options=options, device=rows.device
    )
    return logprobs.view(*hidden.shape[:-1], k), ids.view(*hidden.shape[:-1], k)


def logits_topk(
    logits: Tensor,
    k: int,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: Union[float, Tensor] = 1.0,
    token_chunk: Optional[int] = None,
    vocab_size: Optional[int] = None,
    softcap: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """``fused_linear_topk`` on a materialized logits shard ``[..., vocab_shard]`` (float32,
    bfloat16 or float16; rank ``r`` owns global ids ``[r * vocab_shard, (r + 1) * vocab_shard)``):
    the same results, forward only."""
    check_logits(logits)
    options = HeadOptions.checked(backend="torch", token_chunk=token_chunk, tp_group=tp_group, softcap=softcap)
    check_across_ranks(
        "logits_topk",
        tp_group,
        logits,
        None,
        temperature=temperature,
        vocab_size=vocab_size,
        softcap=options.softcap,
        settings=dict(token_chunk=options.token_chunk, k=k),
    )
    temperature = row_temperatures(temperature, RowSelection(logits.shape[:-1], None, None, None), logits.device)
    first_id, vocab = _shard_ids(logits.shape[-1], vocab_size, tp_group)
    flat = logits.detach().reshape(-1, logits.shape[-1])[:, : live_columns(logits.shape[-1], vocab_size, tp_group)]
    rows_per_chunk = chunk_rows(options.token_chunk, flat.shape[1])

    def local_keys(local_k):
        block_logits = given_logits(flat, temperature, options.softcap)
        return shard_top_keys(
            block_logits, flat.shape[0], k=local_k, first_id=first_id, rows_per_chunk=rows_per_chunk, device=flat.device
        )

    logprobs, ids = _topk_pass(
        local_keys, flat.shape[0], vocab_shard=flat.shape[1], vocab=vocab, k=k, options=options, device=flat.device
    )
    return logprobs.view(*logits.shape[:-1], k), ids.view(*logits.shape[:-1], k)


def _shard_ids(vocab_shard: int, vocab_size: Optional[int], tp_group) -> Tuple[int, int]:
    """This rank's first global id (counting the padded ids of the shards before it) and the whole vocabulary's size."""
    return group_rank(tp_group) * vocab_shard, vocab_shard * group_size(tp_group) if vocab_size is None else vocab_size


def _topk_pass(
    local_keys: Callable[[int], Tuple[Tensor, Tensor]],
    num_rows: int,
    vocab_shard: int,
    vocab: int,
    k: int,
    options: HeadOptions,
    device: torch.device,
) -> Tuple[Tensor, Tensor]:
    """Steps 1-3 above, this shard's statistics ``[n, 4]`` and ``local_k`` largest keys ``[n,
    local_k]`` given by ``local_keys(local_k)`` (``vocab_shard``: the shard's columns of the
    ``vocab`` ids): ``(logprobs [n, k], ids [n, k])``."""
    group = options.tp_group
    if not 1 <= checked_number("k", k, integral=True) <= vocab:
        raise ValueError(f"k must be between 1 and the vocabulary size {vocab}, got {k}")
    if vocab > MAX_ID:
        raise ValueError(f"a vocabulary of {vocab} ids does not fit the keys' 31 bits")
    local_k = min(k, vocab_shard)
    with torch.no_grad(), autocast_off(device):
        stats, local = local_keys(local_k)
        keys = torch.full((num_rows, k), NO_KEY, dtype=torch.int64, device=device)
        keys[:, :local_k] = local
        if group_size(group) > 1 and num_rows > 0:
            # Every rank's candidates side by side, then the k largest of all: the same on every rank.
            candidates = all_gather_stacked(keys, group).permute(1, 0, 2).reshape(num_rows, -1)
            keys = candidates.topk(k, dim=1).values
            stats = merge_across_group(stats, group)
        logits, ids = keyed_logits(keys)
        return logits - summarize(stats).lse.unsqueeze(1), ids
