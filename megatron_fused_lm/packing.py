"""Helpers for packed (THD) micro-batches: sequences laid end to end, delimited by ``cu_seqlens``.

Shift convention: position ``t`` predicts token ``t + 1`` of the same sequence, so the log-prob of
token ``t + 1`` is read at position ``t`` (``targets[t] = tokens[t + 1]``). A sequence at
``[start, end)`` made of a prompt of ``P`` tokens followed by ``R`` response tokens has its response
log-probs at positions ``[start + P - 1, start + P + R - 1)``; the last position of a sequence
predicts nothing. A response therefore needs a prompt of at least one token.

Shapes and dtypes, checked by every helper with its own error:

- ``cu_seqlens``: 1-D integer tensor ``[S + 1]`` (Megatron's ``PackedSeqParams`` holds int32),
  starting at 0 and never decreasing; sequence ``i`` is ``[cu_seqlens[i], cu_seqlens[i + 1])`` and
  ``T = cu_seqlens[-1]`` is the number of tokens. When the sequences are padded (context
  parallelism), pass the padded ``cu_seqlens``: the one that delimits the per-token tensors.
- ``prompt_lengths`` / ``response_lengths``: one integer per sequence, ``[S]`` (a 1-D integer
  tensor, or a list of ints).
- Per-token tensors: ``[T]``, or ``[1, T]`` as Megatron's model returns them for a packed
  micro-batch (its batch dimension is 1).

Under context parallelism a rank's output holds only some positions (``context_parallel_positions``):
build targets and masks over every position, then index them with those; ``context_parallel_gather``
and ``context_parallel_sum`` are the way back.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .ops.inputs import check_on_device
from .ops.options import checked_number

Lengths = Union[torch.Tensor, Sequence[int]]
# How a sum over the context-parallel group hands its gradient back (``context_parallel_sum``).
_GRADIENTS = ("local", "summed")


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _first(condition: torch.Tensor) -> Optional[int]:
    """The first index where the 1-D bool ``condition`` holds, or ``None``."""
    found = condition.nonzero()
    return int(found[0]) if found.numel() else None


def _checked_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` as int64 ``[S + 1]``, after checking it delimits sequences."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor [num_sequences + 1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        raise ValueError(f"cu_seqlens must be 1-D [num_sequences + 1], got shape {tuple(cu_seqlens.shape)}")
    if not _is_integer(cu_seqlens.dtype):
        raise TypeError(f"cu_seqlens must hold integers (int32 or int64), got {cu_seqlens.dtype}")
    cu_seqlens = cu_seqlens.long()
    if int(cu_seqlens[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu_seqlens[0])}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"cu_seqlens must never decrease, got {cu_seqlens.tolist()}")
    return cu_seqlens


def _checked_lengths(name: str, lengths: Lengths, num_sequences: int, device: torch.device) -> torch.Tensor:
    """``lengths`` as int64 ``[S]`` on ``device``, after checking its shape, dtype and sign."""
    tensor = torch.as_tensor(lengths, device=device)
    if not isinstance(lengths, torch.Tensor) and tensor.numel() == 0:
        tensor = tensor.long()  # an empty list has no dtype of its own (torch makes it float32)
    if tensor.dim() != 1 or tensor.numel() != num_sequences:
        raise ValueError(f"{name} must have one entry per sequence ({num_sequences}), got shape {tuple(tensor.shape)}")
    if not _is_integer(tensor.dtype):
        raise TypeError(f"{name} must hold integers, got {tensor.dtype}")
    tensor = tensor.long()
    index = _first(tensor < 0)
    if index is not None:
        raise ValueError(f"{name}[{index}] = {int(tensor[index])} is negative")
    return tensor


def _response_spans(
    cu_seqlens: torch.Tensor, prompt_lengths: Lengths, response_lengths: Optional[Lengths]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Checked ``(first position, count)`` of every sequence's response log-probs, int64 ``[S]``.

    ``cu_seqlens`` is already checked (int64).
    """
    sequence_lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    num_sequences, device = sequence_lengths.numel(), cu_seqlens.device
    prompt = _checked_lengths("prompt_lengths", prompt_lengths, num_sequences, device)
    index = _first(prompt > sequence_lengths)
    if index is not None:
        raise ValueError(
            f"prompt_lengths[{index}] = {int(prompt[index])} is longer than sequence {index} "
            f"({int(sequence_lengths[index])} tokens)"
        )
    if response_lengths is None:
        response = sequence_lengths - prompt
    else:
        response = _checked_lengths("response_lengths", response_lengths, num_sequences, device)
        index = _first(prompt + response > sequence_lengths)
        if index is not None:
            length, room = int(sequence_lengths[index]), int(sequence_lengths[index] - prompt[index])
            raise ValueError(
                f"response_lengths[{index}] = {int(response[index])} does not fit in sequence {index}: "
                f"prompt + response must be at most its {length} tokens, so the response at most {room}"
            )
    index = _first((prompt == 0) & (response > 0))
    if index is not None:
        raise ValueError(
            f"sequence {index}: a response needs a prompt of at least one token: "
            "its first token's log-prob is read before it"
        )
    return cu_seqlens[:-1] + prompt - 1, response


