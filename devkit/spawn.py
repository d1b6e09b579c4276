"""Run a function, or a torchrun script, on several gloo ranks in processes forked from a server
that imported torch and Megatron once (CPU tests of tensor and pipeline parallelism)."""

import multiprocessing
import os
import runpy
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def rendezvous_store() -> dist.TCPStore:
    """A TCP store listening on 127.0.0.1 at a port of the OS's choosing (``.port``), for ranks
    given ``rank_environment(..., store.port)`` to join as clients, as torchrun's ranks join its
    agent's store; keep a reference while they run. It holds its port from the start: picking a
    free port and leaving rank 0 to bind it later lost the port to another test process now and
    then (EADDRINUSE)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _rank_entry(rank, worker, world_size, port, args):
    os.environ.update(rank_environment(rank, world_size, port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        worker(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


# The ranks are forked from a server process that imported these once, rather than each importing
# them anew (a few seconds per rank); the server itself never computes, so forking it is safe.
PRELOADED = ["torch", "megatron.core", "devkit.megatron_gpt", "megatron_fused_lm.integration"]


def run_ranks(worker, world_size: int, *args) -> None:
    """Call ``worker(rank, world_size, *args)`` on ``world_size`` gloo ranks; an exception on any
    rank fails the caller. ``worker`` must be a module-level function (it is pickled)."""
    multiprocessing.set_forkserver_preload(PRELOADED)
    store = rendezvous_store()
    mp.start_processes(
        _rank_entry,
        args=(worker, world_size, store.port, args),
        nprocs=world_size,
        join=True,
        start_method="forkserver",
    )


def run_script_on_ranks(script, world_size: int, argv, env=None, timeout_s: float = 600) -> None:
    """Run the torchrun script ``script`` as ``__main__`` with arguments ``argv`` on ``world_size``
    ranks, each with the environment torchrun gives a rank (and ``env``), without torchrun: a CPU
    dry run whose ranks skip the imports. A failure on any rank fails the caller (with the rank's
    traceback), and so do ranks still running after ``timeout_s``."""
    multiprocessing.set_forkserver_preload(PRELOADED)
    store = rendezvous_store()
    context = mp.start_processes(
        _script_entry,
        args=(str(script), list(argv), world_size, store.port, dict(env or {})),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.terminate()
            raise TimeoutError(f"{script}: the ranks had not finished after {timeout_s} s")


def rank_environment(rank: int, world_size: int, port: int) -> dict:
    """What torchrun sets for ``rank`` of a one-host job whose store (``rendezvous_store``) listens on
    127.0.0.1:``port``; every rank, rank 0 too, joins that store as a client."""
    return dict(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
    )  # fmt: skip


def _script_entry(rank, script, argv, world_size, port, env):
    os.environ.update(env, **rank_environment(rank, world_size, port))
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script` puts its folder first
    runpy.run_path(script, run_name="__main__")
