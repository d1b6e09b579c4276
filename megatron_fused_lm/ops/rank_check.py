"""The raw ops' check that the ranks of a tensor-parallel group agree before their first collective.

Under tensor parallelism every rank must pass the same rows (shapes, targets, mask, temperatures,
kept sets, a loss's per-token inputs), the same options and its own shard of the vocabulary. A mistake there either
gives numbers (a whole weight on every rank: each log-prob off by log P; targets or temperatures
that differ) or aborts inside a collective (a mask that selects other rows). So the first call of an
op for each group, weight shape and dtype gathers a digest of its inputs from every rank (one
all-gather of a few int64, one read on the host) and raises a ``ValueError`` naming what differs.
Later calls with the same signature take no collective and no read, so a mistake that first shows in
a later call (a mask that selects other rows on one rank in the tenth micro-batch) is not caught and
the op's own collective fails on it. Each rank decides from its own signature: a mistake that
changes it on some ranks only (their shard size) makes only those ranks run the check's all-gather:
the group then aborts (gloo) or hangs (NCCL). ``check_ranks_agree("always")`` checks every call
instead, at one such all-gather and read per call. Skipped where values are not available (meta and
fake tensors, compiled graphs, CUDA-graph capture) and turned off for the process with
``check_ranks_agree(False)``. The head's route passes the model's own group and shard; the batch
(the labels, a mask) is the trainer's, and a disagreement there is named as the labels path's.
"""

from __future__ import annotations

import struct
import threading
import zlib
from typing import List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .distributed import all_gather_stacked, group_name, group_size
from .inputs import has_values

_lock = threading.Lock()
_checked: set = set()
_mode: List[Union[bool, str]] = [True]  # True: each signature's first call; False: never; "always"

# Vocabulary rows sampled for the shard's digest: enough to tell shards apart, a read of a few KiB.
SAMPLED_WEIGHT_ROWS = 16


def check_ranks_agree(enabled: Union[bool, str]) -> None:
    """Set for this process when the ops check that the tensor-parallel ranks agree on their inputs:
    ``True`` (the default) on the first call of each op, group, shard size, row width and dtypes;
    ``"always"`` on every call (one all-gather of a few int64 and one host read per call: what
    catches a mistake that first shows in a later call); ``False`` never. Every rank must set the
    same (``megatron_fused_lm.ops.rank_check`` says what is checked)."""
    if enabled not in (True, False, "always"):
        raise ValueError(f"check_ranks_agree takes True, False or 'always', got {enabled!r}")
    _mode[0] = enabled


class RanksDisagree(ValueError):
    """The ranks of a tensor-parallel group disagree on an op's inputs; ``differing`` names them as
    ``NAMES`` does (empty where every rank holds the same weight rows)."""

    def __init__(self, message: str, differing: Sequence[str] = ()):
        super().__init__(message)
        self.differing = tuple(differing)


NAMES = (
    "the rows' shape",
    "the hidden size",
    "the shard's vocabulary rows",
    "vocab_size",
    "softcap",
    "the options (backend, token_chunk, max_rows, out_of_vocab, ...)",
    "targets",
    "mask",
    "temperature",
    "kept_tokens",
    "loss_inputs",
)
DIGEST_SIZE = len(NAMES) + 2  # and the shard's sampled rows: their digest, whether they differ


