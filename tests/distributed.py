"""Spawn gloo workers on one machine (nanotron/DeepSpeed style), for multi-process tests.

``run_workers(fn, world_size, *args)`` starts ``world_size`` processes that each call
``fn(rank, world_size, *args)`` inside an initialised gloo process group (``backend="nccl"``:
NCCL, rank r on GPU r, for the GPU-only tests). A failure in any worker fails the test with
that worker's traceback. Batch several checks into one launch: each launch costs seconds of
start-up on CI's two cores.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, errors, backend: str
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable, world_size: int, *args, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of ``backend`` (gloo; or
    nccl, rank r on GPU r); re-raise failures. A port that another process took between
    :func:`free_port` and rank 0's listening on it (``EADDRINUSE``: the rendezvous failed,
    ``fn`` never ran) is retried on a new port, twice at most."""
    ctx = mp.get_context("spawn")
    for attempt in range(3):
        errors = ctx.SimpleQueue()
        try:
            mp.start_processes(
                _worker,
                args=(world_size, free_port(), fn, args, errors, backend),
                nprocs=world_size,
                start_method="spawn",
            )
            return
        except mp.ProcessRaisedException as err:
            messages = []
            while not errors.empty():
                messages.append(errors.get())
            text = "\n".join(messages) or str(err)
            if "EADDRINUSE" not in text or attempt == 2:
                raise AssertionError(text) from None
