"""The training loop shared by ``launch/pretrain.py`` and ``ds-stpar demo``.

Every rank: read and check the DeepSpeed config with its "ds_stpar" section, the tokenizer,
the data path, the world size and the checkpoint to resume (all before anything is written);
initialise torch.distributed (gloo on CPU, NCCL on GPU) from the launcher's environment; load
the documents (rank 0 first, so HF datasets' cache is built once); build one megatron-core
GPTModel per layout the plan uses (fp32 on CPU, the config's bf16/fp16 on GPU), the DeepSpeed
engine of the home layout and the :class:`~ds_stpar.seqbucket.runner.BucketRunner`; then run
``--steps`` optimizer steps (a resumed run continues up to that total).

Rank 0 shows a progress bar (plain lines when stderr is not a terminal), writes the resolved
config to ``<out>/config.json`` and appends one JSON object per step to
``<out>/metrics.jsonl``: step, epoch, mini_batch, loss (mean token loss of the mini-batch),
tokens, targets, step_s, switch_s, optimizer_s, bucket_s (per bucket edge), micro_batches
(per DP rank), bucket_tokens (real tokens, all ranks), layouts, switches, tokens_per_s, tflops (model FLOPs per second per process, the planner's
convention: 6 x parameters-in-linears x tokens + LM head + full-square attention per document
piece; pad tokens not counted), mfu (GPU only: against the config's GPU peak; null on CPU)
and lr: the learning rate of the step's update, read before ``engine.step()``. DeepSpeed
builds the config's "scheduler" in ``deepspeed.initialize`` and steps it inside
``engine.step()`` after the update (on the accumulation boundary, which the runner sets on
the step's last home micro-batch, so once per optimizer step; not after a skipped fp16
step); reading the LR afterwards would give the next step's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ds_stpar.config import GPU_PRESETS, ModelSpec, StparConfig, read_json
from ds_stpar.errors import ConfigError, DataError, StparError
from ds_stpar.planner.profile import LOCAL_STACK
from ds_stpar.seqbucket.sampler import MiniBatchPlan

STDLIB = "stdlib"  # --data value: the Python standard library's sources


@dataclass
class RunOptions:
    """What a training run needs besides the config file (the CLI flags)."""

    config: str
    data: str = STDLIB
    tokenizer: str = "bytes"
    text_column: str = "text"
    steps: int = 20
    out: str = "runs/ds_stpar"
    save: str | None = None
    load: str | None = None
    save_interval: int = 0  # 0: save only after the last step
    seed: int = 1234
    stdlib_files: int = 300  # with --data stdlib: the first N files of the sorted list
    log_interval: int = 1
    profile_step: int = 0  # 0: no profile; else torch.profiler over that step, rank 0's table
    trace_step: int = 0  # 0: no trace; else that step's GPU timeline, every rank's


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """The training flags (``launch/pretrain.py`` and the demo share them)."""
    parser.add_argument(
        "--config",
        "--deepspeed_config",
        dest="config",
        required=True,
        help="ds_stpar.json: a DeepSpeed config with a ds_stpar section (`ds-stpar plan --out`)",
    )
    parser.add_argument(
        "--data",
        default=STDLIB,
        help="a .jsonl/.json/.parquet file, a Dataset.save_to_disk folder or a folder of text "
        f"files; '{STDLIB}' (default) trains on the Python standard library's sources",
    )
    parser.add_argument(
        "--tokenizer", default="bytes", help="'bytes' (default) or a local tokenizer.json"
    )
    parser.add_argument("--text-column", default="text", help="text column of the data")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in total")
    parser.add_argument("--out", default="runs/ds_stpar", help="run folder (config, metrics)")
    parser.add_argument("--save", help="checkpoint folder (step-N subfolders and 'latest')")
    parser.add_argument("--load", help="resume from this checkpoint (folder or step-N)")
    parser.add_argument(
        "--save-interval", type=int, default=0, help="save every N steps (0: at the end)"
    )
    parser.add_argument("--seed", type=int, default=1234, help="model init and data order")
    parser.add_argument(
        "--stdlib-files", type=int, default=300, help=f"files of --data {STDLIB} (default 300)"
    )
    parser.add_argument("--log-interval", type=int, default=1, help="steps per log line")
    parser.add_argument(
        "--profile-step",
        type=int,
        default=0,
        help="profile this step with torch.profiler; rank 0 writes <out>/profile-step-N.txt "
        "(ops by device time and by host time)",
    )
    parser.add_argument(
        "--trace-step",
        type=int,
        default=0,
        help="record this step's GPU timeline (kernels, copies and the CUDA calls that launched "
        "them; no operator recording, so the host keeps nearly its own speed); every rank "
        "writes <out>/trace-step-N-rank-R.json.gz for bench/timeline.py",
    )
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)


def options_from_args(args: argparse.Namespace) -> RunOptions:
    names = {f.name for f in dataclasses.fields(RunOptions)}
    return RunOptions(**{k: v for k, v in vars(args).items() if k in names})


# --------------------------------------------------------------------------------------
# Checks (no side effects)
# --------------------------------------------------------------------------------------


@dataclass
class Checked:
    """The validated inputs of a run."""

    ds_config: dict
    cfg: StparConfig
    tokenizer: object
    world: int


def stack_warning(cfg: StparConfig, where: str) -> str | None:
    """A warning when the plan's predictions are for another software stack than the one this
    loop builds (``ds-stpar plan --stack fused``): its times and memory do not hold here, and
    its static baseline may not be the best one (BENCHMARKS.md, fifth session)."""
    stack = cfg.extra.get("predicted", {}).get("stack")
    if stack in (None, LOCAL_STACK):
        return None
    return (
        f"warning: {where} was planned for the {stack} stack; this loop runs {LOCAL_STACK} "
        "(megatron-core's local modules), whose times and memory differ: plan with the "
        "default --stack for predictions that hold here"
    )


def check_inputs(opts: RunOptions, world: int) -> Checked:
    """Every check that needs no process group; raises a one-line StparError."""
    from ds_stpar.integrations.deepspeed import check_world_size, engine_config
    from ds_stpar.seqbucket.runner import check_strategies
    from ds_stpar.seqbucket.tokenize import load_tokenizer

    ds_config = read_json(opts.config)
    cfg = StparConfig.from_deepspeed_json(opts.config)
    check_world_size(cfg, world, opts.config)
    check_strategies([b.strategy for b in cfg.buckets], [b.max_len for b in cfg.buckets])
    engine_config(ds_config, cfg)  # refuses ZeRO 3
    if opts.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {opts.steps}")
    for flag, value in (("--profile-step", opts.profile_step), ("--trace-step", opts.trace_step)):
        if not 0 <= value <= opts.steps:
            raise ConfigError(
                f"{flag} must be a step of this run (1-{opts.steps}) or 0, got {value}"
            )
    if opts.profile_step and opts.profile_step == opts.trace_step:
        raise ConfigError(
            f"--profile-step and --trace-step are both {opts.trace_step}: one profiler per step"
        )
    if opts.trace_step and not torch.cuda.is_available():
        raise ConfigError("--trace-step records a GPU timeline: it needs CUDA")
    model = cfg.model
    if model.position_embedding == "learned" and cfg.train.seq_len > model.max_position_embeddings:
        raise ConfigError(
            f"seq_len {cfg.train.seq_len} exceeds the model's {model.max_position_embeddings} "
            "learned positions; lower seq_len or raise max_position_embeddings"
        )
    tokenizer = load_tokenizer(opts.tokenizer)
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{model.vocab_size}; raise vocab_size in the config's model"
        )
    if opts.data != STDLIB and not os.path.exists(opts.data):
        raise DataError(f"{opts.data}: no such file or folder")
    if opts.load:
        from ds_stpar.checkpoint import resolve_checkpoint

        resolve_checkpoint(opts.load)
    for flag, path in (("--out", opts.out), ("--save", opts.save)):
        if path and Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"{path}: exists and is not a directory; choose another {flag}")
    return Checked(ds_config, cfg, tokenizer, world)


# --------------------------------------------------------------------------------------
# Set-up
# --------------------------------------------------------------------------------------


def init_distributed() -> None:
    """torch.distributed from the launcher's environment (gloo on CPU, NCCL on GPU)."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def _on_all_ranks(err: StparError) -> StparError:
    """Mark an error every rank raises alike (input checks): only rank 0 prints it."""
    err.all_ranks = True
    return err