def check_across_ranks(
    op: str,
    tp_group: Optional[dist.ProcessGroup],
    hidden: torch.Tensor,
    shard: Optional[torch.Tensor],
    targets: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    temperature=1.0,
    kept_tokens=None,
    loss_inputs: Optional[Mapping[str, torch.Tensor]] = None,
    vocab_size: Optional[int] = None,
    softcap: Optional[float] = None,
    settings: Optional[Mapping[str, object]] = None,
) -> None:
    """``ValueError`` where the ranks of ``tp_group`` disagree on ``op``'s inputs: ``hidden [..., H]``
    and ``shard [V / P, H]`` the rank's weight shard, or a logits shard ``[..., V / P]`` and
    ``None`` (its columns are the vocabulary rows); the rest as the op takes them (``loss_inputs`` a
    loss's per-token tensors by name, or ``{"declared_weights": ...}``; ``settings`` its other
    options by name (numbers, bools, strings or ``None``, as far as the op has checked them, compared
    by their ``repr``): ranks whose backend, chunks, row count or collectives differ abort or hang in the
    op). Once per op, group, shard size, row width, dtypes and device, whatever the number of rows;
    nothing else on later calls."""
    if not _mode[0] or group_size(tp_group) == 1 or not has_values(hidden):
        return
    vocab_shard, shard_dtype = (hidden.shape[-1], hidden.dtype) if shard is None else (shard.shape[0], shard.dtype)
    signature = (op, group_name(tp_group), vocab_shard, hidden.shape[-1], shard_dtype, hidden.dtype, hidden.device)
    with _lock:  # claimed before the collective: one thread of a rank runs it
        if signature in _checked and _mode[0] != "always":
            return
        _checked.add(signature)
    try:
        temperature = temperature if isinstance(temperature, torch.Tensor) else torch.tensor(float(temperature))
        if shard is None:  # the logits' columns as rows, built on the first call only
            shard = hidden.reshape(-1, vocab_shard).t()
        vocab = -1 if vocab_size is None else vocab_size
        cap = -1 if softcap is None else struct.unpack("<q", struct.pack("<d", float(softcap)))[0]  # its exact bits
        chosen = zlib.crc32(repr(sorted((settings or {}).items())).encode())
        local = [hidden.shape[:-1].numel(), hidden.shape[-1], vocab_shard, vocab, cap, chosen]
        inputs = _digests(targets, mask, temperature, kept_tokens, loss_inputs, hidden.device)
        digest = torch.cat([torch.tensor(local, device=hidden.device), inputs, _shard_digest(shard)])
        gathered = all_gather_stacked(digest[None], tp_group)[:, 0].cpu()  # the one read on the host
        differing = [
            name for index, name in enumerate(NAMES) if not bool((gathered[:, index] == gathered[0, index]).all())
        ]
        if differing:
            raise RanksDisagree(
                f"{op}: the ranks of tp_group disagree on {', '.join(differing)}; under tensor parallelism every rank "
                "passes the same rows, targets, mask, temperatures, kept sets, loss inputs and options, and its own "
                "shard of the vocabulary",
                differing,
            )
        sampled, rows_vary = gathered[:, -2], gathered[:, -1]
        if bool((sampled == sampled[0]).all()) and bool(rows_vary.all()):
            raise RanksDisagree(
                f"{op}: every rank of tp_group holds the same weight rows; pass each rank its shard of the vocabulary "
                f"(rows [r V / P, (r + 1) V / P) on rank r of P = {group_size(tp_group)}), or the whole weight without "
                "tp_group"
            )
    except BaseException:
        # Every rank reads the same gathered digest, so all refuse alike: a refused call, caught and
        # repeated, is checked again.
        with _lock:
            _checked.discard(signature)
        raise


def _digests(targets, mask, temperature, kept_tokens, loss_inputs, device: torch.device) -> torch.Tensor:
    """One int64 per input, in ``NAMES``' order after the shapes: a position-weighted sum of its values
    (wrapping, exact), -1 where absent; ``targets`` with their shape (``[n]`` and ``[n, 1]``: one target
    per row or several, other collectives; a temperature may come as ``[b]`` or ``[b, 1]``);
    ``kept_tokens`` by both tensors, ``loss_inputs`` by name (the same tensors under other names are
    other inputs). Tensors only: the op names a value of another type later."""
    absent = torch.tensor(-1, device=device)
    values = [_digest(value) if isinstance(value, torch.Tensor) else absent for value in (targets, mask, temperature)]
    if isinstance(targets, torch.Tensor):
        values[0] = values[0] + zlib.crc32(repr(tuple(targets.shape)).encode())
    tensors = kept_tokens is not None and all(isinstance(part, torch.Tensor) for part in kept_tokens[:2])
    values.append(_digest(kept_tokens[0]) * 1_000_003 + _digest(kept_tokens[1]) if tensors else absent)
    named = {key: value for key, value in (loss_inputs or {}).items() if isinstance(value, torch.Tensor)}
    keyed = [(_digest(named[key]) + zlib.crc32(key.encode())) * (index + 1) for index, key in enumerate(sorted(named))]
    values.append(sum(keyed) + len(named) if named else absent)
    return torch.stack([value.to(device) for value in values])


def _digest(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values and their number as one int64, the same on every rank exactly when they are."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype.is_floating_point:  # the float32 bits, so that equal values give equal digests
        flat = flat.float().view(torch.int32)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) * 2_654_435_761
    return (flat.long() * weights).sum() + flat.numel()


def _shard_digest(shard: torch.Tensor) -> torch.Tensor:
    """``[digest of a few evenly spaced vocabulary rows, whether those rows differ]`` (a constant
    weight, such as a zero initialization, is the same on every rank by design)."""
    step = max(shard.shape[0] // SAMPLED_WEIGHT_ROWS, 1)
    sample = shard.detach()[::step][:SAMPLED_WEIGHT_ROWS]
    rows_vary = (sample != sample[:1]).any().long()
    return torch.stack([_digest(sample), rows_vary])
