"""``ds-stpar demo``: hot switching end to end on this machine's CPU, in about a minute or two.

1. Corpus: the Python standard library's ``*.py`` files under ``--max-file-bytes`` (6000 by
   default: ~870 files, 1.7 M byte tokens, a long tail of lengths with a fair share of short
   documents), written to ``<out>/data.jsonl``; byte-level tokens; their lengths, cut at the
   context, form the histogram.
2. Buckets for 2 processes: ``ds_stpar.planner.buckets.plan_buckets`` is asked first (its GPU
   cost model, 2 x the config's GPU); when it keeps one static layout -- a model this small
   gains nothing from switching on a GPU -- the demo pins two buckets to show the mechanism:
   the short edge is the median length of the pieces shorter than the context (rounded up to
   a multiple of 64), short pieces run data parallel (DP2), the long ones tensor parallel
   (TP2, the home layout where the optimizer lives). The output says which happened.
3. Training: a tiny GPT (2 layers, hidden 64, byte vocabulary) through the same code path as
   ``launch/pretrain.py`` (:func:`ds_stpar.train.run`: DeepSpeed ZeRO 1 engine on the home
   layout, seqbucket sampler, weights and gradients switched every step) in 2 spawned
   processes over gloo.
4. Run folder: ``data.jsonl``, ``ds_stpar.json`` (the config trained with), ``config.json``
   (resolved),
   ``metrics.jsonl``, ``plan.txt`` and, with matplotlib (the ``[plot]`` extra), ``loss.png``,
   ``lengths.png`` (histogram with the bucket edges) and ``timeline.png`` (per step: each
   bucket's time, the switches and the optimizer step, stacked).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

import numpy as np

from ds_stpar.config import (
    Bucket,
    ClusterSpec,
    Layout,
    ModelSpec,
    StparConfig,
    Strategy,
    TrainSpec,
    load_gpu,
)
from ds_stpar.errors import ConfigError, StparError

PROCESSES = 2
DEMO_GPU = "h100-80g"


def demo_model(seq_len: int) -> ModelSpec:
    return ModelSpec(
        "demo-byte-gpt", 2, 64, 4, vocab_size=258, max_position_embeddings=seq_len, dropout=0.0
    )


def quantile_edge(piece_lengths: np.ndarray, seq_len: int) -> int:
    """Median of the pieces shorter than the context, rounded up to a multiple of 64 and kept
    within [64, seq_len / 2]."""
    short = piece_lengths[piece_lengths < seq_len]
    median = float(np.median(short)) if short.size else seq_len / 4
    edge = int(-(-median // 64) * 64)
    return max(64, min(edge, seq_len // 2))


def choose_buckets(
    lengths: np.ndarray, model: ModelSpec, train: TrainSpec
) -> tuple[tuple[Bucket, ...], str]:
    """The buckets to train with and a line saying where they come from."""
    from ds_stpar.seqbucket.lengths import split_lengths

    note = ""
    try:
        from ds_stpar.planner.buckets import plan_buckets, runnable

        cluster = ClusterSpec(load_gpu(DEMO_GPU), PROCESSES, gpus_per_node=PROCESSES)
        plan = plan_buckets(lengths, model, cluster, train, max_buckets=2)
        runs = all(runnable(b.strategy) for b in plan.buckets)
        if len(plan.buckets) > 1 and runs:
            buckets = tuple(
                Bucket(b.edge, Strategy(b.strategy.layout, b.strategy.micro_batch, 1))
                for b in plan.buckets
            )
            return buckets, f"buckets from the planner (2 x {DEMO_GPU}): {plan.speedup:.2f}x"
        note = (
            f"the planner keeps one static layout for 2 x {DEMO_GPU} "
            f"({plan.static.strategy.short()}: {plan.note or 'no gain from switching'}); "
        )
    except ImportError:
        note = "no bucket planner in this build; "
    _, _, pieces = split_lengths(lengths, train.seq_len)
    edge = quantile_edge(pieces, train.seq_len)
    buckets = (
        Bucket(edge, Strategy(Layout(dp=2), micro_batch=8, zero=1)),
        Bucket(train.seq_len, Strategy(Layout(tp=2), micro_batch=2, zero=1)),
    )
    return buckets, note + (
        f"the demo pins edges from the length histogram (short edge {edge} = median of the "
        "pieces shorter than the context) to show hot switching"
    )


def demo_config(cfg: StparConfig, lr: float) -> dict:
    """A DeepSpeed config with the ds_stpar section (what `ds-stpar plan` would write)."""
    home = cfg.home
    return {
        "train_batch_size": home.micro_batch * home.layout.dp,
        "train_micro_batch_size_per_gpu": home.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1 << 30,
        "zero_optimization": {"stage": 1},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.1, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": lr / 10, "warmup_max_lr": lr, "warmup_num_steps": 5},
        },
        "ds_stpar": cfg.to_dict(),
    }


# --------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, port: int, opts) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the demo is a CPU run
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(PROCESSES),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    from ds_stpar.train import run

    try:
        run(opts)
    except StparError as err:
        if rank == 0:
            print(f"ds-stpar demo: error: {err}", flush=True)
        raise SystemExit(err.exit_code) from None
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _train(opts) -> None:
    import torch.multiprocessing as mp

    try:
        mp.start_processes(
            _worker, args=(_free_port(), opts), nprocs=PROCESSES, start_method="spawn"
        )
    except mp.ProcessExitedException as err:
        raise ConfigError(f"a training process failed ({err}); see its output above") from None


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def summary_lines(rows: list[dict]) -> list[str]:
    """Loss, per-bucket time and layout, switches and throughput of a run's metrics rows."""
    runs: dict[int, list[tuple[float, str]]] = {}
    for row in rows:  # bucket_s and layouts are both in execution order
        for (edge, seconds), layout in zip(row["bucket_s"].items(), row["layouts"]):
            runs.setdefault(int(edge), []).append((seconds, layout))
    lines = [f"{len(rows)} steps: loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}"]
    for edge in sorted(runs):
        times = [t for t, _ in runs[edge]]
        layouts = ", ".join(sorted({layout for _, layout in runs[edge]}))
        lines.append(
            f"  bucket <= {edge:>5}: ran in {len(times)} steps, mean {np.mean(times):.3f}s "
            f"({layouts})"
        )
    switches = sum(r["switches"] for r in rows)
    switch_s = sum(r["switch_s"] for r in rows)
    steps = sum(r["step_s"] for r in rows)
    lines.append(
        f"  switches: {switches} ({switch_s:.2f}s, {switch_s / steps:.1%} of {steps:.1f}s "
        f"training); optimizer {np.mean([r['optimizer_s'] for r in rows]):.3f}s per step"
    )
    lines.append(f"  throughput: {np.mean([r['tokens_per_s'] for r in rows]):,.0f} tokens/s")
    return lines


