"""Recording the collectives an op calls, for tests that count them."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_fused_lm.ops.rank_check import DIGEST_SIZE

# The all-gather the ops call: torch >= 2.10 names it all_gather_single.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


@contextlib.contextmanager
def recorded_collectives(rank_check: bool = False):
    """Record ``(name, shape of the tensor sent)`` of each all-gather and all-reduce, in order: an
    op's own collectives. The ranks' check on the first call of each signature (``ops.rank_check``,
    one all-gather of ``[1, DIGEST_SIZE]`` int64) is recorded as ``("rank_check", shape)`` with
    ``rank_check=True``, else left out."""
    calls = []
    originals = {name: getattr(dist, name) for name in (ALL_GATHER, "all_reduce")}

    def recording(name):
        def call(*args, **kwargs):
            sent = args[1] if name == ALL_GATHER else args[0]
            if name == ALL_GATHER and sent.dtype == torch.int64 and tuple(sent.shape) == (1, DIGEST_SIZE):
                if rank_check:
                    calls.append(("rank_check", tuple(sent.shape)))
            else:
                calls.append((name, tuple(sent.shape)))
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, recording(name))
    try:
        yield calls
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


def counts(calls) -> dict:
    """``{ALL_GATHER: n, "all_reduce": m}`` of what ``recorded_collectives`` recorded."""
    names = [name for name, _ in calls]
    return {ALL_GATHER: names.count(ALL_GATHER), "all_reduce": names.count("all_reduce")}
