"""Host time to issue one transfer staged through host memory, by the number of pieces.

    torchrun --nproc_per_node P bench/staged_issue.py [--shared-gpu] [--pieces 1,2,4,8]
        [--kib 4,16384] [--iters 200]

Where the host sets a layer's pace (the interleaved layer at h 4096 / 8K tokens over the slow
link, BENCHMARKS.md, thirty-second session), what a staged transfer costs the host counts as
much as what it moves. Each rank runs the transfers of ``layers/host_staged.py`` in a group of
its own with ``pieces`` pieces per copy (``HostStagedGroup(..., pieces=n)``), of ``--kib``
KiB (bf16) per rank, ``--iters`` times each, and times with ``time.perf_counter``:

- ``start us``: the host's time in ``start`` (or ``start_shift``) of one transfer;
- ``finish us``: its time in ``finish``;

each the median over the iterations, rank 0's. The GPU is synchronised (and the ranks meet)
every 4 transfers, so that the driver's queues never fill and block the host; what the GPU
does meanwhile is not timed. ``wall us``: the time per transfer of ``--iters`` transfers
issued back to back and then synchronised, which the copies and the link set where the host
keeps ahead.

``--shared-gpu``: every rank on GPU 0 in a gloo world, each its own process and CUDA context,
for a machine with one GPU: the host's times are its own, ``wall us`` is not a link's (the
ranks' copies share one GPU's copy engines). Otherwise rank r on GPU r, an NCCL world.
Kinds: ``gather``, ``all_reduce`` and ``reduce_scatter`` (``async_comm``'s patterns) and
``shift`` (a ring's hop: to the left neighbour, from the right).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from ds_stpar.layers.host_staged import HostStagedGroup

KINDS = ("gather", "all_reduce", "reduce_scatter", "shift")
SYNC_EVERY = 4


def _issue(staged: HostStagedGroup, kind: str, x: torch.Tensor, into: torch.Tensor):
    if kind != "shift":
        return staged.start(kind, x)
    size, me = staged.size, staged.rank
    return staged.start_shift([x], (me - 1) % size, [into], (me + 1) % size)


def _host_us(staged: HostStagedGroup, kind: str, x, into, iters: int) -> tuple[float, float]:
    """Median host microseconds in start and in finish of one transfer."""
    starts, finishes = [], []
    for i in range(iters):
        if i % SYNC_EVERY == 0:
            torch.cuda.synchronize()
            dist.barrier(staged.group)
        t0 = time.perf_counter()
        transfer = _issue(staged, kind, x, into)
        t1 = time.perf_counter()
        transfer.finish()
        t2 = time.perf_counter()
        starts.append(t1 - t0)
        finishes.append(t2 - t1)
    return statistics.median(starts) * 1e6, statistics.median(finishes) * 1e6


def _wall_us(staged: HostStagedGroup, kind: str, x, into, iters: int) -> float:
    torch.cuda.synchronize()
    dist.barrier(staged.group)
    t0 = time.perf_counter()
    for _ in range(iters):
        _issue(staged, kind, x, into).finish()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shared-gpu", action="store_true", help="every rank on GPU 0 (gloo)")
    parser.add_argument("--pieces", default="1,2,4,8")
    parser.add_argument("--kib", default="4,16384", help="KiB per rank per transfer")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        raise SystemExit("bench/staged_issue.py stages through GPUs: run it under torchrun")
    pieces = [int(n) for n in args.pieces.split(",")]
    sizes = [int(n) for n in args.kib.split(",")]
    local = 0 if args.shared_gpu else int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo" if args.shared_gpu else "nccl")
    size = dist.get_world_size()
    groups = []  # kept to the end: a group's pages stay mapped and registered while it lives
    rows = []
    for n in pieces:
        staged = HostStagedGroup(dist.new_group(list(range(size))), device, pieces=n)
        groups.append(staged)
        for kib in sizes:
            numel = max(kib * 512 // size * size, size)  # bf16 elements, divisible by P
            x = torch.randn(numel, device=device).bfloat16()
            into = torch.empty_like(x)
            for kind in KINDS:
                _wall_us(staged, kind, x, into, 8)  # buffers grown
                start_us, finish_us = _host_us(staged, kind, x, into, args.iters)
                wall = _wall_us(staged, kind, x, into, args.iters)
                rows.append((kind, kib, n, start_us, finish_us, wall))
    if dist.get_rank() == 0:
        where = "sharing GPU 0" if args.shared_gpu else "a GPU each"
        print(
            f"| transfer | KiB | pieces | start us | finish us | wall us "
            f"({torch.cuda.get_device_name(device)}, P = {size}, {where}) |"
        )
        print("|---|---|---|---|---|---|")
        for kind, kib, n, start_us, finish_us, wall in rows:
            print(f"| {kind} | {kib} | {n} | {start_us:.1f} | {finish_us:.1f} | {wall:.1f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