def plot_run(out: Path, rows: list[dict], pieces: np.ndarray, edges: list[int], seq_len: int):
    """loss.png, lengths.png and timeline.png in ``out``; [] without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in rows], marker=".")
    ax.set(xlabel="step", ylabel="mean token loss (nats)", title="training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)
    written.append(out / "loss.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.logspace(0, np.log10(seq_len), 50)
    ax.hist(pieces, bins=bins, color="#8fa8c8")
    ax.set_xscale("log")
    ax.set_yscale("log")
    lo, shares = 0, []
    for edge in edges:
        ax.axvline(edge, color="black", linestyle="--", linewidth=1)
        ax.text(edge, ax.get_ylim()[1], f"{edge} ", va="top", ha="right", fontsize=9)
        share = pieces[(pieces > lo) & (pieces <= edge)].sum() / max(1, pieces.sum())
        shares.append(f"bucket <= {edge}: {share:.0%} of tokens")
        lo = edge
    ax.text(0.02, 0.97, "\n".join(shares), transform=ax.transAxes, va="top", fontsize=9)
    ax.set(
        xlabel=f"tokens per piece (documents cut at {seq_len})",
        ylabel="pieces",
        title="length histogram and bucket edges",
    )
    fig.tight_layout()
    fig.savefig(out / "lengths.png", dpi=110)
    plt.close(fig)
    written.append(out / "lengths.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = np.zeros(len(rows))
    parts = [(f"bucket <= {e}", [r["bucket_s"].get(str(e), 0.0) for r in rows]) for e in edges]
    parts += [("switches", [r["switch_s"] for r in rows])]
    parts += [("optimizer", [r["optimizer_s"] for r in rows])]
    for label, values in parts:
        ax.bar(steps, values, bottom=bottom, label=label)
        bottom += np.asarray(values)
    ax.set(xlabel="step", ylabel="seconds", title="time per step: buckets, switches, optimizer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)
    plt.close(fig)
    written.append(out / "timeline.png")
    return written


# --------------------------------------------------------------------------------------
# Command
# --------------------------------------------------------------------------------------


def demo_command_parser(subparsers=None) -> argparse.ArgumentParser:
    description = (
        "Train a tiny GPT on the Python standard library with sequence-length buckets and "
        "parallelism hot switching, on this machine's CPU in 2 processes; writes a run folder "
        "with the config, metrics.jsonl and plots."
    )
    if subparsers is not None:
        parser = subparsers.add_parser("demo", description=description, help="CPU demo run")
    else:
        parser = argparse.ArgumentParser("ds-stpar demo", description=description)
    parser.add_argument("--out", default="runs/demo", help="run folder (default runs/demo)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument(
        "--max-file-bytes",
        type=int,
        default=6000,
        help="use the stdlib files below this size (default 6000)",
    )
    parser.add_argument("--seq-len", type=int, default=512, help="context (default 512)")
    parser.add_argument("--global-batch", type=int, default=8, help="rows of --seq-len per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=1234)
    parser.set_defaults(func=demo_command)
    return parser


def demo_command(args: argparse.Namespace) -> int:
    """Plan, train in 2 processes, report; returns the exit code."""
    from ds_stpar.seqbucket.corpus import stdlib_documents, write_jsonl
    from ds_stpar.seqbucket.data import Documents, load_documents
    from ds_stpar.seqbucket.lengths import split_lengths
    from ds_stpar.train import RunOptions

    for flag in ("steps", "max_file_bytes", "seq_len", "global_batch"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.seq_len % 64 or args.seq_len < 128:
        raise ConfigError(f"--seq-len must be a multiple of 64, at least 128; got {args.seq_len}")
    import datasets

    datasets.disable_progress_bars()
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{args.out}: exists and is not a directory")
    texts = [d for d in stdlib_documents() if len(d["text"].encode()) < args.max_file_bytes]
    if not texts:
        raise ConfigError(f"no standard-library file is under {args.max_file_bytes} bytes")
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data.jsonl"
    write_jsonl(texts, data)
    docs = Documents(load_documents(data))
    model = demo_model(args.seq_len)
    train = TrainSpec(args.seq_len, args.global_batch, "fp32")
    buckets, note = choose_buckets(docs.lengths, model, train)
    cfg = StparConfig(model, train, buckets, gpu=DEMO_GPU, gpus_per_node=PROCESSES)
    config_path = out / "ds_stpar.json"
    config_path.write_text(json.dumps(demo_config(cfg, args.lr), indent=2) + "\n")
    plan = [
        f"corpus: {len(docs)} standard-library files under {args.max_file_bytes} bytes, "
        f"{docs.num_tokens:,} byte tokens",
        note,
        *(
            f"  bucket <= {b.max_len:>5} tokens: {b.strategy.layout.short()} micro-batch "
            f"{b.strategy.micro_batch}" + ("  (home: optimizer)" if b is buckets[-1] else "")
            for b in buckets
        ),
    ]
    (out / "plan.txt").write_text("\n".join(plan) + "\n")
    print("\n".join(plan), flush=True)
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()  # a fresh run, not a resume
    opts = RunOptions(
        config=str(config_path),
        data=str(data),
        steps=args.steps,
        out=str(out),
        seed=args.seed,
        log_interval=max(1, args.steps // 20),
    )
    _train(opts)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    print("\n".join(summary_lines(rows)))
    _, _, pieces = split_lengths(docs.lengths, args.seq_len)
    written = plot_run(out, rows, pieces, [b.max_len for b in buckets], args.seq_len)
    files = ["data.jsonl", "ds_stpar.json", "config.json", "metrics.jsonl", "plan.txt"]
    files += [p.name for p in written]
    print(f"run folder {out}: {', '.join(files)}")
    if not written:
        print("no plots: matplotlib is not installed (pip install 'ds_stpar[plot]')")
    return 0


def main(argv=None) -> int:
    """Run the demo alone (``python -m ds_stpar.demo``); the CLI registers the parser."""
    import sys

    args = demo_command_parser().parse_args(argv)
    try:
        return args.func(args)
    except StparError as err:
        print(f"ds-stpar demo: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
