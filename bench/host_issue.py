"""Host time to issue one neighbour exchange, per way of issuing it.

    torchrun --nproc_per_node 2 bench/host_issue.py [--iters 2000] [--numel 4096]

A P = 2 ring layer is host-bound in whole models of modest width (BENCHMARKS.md, eighteenth
session): what the host spends per hop matters as much as what the GPU does. Each rank sends
a small bf16 buffer to its right neighbour and receives one from its left, ``--iters`` times;
the buffers are tiny, so the GPU keeps up and the wall time per exchange is the host's. Rows
(rank 0, median of 5 rounds after one more), "side stream" as ``start_p2p`` issued before the
eighteenth session (the side stream waits for the compute stream, and back):

- ``batch_isend_irecv``: ``dist.P2POp`` pairs through ``dist.batch_isend_irecv``, side stream;
- ``coalesced send/recv, side stream``: the group's own start / send / recv / end coalescing
  calls, on the side stream;
- ``coalesced send/recv``: the same from the compute stream (NCCL's stream orders itself);
- ``start_p2p``: ds_stpar's primitive (the previous row plus its in-flight bound);
- ``all_to_all_single``: one collective with splits that send only to the neighbour, side
  stream;
- ``all_gather_into_tensor``: the P = 2 exchange as a gather (its output holds both chunks),
  side stream;
- ``copy engines``: the ring's batch by the copy engines (``layers.symmetric.SymmetricRing``:
  the push into the left neighbour's symmetric buffer between two barriers, side stream), the
  path ``DS_STPAR_RING_TRANSPORT=auto`` takes over peer links (left out without them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from ds_stpar.layers.comm import Message, _coalesced_batch, _p2p_ops, _side_stream, start_p2p
from ds_stpar.layers.symmetric import SymmetricRing, peer_links


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--numel", type=int, default=4096)
    args = parser.parse_args()
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        raise SystemExit("bench/host_issue.py measures NCCL: run it under torchrun on GPUs")
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    group = dist.new_group(list(range(dist.get_world_size())))
    size, me = group.size(), group.rank()
    left, right = (me - 1) % size, (me + 1) % size
    device = torch.device("cuda", rank)
    send = torch.ones(args.numel, dtype=torch.bfloat16, device=device)
    recv = torch.empty_like(send)
    gathered = torch.empty(size * args.numel, dtype=torch.bfloat16, device=device)
    in_splits = [args.numel if r == left else 0 for r in range(size)]
    out_splits = [args.numel if r == right else 0 for r in range(size)]
    stream = _side_stream(device)
    compute = torch.cuda.current_stream(device)

    def on_side(issue):
        def run():
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                works = issue()
            for work in works:
                work.wait()
            compute.wait_stream(stream)

        return run

    sends, recvs = [Message(send, left)], [Message(recv, right)]

    def batch():
        return dist.batch_isend_irecv(_p2p_ops(sends, recvs, group))

    def coalesced():
        return [_coalesced_batch(sends, recvs, group, device)]

    def all_to_all():
        return [dist.all_to_all_single(recv, send, out_splits, in_splits, group, async_op=True)]

    def all_gather():
        return [dist.all_gather_into_tensor(gathered, send, group, async_op=True)]

    ways = {
        "batch_isend_irecv": on_side(batch),
        "coalesced send/recv, side stream": on_side(coalesced),
        "coalesced send/recv": lambda: [work.wait() for work in coalesced()],
        "start_p2p": lambda: start_p2p(sends, recvs, group).wait(),
        "all_to_all_single": on_side(all_to_all),
    }
    if size == 2:
        ways["all_gather_into_tensor"] = on_side(all_gather)
    if peer_links(group, device):  # where DS_STPAR_RING_TRANSPORT=auto would take them
        ring = SymmetricRing(group, device)
        ways["copy engines"] = lambda: ring.start([send]).wait()
    results = {}
    for name, run in ways.items():
        rounds = []
        for _ in range(6):
            torch.cuda.synchronize()
            dist.barrier(group)
            start = time.perf_counter()
            for _ in range(args.iters):
                run()
            torch.cuda.synchronize()
            rounds.append((time.perf_counter() - start) / args.iters * 1e6)
        results[name] = statistics.median(rounds[1:])
    if me == 0:
        print(f"| way | host us per exchange ({torch.cuda.get_device_name()}, P = {size}) |")
        print("|---|---|")
        for name, us in results.items():
            print(f"| {name} | {us:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