def _token_major(name: str, values: torch.Tensor, total: int, trailing_dims: bool) -> torch.Tensor:
    """``values`` ``[T, ...]`` from ``[T]`` or ``[1, T, ...]`` (trailing dims only if allowed)."""
    layouts = "[T] or [1, T, ...]" if trailing_dims else "[T] or [1, T]"
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layouts}, got {type(values).__name__}")
    if values.dim() == 1:
        flat = values
    elif values.dim() == 2 or (trailing_dims and values.dim() > 2):
        if values.shape[0] != 1:
            raise ValueError(
                f"{name} of shape {tuple(values.shape)}: expected {layouts}, the packed micro-batch "
                f"having a batch dimension of 1, got a leading dimension of {values.shape[0]}"
            )
        flat = values[0]
    else:
        raise ValueError(f"{name} of shape {tuple(values.shape)}: expected {layouts}")
    if flat.shape[0] != total:
        raise ValueError(
            f"cu_seqlens[-1] = {total} must be the number of tokens of {name}, which has {flat.shape[0]} tokens "
            f"(shape {tuple(values.shape)})"
        )
    return flat


def response_mask(
    cu_seqlens: torch.Tensor, prompt_lengths: Lengths, response_lengths: Optional[Lengths] = None
) -> torch.Tensor:
    """Bool ``[T]`` (``T = cu_seqlens[-1]``): True at the positions whose log-probs score response
    tokens.

    Args:
        cu_seqlens: integer ``[S + 1]``.
        prompt_lengths: integer ``[S]``: tokens of each sequence's prompt.
        response_lengths: integer ``[S]``: response tokens after the prompt; without it, everything
            after the prompt is response, with it the rest of the sequence (padding) is left out.

    Returns:
        bool ``[T]`` on ``cu_seqlens``' device; ``.unsqueeze(0)`` gives Megatron's ``[1, T]``.
    """
    cu_seqlens = _checked_cu_seqlens(cu_seqlens)
    first, count = _response_spans(cu_seqlens, prompt_lengths, response_lengths)
    positions = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens[1:], positions, right=True)
    offset = positions - first[sequence]
    return (offset >= 0) & (offset < count[sequence])


def split_responses(
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    prompt_lengths: Lengths,
    response_lengths: Optional[Lengths] = None,
) -> List[torch.Tensor]:
    """Per-token results split into one tensor per sequence, holding the results at the positions
    that score that sequence's response tokens, in order.

    Args:
        values: ``[T]``, or ``[1, T, ...]`` as Megatron returns per-token results of a packed
            micro-batch (log-probs ``[1, T]``, logits ``[1, T, V]``); any dtype.
        cu_seqlens, prompt_lengths, response_lengths: as in ``response_mask``.

    Returns:
        ``S`` views of ``values``, each ``[R_i, ...]`` (``[0, ...]`` for an empty response), for
        either layout of ``values``: the leading 1 is the packed micro-batch's batch dimension, not a
        dimension of one sequence's results, so the pieces are ready for per-sequence reductions
        or ``torch.nn.utils.rnn.pad_sequence`` whichever layout came in.
    """
    cu_seqlens = _checked_cu_seqlens(cu_seqlens)
    flat = _token_major("values", values, int(cu_seqlens[-1]), trailing_dims=True)
    first, count = _response_spans(cu_seqlens, prompt_lengths, response_lengths)
    return [flat[start : start + length] for start, length in zip(first.tolist(), count.tolist(), strict=True)]


