"""``ds-stpar``: one command, one subcommand per job (also ``python -m ds_stpar``).

Each subcommand is built by a ``<name>_command_parser(subparsers=None)`` function that adds
itself to the main parser or, called alone, returns a standalone parser (accelerate's
layout); :data:`COMMANDS` lists them, so a new subcommand is one function and one entry.

- ``plan``: search layouts for a model on a cluster, print a ranked ASCII table and the
  derived numbers; with ``--out DIR`` write ds_stpar.json, megatron_args.txt and plan.md
  (all or nothing).
- ``estimate``: time and memory of one given strategy (``--json`` for one JSON object).
- ``profile``: measure this machine's GEMM and memory speed (and collectives when launched
  by torchrun) into a JSON file that ``--profile`` feeds back to ``plan``/``estimate``.
- ``buckets``: sequence-length buckets for a dataset (edges and one layout per bucket,
  :mod:`ds_stpar.planner.buckets`) against the best static layout; ``plan --data`` writes
  them into ds_stpar.json.
- ``demo``: the README's main job: plan buckets for 2 local processes and train a tiny GPT
  with hot switching on CPU through launch/pretrain.py's code path (:mod:`ds_stpar.demo`).

Human-readable output goes to stdout; with ``--json`` stdout carries only the JSON object.
A user mistake (:class:`~ds_stpar.errors.StparError`) prints ``ds-stpar: error: <message>``
on stderr and exits with its ``exit_code`` (2), without a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence

from ds_stpar import __version__
from ds_stpar.config import (
    DTYPES,
    GPU_PRESETS,
    MODEL_PRESETS,
    OPTIMIZERS,
    RECOMPUTE_MODES,
    TP_MODES,
    ClusterSpec,
    Layout,
    ModelSpec,
    Strategy,
    TrainSpec,
    load_gpu,
)
from ds_stpar.demo import demo_command_parser
from ds_stpar.errors import ConfigError, DoesNotFitError, StparError

DEFAULT_MODEL = "gpt3-1.3b"
DEFAULT_GPU = "h100-80g"
DEFAULT_GPUS = 8
DEFAULT_SEQ_LEN = 2048
DEFAULT_GLOBAL_BATCH = 512
SHOW_REJECTED = 8  # rejected families printed by `plan`; plan.md and --json list them all
# planner.buckets' defaults, repeated here because importing it loads torch (tests compare)
DEFAULT_MAX_BUCKETS = 4
DEFAULT_MIN_EDGE = 256

# GPUSpec fields a user may override: flag -> (field, help).
GPU_FIGURES = {
    "--peak-tflops": ("peak_tflops", "dense bf16 TFLOP/s per GPU"),
    "--hbm-gib": ("hbm_gib", "GPU memory in GiB"),
    "--hbm-gbs": ("hbm_gbs", "HBM bandwidth in GB/s"),
    "--nvlink-gbs": ("nvlink_gbs", "intra-node bus bandwidth per GPU in GB/s (nccl busbw)"),
    "--internode-gbs": ("internode_gbs", "inter-node bus bandwidth per GPU in GB/s"),
    "--intra-latency-us": ("intra_latency_us", "intra-node collective latency in microseconds"),
    "--inter-latency-us": ("inter_latency_us", "inter-node collective latency in microseconds"),
}


# --------------------------------------------------------------------------------------
# Shared inputs
# --------------------------------------------------------------------------------------


def _add_input_args(parser: argparse.ArgumentParser) -> None:
    """Model, training and cluster options shared by ``plan`` and ``estimate``."""
    work = parser.add_argument_group("model and training")
    work.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a preset ({', '.join(MODEL_PRESETS)}), a HuggingFace config.json or a model "
        f"JSON (default {DEFAULT_MODEL})",
    )
    work.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="tokens per sequence")
    batch = work.add_mutually_exclusive_group()
    batch.add_argument(
        "--global-batch",
        type=int,
        help=f"sequences per optimizer step (default {DEFAULT_GLOBAL_BATCH})",
    )
    batch.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    work.add_argument("--dtype", choices=DTYPES, default="bf16")
    work.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument(
        "--gpu",
        default=DEFAULT_GPU,
        help=f"GPU preset: {', '.join(GPU_PRESETS)} (default {DEFAULT_GPU})",
    )
    cluster.add_argument("--gpus", type=int, default=DEFAULT_GPUS, help="total number of GPUs")
    cluster.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing NVLink")
    for flag, (_, text) in GPU_FIGURES.items():
        cluster.add_argument(flag, type=float, help=f"override the preset's {text}")
    cluster.add_argument(
        "--profile", metavar="FILE", help="measurements from `ds-stpar profile` (JSON)"
    )
    cluster.add_argument(
        "--allow-tp-across-nodes",
        action="store_true",
        help="let tensor-parallel groups span nodes",
    )


def _inputs(args: argparse.Namespace) -> tuple[ModelSpec, ClusterSpec, TrainSpec]:
    from ds_stpar.planner.profile import Profile

    model = ModelSpec.load(args.model)
    gpu = load_gpu(args.gpu, **{name: getattr(args, name) for name, _ in GPU_FIGURES.values()})
    profile = Profile.from_json(args.profile) if args.profile else None
    cluster = ClusterSpec(
        gpu,
        args.gpus,
        args.gpus_per_node,
        profile=profile,
        tp_across_nodes=args.allow_tp_across_nodes,
    )
    extra = {"dtype": args.dtype, "optimizer": args.optimizer}
    if args.global_batch_tokens is not None:
        train = TrainSpec.from_tokens(args.seq_len, args.global_batch_tokens, **extra)
    else:
        train = TrainSpec(args.seq_len, args.global_batch or DEFAULT_GLOBAL_BATCH, **extra)
    return model, cluster, train


def _add_tp_modes_arg(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--tp-modes",
        nargs="+",
        choices=TP_MODES,
        default=list(TP_MODES),
        help="tensor-parallel modes to consider (default: all)",
    )


def _add_data_args(parser: argparse.ArgumentParser, required: bool) -> None:
    """The dataset and bucket options of ``buckets`` (``--data`` required) and ``plan``."""
    data = parser.add_argument_group("data and sequence-length buckets")
    data.add_argument(
        "--data",
        metavar="PATH",
        required=required,
        help="documents: a .jsonl/.json/.parquet file, a Dataset.save_to_disk folder or a "
        "folder of text files"
        + ("" if required else "; plans sequence-length buckets for them (see `buckets`)"),
    )
    column = data.add_mutually_exclusive_group()
    column.add_argument(
        "--text-column", default="text", help="column of texts to tokenize (default text)"
    )
    column.add_argument("--ids-column", help="column of token ids (instead of texts)")
    data.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (UTF-8 bytes + EOS, no download) or a local tokenizer.json (default bytes)",
    )
    data.add_argument(
        "--max-buckets",
        type=int,
        default=DEFAULT_MAX_BUCKETS,
        help=f"at most this many buckets (default {DEFAULT_MAX_BUCKETS})",
    )
    data.add_argument(
        "--stack",
        choices=("megatron-core-local", "fused"),
        default="megatron-core-local",
        help="software the bucket plan's times are predicted for: megatron-core-local (default: "
        "what launch/pretrain.py builds, megatron-core's local modules with ds_stpar's layers, "
        "no Transformer Engine) or fused (the published Megatron-LM stack)",
    )
    data.add_argument(
        "--min-buckets",
        type=int,
        default=1,
        help="at least this many buckets, even when the static layout is predicted faster "
        "(default 1: bucket only where it pays)",
    )
    data.add_argument(
        "--min-edge",
        type=int,
        default=DEFAULT_MIN_EDGE,
        help="smallest candidate bucket edge; candidates are the powers of two from it up to "
        "--seq-len and, in the top three octaves, the steps half-way between them (24K at 32K) "
        f"(default {DEFAULT_MIN_EDGE})",
    )


def _document_lengths(args: argparse.Namespace):
    """Token counts of the documents at ``--data`` (tokenized unless ``--ids-column``)."""
    import datasets

    from ds_stpar.seqbucket.data import load_documents
    from ds_stpar.seqbucket.lengths import document_lengths
    from ds_stpar.seqbucket.tokenize import load_tokenizer

    datasets.disable_progress_bars()  # stdout/stderr carry only our output
    tokenizer = None if args.ids_column else load_tokenizer(args.tokenizer)
    docs = load_documents(
        args.data, text_column=args.text_column, ids_column=args.ids_column, tokenizer=tokenizer
    )
    return document_lengths(docs)


def _bucket_plan(args: argparse.Namespace, model: ModelSpec, cluster: ClusterSpec, train):
    from ds_stpar.planner.buckets import plan_buckets
    from ds_stpar.planner.profile import Calibration

    return plan_buckets(
        _document_lengths(args),
        model,
        cluster,
        train,
        max_buckets=args.max_buckets,
        min_buckets=args.min_buckets,
        min_edge=args.min_edge,
        calibration=Calibration.load_default(cluster.gpu.name, stack=args.stack),
        tp_modes=tuple(args.tp_modes),
        allow_tp_across_nodes=args.allow_tp_across_nodes or None,
    )


def _print_buckets(plan, stack: str) -> None:
    from ds_stpar.planner.emit import BUCKET_HEADERS, bucket_rows, bucket_summary

    print(f"times predicted for the {stack} stack (--stack)")
    print(ascii_table(BUCKET_HEADERS, bucket_rows(plan)))
    for line in bucket_summary(plan):
        print(line)


def ascii_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A boxed table; text columns left-aligned, numeric ones (no letters) right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    text = [any(ch.isalpha() for row in cells[1:] for ch in row[i]) for i in range(len(headers))]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(row: list[str]) -> str:
        parts = [c.ljust(w) if text[i] else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "| " + " | ".join(parts) + " |"

    return "\n".join([rule, line(cells[0]), rule, *map(line, cells[1:]), rule])


def _print_inputs(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> None:
    from ds_stpar.planner.emit import inputs_summary

    for name, text in inputs_summary(model, cluster, train):
        print(f"{name + ':':10}{text}")


def _print_breakdown(est) -> None:
    time_rows = [
        (name, f"{sec * 1e3:.1f}", f"{sec / est.step_time_s:.1%}")
        for name, sec in est.time_breakdown.items()
    ]
    mem_rows = [(name, f"{gib:.2f}") for name, gib in est.memory_breakdown.items()]
    print(ascii_table(("time per step", "ms", "share"), time_rows))
    print(ascii_table(("memory per GPU", "GiB"), mem_rows))


# --------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------


def _add_schedule_args(parser: argparse.ArgumentParser) -> None:
    """The learning-rate schedule written into both outputs (``emit.lr_schedule``)."""
    from ds_stpar.planner import emit

    group = parser.add_argument_group(
        "learning-rate schedule (linear warm-up from 0, then cosine decay)"
    )
    group.add_argument(
        "--lr",
        type=float,
        default=emit.OptimizerSettings.lr,
        help=f"peak learning rate (default {emit.OptimizerSettings.lr:g})",
    )
    group.add_argument(
        "--min-lr",
        type=float,
        help=f"learning rate at the end of the decay (default {emit.MIN_LR_RATIO:g} x --lr)",
    )
    group.add_argument(
        "--train-steps",
        type=int,
        help="optimizer steps of the run, the end of the decay (default "
        f"{emit.TOKENS_PER_PARAMETER} tokens per parameter: ceil({emit.TOKENS_PER_PARAMETER} "
        "x parameters / tokens per step))",
    )
    group.add_argument(
        "--warmup-steps",
        type=int,
        help=f"warm-up steps (default {emit.WARMUP_PERCENT}%% of --train-steps, at least "
        f"{emit.MIN_WARMUP_STEPS})",
    )


def _optimizer_settings(args: argparse.Namespace, model: ModelSpec, train: TrainSpec):
    """``emit.OptimizerSettings`` from the schedule flags, checked (a ConfigError names the
    flag) before any search runs."""
    from ds_stpar.planner import emit

    settings = emit.OptimizerSettings(
        lr=args.lr,
        min_lr=args.min_lr,
        train_steps=args.train_steps,
        warmup_steps=args.warmup_steps,
    )
    emit.lr_schedule(model, train, settings)
    return settings


def plan_command_parser(subparsers=None) -> argparse.ArgumentParser:
    description = (
        "Search parallel layouts (DP x TP x PP, TP mode, ZeRO, micro-batch, recompute) for a "
        "model on a cluster and rank them by predicted step time. With no arguments: "
        f"{DEFAULT_MODEL} on {DEFAULT_GPUS} x {DEFAULT_GPU}, seq {DEFAULT_SEQ_LEN}, global "
        f"batch {DEFAULT_GLOBAL_BATCH}."
    )
    if subparsers is not None:
        parser = subparsers.add_parser("plan", description=description, help="rank layouts")
    else:
        parser = argparse.ArgumentParser("ds-stpar plan", description=description)
    _add_input_args(parser)
    _add_schedule_args(parser)
    out = parser.add_argument_group("output")
    out.add_argument(
        "--out", metavar="DIR", help="write ds_stpar.json, megatron_args.txt, plan.md here"
    )
    out.add_argument("--top", type=int, default=5, help="layouts to rank (default 5)")
    _add_tp_modes_arg(out)
    out.add_argument(
        "--interleave",
        action="store_true",
        help="also rank ring layouts as the interleaved layer of 2 pieces, and try them for "
        "megatron_args.txt (Megatron-LM with unpacked micro-batches of whole sequences, "
        "DS_STPAR_INTERLEAVE; it wins over slow TP links; the training loop packs rows and "
        "cannot run it)",
    )
    out.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    _add_data_args(parser, required=False)
    parser.set_defaults(func=plan_command)
    return parser


def _fits_with_more_gpus(model, cluster, train, args, limit: int = 64) -> tuple[int, str] | None:
    """The smallest cluster of ``num_gpus * 2**k`` GPUs (up to ``limit`` times more) on which
    some layout fits, with that layout; ``None`` if none does."""
    from ds_stpar.planner.search import search

    factor = 2
    while factor <= limit:
        bigger = ClusterSpec(
            cluster.gpu,
            cluster.num_gpus * factor,
            cluster.gpus_per_node,
            profile=cluster.profile,
            tp_across_nodes=cluster.tp_across_nodes,
        )
        result = search(
            model,
            bigger,
            train,
            top_k=1,
            tp_modes=tuple(args.tp_modes),
            allow_tp_across_nodes=args.allow_tp_across_nodes or None,
        )
        if result.top:
            return bigger.num_gpus, result.top[0].strategy.short()
        factor *= 2
    return None


def does_not_fit_message(result, model, cluster, train, args) -> str:
    """Why nothing fits: the closest layout, how short it is, and what would make it fit.

    The search already tried full recompute, ZeRO-3 (where the rules allow it) and every
    micro-batch, so what remains is more GPUs (found by searching 2x, 4x, ... the cluster),
    larger GPUs, or a shorter sequence.
    """
    where = f"{cluster.num_gpus} x {cluster.gpu.name}"
    if result.closest is None:
        reasons = "; ".join(f"{k}: {v}" for k, v in list(result.rejected.items())[:3])
        return f"no valid layout of {model.name} on {where} ({reasons})"
    closest = result.closest
    short = closest.peak_memory_gib - closest.memory_capacity_gib
    hints = []
    more = _fits_with_more_gpus(model, cluster, train, args)
    if more is not None:
        hints.append(f"--gpus {more[0]} ({more[1]} fits)")
    hints.append(f"GPUs with >= {math.ceil(closest.peak_memory_gib)} GiB (--gpu, --hbm-gib)")
    hints.append("a shorter --seq-len")
    return (
        f"no layout of {model.name} ({model.num_params() / 1e9:.1f} B parameters) fits in "
        f"{where} at seq {train.seq_len} ({result.considered} strategies tried, with full "
        f"recompute and ZeRO-3 where the rules allow); closest: {closest.strategy.short()} needs "
        f"{closest.peak_memory_gib:.1f} GiB per GPU of {closest.memory_capacity_gib:.1f} "
        f"({short:.1f} GiB short); would fit: {'; or '.join(hints)}"
    )


def plan_command(args: argparse.Namespace) -> int:
    from ds_stpar.planner import emit
    from ds_stpar.planner.search import search
    from ds_stpar.seqbucket.runner import LOOP_RULE

    model, cluster, train = _inputs(args)
    if args.top < 1:
        raise ConfigError(f"--top must be at least 1, got {args.top}")
    optimizer = _optimizer_settings(args, model, train)
    if not args.json:
        _print_inputs(model, cluster, train)
    result = search(
        model,
        cluster,
        train,
        top_k=args.top,
        tp_modes=tuple(args.tp_modes),
        allow_tp_across_nodes=args.allow_tp_across_nodes or None,
        interleave=args.interleave,
    )
    allow = args.allow_tp_across_nodes or None
    loop = None
    if not result.top:  # the published stack fits nothing; the loop's own modules may
        message = does_not_fit_message(result, model, cluster, train, args)
        loop = emit.loop_estimate(model, cluster, train, args.tp_modes, allow)
        if loop is None or not (args.data or args.out):
            raise DoesNotFitError(message)
        if not args.json:
            print(f"Megatron-LM stack: {message}")
            print(
                f"launch/pretrain.py's stack (megatron-core local modules) fits "
                f"{loop.strategy.short()}: {loop.step_time_s:.3f} s, "
                f"{loop.peak_memory_gib:.1f} GiB"
            )
    buckets = _bucket_plan(args, model, cluster, train) if args.data else None
    files = {}
    if args.out:
        if buckets is None and loop is None:
            loop = emit.loop_estimate(model, cluster, train, args.tp_modes, allow)
        files = emit.plan_files(
            result,
            model,
            cluster,
            train,
            optimizer=optimizer,
            tp_modes=args.tp_modes,
            allow_tp_across_nodes=allow,
            buckets=buckets,
            loop=loop,
            interleave=args.interleave,
        )
    written = [str(p) for p in emit.write_files_atomically(args.out, files)] if files else []
    if args.json:
        report = {
            "model": model.to_dict(),
            "num_gpus": cluster.num_gpus,
            "gpu": cluster.gpu.name,
            "seq_len": train.seq_len,
            "global_batch": train.global_batch,
            "tokens_per_step": train.tokens_per_step,
            "considered": result.considered,
            "top": [est.to_dict() for est in result.top],
            "rejected": result.rejected,
            "files": written,
        }
        if buckets is not None:
            report["buckets"] = buckets.to_dict()
        print(json.dumps(report, indent=2))
        return 0
    if result.top:
        best = result.top[0]
        print(
            f"searched {result.considered} strategies; model FLOPs per step "
            f"{best.model_flops_per_step / 1e15:.2f} PFLOP"
        )
        print(ascii_table(emit.RANKED_HEADERS, emit.ranked_rows(result.top)))
        print(f"best: {best.strategy.short()}")
        _print_breakdown(best)
    else:
        best = loop
    if result.rejected:
        rejected = sorted(result.rejected.items())
        print(f"rejected layout families ({len(rejected)}):")
        for family, reason in rejected[:SHOW_REJECTED]:
            print(f"  {family}: {reason}")
        if len(rejected) > SHOW_REJECTED:
            print(f"  ... {len(rejected) - SHOW_REJECTED} more in plan.md (--out) and --json")
    if buckets is not None:
        print(f"sequence-length buckets for {args.data} (packed documents):")
        _print_buckets(buckets, args.stack)
    if written:
        print("wrote " + ", ".join(written))
        if loop is not None and loop.strategy != best.strategy:
            print(
                f"ds_stpar.json holds {loop.strategy.short()}, the fastest layout launch/pretrain.py "
                f"runs (megatron-core local modules, {LOOP_RULE}); the "
                "ranking is for the published Megatron-LM stack"
            )
    else:
        print("write ds_stpar.json, megatron_args.txt and plan.md with --out DIR")
    return 0


# --------------------------------------------------------------------------------------
# estimate
# --------------------------------------------------------------------------------------


def estimate_command_parser(subparsers=None) -> argparse.ArgumentParser:
    description = "Predict step time, throughput and peak memory of one strategy."
    if subparsers is not None:
        parser = subparsers.add_parser(
            "estimate", description=description, help="time and memory of one strategy"
        )
    else:
        parser = argparse.ArgumentParser("ds-stpar estimate", description=description)
    _add_input_args(parser)
    s = parser.add_argument_group("strategy (DP = GPUs / (TP x PP))")
    s.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    s.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    s.add_argument("--tp-mode", choices=TP_MODES, default="megatron")
    s.add_argument(
        "--vpp-layers", type=int, default=0, help="layers per virtual pipeline stage (0: off)"
    )
    s.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage")
    s.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none")
    s.add_argument(
        "--recompute-layers",
        type=int,
        default=0,
        help="with --recompute full: recompute the first K layers of each pipeline stage, "
        "keep all activations of the others (Megatron's block method; 0: every layer)",
    )
    s.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    s.add_argument(
        "--ring-linear-mlp",
        action="store_true",
        help="ring: the MLP as the two ring linears' passes instead of one fused ring pass",
    )
    s.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="K",
        help="ring: each layer as the interleaved layer of K >= 2 pieces of the micro-batch's "
        "sequences (rule 17; 0: off)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    parser.set_defaults(func=estimate_command)
    return parser


def estimate_json(est) -> dict:
    """The estimate as one JSON object; ``breakdown`` holds the time (s) and memory (GiB) parts."""
    data = est.to_dict()
    data["breakdown"] = {"time_s": est.time_breakdown, "memory_gib": est.memory_breakdown}
    return data


def estimate_command(args: argparse.Namespace) -> int:
    from ds_stpar.planner import rules
    from ds_stpar.planner.cost import estimate

    model, cluster, train = _inputs(args)
    for flag in ("tp", "pp"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag} must be a positive integer, got {getattr(args, flag)}")
    model_parallel = args.tp * args.pp
    if cluster.num_gpus % model_parallel:
        raise ConfigError(
            f"rule 1: {cluster.num_gpus} GPUs is not a multiple of tp {args.tp} x pp {args.pp} "
            f"= {model_parallel}; change --gpus, --tp or --pp"
        )
    layout = Layout(cluster.num_gpus // model_parallel, args.tp, args.pp, args.tp_mode)
    strategy = Strategy(
        layout,
        micro_batch=args.micro_batch,
        zero=args.zero,
        recompute=args.recompute,
        sequence_parallel=args.sp,
        vpp_layers=args.vpp_layers,
        fused_ring_mlp=not args.ring_linear_mlp,
        recompute_layers=args.recompute_layers,
        interleave=args.interleave,
    )
    rules.check(model, cluster, train, strategy)
    est = estimate(model, cluster, train, strategy)
    if args.json:
        print(json.dumps(estimate_json(est), indent=2))
        return 0
    _print_inputs(model, cluster, train)
    print(f"strategy: {strategy.short()}")
    print(
        f"step {est.step_time_s:.3f} s, {est.tokens_per_s:,.0f} tokens/s, "
        f"{est.model_tflops_per_gpu:.1f} model / {est.hardware_tflops_per_gpu:.1f} hardware "
        f"TFLOP/s per GPU, MFU {est.mfu:.1%}, HFU {est.hfu:.1%}"
    )
    _print_breakdown(est)
    verdict = "fits" if est.fits else "does NOT fit"
    print(f"peak memory {est.peak_memory_gib:.1f} of {est.memory_capacity_gib:.1f} GiB: {verdict}")
    if not est.fits:
        for flags, peak in _lighter_variants(model, cluster, train, strategy):
            verdict = "fits" if peak <= est.memory_capacity_gib else "still too much"
            print(f"  with {flags}: {peak:.1f} GiB ({verdict})")
        print("or more --gpus / a larger --tp or --pp; `ds-stpar plan` searches them all")
    return 0


def _lighter_variants(model, cluster, train, strategy) -> list[tuple[str, float]]:
    """Peak memory of ``strategy`` with full recompute and/or the highest ZeRO stage the rules
    allow, for the variants that differ from it and break no rule."""
    import dataclasses

    from ds_stpar.planner import rules
    from ds_stpar.planner.cost import estimate

    zero = 3 if strategy.layout.pp == 1 else 1
    full = {"recompute": "full", "recompute_layers": 0}  # every layer
    changes = [(full, "--recompute full"), ({"zero": zero}, f"--zero {zero}")]
    changes.append(({**full, "zero": zero}, f"--recompute full --zero {zero}"))
    out = []
    for change, flags in changes:
        variant = dataclasses.replace(strategy, **change)
        if variant == strategy or rules.violations(model, cluster, train, variant):
            continue
        out.append((flags, estimate(model, cluster, train, variant).peak_memory_gib))
    return out


# --------------------------------------------------------------------------------------
# profile
# --------------------------------------------------------------------------------------


def profile_command_parser(subparsers=None) -> argparse.ArgumentParser:
    description = (
        "Measure bf16 GEMM speed over a grid of shapes on this machine's GPU (and collective "
        "bus bandwidth when launched by torchrun on several GPUs), for --profile. Needs a "
        "CUDA GPU."
    )
    if subparsers is not None:
        parser = subparsers.add_parser("profile", description=description, help="measure GPUs")
    else:
        parser = argparse.ArgumentParser("ds-stpar profile", description=description)
    parser.add_argument("--out", metavar="FILE", default="profile.json", help="JSON to write")
    parser.set_defaults(func=profile_command)
    return parser


def profile_summary(profile) -> str:
    """One line: the best GEMM, each measured collective's bus bandwidth at the largest
    group and, with collectives, whether the ring's hops can go by the copy engines."""
    best = max((row[3] for row in profile.gemm), default=0.0)
    links = [
        f"{name} {table[max(table)]:.0f} GB/s over {max(table)}"
        for name, table in profile.bus_bandwidth_gbs.items()
        if table
    ]
    peer = ""
    if links:
        peer = "; peer copies (the ring's copy engines): " + (
            "yes" if profile.peer_copies else "no"
        )
    return (
        f"{profile.gpu}: best bf16 GEMM {best:.0f} TFLOP/s over {len(profile.gemm)} shapes; "
        f"collectives: {', '.join(links) or 'none (single process)'}{peer}"
    )


