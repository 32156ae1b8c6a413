"""What one ring hop costs the GEMMs beside it, per transport and per cuBLAS SM target.

    torchrun --nproc_per_node 2 bench/hop_interference.py [--shapes 8192x8192x16384,...]
        [--transports nccl,copy-engine,local-copy] [--blas cublas,cublaslt] [--carveouts none,4,8,16,32]

Where the P = 2 ring and the interleaved layer lose to the no-communication limit, the
timelines put most of it in GEMMs running slower beside NCCL's kernels (BENCHMARKS.md,
twentieth and twenty-first sessions). Two remedies are measured here on one hop of a
``[rows, k]`` bf16 chunk between the two ranks, beside ``[rows, k] x [k, n]`` GEMMs:

- the transport: ``nccl`` is ds_stpar's ``start_p2p`` (NCCL's send/receive kernels, on SMs);
  ``copy-engine`` pushes the chunk into the peer's symmetric memory with ``copy_`` on a side
  stream (the GPU's copy engines, no SMs), between two symmetric-memory barriers (buffer free,
  data landed; one-block kernels); ``local-copy`` moves nothing between the GPUs, only copies
  the chunk within each (copy engine): the hop's memory traffic (read 1 chunk, write 1 chunk
  per GPU) without the link, to tell the traffic's share of the loss from the link's;
- the GEMM's SM target: PyTorch's ``torch._C._set_sm_carveout_experimental(c)`` tells cuBLASLt
  (and the Lt path of ``--blas cublaslt``) to plan for all SMs but ``c``, so that a GEMM
  launched beside a communication kernel is not split into a second wave.

Timed per configuration (median of ``--repeats`` CUDA-event steps after warm-up, the max over
the ranks, then the min over ``--rounds`` rounds; clocks drift by a few percent between
rounds): ``2 GEMMs``; ``hop`` alone; ``step`` = hop started, GEMM beside it, wait, GEMM on the
arrival (a ring pass at P = 2); ``4 GEMMs`` and ``4 GEMMs + hop`` (a hop under a long stretch of
compute, as in the interleaved layer). ``step - 2 GEMMs`` and ``+hop - 4 GEMMs`` are what the
hop costs there: exposed transfer plus slower GEMMs.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from ds_stpar.layers.comm import Message, start_p2p


def timed(fn: Callable[[], None], group, repeats: int, warmup: int) -> float:
    """Median ms of ``fn`` over ``repeats`` CUDA-event steps, the max over the ranks."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(repeats)
    ]
    for begin, end in events:
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(begin.elapsed_time(end) for begin, end in events)
    median = torch.tensor([times[len(times) // 2]], device="cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
    return median.item()


class CopyEngineHop:
    """ds_stpar's copy-engine ring (``layers/symmetric.SymmetricRing``, as ``ring_pass`` uses
    it): the chunk pushed into the peer's symmetric buffer on a side stream between two
    barriers; the arrival is a view of this rank's own buffer."""

    def __init__(self, chunk: torch.Tensor, group) -> None:
        from ds_stpar.layers.symmetric import SymmetricRing

        self._ring = SymmetricRing(group, chunk.device)
        self._batch = None

    def start(self, chunk: torch.Tensor) -> None:
        self._batch = self._ring.start([chunk])

    def finish(self) -> torch.Tensor:
        return self._batch.wait()[0]


class NcclHop:
    """ds_stpar's ``start_p2p``: send the chunk to the peer, receive the peer's."""

    def __init__(self, chunk: torch.Tensor, group) -> None:
        self._group, self._peer = group, 1 - group.rank()
        self.arrival = torch.empty_like(chunk)
        self._pending = None

    def start(self, chunk: torch.Tensor) -> None:
        sends, recvs = [Message(chunk, self._peer)], [Message(self.arrival, self._peer)]
        self._pending = start_p2p(sends, recvs, self._group)

    def finish(self) -> torch.Tensor:
        self._pending.wait()
        return self.arrival


class LocalCopy:
    """No transfer: the chunk copied within this GPU by ``copy_`` on a side stream (copy
    engine), the hop's memory traffic without NVLink or the peer: what the GEMMs lose to
    that alone."""

    def __init__(self, chunk: torch.Tensor, group) -> None:
        self.arrival = torch.empty_like(chunk)
        self._stream = torch.cuda.Stream(chunk.device)

    def start(self, chunk: torch.Tensor) -> None:
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            self.arrival.copy_(chunk)

    def finish(self) -> torch.Tensor:
        torch.cuda.current_stream().wait_stream(self._stream)
        return self.arrival


TRANSPORTS = {"nccl": NcclHop, "copy-engine": CopyEngineHop, "local-copy": LocalCopy}


def measure(rows: int, k: int, n: int, hop, group, args) -> dict[str, float]:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)

    def gemm(a: torch.Tensor = x) -> None:
        torch.mm(a, w.t(), out=y)

    def two_gemms() -> None:
        gemm()
        gemm()

    def alone() -> None:
        hop.start(x)
        hop.finish()

    def step() -> None:
        hop.start(x)
        gemm()
        gemm(hop.finish())

    def four_gemms() -> None:
        for _ in range(4):
            gemm()

    def four_and_hop() -> None:
        hop.start(x)
        four_gemms()
        hop.finish()

    runs = {
        "2 GEMMs": two_gemms,
        "hop": alone,
        "step": step,
        "4 GEMMs": four_gemms,
        "4 GEMMs + hop": four_and_hop,
    }
    best = {name: float("inf") for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            best[name] = min(best[name], timed(fn, group, args.repeats, args.warmup))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="8192x8192x16384,8192x8192x8192,4096x4096x8192")
    parser.add_argument("--transports", default="nccl,copy-engine,local-copy")
    parser.add_argument("--blas", default="cublas,cublaslt")
    parser.add_argument("--carveouts", default="none,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the rows as JSON here (rank 0)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        raise SystemExit("bench/hop_interference.py measures GPUs: run it under torchrun")
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    if dist.get_world_size() != 2:
        raise SystemExit("bench/hop_interference.py times one hop between 2 ranks")
    group = dist.new_group([0, 1])
    carveouts = [None if c == "none" else int(c) for c in args.carveouts.split(",")]
    rows_out = []
    for shape in args.shapes.split(","):
        rows, k, n = (int(v) for v in shape.split("x"))
        chunk = torch.empty(rows, k, device="cuda", dtype=torch.bfloat16)
        for transport in args.transports.split(","):
            hop = TRANSPORTS[transport](chunk, group)
            for blas in args.blas.split(","):
                torch.backends.cuda.preferred_blas_library(blas)
                for carveout in carveouts:
                    torch._C._set_sm_carveout_experimental(carveout)
                    times = measure(rows, k, n, hop, group, args)
                    torch._C._set_sm_carveout_experimental(None)
                    rows_out.append(
                        {
                            "shape": shape,
                            "transport": transport,
                            "blas": blas,
                            "carveout": carveout,
                            **times,
                        }
                    )
            del hop
    if rank == 0:
        card = torch.cuda.get_device_name()
        link = "slow" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "nvlink"
        print(f"## {card} x 2, {link}, ms (min over {args.rounds} rounds of medians)\n")
        print(
            "| rows x k x n | transport | blas | carveout | 2 GEMMs | hop | step | step - 2 GEMMs"
            " | 4 GEMMs | 4 GEMMs + hop | + hop - 4 GEMMs |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows_out:
            print(
                f"| {r['shape']} | {r['transport']} | {r['blas']} | {r['carveout']} "
                f"| {r['2 GEMMs']:.3f} | {r['hop']:.3f} | {r['step']:.3f} "
                f"| {r['step'] - r['2 GEMMs']:+.3f} | {r['4 GEMMs']:.3f} "
                f"| {r['4 GEMMs + hop']:.3f} | {r['4 GEMMs + hop'] - r['4 GEMMs']:+.3f} |"
            )
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"card": card, "link": link, "rows": rows_out}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