def next_token_targets(tokens: torch.Tensor, cu_seqlens: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """``targets[t] = tokens[t + 1]`` within each sequence; the last position of every sequence,
    which predicts nothing, gets ``fill``.

    Args:
        tokens: integer ``[T]`` or ``[1, T]`` (Megatron's packed ``input_ids``).
        cu_seqlens: integer ``[S + 1]``.
        fill: an int that ``tokens``' dtype holds (e.g. 0, or an ignore index such as -100).

    Returns:
        ``tokens``' shape, dtype and device.
    """
    cu_seqlens = _checked_cu_seqlens(cu_seqlens)
    flat = _token_major("tokens", tokens, int(cu_seqlens[-1]), trailing_dims=False)
    if not _is_integer(tokens.dtype):
        raise TypeError(f"tokens must hold integer token ids, got {tokens.dtype}")
    fill = checked_number("fill", fill, integral=True)
    limits = torch.iinfo(tokens.dtype)
    if not limits.min <= fill <= limits.max:
        raise ValueError(f"fill = {fill} does not fit in {tokens.dtype}, the dtype of tokens")
    targets = torch.full(tokens.shape, fill, dtype=tokens.dtype, device=tokens.device)
    flat_targets = targets.view(-1)
    flat_targets[:-1] = flat[1:]
    ends = cu_seqlens[1:].to(tokens.device)
    flat_targets[ends[ends > 0] - 1] = fill  # an empty sequence ends where the one before it does
    return targets


def context_parallel_positions(cu_seqlens: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The positions rank ``cp_rank`` of ``cp_size`` holds under Megatron's load-balanced context
    parallelism, in the order of its output rows: every sequence is cut into ``2 * cp_size`` equal
    chunks and the rank holds chunk ``cp_rank``, then chunk ``2 * cp_size - 1 - cp_rank``, sequence
    after sequence (``get_batch_on_this_cp_rank`` per sequence, as the THD trainers split).

    Args:
        cu_seqlens: integer ``[S + 1]``, the padded one: every sequence's length must be a multiple
            of ``2 * cp_size`` (any length at ``cp_size == 1``).
        cp_rank, cp_size: ``mpu.get_context_parallel_rank()`` and ``..._world_size()``.

    Returns:
        int64 ``[T / cp_size]`` on ``cu_seqlens``' device; every position ``arange(T)`` at
        ``cp_size == 1``. Index per-position tensors ``[1, T]`` with it (``values[:, positions]``).
    """
    cu_seqlens = _checked_cu_seqlens(cu_seqlens)
    cp_rank, cp_size = (
        checked_number("cp_rank", cp_rank, integral=True),
        checked_number("cp_size", cp_size, integral=True),
    )
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size) with cp_size >= 1, got cp_rank={cp_rank}, cp_size={cp_size}")
    positions = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device)
    if cp_size == 1:
        return positions
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    index = _first(lengths % (2 * cp_size) != 0)
    if index is not None:
        raise ValueError(
            f"sequence {index} has {int(lengths[index])} positions, not a multiple of 2 x cp_size = {2 * cp_size}: "
            "pass the cu_seqlens padded for context parallelism"
        )
    sequence = torch.searchsorted(cu_seqlens[1:], positions, right=True)
    chunk = (positions - cu_seqlens[sequence]) // (lengths[sequence] // (2 * cp_size))
    # Chunk cp_rank precedes chunk 2 * cp_size - 1 - cp_rank in the sequence, so position order is row order.
    return positions[(chunk == cp_rank) | (chunk == 2 * cp_size - 1 - cp_rank)]


class _SumOverGroup(torch.autograd.Function):
    """``value`` summed over ``group``; the backward hands each rank its own upstream gradient, or
    with ``summed`` the sum of every rank's (the all-reduce's adjoint, itself an all-reduce)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, group: dist.ProcessGroup, summed: bool) -> torch.Tensor:
        ctx.group, ctx.summed = group, summed
        total = value.clone(memory_format=torch.contiguous_format)  # all_reduce works in place
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.summed:
            grad = grad.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


