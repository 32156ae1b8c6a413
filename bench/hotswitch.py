"""The planner's bucketed plans vs its best static layout, predicted and measured, through the
real training path (``ds-stpar plan --data`` then ``deepspeed launch/pretrain.py``).

    python bench/hotswitch.py --model bench/models/llama-3b.json --gpus 4 --seq-len 32768 \\
        --global-batch-tokens 262144 --steps 5 --tp-modes megatron --edge 4096 --out DIR
    NCCL_P2P_DISABLE=1 python bench/hotswitch.py ... --label slow --plan-args "--nvlink-gbs 20"

Plans, each written by ``python -m ds_stpar plan ... --data CORPUS --out DIR/<plan> --json``
for the same model, corpus, context and tokens per step:

- ``static``: ``--max-buckets 1``, the best static layout (every packed row of ``--seq-len``);
- ``planned``: the planner's own choice (``--max-buckets`` default); run only when it differs
  from ``static`` (the planner buckets only where it predicts a gain of 1% per bucket);
- ``bucketed``: ``--min-buckets 2 --max-buckets 2 --min-edge EDGE``: the best two-bucket plan
  whose short edge is at least ``--edge``, even when it is predicted slower than static -- it
  checks the prediction where bucketing does not pay.

``--config NAME=PATH`` (repeatable) adds a plan written earlier (a ds_stpar.json, e.g. by
another version of the planner or with other options), run and reported like the others from
the prediction it records (``extra.predicted``).

Each plan runs ``--steps`` optimizer steps (in the data order of ``--seed``) through the
DeepSpeed launcher (``--num_gpus``, or ``--launcher-args`` to pick GPUs and a port for a
second run beside the first) on the same corpus
(``--stdlib-files`` of the Python standard library, written once as JSON lines; or ``--data``).
The table compares, per plan, the planner's predicted step and switch time (the switch planner's
bandwidth bound) with the measured means of ``metrics.jsonl`` (the first step excluded: it
warms up the allocator and NCCL), and the speedups over ``--baseline`` (default ``static``; any
plan of the call, e.g. a ``--config`` layout measured faster than the planner's static),
predicted and measured
(ratio of tokens/s over all timed steps). "pred (steps run)" re-weights each bucket's
predicted time by the tokens the timed steps really put in it (:func:`steps_run_prediction`):
a few steps of context-long rows hold more or fewer long rows than the expected step the
planner predicts, and this column separates that sampling from the cost model's error (its
error in brackets after the expected step's). A second table (:func:`bucket_table`) gives
each bucket's microseconds per real token, predicted and measured. Plan with the ``--stack``
the runs use: the default, ``megatron-core-local``, is what ``launch/pretrain.py`` builds (the
fifth session planned with ``--stack fused`` by mistake, which hid that DP2 with ZeRO-2 fits
where it said it did not).
``--gpu`` names the planner's GPU preset (default: from the device name). Set
NCCL_P2P_DISABLE=1 for the slow-link variant and tell the planner the link with
``--plan-args "--nvlink-gbs G"`` (bench/layers.py's slow-link run measures G).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys


def gpu_preset() -> str:
    import torch

    from ds_stpar.planner.profile import preset_for

    if not torch.cuda.is_available():
        return "h100-80g"  # a CPU smoke run: the planner's numbers mean nothing there
    props = torch.cuda.get_device_properties(0)
    return preset_for(props.name, props.total_memory) or "h100-80g"


def plan_commands(args: argparse.Namespace, corpus: str, gpu: str) -> dict[str, list[str]]:
    base = [sys.executable, "-m", "ds_stpar", "plan", "--model", args.model, "--gpu", gpu]
    base += ["--gpus", str(args.gpus), "--gpus-per-node", str(args.gpus)]
    base += ["--seq-len", str(args.seq_len), "--global-batch-tokens", str(args.global_batch_tokens)]
    base += ["--data", corpus, "--tokenizer", args.tokenizer]
    base += ["--tp-modes", *args.tp_modes, *shlex.split(args.plan_args)]
    return {
        "static": base + ["--max-buckets", "1"],
        "planned": base,
        "bucketed": base
        + ["--min-buckets", "2", "--max-buckets", "2", "--min-edge", str(args.edge)],
    }


def make_plan(name: str, cmd: list[str], out: str) -> dict:
    """Run ``ds-stpar plan`` for one plan; returns its bucket report (``--json``'s buckets)."""
    folder = os.path.join(out, name)
    result = subprocess.run(
        cmd + ["--out", folder, "--json"], capture_output=True, text=True, check=False
    )
    if result.returncode:
        raise SystemExit(f"{name}: {shlex.join(cmd)} failed:\n{result.stderr}")
    report = json.loads(result.stdout)["buckets"]
    report["config"] = os.path.join(folder, "ds_stpar.json")
    return report


def config_report(path: str) -> dict:
    """The bucket report of a ds_stpar.json written by ``ds-stpar plan --out``: its buckets'
    edges and strategies and the prediction it records (with each bucket's time and tokens
    per step where the file has them, as files written since the fifteenth session do, for
    the steps-run prediction and the per-bucket table)."""
    from ds_stpar.config import Strategy

    with open(path) as handle:
        section = json.load(handle)["ds_stpar"]
    predicted = section["extra"]["predicted"]
    kept = ("peak_memory_gib", "time_s", "switch_s", "tokens_per_step")
    buckets = [
        {
            "edge": b["max_len"],
            "short": Strategy.from_dict(b["strategy"]).short(),
            **{key: p[key] for key in kept if key in p},
        }
        for b, p in zip(section["buckets"], predicted["buckets"], strict=True)
    ]
    report = {
        "config": path,
        "edges": [b["edge"] for b in buckets],
        "bucketed_step_s": predicted["step_time_s"],
        "switch_s": predicted["switch_s"],
        "buckets": buckets,
    }
    if all("tokens_per_step" in b for b in buckets) and "update_s" in predicted:
        report["update_s"] = predicted["update_s"]
    return report


def layouts(report: dict) -> str:
    return " / ".join(f"<={b['edge']}: {b['short']}" for b in report["buckets"])


def train(name: str, report: dict, args: argparse.Namespace, corpus: str) -> dict | None:
    run_dir = os.path.join(args.out, name, "run")
    launcher = shlex.split(args.launcher_args) or ["--num_gpus", str(args.gpus)]
    cmd = ["deepspeed", *launcher, "launch/pretrain.py"]
    cmd += ["--config", report["config"], "--data", corpus, "--tokenizer", args.tokenizer]
    cmd += ["--steps", str(args.steps), "--seed", str(args.seed)]
    cmd += ["--out", run_dir]
    with open(os.path.join(args.out, f"{name}.log"), "w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if code:
        print(f"{name}: exit {code}, see {name}.log", file=sys.stderr, flush=True)
        return None
    return summarize(read_metrics(os.path.join(run_dir, "metrics.jsonl")))


def read_metrics(metrics_path: str) -> list[dict]:
    """Every step of a metrics.jsonl."""
    return [json.loads(line) for line in open(metrics_path)]


def summarize(rows: list[dict], timed: list[dict] | None = None) -> dict:
    """Means over the timed steps (default: every step of ``rows`` after the first, which
    warms up the allocator and NCCL), not medians: a step of a few rows of the context holds
    a different number of rows per bucket each time (e.g. 3-5 home micro-batches), and the
    planner predicts the expected step. Every plan runs the same steps of the same sampler,
    so throughput (all timed tokens over all timed seconds) compares them directly. Peaks and
    losses are read over all of ``rows``."""
    timed = timed or rows[1:] or rows
    seconds = sum(r["step_s"] for r in timed)
    edges = {edge for r in timed for edge in r.get("bucket_tokens", {})}  # older metrics: none
    return {
        "steps": len(timed),
        "step_s": seconds / len(timed),
        "median_step_s": statistics.median(r["step_s"] for r in timed),
        "switch_s": sum(r["switch_s"] for r in timed) / len(timed),
        "tokens_per_s": sum(r["tokens"] for r in timed) / seconds,
        # mean real tokens per bucket edge per timed step (a step without the bucket: 0)
        "bucket_tokens": {
            edge: sum(r.get("bucket_tokens", {}).get(edge, 0) for r in timed) / len(timed)
            for edge in sorted(edges, key=int)
        },
        # mean forward + backward seconds per bucket edge per timed step
        "bucket_s": {
            edge: sum(r.get("bucket_s", {}).get(edge, 0.0) for r in timed) / len(timed)
            for edge in sorted(edges, key=int)
        },
        "peak_gib": max((r.get("peak_gib") or 0.0) for r in rows),
        "peak_gib_ranks": rows[-1].get("peak_gib_ranks"),  # peaks since the start, per rank
        "peak_reserved_gib": max((r.get("peak_reserved_gib") or 0.0) for r in rows),
        "alloc_retries": max((r.get("alloc_retries") or 0) for r in rows),
        "device_gib": rows[-1].get("device_gib"),
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
    }


def steps_run_prediction(report: dict, measured: dict | None) -> float | None:
    """The plan's predicted step for the timed steps' own mix of buckets: each bucket's
    predicted seconds per token times its mean measured tokens per step, plus its switch when
    it ran, plus the home's update. The planner predicts the expected step; a few steps of
    rows as long as the context hold more or fewer long rows than expected, and this
    separates that sampling from the cost model's error. None without per-bucket figures."""
    if measured is None or not measured.get("bucket_tokens") or "update_s" not in report:
        return None
    step = report["update_s"]
    for bucket in report["buckets"]:
        tokens = measured["bucket_tokens"].get(str(bucket["edge"]), 0.0)
        if tokens and bucket["tokens_per_step"]:
            step += bucket["time_s"] * tokens / bucket["tokens_per_step"] + bucket["switch_s"]
    return step


def table(label: str, gpu: str, reports: dict, measured: dict, baseline: str = "static") -> str:
    head = (
        "| link | plan | buckets (edge: strategy) | step s pred | pred (steps run) | meas "
        "| err (steps run) | switch s bound | meas | tokens/s | speedup pred | pred (steps run) "
        "| meas | peak GiB pred (total) | meas (allocated) |"
    )  # step and switch: means over the timed steps; speedup: ratio of tokens/s
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    base_meas = measured.get(baseline, {}).get("tokens_per_s")
    base_run = (
        steps_run_prediction(reports[baseline], measured.get(baseline))
        if baseline in reports
        else None
    )
    for name, rep in reports.items():
        m = measured.get(name)
        pred = rep["bucketed_step_s"]
        # the baseline's prediction, else the static one the plan records (--plans planned
        # run beside a --plans static run: the measured speedup is then taken across the two)
        base = reports.get(baseline)
        base_pred = base["bucketed_step_s"] if base else rep.get("static_step_s")
        speed_pred = f"{base_pred / pred:.3f}x" if base_pred else "n/a"
        peak_pred = max(b["peak_memory_gib"] for b in rep["buckets"])
        run = steps_run_prediction(rep, m)
        run_s = f"{run:.3f}" if run else "n/a"
        speed_run = f"{base_run / run:.3f}x" if run and base_run else "n/a"
        if m is None:
            meas = err = sw = tps = speed = peak = "failed"
        else:
            peak = f"{m['peak_gib']:.1f}"
            meas = f"{m['step_s']:.3f}"
            err = f"{pred / m['step_s'] - 1:+.1%}"
            if run:
                err += f" ({run / m['step_s'] - 1:+.1%})"
            sw = f"{m['switch_s']:.3f}"
            tps = f"{m['tokens_per_s']:,.0f}"
            speed = f"{m['tokens_per_s'] / base_meas:.3f}x" if base_meas else "n/a"
        lines.append(
            f"| {label} | {name} | {layouts(rep)} | {pred:.3f} | {run_s} | {meas} | {err} "
            f"| {rep['switch_s']:.3f} | {sw} | {tps} | {speed_pred} | {speed_run} | {speed} "
            f"| {peak_pred:.1f} | {peak} |"
        )
    return f"planner preset {gpu}\n" + "\n".join(lines)


def bucket_table(reports: dict, measured: dict) -> str:
    """Per plan and bucket: microseconds per real token, predicted (the bucket's time over
    its tokens per step) and measured (its seconds over its tokens, timed steps), so that a
    step's error can be traced to the bucket that makes it."""
    lines = [
        "| plan | bucket | strategy | tokens/step pred | meas | us/token pred | meas | err |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, rep in reports.items():
        m = measured.get(name) or {}
        for bucket in rep["buckets"]:
            edge = str(bucket["edge"])
            tokens = m.get("bucket_tokens", {}).get(edge, 0.0)
            seconds = m.get("bucket_s", {}).get(edge, 0.0)
            per_step = bucket.get("tokens_per_step")
            pred = bucket["time_s"] / per_step * 1e6 if per_step and "time_s" in bucket else None
            meas = seconds / tokens * 1e6 if tokens else None
            lines.append(
                f"| {name} | <={edge} | {bucket['short']} "
                f"| {f'{per_step:,.0f}' if per_step else 'n/a'} "
                f"| {f'{tokens:,.0f}' if tokens else 'n/a'} "
                f"| {f'{pred:.2f}' if pred else 'n/a'} | {f'{meas:.2f}' if meas else 'n/a'} "
                f"| {f'{pred / meas - 1:+.1%}' if pred and meas else 'n/a'} |"
            )
    return "\n".join(lines)


def merge(folders: list[str], label: str, baseline: str = "static") -> None:
    """Print one table for the plans of several runs of this script over other data orders
    (``--seed``), pooling the timed steps that every plan of a run completed (a run cut short
    by a time limit counts only the steps all its plans reached). The plans must be the same
    in every run; their predictions come from the first run that wrote a summary.json."""
    summaries = [os.path.join(f, "summary.json") for f in folders]
    first = next((json.load(open(p)) for p in summaries if os.path.exists(p)), None)
    if first is None:
        raise SystemExit("--merge: no summary.json in " + ", ".join(folders))
    reports = first["plans"]
    everything: dict[str, list[dict]] = {name: [] for name in reports}
    pooled: dict[str, list[dict]] = {name: [] for name in reports}
    for folder in folders:
        runs = {}
        for name, rep in reports.items():
            config = config_report(os.path.join(folder, name, "ds_stpar.json"))
            if layouts(config) != layouts(rep):
                raise SystemExit(f"--merge: {folder}/{name} ran {layouts(config)}")
            runs[name] = read_metrics(os.path.join(folder, name, "run", "metrics.jsonl"))
        # the first step of a run warms up; then the steps every plan of the run reached
        common = set.intersection(*({r["step"] for r in rows[1:]} for rows in runs.values()))
        for name, rows in runs.items():
            everything[name] += rows
            pooled[name] += [r for r in rows if r["step"] in common]
    measured = {}
    for name, rows in pooled.items():
        measured[name] = summarize(everything[name], rows)
        print(f"{name}: {len(rows)} timed steps from {len(folders)} runs", flush=True)
    print(table(label, first["gpu"], reports, measured, baseline))
    print(bucket_table(reports, measured))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="bench/models/llama-3b.json")
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--global-batch-tokens", type=int, default=262144)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per plan")
    parser.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="launch/pretrain.py's seed (model init and data order): another seed runs other "
        "steps of the corpus, to add timed steps to an earlier call's",
    )
    parser.add_argument("--tp-modes", nargs="+", default=["megatron"])
    parser.add_argument("--edge", type=int, default=4096, help="smallest short-bucket edge")
    parser.add_argument("--gpu", help="planner GPU preset (default: from the device name)")
    parser.add_argument("--plan-args", default="", help="more `ds-stpar plan` arguments")
    parser.add_argument("--data", help="corpus (default: --stdlib-files of the stdlib)")
    parser.add_argument("--stdlib-files", type=int, default=0, help="0: every file")
    parser.add_argument(
        "--tokenizer",
        default="bytes",
        help="'bytes' or a tokenizer.json (bench/bpe_tokenizer.py), for the plans and the runs",
    )
    parser.add_argument("--plans", default="static,planned,bucketed")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also run this ds_stpar.json as plan NAME (repeatable)",
    )
    parser.add_argument("--label", default="nvlink")
    parser.add_argument(
        "--baseline",
        default="static",
        help="the plan the speedups are over (a --plans or --config NAME of this call)",
    )
    parser.add_argument(
        "--launcher-args",
        default="",
        help="deepspeed launcher arguments instead of --num_gpus (e.g. "
        '"--include localhost:2,3 --master_port 29600" for a second run beside the first)',
    )
    parser.add_argument("--out", help="folder for the plans, runs and summary.json")
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="OUT",
        help="print one table for earlier runs' --out folders (other --seed data orders of "
        "the same plans), their timed steps pooled; runs nothing",
    )
    args = parser.parse_args(argv)
    if args.merge:
        merge(args.merge, args.label, args.baseline)
        return
    if not args.out:
        parser.error("--out is required (or --merge)")
    os.makedirs(args.out, exist_ok=True)
    corpus = args.data
    if corpus is None:
        from ds_stpar.seqbucket.corpus import stdlib_documents, write_jsonl

        corpus = os.path.join(args.out, "corpus.jsonl")
        write_jsonl(stdlib_documents(args.stdlib_files or None), corpus)
    gpu = args.gpu or gpu_preset()
    wanted = args.plans.split(",")
    reports = {}
    for name, cmd in plan_commands(args, corpus, gpu).items():
        if name in wanted:
            reports[name] = make_plan(name, cmd, args.out)
    for item in args.config:
        name, _, path = item.partition("=")
        reports[name] = config_report(path)
    if "planned" in reports and "static" in reports:
        if reports["planned"]["edges"] == reports["static"]["edges"]:
            del reports["planned"]  # the planner chose the static layout: nothing new to run
    if args.baseline not in reports:
        parser.error(f"--baseline {args.baseline}: not among the plans {sorted(reports)}")
    measured = {}
    for name, rep in reports.items():
        print(f"{name}: {layouts(rep)}, predicted {rep['bucketed_step_s']:.3f} s", flush=True)
        result = train(name, rep, args, corpus)
        if result is not None:
            measured[name] = result
            print(f"{name}: measured {result}", flush=True)
    print(table(args.label, gpu, reports, measured, args.baseline))
    print(bucket_table(reports, measured))
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump({"args": vars(args), "gpu": gpu, "plans": reports, "measured": measured}, handle)


if __name__ == "__main__":
    main()
