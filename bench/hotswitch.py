"""Static layouts vs a bucketed plan with hot switching, through launch/pretrain.py.

    python bench/hotswitch.py --base configs/gpt3-1.3b-2xh100.json --gpus 2 \\
        --short-edge 512 --global-batch 64 --steps 8 --out DIR

Writes three ds_stpar.json variants of ``--base`` (same model, data, seed and token budget):
``static-dp`` (every row under the base's DP layout), ``static-tp`` (TP = --gpus, Megatron
linears, sequence parallel) and ``bucketed`` (rows up to --short-edge under DP, the rest under
the TP home layout, switching weights in and gradients back every step), runs each with the
DeepSpeed launcher for --steps steps, and prints a table of the median step time (first step
excluded), tokens/s, median switch time and its share of the step, read from each run's
metrics.jsonl. Set NCCL_P2P_DISABLE=1 in the environment for the slow-link variant.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys


def variants(base: dict, gpus: int, short_edge: int, global_batch: int) -> dict[str, dict]:
    section = base["ds_stpar"]
    seq_len = section["train"]["seq_len"]
    dp_strategy = dict(section["buckets"][-1]["strategy"])
    dp_strategy["layout"] = {"dp": gpus, "tp": 1, "pp": 1, "tp_mode": "megatron"}
    tp_strategy = dict(dp_strategy, micro_batch=1, sequence_parallel=True)
    tp_strategy["layout"] = {"dp": 1, "tp": gpus, "pp": 1, "tp_mode": "megatron"}
    plans = {
        "static-dp": [{"max_len": seq_len, "strategy": dp_strategy}],
        "static-tp": [{"max_len": seq_len, "strategy": tp_strategy}],
        "bucketed": [
            {"max_len": short_edge, "strategy": dp_strategy},
            {"max_len": seq_len, "strategy": tp_strategy},
        ],
    }
    out = {}
    for name, buckets in plans.items():
        cfg = copy.deepcopy(base)
        cfg["ds_stpar"]["buckets"] = buckets
        cfg["ds_stpar"]["train"]["global_batch"] = global_batch
        out[name] = cfg
    return out


def summarize(metrics_path: str) -> dict:
    rows = [json.loads(line) for line in open(metrics_path)][1:]  # first step: warm-up
    step = statistics.median(r["step_s"] for r in rows)
    switch = statistics.median(r["switch_s"] for r in rows)
    tokens = statistics.median(r["tokens"] for r in rows)
    return {
        "step_s": step,
        "tokens_per_s": tokens / step,
        "switch_s": switch,
        "switch_share": switch / step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--short-edge", type=int, default=512)
    parser.add_argument(
        "--global-batch", type=int, default=64, help="sequences of seq_len per step"
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stdlib-files", type=int, default=1200)
    parser.add_argument("--label", default="nvlink")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(args.base) as handle:
        base = json.load(handle)
    results = {}
    for name, cfg in variants(base, args.gpus, args.short_edge, args.global_batch).items():
        path = os.path.join(args.out, f"{name}.json")
        with open(path, "w") as handle:
            json.dump(cfg, handle, indent=1)
        run_dir = os.path.join(args.out, name)
        cmd = ["deepspeed", "--num_gpus", str(args.gpus), "launch/pretrain.py", "--config", path]
        cmd += [
            "--steps",
            str(args.steps),
            "--stdlib-files",
            str(args.stdlib_files),
            "--out",
            run_dir,
        ]
        with open(os.path.join(args.out, f"{name}.log"), "w") as log:
            code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        if code:
            print(f"{name}: exit {code}, see {name}.log", file=sys.stderr)
            continue
        results[name] = summarize(os.path.join(run_dir, "metrics.jsonl"))
    print(
        "\n| link | plan | step s | tokens/s | switch s | switch share | vs static-dp |\n|---|---|---|---|---|---|---|"
    )
    for name, r in results.items():
        ratio = (
            results["static-dp"]["step_s"] / r["step_s"] if "static-dp" in results else float("nan")
        )
        print(
            f"| {args.label} | {name} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['switch_s']:.3f} "
            f"| {r['switch_share']:.1%} | {ratio:.3f}x |"
        )
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