def profile_command(args: argparse.Namespace) -> int:
    from ds_stpar.planner.profile import measure

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:  # launched by torchrun: one process per GPU, collectives measured too
        import torch

        if not torch.cuda.is_available():
            raise StparError("ds-stpar profile needs CUDA GPUs and none is visible")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group("nccl")
    try:
        profile = measure()
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()
    if rank == 0:
        tmp = f"{args.out}.tmp-{os.getpid()}"
        try:
            profile.to_json(tmp)
            os.replace(tmp, args.out)
        except OSError as err:
            raise ConfigError(f"cannot write {args.out}: {err.strerror}") from None
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        print(profile_summary(profile) + f"; wrote {args.out}")
    return 0


# --------------------------------------------------------------------------------------
# buckets
# --------------------------------------------------------------------------------------


def buckets_command_parser(subparsers=None) -> argparse.ArgumentParser:
    description = (
        "Plan sequence-length buckets for a dataset: bucket edges and one layout per bucket "
        "(each over all GPUs, switched in and out every step), chosen by the cost model with "
        "the switch costs, against the best static layout for the same packed documents."
    )
    if subparsers is not None:
        parser = subparsers.add_parser(
            "buckets", description=description, help="sequence-length buckets for a dataset"
        )
    else:
        parser = argparse.ArgumentParser("ds-stpar buckets", description=description)
    _add_input_args(parser)
    _add_data_args(parser, required=True)
    out = parser.add_argument_group("output")
    _add_tp_modes_arg(out)
    out.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    out.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw the length histogram with the bucket edges (needs matplotlib)",
    )
    parser.set_defaults(func=buckets_command)
    return parser