def load_data(opts: RunOptions, tokenizer):
    """The documents as :class:`~ds_stpar.seqbucket.data.Documents` (every rank reads and
    tokenizes them itself, before any process group exists; HF datasets' cache is
    lock-protected)."""
    from ds_stpar.seqbucket.data import Documents, load_documents
    from ds_stpar.seqbucket.tokenize import tokenize_dataset

    if opts.data == STDLIB:
        from ds_stpar.seqbucket.corpus import stdlib_corpus

        data = tokenize_dataset(stdlib_corpus(max_files=opts.stdlib_files), tokenizer)
    else:
        data = load_documents(opts.data, text_column=opts.text_column, tokenizer=tokenizer)
    return Documents(data)


def _quiet_libraries() -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\..*")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if int(os.environ.get("RANK", "0")) != 0:
        import datasets

        datasets.disable_progress_bars()


# --------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------


def step_flops(model: ModelSpec, plan: MiniBatchPlan) -> float:
    """Model FLOPs of one mini-batch (forward + backward = 3 x forward), planner.cost's
    convention: linears and LM head per token, full-square attention per document piece."""
    from ds_stpar.planner.cost import attention_flops_per_token, linear_flops_per_token

    tokens = plan.num_tokens
    attention = sum(
        piece.length * attention_flops_per_token(model, piece.length)
        for bucket in plan.buckets
        for rank in bucket.ranks
        for mb in rank
        for row in mb.rows
        for piece in row.pieces
    )
    per_token = model.num_layers * linear_flops_per_token(model)
    per_token += 2.0 * model.hidden_size * model.vocab_size
    return 3.0 * (tokens * per_token + model.num_layers * attention)


