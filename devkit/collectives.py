"""Recording the collectives an op calls, for tests that count them."""

from __future__ import annotations

import contextlib

import torch.distributed as dist

# The all-gather the ops call: torch >= 2.10 names it all_gather_single.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


@contextlib.contextmanager
def recorded_collectives():
    """Record ``(name, shape of the tensor sent)`` of each all-gather and all-reduce, in order."""
    calls = []
    originals = {name: getattr(dist, name) for name in (ALL_GATHER, "all_reduce")}

    def recording(name):
        def call(*args, **kwargs):
            sent = args[1] if name == ALL_GATHER else args[0]
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
