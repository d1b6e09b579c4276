"""The tensor checks shared by the public ops, the selection of the rows they compute, and the
mapping of global target ids onto this rank's vocabulary shard (``softmax`` gives the encoding)."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from .distributed import group_rank, group_size
from .options import check_vocab_size, checked_number
from .softmax import OUTSIDE_VOCAB

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float(name: str, tensor: torch.Tensor) -> None:
    """``TypeError`` unless ``tensor`` is float32, bfloat16 or float16."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {tensor.dtype}")


def check_linear_inputs(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """``TypeError`` / ``ValueError`` unless ``hidden [..., H]`` and ``weight [vocab_shard >= 1, H]``
    are float32, bfloat16 or float16 tensors of matching hidden size."""
    check_float("hidden", hidden)
    check_float("weight", weight)
    if weight.dim() != 2 or weight.shape[0] == 0:
        raise ValueError(f"weight must be 2-D [vocab_shard >= 1, H], got shape {tuple(weight.shape)}")
    if hidden.dim() == 0 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size {tuple(hidden.shape)[-1:]} does not match weight's {weight.shape[1]}")


def check_logits(logits: torch.Tensor) -> None:
    """``TypeError`` / ``ValueError`` unless ``logits`` is a float32, bfloat16 or float16 shard
    ``[..., vocab_shard >= 1]``."""
    check_float("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., vocab_shard >= 1], got shape {tuple(logits.shape)}")


def check_weight_grad_into(weight_grad_into: torch.Tensor, weight: torch.Tensor) -> None:
    """``TypeError`` / ``ValueError`` unless ``weight_grad_into`` is a contiguous float32 tensor of the
    weight's shape on its device, needing no gradient."""
    if not isinstance(weight_grad_into, torch.Tensor):
        raise TypeError(f"weight_grad_into must be a torch.Tensor, got {type(weight_grad_into).__name__}")
    if weight_grad_into.dtype != torch.float32:
        raise TypeError(f"weight_grad_into must be float32, got {weight_grad_into.dtype}")
    if weight_grad_into.shape != weight.shape or weight_grad_into.device != weight.device:
        raise ValueError(
            f"weight_grad_into must have the weight's shape {tuple(weight.shape)} on {weight.device}, got "
            f"{tuple(weight_grad_into.shape)} on {weight_grad_into.device}"
        )
    if not weight_grad_into.is_contiguous() or weight_grad_into.requires_grad:
        raise ValueError("weight_grad_into must be contiguous and need no gradient")


def may_synchronize(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor``'s values on the host is allowed now: not while a CUDA graph is
    captured, nor while ``torch.compile`` traces."""
    if torch.compiler.is_compiling():
        return False
    return not (tensor.is_cuda and torch.cuda.is_current_stream_capturing())


def is_abstract(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has a shape and dtype but no values: a meta or fake tensor."""
    return tensor.device.type == "meta" or is_fake(tensor)


def has_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values exist to be checked: not on meta or fake tensors, not while
    ``torch.compile`` traces or a CUDA graph is captured (a check there would run at every replay)."""
    return may_synchronize(tensor) and not is_abstract(tensor)  # this order: a compiled graph cannot trace is_fake


def checked_at_once(tensor: torch.Tensor) -> bool:
    """Whether a check of ``tensor``'s values can raise at once, reading them on the host without a
    synchronization: on the CPU, outside compiled graphs."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()


def check_on_device(condition: torch.Tensor, message: str) -> None:
    """``ValueError(message)`` unless the bool scalar ``condition`` holds, without a host sync: at
    once where ``checked_at_once``; on a GPU or in a compiled graph as an asynchronous device-side
    assertion, which stops the program at its next synchronization."""
    if checked_at_once(condition):
        if not bool(condition):
            raise ValueError(message)
    else:  # the device's message holds at most 254 characters
        torch._assert_async(condition, message if len(message) < 255 else message[:251] + "...")


class RowSelection(NamedTuple):
    """The rows an op computes: the selected rows of the flattened leading shape, where each
    result goes back, and the rows' target columns on this rank's vocabulary shard."""

    lead_shape: torch.Size
    row_index: Optional[torch.Tensor]  # [k] int64 indices into the flattened lead_shape; None: every row
    slots: Optional[torch.Tensor]  # [k] int64 where each result goes; lead_shape.numel(): nowhere (padding);
    # ``row_index`` itself where there is no max_rows padding
    target_column: torch.Tensor  # [k] int64 of the selected rows, -1 where another shard owns the target

    def take(self, values: torch.Tensor) -> torch.Tensor:
        """``values [*lead_shape, X]`` -> the selected rows ``[k, X]`` (differentiable)."""
        flat = values.reshape(-1, values.shape[-1])
        return flat if self.row_index is None else flat.index_select(0, self.row_index)

    def take_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row ``values [*lead_shape]`` -> the selected rows' ``[k]``."""
        flat = values.reshape(-1)
        return flat if self.row_index is None else flat.index_select(0, self.row_index)

    @property
    def padding(self) -> Optional[torch.Tensor]:
        """``[k]`` bool: the ``max_rows`` padding rows, which compute a real row whose inputs are
        not read and whose results go nowhere; ``None`` without ``max_rows``."""
        return None if self.slots is None or self.slots is self.row_index else self.slots == self.lead_shape.numel()

    def place(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row results ``[k, ...]`` back in ``[*lead_shape, ...]``, 0 on unselected rows
        (differentiable)."""
        shape = (*self.lead_shape, *values.shape[1:])
        if self.row_index is None:
            return values.view(shape)
        size = self.lead_shape.numel()
        full = values.new_zeros(size + 1, *values.shape[1:])  # the last slot takes the padding rows' results
        return full.index_copy(0, self.slots, values)[:size].view(shape)


def select_rows(
    targets: torch.Tensor,
    lead_shape: torch.Size,
    mask: Optional[torch.Tensor],
    max_rows: Optional[int],
    vocab_shard: int,
    tp_group: Optional[dist.ProcessGroup],
    out_of_vocab: str = "error",
    several: bool = False,
    vocab_size: Optional[int] = None,
    device: Optional[torch.device] = None,
) -> RowSelection:
    """Check ``targets`` (and ``mask``) against ``lead_shape`` and select the rows to compute:
    every row without a mask, else those where ``mask`` is True (their targets only are read);
    ``out_of_vocab`` and ``vocab_size`` as for ``target_columns``. With ``several``, ``targets [*lead_shape, k]`` hold
    ``k`` ids per row and the selection's ``target_column`` is ``[rows, k]``.

    With ``max_rows`` the selection has a static shape, ``[max_rows]``: the selected rows padded
    with rows whose results go nowhere (no host sync; more selected rows than ``max_rows`` is an
    error). Without it the number of selected rows is read on the host (``nonzero``). ``device``:
    where the rows are, which ``targets`` and ``mask`` must share.
    """
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer token ids, got {targets.dtype}")
    if (targets.shape[:-1] if several else targets.shape) != lead_shape:
        raise ValueError(
            f"targets.shape {tuple(targets.shape)} must equal the leading shape {tuple(lead_shape)} (several "
            "targets per row, [..., k]: every op but fused_linear_cross_entropy takes them)"
        )
    for name, value in (("targets", targets), ("mask", mask)):
        if device is not None and isinstance(value, torch.Tensor) and value.device != device:
            raise ValueError(f"{name} must be on {device}, the rows' device, got {value.device}")
    flat = targets.reshape(lead_shape.numel(), targets.shape[-1]) if several else targets.reshape(-1)

    def columns(chosen: torch.Tensor) -> torch.Tensor:  # [rows] or [rows, k]
        return target_columns(chosen.reshape(-1), vocab_shard, tp_group, out_of_vocab, vocab_size).view(chosen.shape)

    if mask is None:
        if max_rows is not None:
            raise ValueError("max_rows bounds the rows a mask selects; it needs a mask")
        return RowSelection(lead_shape, None, None, columns(flat))
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
    if mask.shape != lead_shape:
        raise ValueError(
            f"mask.shape {tuple(mask.shape)} must equal the rows' shape {tuple(lead_shape)} (the hidden states' "
            "without their last dimension): one flag per row, also with several targets per row"
        )
    flat_mask = mask.reshape(-1)
    if max_rows is None:
        rows = flat_mask.nonzero().squeeze(-1)
        return RowSelection(lead_shape, rows, rows, columns(flat[rows]))
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0:
        raise ValueError(f"max_rows must be a non-negative int or None, got {max_rows!r}")
    size = lead_shape.numel()
    max_rows = min(max_rows, size)
    check_on_device(flat_mask.sum() <= max_rows, f"mask selects more than max_rows={max_rows} rows")
    # The selected rows in order, then padding, by a scatter (no host sync, no data-dependent
    # shape): the i-th selected row goes to slot i; every other row to a slot past max_rows.
    rank = flat_mask.long().cumsum(0) - 1
    row_ids = torch.arange(size, device=flat_mask.device)
    destination = torch.where(flat_mask & (rank < max_rows), rank, max_rows + row_ids)
    slots = flat_mask.new_full((max_rows + size,), size, dtype=torch.long).scatter_(0, destination, row_ids)
    slots = slots[:max_rows]
    rows = slots.clamp(max=max(size - 1, 0))  # padding rows compute a real row, their results go nowhere
    selection = RowSelection(lead_shape, rows, slots, None)
    padding = selection.padding.view(-1, *(1,) * (flat.dim() - 1))
    selected_targets = torch.where(padding, 0, flat[rows])  # a padding row's targets are never read
    return selection._replace(target_column=columns(selected_targets))


OUT_OF_VOCAB = ("error", "max_logit")


def check_out_of_vocab(out_of_vocab: str) -> str:
    """``out_of_vocab`` if it is one of ``OUT_OF_VOCAB``, else ``ValueError``."""
    if out_of_vocab not in OUT_OF_VOCAB:
        raise ValueError(f"out_of_vocab must be one of {', '.join(map(repr, OUT_OF_VOCAB))}; got {out_of_vocab!r}")
    return out_of_vocab


def live_columns(vocab_shard: int, vocab_size: Optional[int], tp_group: Optional[dist.ProcessGroup]) -> int:
    """How many of this rank's ``vocab_shard`` columns lie below the true vocabulary ``vocab_size``
    (global ids; ``None``: every column, as the stock head). Megatron pads the head to a multiple of
    ``make_vocab_size_divisible_by x TP``: the padded ids are the last, on the last ranks. The same
    check on every rank: ``ValueError`` unless each rank holds at least one id of the vocabulary."""
    vocab_size = check_vocab_size(vocab_size)
    if vocab_size is None:
        return vocab_shard
    ranks = group_size(tp_group)
    if not (ranks - 1) * vocab_shard < vocab_size <= ranks * vocab_shard:
        raise ValueError(
            f"vocab_size={vocab_size} must lie in ({(ranks - 1) * vocab_shard}, {ranks * vocab_shard}]: at most the "
            f"head's {vocab_shard} rows x {ranks} ranks, and every rank holding at least one id of it"
        )
    return min(vocab_shard, vocab_size - group_rank(tp_group) * vocab_shard)


def target_columns(
    targets: torch.Tensor,
    vocab_shard: int,
    tp_group: Optional[dist.ProcessGroup],
    out_of_vocab: str = "error",
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """Flat global ``targets [n]`` as ``target_column [n]`` int64 on this rank's vocabulary shard:
    rank ``r`` owns global ids ``[r * vocab_shard, (r + 1) * vocab_shard)``; -1 where another rank
    owns the id. The vocabulary is ``[0, vocab_size)`` (``None``: every rank's columns, padded ones
    included). An id outside the vocabulary is an error (``check_on_device``: at once on the CPU,
    asynchronous on a GPU) unless ``out_of_vocab="max_logit"``, which gives it ``OUTSIDE_VOCAB`` on
    every rank: no rank owns it, its logit counts as the row's largest and takes no gradient, as in
    Megatron's vocabulary-parallel cross-entropy (``check_out_of_vocab`` checks it first)."""
    vocab = vocab_shard * group_size(tp_group) if vocab_size is None else vocab_size
    targets = targets.long()
    inside = targets.clamp(0, vocab - 1) == targets
    column = targets
    if group_size(tp_group) > 1:  # another rank's ids: -1
        column = targets - group_rank(tp_group) * vocab_shard
        column = torch.where(column.clamp(0, vocab_shard - 1) == column, column, -1)
    if out_of_vocab == "max_logit":
        return torch.where(inside, column, OUTSIDE_VOCAB)
    if targets.numel() > 0:
        bound = (
            "vocab_size" if vocab_size is not None else f"{vocab_shard} rows per rank x {group_size(tp_group)} ranks"
        )
        check_on_device(
            inside.all(),
            f"a target id is outside the vocabulary [0, {vocab}) ({bound}); leave such positions out with mask=",
        )
    return column


def per_sequence_broadcast(value: torch.Tensor, lead_shape: torch.Size) -> torch.Tensor:
    """``value`` expanded to ``lead_shape`` where it holds one value per sequence, as trainers pass a
    GRPO advantage or a sampling temperature: its shape is a prefix of ``lead_shape`` padded with
    1s (``[b]`` or ``[b, 1]`` for rows ``[b, s]``), and the trainers' own code broadcasts it over
    the positions. Any other shape is returned as it is, for the caller's own check."""
    if not 0 < value.dim() <= len(lead_shape) or value.shape == lead_shape:
        return value
    padded = (*value.shape, *(1,) * (len(lead_shape) - value.dim()))
    if padded[0] != lead_shape[0] or any(got not in (1, want) for got, want in zip(padded, lead_shape, strict=True)):
        return value
    return value.reshape(padded).expand(lead_shape)


def row_temperatures(
    temperature: Union[float, torch.Tensor], selection: RowSelection, device: torch.device
) -> torch.Tensor:
    """The selected rows' temperatures, float32 ``[k]`` on ``device`` (stride 0 where they share one),
    from ``temperature``: a positive finite number (a 0-dim CPU tensor counts as one), or a float
    tensor on ``device``, shaped like the rows (``selection.lead_shape``), one per sequence
    (``per_sequence_broadcast``: ``[b]`` or ``[b, 1]`` for rows ``[b, s]``) or 0-dim, that needs no
    gradient. ``TypeError`` / ``ValueError`` otherwise; a tensor's values are checked by
    ``check_on_device`` (no host synchronization on a GPU), those of rows the selection leaves out
    (``max_rows`` padding included) not at all. Always a copy: the caller's tensor may change, or
    be an inference tensor, before the backward reads it."""
    num_rows = selection.lead_shape.numel() if selection.row_index is None else selection.row_index.shape[0]
    if isinstance(temperature, torch.Tensor) and temperature.dim() == 0 and temperature.device.type == "cpu":
        if temperature.requires_grad:
            raise ValueError("temperature takes no gradient: pass it detached")
        temperature = temperature.item()  # read on the host, where it lives
    if not isinstance(temperature, torch.Tensor):
        value = checked_number("temperature", temperature)
        if not value > 0 or not math.isfinite(value):
            raise ValueError(f"temperature must be a positive finite number, got {value}")
        # One value seen by every row (stride 0): the kernels then scale by a scalar.
        return torch.full((1,), value, dtype=torch.float32, device=device).expand(num_rows)
    if not temperature.dtype.is_floating_point:
        raise TypeError(f"temperature must be a float tensor (one per row) or a number, got {temperature.dtype}")
    if temperature.requires_grad:
        raise ValueError("temperature takes no gradient: pass it detached")
    if temperature.device != device:
        raise ValueError(f"temperature must be on {device} (or be a number), got {temperature.device}")
    temperature = per_sequence_broadcast(temperature, selection.lead_shape)
    if temperature.dim() == 0:
        rows = temperature.to(torch.float32, copy=True).reshape(1)
    elif temperature.shape != selection.lead_shape:
        raise ValueError(
            f"temperature.shape {tuple(temperature.shape)} must equal the rows' shape {tuple(selection.lead_shape)} "
            "(one per row), hold one per sequence ([b] or [b, 1] for rows [b, s]), or be 0-dim"
        )
    else:
        rows = selection.take_rows(temperature).to(torch.float32, copy=True)
        if selection.padding is not None:  # a padding row's temperature is not read
            rows = torch.where(selection.padding, 1.0, rows)
    if rows.numel() > 0:
        check_on_device(((rows > 0) & rows.isfinite()).all(), "every temperature must be positive and finite")
    return rows.expand(num_rows) if temperature.dim() == 0 else rows.contiguous()