def metrics_row(step: int, stats, flops: float, world: int, gpu: str, lr: float) -> dict:
    """One line of metrics.jsonl (collective on GPU: ``peak_gib_ranks`` gathers every rank's
    peak, ``peak_gib`` is their maximum)."""
    row = {"step": step, "mini_batch": stats.index, **stats.to_dict()}
    row.pop("index")
    row["tokens"] = row.pop("num_tokens")
    row["targets"] = row.pop("num_targets")
    row["tokens_per_s"] = stats.num_tokens / stats.step_s if stats.step_s else None
    row["tflops"] = flops / stats.step_s / world / 1e12 if stats.step_s else None
    peak = GPU_PRESETS[gpu].peak_tflops if gpu in GPU_PRESETS else None
    cuda = torch.cuda.is_available()
    row["mfu"] = row["tflops"] / peak if cuda and peak else None
    row["lr"] = lr
    allocated, reserved, retries = _memory_peaks_of_ranks() if cuda else (None, None, None)
    row["peak_gib"] = max(allocated) if allocated else None
    row["peak_gib_ranks"] = allocated
    row["peak_reserved_gib"] = max(reserved) if reserved else None
    row["alloc_retries"] = int(max(retries)) if retries else None
    row["device_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None
    return row


def _memory_peaks_of_ranks() -> tuple[list[float], list[float], list[float]]:
    """Every rank's peaks of allocated and of reserved GPU memory in GiB, and its caching
    allocator's retries so far, by global rank (collective): pipeline stages, and layouts
    that place a parameter on some ranks only, differ, and the plan must fit on the fullest
    GPU; reserved less allocated is what the caching allocator holds beyond the tensors (the
    planner's allocator headroom); a retry is an allocation that found no free block, so the
    allocator released its cache (a device-wide synchronisation) and asked again."""
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    peak = torch.tensor(
        [
            float(torch.cuda.max_memory_allocated()),
            float(torch.cuda.max_memory_reserved()),
            float(retries),
        ],
        device="cuda",
    )
    peaks = [peak]
    if torch.distributed.is_initialized():
        peaks = [torch.empty_like(peak) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(peaks, peak)
    allocated, reserved, retried = torch.stack(peaks).T.tolist()  # one read back to the host
    return [b / 2**30 for b in allocated], [b / 2**30 for b in reserved], retried


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _prepare_out(out: Path, resolved: dict, start_step: int) -> Path:
    """Create the run folder, write config.json, keep metrics of steps <= ``start_step``."""
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / "config.json", json.dumps(resolved, indent=2) + "\n")
    metrics = out / "metrics.jsonl"
    kept = []
    if metrics.exists():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line)["step"] <= start_step:
                    kept.append(line)
            except (ValueError, KeyError):
                continue
    _write_atomic(metrics, "".join(line + "\n" for line in kept))
    return metrics


