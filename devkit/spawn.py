"""Run a function on several gloo ranks in spawned processes (CPU tests of tensor parallelism)."""

import multiprocessing
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(rank, worker, world_size, port, args):
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
    mp.start_processes(
        _rank_entry,
        args=(worker, world_size, _free_port(), args),
        nprocs=world_size,
        join=True,
        start_method="forkserver",
    )
