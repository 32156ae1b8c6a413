"""Time the layout search (pure Python, one core, no GPU) and show what it picks.

    .venv/bin/python bench/planner_search.py [--repeat 3]

Each case runs ``ds_stpar.planner.search.search`` ``--repeat`` times and reports the
fastest wall time (the machine may be shared), the strategies looked at, the layout families
rejected, and the best strategy with its predicted throughput, MFU and peak memory. The
headline case is Llama-3 405B at sequence 8192 on 1024 H100s (global batch 1024 sequences),
which the planner is meant to search in under 2 s. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import time

from ds_stpar.config import MODEL_PRESETS, ClusterSpec, TrainSpec, load_gpu
from ds_stpar.planner.search import search

CASES = [
    # model, gpu, GPUs, seq, global batch (sequences)
    ("llama3-405b", "h100-80g", 1024, 8192, 1024),
    ("llama3-405b", "h100-80g", 16384, 8192, 2048),
    ("llama3-70b", "h100-80g", 64, 8192, 256),
    ("llama3-8b", "h100-80g", 8, 8192, 64),
    ("gpt3-175b", "a100-80g", 1024, 2048, 1536),
    ("gpt3-1.3b", "h200-141g", 2, 2048, 64),
]


def run_case(name: str, gpu: str, gpus: int, seq: int, batch: int, repeat: int) -> list[str]:
    model, train = MODEL_PRESETS[name], TrainSpec(seq, batch)
    cluster = ClusterSpec(load_gpu(gpu), gpus, 8)
    best_s = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        result = search(model, cluster, train)
        best_s = min(best_s, time.perf_counter() - start)
    top = result.top[0] if result.top else None
    return [
        f"{name} s={seq} B={batch}",
        f"{gpus} x {gpu}",
        f"{best_s:.3f}",
        str(result.considered),
        str(len(result.rejected)),
        top.strategy.short() if top else "nothing fits",
        f"{top.tokens_per_s:,.0f}" if top else "-",
        f"{top.mfu:.1%}" if top else "-",
        f"{top.peak_memory_gib:.1f}" if top else "-",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    headers = [
        "case",
        "cluster",
        "search s",
        "considered",
        "families rejected",
        "best strategy",
        "tokens/s",
        "MFU",
        "peak GiB",
    ]
    rows = [run_case(*case, args.repeat) for case in CASES]
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