def plan_summary(cfg: StparConfig, ds_config: dict, docs, sampler, dtype: str) -> list[str]:
    train = cfg.train
    lines = [
        f"model {cfg.model.name}: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, "
        f"{cfg.model.num_params() / 1e6:.2f} M parameters, {dtype}",
        f"data: {len(docs)} documents, {docs.num_tokens} tokens; {train.tokens_per_step} "
        f"tokens per step ({sampler.num_mini_batches()} steps per epoch)",
        f"world {cfg.world_size}, ZeRO {ds_config.get('zero_optimization', {}).get('stage', 0)}, "
        f"home layout {cfg.home.layout.short()}",
    ]
    for bucket in cfg.buckets:
        s = bucket.strategy
        lines.append(
            f"  bucket <= {bucket.max_len:>6} tokens: {s.layout.short():<18} "
            f"micro-batch {s.micro_batch}"
        )
    return lines


class _Progress:
    """tqdm on a terminal, plain lines otherwise; rank 0 only."""

    def __init__(self, total: int, initial: int, enabled: bool, interval: int) -> None:
        self.bar = None
        self.enabled, self.interval, self.total = enabled, max(1, interval), total
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)

    def update(self, row: dict) -> None:
        if not self.enabled:
            return
        tok = row["tokens_per_s"] or 0.0
        buckets = " ".join(f"{k}:{v:.2f}s" for k, v in row["bucket_s"].items())
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{tok:.0f}")
            self.bar.update(1)
            return
        if row["step"] % self.interval == 0 or row["step"] == self.total:
            mfu = f" mfu {row['mfu']:.1%}" if row["mfu"] is not None else ""
            print(
                f"step {row['step']}/{self.total} loss {row['loss']:.4f} tok/s {tok:.0f}{mfu} "
                f"step {row['step_s']:.2f}s switch {row['switch_s']:.3f}s buckets {buckets}",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------


def _plans(sampler) -> Iterator[MiniBatchPlan]:
    while True:
        yield from sampler


def run(opts: RunOptions) -> list[dict]:
    """Train as ``opts`` says; returns the metrics rows of this run's steps (every rank)."""
    from ds_stpar.checkpoint import load_checkpoint, save_checkpoint
    from ds_stpar.integrations.deepspeed import (
        build_engine,
        engine_config,
        model_dtype,
        prepare_cpu,
    )
    from ds_stpar.parallel import GroupCache
    from ds_stpar.seqbucket.runner import (
        BucketRunner,
        build_layout_models,
        model_key,
        padded_vocab,
    )
    from ds_stpar.seqbucket.sampler import BucketSampler, RowCost

    # Buckets alternate activations of very different shapes (16K rows without recompute,
    # then 32K rows with it) in one step; the caching allocator's fixed segments fragmented
    # (an H100 OOM with 38 GiB reserved but unallocated, bench/results/2026-11-26-s5-4xH100).
    # Expandable segments grow and shrink in place. Read at the first CUDA allocation; a
    # user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    world = int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    _quiet_libraries()
    try:
        checked = check_inputs(opts, world)
        docs = load_data(opts, checked.tokenizer)
    except StparError as err:
        raise _on_all_ranks(err) from None
    cfg, ds_config = checked.cfg, checked.ds_config
    prepare_cpu()
    init_distributed()
    rank = dist.get_rank()
    warning = stack_warning(cfg, opts.config)
    if rank == 0 and warning:
        print(warning, flush=True)
    sampler = BucketSampler(
        docs.lengths,
        cfg.buckets,
        cfg.train.tokens_per_step,
        seed=opts.seed,
        cost=RowCost(cfg.model.hidden_size),
    )
    strategies = [b.strategy for b in cfg.buckets]
    model = dataclasses.replace(
        cfg.model, vocab_size=padded_vocab(cfg.model.vocab_size, strategies)
    )
    dtype = model_dtype(ds_config)
    engine_cfg = engine_config(ds_config, cfg)
    models = build_layout_models(
        model, strategies, cfg.home, GroupCache(), dtype, opts.seed, cfg.train.seq_len
    )
    home = models[model_key(cfg.home)]
    engine = build_engine(home.module, engine_cfg, home.groups)
    runner = BucketRunner(
        engine,
        models,
        cfg.home,
        docs.__getitem__,
        checked.tokenizer.pad_id,
        model.tied_embeddings,
        cfg.gpus_per_node,
    )
    start = 0
    if opts.load:
        start = int(load_checkpoint(opts.load, runner, sampler)["step"])
    resolved = {
        "deepspeed": engine_cfg,
        "ds_stpar": cfg.to_dict(),
        "run": {**dataclasses.asdict(opts), "world_size": world, "dtype": dtype},
        "model_padded_vocab": model.vocab_size,
    }
    metrics_path = _prepare_out(Path(opts.out), resolved, start) if rank == 0 else None
    if rank == 0:
        print("\n".join(plan_summary(cfg, ds_config, docs, sampler, dtype)), flush=True)
        if start:
            print(f"resumed from {opts.load} at step {start}", flush=True)
    progress = _Progress(opts.steps, start, rank == 0, opts.log_interval)
    rows = []
    plans = _plans(sampler)
    step = start
    try:
        while step < opts.steps:
            plan = next(plans)
            flops = step_flops(model, plan)
            lr = float(engine.get_lr()[0])  # what this step's update uses (module docstring)
            with _step_profiler(opts, step + 1, rank), _step_tracer(opts, step + 1, rank):
                stats = runner.step(plan)
            step += 1
            row = metrics_row(step, stats, flops, world, cfg.gpu, lr)
            rows.append(row)
            if metrics_path is not None:
                with open(metrics_path, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(row) + "\n")
            progress.update(row)
            if opts.save and (
                step == opts.steps or (opts.save_interval and step % opts.save_interval == 0)
            ):
                t0 = time.perf_counter()
                path = save_checkpoint(opts.save, step, runner, sampler)
                if rank == 0 and progress.bar is None:
                    print(f"saved {path} ({time.perf_counter() - t0:.1f}s)", flush=True)
    finally:
        progress.close()
    return rows


@contextlib.contextmanager
def _step_profiler(opts: RunOptions, step: int, rank: int):
    """torch.profiler around step ``opts.profile_step`` (1-based); rank 0 writes two tables
    to ``<out>/profile-step-N.txt``: ops by device (CUDA) time and by host (CPU) time."""
    if step != opts.profile_step:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    if rank == 0:
        events = prof.key_averages()
        device = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        tables = [
            f"# step {step}: ops by {device}\n"
            + events.table(sort_by=device, row_limit=40, max_name_column_width=70),
            f"# step {step}: ops by self_cpu_time_total\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70),
        ]
        _write_atomic(Path(opts.out) / f"profile-step-{step}.txt", "\n\n".join(tables))


@contextlib.contextmanager
def _step_tracer(opts: RunOptions, step: int, rank: int):
    """The GPU timeline of step ``opts.trace_step`` (1-based) on every rank: CUDA activity
    only (kernels, copies, the runtime and driver calls that launched them), which costs the
    host a few microseconds per launch where operator recording costs it about as much as the
    operators themselves, so host-bound stretches show as they are (bench/timeline.py)."""
    if step != opts.trace_step:
        yield
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        yield
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(Path(opts.out) / f"trace-step-{step}-rank-{rank}.json.gz"))


def main(argv: Sequence[str] | None = None, prog: str = "pretrain.py") -> int:
    """CLI entry: parse, run; a StparError prints one line and returns its exit code."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Train with a ds_stpar plan under DeepSpeed (hot switching)."
    )
    add_train_args(parser)
    args = parser.parse_args(argv)
    try:
        run(options_from_args(args))
    except StparError as err:
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0 or not getattr(err, "all_ranks", False):
            where = "" if rank == 0 else f" [rank {rank}]"
            print(f"{prog}: error{where}: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
