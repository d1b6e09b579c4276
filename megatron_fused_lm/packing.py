"""Helpers for packed (THD) micro-batches: sequences laid end to end, delimited by ``cu_seqlens``.

Shift convention: position ``t`` predicts token ``t + 1`` of the same sequence, so the log-prob of
token ``t + 1`` is read at position ``t`` (``targets[t] = tokens[t + 1]``). A sequence at
``[start, end)`` made of a prompt of ``P`` tokens followed by ``R`` response tokens has its response
log-probs at positions ``[start + P - 1, start + P + R - 1)``; the last position of a sequence
predicts nothing. A response therefore needs a prompt of at least one token.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch


def _response_spans(
    cu_seqlens: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Checked ``(first position, count)`` of every sequence's response log-probs, int64 ``[S]``."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype.is_floating_point:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [num_sequences + 1]")
    cu_seqlens = cu_seqlens.long()
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if int(cu_seqlens[0]) != 0 or bool((lengths < 0).any()):
        raise ValueError("cu_seqlens must start at 0 and never decrease")
    prompt_lengths = torch.as_tensor(prompt_lengths, device=cu_seqlens.device).long()
    response_lengths = (
        lengths - prompt_lengths
        if response_lengths is None
        else torch.as_tensor(response_lengths, device=cu_seqlens.device).long()
    )
    if prompt_lengths.shape != lengths.shape or response_lengths.shape != lengths.shape:
        raise ValueError(f"prompt and response lengths must have one entry per sequence ({lengths.numel()})")
    if bool(
        (prompt_lengths < 0).any() | (response_lengths < 0).any() | (prompt_lengths + response_lengths > lengths).any()
    ):
        raise ValueError("each sequence needs 0 <= prompt, 0 <= response and prompt + response <= its length")
    if bool(((prompt_lengths == 0) & (response_lengths > 0)).any()):
        raise ValueError(
            "a response needs a prompt of at least one token: its first token's log-prob is read before it"
        )
    return cu_seqlens[:-1] + prompt_lengths - 1, response_lengths


def response_mask(
    cu_seqlens: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Bool ``[cu_seqlens[-1]]``: True at the positions whose log-probs score response tokens.

    ``prompt_lengths`` and ``response_lengths`` hold one entry per sequence; without
    ``response_lengths`` everything after the prompt is response.
    """
    first, count = _response_spans(cu_seqlens, prompt_lengths, response_lengths)
    total = int(cu_seqlens[-1])
    positions = torch.arange(total, device=first.device)
    sequence = torch.searchsorted(cu_seqlens.long()[1:], positions, right=True)
    offset = positions - first[sequence]
    return (offset >= 0) & (offset < count[sequence])


def split_responses(
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    prompt_lengths: torch.Tensor,
    response_lengths: Optional[torch.Tensor] = None,
) -> List[torch.Tensor]:
    """Per-token results ``[total, ...]`` split into one tensor ``[R_i, ...]`` per sequence, holding
    the results for that sequence's response tokens in order (empty for an empty response)."""
    first, count = _response_spans(cu_seqlens, prompt_lengths, response_lengths)
    return [values[start : start + length] for start, length in zip(first.tolist(), count.tolist(), strict=True)]


def next_token_targets(tokens: torch.Tensor, cu_seqlens: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """``targets[t] = tokens[t + 1]`` within each sequence of a packed ``tokens [total]``; the last
    position of every sequence, which predicts nothing, gets ``fill``."""
    targets = torch.full_like(tokens, fill)
    targets[:-1] = tokens[1:]
    last = cu_seqlens.long()[1:] - 1
    targets[last[last >= 0]] = fill
    return targets