def buckets_command(args: argparse.Namespace) -> int:
    model, cluster, train = _inputs(args)
    plan = _bucket_plan(args, model, cluster, train)
    if args.plot:
        from ds_stpar.planner.buckets import plot_plan

        plot_plan(
            plan,
            args.plot,
            f"{model.name} on {cluster.num_gpus} x {cluster.gpu.name}, seq {train.seq_len}: "
            f"{plan.speedup:.3f}x predicted",
        )
    if args.json:
        report = {
            "model": model.name,
            "num_gpus": cluster.num_gpus,
            "gpu": cluster.gpu.name,
            "seq_len": train.seq_len,
            "data": args.data,
            "stack": args.stack,
            **plan.to_dict(),
            "plot": args.plot,
        }
        print(json.dumps(report, indent=2))
        return 0
    _print_inputs(model, cluster, train)
    _print_buckets(plan, args.stack)
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------

COMMANDS: list[Callable] = [
    plan_command_parser,
    estimate_command_parser,
    profile_command_parser,
    buckets_command_parser,
    demo_command_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        "ds-stpar",
        description="Parallel-layout planner and config generator for DeepSpeed and Megatron-LM.",
    )
    parser.add_argument("--version", action="version", version=f"ds-stpar {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for make in COMMANDS:
        make(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ds-stpar``; returns the exit code (0 success, 2 a user mistake)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed usage / help / version
        return exit_.code if isinstance(exit_.code, int) else 2
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except StparError as err:
        print(f"ds-stpar: error: {err}", file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:  # the reader left early (`ds-stpar plan | head`): not our error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