def context_parallel_sum(value: torch.Tensor, cp_group: Optional[dist.ProcessGroup], *, gradient: str) -> torch.Tensor:
    """``value`` summed over the context-parallel group, on every rank (a collective): a loss a rank
    takes over its own rows (weights normalized by global counts) becomes the whole loss's value.

    Args:
        value: a floating-point tensor of any shape, the same shape on every rank.
        cp_group: ``mpu.get_context_parallel_group()``; ``None`` or one rank: ``value`` as it is.
        gradient: the upstream gradient this rank's ``value`` gets: ``"local"``, its own (a rank's
            rows get their share of the whole loss's gradient, as from SkyRL's losses on gathered
            log-probs); ``"summed"``, every rank's summed (the sum's adjoint, an all-reduce in the
            backward: ``cp_size`` times the share, as from NeMo-RL's losses).
    """
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        raise TypeError(f"value must be a floating-point tensor, got {_described(value)}")
    if gradient not in _GRADIENTS:
        raise ValueError(f"gradient must be one of {_GRADIENTS}, got {gradient!r}")
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return value
    return _SumOverGroup.apply(value, cp_group, gradient == "summed")


def context_parallel_gather(
    values: torch.Tensor,
    positions: torch.Tensor,
    num_positions: int,
    cp_group: Optional[dist.ProcessGroup],
    *,
    gradient: str,
) -> torch.Tensor:
    """The inverse of a context-parallel split, differentiable, a collective: every rank's per-row
    results at their positions, on every rank.

    Args:
        values: floating point ``[..., R]``, one result per row this rank holds along the last
            dimension (``[1, T / cp_size]`` for packed log-probs); the same leading dimensions on
            every rank.
        positions: integer ``[R]``, distinct, held by no other rank: ``context_parallel_positions``.
        num_positions: the positions of the whole sequences (``cu_seqlens[-1]``).
        cp_group: as in ``context_parallel_sum``.
        gradient: as in ``context_parallel_sum``: ``"local"`` for a loss every rank computes alike
            from the result, counted once (SkyRL's ``allgather_cp_sharded_packed_tensor``);
            ``"summed"``, the gather's adjoint, for losses that differ per rank and add up (NeMo-RL's
            ``AllGatherCPTensor``).

    Returns:
        ``[..., num_positions]`` in ``values``' dtype and device, 0 at positions no rank holds.
    """
    if not isinstance(values, torch.Tensor) or not values.dtype.is_floating_point or values.dim() == 0:
        raise TypeError(f"values must be a floating-point tensor [..., rows], got {_described(values)}")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or not _is_integer(positions.dtype):
        raise TypeError(f"positions must be a 1-D integer tensor [rows], got {_described(positions)}")
    if positions.numel() != values.shape[-1]:
        raise ValueError(
            f"positions has {positions.numel()} entries but values {values.shape[-1]} rows (shape "
            f"{tuple(values.shape)}): one position per row, along the last dimension"
        )
    if checked_number("num_positions", num_positions, integral=True) < 0:
        raise ValueError(f"num_positions must be at least 0, got {num_positions}")
    positions = positions.to(device=values.device, dtype=torch.long)
    # Checked on the device: the log-prob path of a step reads nothing back to the host.
    inside = ((positions >= 0) & (positions < num_positions)).all()
    check_on_device(inside, f"positions must lie in [0, num_positions = {num_positions})")
    ordered = positions.sort().values
    distinct = (ordered[1:] != ordered[:-1]).all()
    check_on_device(distinct, "positions must be distinct: a rank holds each of its positions once")
    whole = values.new_zeros(*values.shape[:-1], num_positions).index_copy(-1, positions, values)
    return context_parallel_sum(whole, cp_group, gradient=gradient)


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
