"""The torch backend: walk the tokens in chunks, each chunk's logits a float32 block in memory.

Peak working set per call, besides the inputs and the returned gradients: about three float32
blocks of ``chunk_size x vocab_shard`` (the logits, their exponentials and the gradient) and,
in the backward, a float32 ``grad_hidden [n, H]`` (reduced across ranks before it is cast) and,
for a weight that is not float32, a float32 accumulator for ``grad_weight [vocab_shard, H]``.
The default chunk size keeps one block at ``BLOCK_BYTES``.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .products import add_product, float32_product
from .softmax_stats import NUM_STATISTICS, block_statistics, logit_grad, token_chunks

BLOCK_BYTES = 256 * 2**20


def default_chunk_size(vocab_shard: int) -> int:
    """Tokens per chunk so that one float32 ``[chunk, vocab_shard]`` block is ``BLOCK_BYTES``."""
    return max(1, BLOCK_BYTES // (4 * vocab_shard))


def chunk_statistics(
    block_logits: Callable[[slice], torch.Tensor],
    num_tokens: int,
    chunk_size: int,
    local_target: torch.Tensor,
    owned: torch.Tensor,
) -> torch.Tensor:
    """Shard statistics ``[n, 4]`` from float32 logits blocks produced one chunk at a time."""
    stats = torch.empty(num_tokens, NUM_STATISTICS, dtype=torch.float32, device=local_target.device)
    for chunk in token_chunks(num_tokens, chunk_size):
        stats[chunk] = block_statistics(block_logits(chunk), local_target[chunk], owned[chunk])
    return stats


def chunk_logit_grads(
    block_logits: Callable[[slice], torch.Tensor],
    num_tokens: int,
    chunk_size: int,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    lse: torch.Tensor,
    mean_logit: torch.Tensor,
    grad_logprob: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    temperature: float,
):
    """Yield ``(chunk, grad)``: the float32 gradient with respect to the *unscaled* logits of
    each chunk (``dz / temperature``), recomputing the chunk's logits with ``block_logits``."""
    for chunk in token_chunks(num_tokens, chunk_size):
        grad = logit_grad(
            block_logits(chunk),
            lse[chunk],
            mean_logit[chunk],
            local_target[chunk],
            owned[chunk],
            None if grad_logprob is None else grad_logprob[chunk],
            None if grad_entropy is None else grad_entropy[chunk],
        )
        yield chunk, grad.div_(temperature)


def _logits_of(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> Callable[[slice], torch.Tensor]:
    weight_t = weight.t()
    return lambda chunk: float32_product(hidden[chunk], weight_t).div_(temperature)


def local_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    temperature: float,
    chunk_size: Optional[int],
) -> torch.Tensor:
    """This shard's statistics ``[n, 4]`` for ``hidden [n, H]`` and ``weight [vocab_shard, H]``
    (same dtype)."""
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    return chunk_statistics(_logits_of(hidden, weight, temperature), hidden.shape[0], chunk_size, local_target, owned)


def local_gradients(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    lse: torch.Tensor,
    mean_logit: torch.Tensor,
    grad_logprob: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    temperature: float,
    chunk_size: Optional[int],
    need_hidden_grad: bool,
    need_weight_grad: bool,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """This shard's ``grad_hidden [n, H]`` (float32, partial: the shard's vocabulary only) and
    ``grad_weight [vocab_shard, H]`` (weight's dtype); ``None`` where not needed."""
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    num_tokens = hidden.shape[0]
    grad_hidden = hidden.new_empty(hidden.shape, dtype=torch.float32) if need_hidden_grad else None
    grad_weight = weight.new_zeros(weight.shape, dtype=torch.float32) if need_weight_grad else None
    grads = chunk_logit_grads(
        _logits_of(hidden, weight, temperature), num_tokens, chunk_size, local_target, owned,
        lse, mean_logit, grad_logprob, grad_entropy, temperature,
    )
    for chunk, grad in grads:
        # The product runs in the weight's dtype, as the stock path's logits gradient does.
        grad = grad.to(weight.dtype)
        if grad_hidden is not None:
            add_product(grad_hidden[chunk], grad, weight, accumulate=False)
        if grad_weight is not None:
            add_product(grad_weight, grad.t(), hidden[chunk], accumulate=True)
    return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype)
