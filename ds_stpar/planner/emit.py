"""Plan outputs: the DeepSpeed JSON, Megatron-LM arguments and the report, written all-or-nothing.

Three files come out of ``ds-stpar plan --out DIR``:

- ``ds_stpar.json`` — a DeepSpeed config (:func:`deepspeed_config`) that also carries the
  plan as a top-level ``"ds_stpar"`` section (:class:`~ds_stpar.config.StparConfig`).
  DeepSpeed (checked on 0.19.8) validates only the top-level keys it knows and ignores the
  rest — its sub-sections such as ``zero_optimization`` are strict pydantic models, the top
  level is a plain dict — and the engine keeps the whole dict as ``engine.config``.
  ``tests/test_emit.py`` runs ``deepspeed.initialize`` on the emitted file to keep that true.
- ``megatron_args.txt`` — Megatron-LM flags (:func:`megatron_args`) and the environment they
  expect (:func:`megatron_env`), one per line, for ``pretrain_gpt.py``.
- ``plan.md`` — the ranked layouts with their time and memory breakdowns and the layout
  families the search rejected, with reasons (:func:`report_markdown`).

Batch algebra (planner.md "DeepSpeed JSON"): with ``d`` data-parallel ranks, micro-batch
``b`` and global batch ``B`` sequences, each rank runs ``GAS = B / (b d)`` micro-batches per
step, and ``train_batch_size = b * GAS * d = B``. DeepSpeed asserts exactly this equality
with ``d`` its notion of "world": the data-parallel size when an ``mpu`` is passed to
``deepspeed.initialize``, otherwise the whole world ``d t p``. ds_stpar always passes an
``mpu`` (an adapter over the layout's groups), so the emitted numbers use the DP size; a
caller that passes no ``mpu`` while ``t p > 1`` fails DeepSpeed's batch assertion. No field
is left "auto" (HF Trainer would fill train_batch_size from the whole world).

Bucketed plans (``ds-stpar plan --data``, :mod:`ds_stpar.planner.buckets`): the section's
``buckets`` list holds one strategy per sequence-length bucket, the last (longest) being the
home layout that the DeepSpeed engine wraps. The number of micro-batches per step then
varies by bucket and by step, so DeepSpeed's ``GAS`` cannot count a step: the file states
the home bucket's expected micro-batches per DP rank (rounded up) as
``gradient_accumulation_steps`` and ``train_batch_size = b x GAS x d`` of the home layout, which
keeps DeepSpeed's batch assertion true, and nothing else depends on it. The ds_stpar runner
(seqbucket/runner.py) calls ``engine.backward(loss * d, scale_wrt_gas=False)`` (its losses
are already normalised by the step's target-token count, seqbucket/loss.py, and DeepSpeed
averages over the ``d`` DP ranks) and sets the
accumulation boundary itself (``engine.set_gradient_accumulation_boundary``, True only on the
step's last home micro-batch), so GAS neither scales the loss nor decides when the optimizer
steps; integrations/deepspeed.py hands the engine GAS 1 and ``train_batch_size = b x d``.
``train.global_batch`` in the section is the step's token budget in ``seq_len`` units
(``tokens_per_step / seq_len``): the sampler cuts steps by tokens.

Learning-rate schedule (:func:`lr_schedule`, planner.md "Learning-rate schedule"): linear
warm-up from 0 to ``lr`` over ``W`` optimizer steps, then cosine decay to ``min_lr`` at
``T`` steps, as DeepSpeed's ``WarmupCosineLR`` (``warmup_type`` "linear", the ratio bounds
``0`` and ``min_lr / lr`` of the optimizer's ``lr``) and Megatron-LM's ``--lr-warmup-iters W
--lr-decay-style cosine --min-lr --train-iters T``. The two step their schedulers alike (once
per optimizer step, after it) but start them differently: DeepSpeed's sets the LR of step 1
from iteration -1 (0), so step ``k`` runs at iteration ``k - 2``; Megatron's starts at 0, so
step ``k`` runs at ``k - 1``. Step ``k`` then gets ``lr (k - 2) / W`` (DeepSpeed, step 1: 0)
and ``lr (k - 1) / W`` (Megatron-LM) for ``k <= W + 1``, and from step ``W + 2`` on both give
``min_lr + (lr - min_lr) (1 + cos(pi min(1, (k - 1 - W) / (T - W)))) / 2``: DeepSpeed's
warm-up is one step later and never quite reaches ``lr``; the decays are the same.
``tests/test_lr_schedule.py`` drives both libraries' scheduler classes with the emitted
values and checks exactly this.

ZeRO in Megatron-LM terms: ``--use-distributed-optimizer`` shards the fp32 master weights
and Adam moments over DP, which is ZeRO-1. Megatron-LM's DDP keeps full-size gradient
buffers and full weights, so ZeRO stages 1, 2 and 3 all map to that flag, and a stage-2/3
plan uses more memory under Megatron-LM than estimated; megatron_args.txt says so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_stpar.config import (
    TP_MODES,
    Bucket,
    ClusterSpec,
    ModelSpec,
    StparConfig,
    Strategy,
    TrainSpec,
)
from ds_stpar.errors import ConfigError, DoesNotFitError
from ds_stpar.planner import rules
from ds_stpar.planner.cost import Estimate, estimate, micro_batches
from ds_stpar.planner.profile import LOCAL_STACK, Calibration
from ds_stpar.planner.search import SearchResult, search

if TYPE_CHECKING:
    from ds_stpar.planner.buckets import BucketPlan

PLAN_FILES = ("ds_stpar.json", "megatron_args.txt", "plan.md")
ALL = 1 << 30  # a top_k that keeps every fitting strategy

MEGATRON_SPEC = ("ds_stpar.layers.megatron_spec", "gpt_layer_stpar_spec")


# Learning-rate schedule defaults (docs/planner.md, "Learning-rate schedule").
TOKENS_PER_PARAMETER = 20  # default training length: Chinchilla's compute-optimal tokens
WARMUP_PERCENT = 1  # default warm-up: 1% of the steps (Megatron-LM's GPT examples, Pythia)
MIN_WARMUP_STEPS = 2  # DeepSpeed's warm-up schedulers run max(2, warmup_num_steps) steps
MIN_LR_RATIO = 0.1  # default cosine floor: 10% of the peak (GPT-3, Llama 1 and 2)


@dataclass(frozen=True)
class OptimizerSettings:
    """Optimizer and learning-rate schedule settings copied into both outputs (the planner
    does not search them). ``None`` fields take the defaults :func:`lr_schedule` resolves."""

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    gradient_clipping: float = 1.0
    min_lr: float | None = None
    train_steps: int | None = None
    warmup_steps: int | None = None


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up from 0 to ``lr`` over ``warmup_steps`` optimizer steps, then cosine decay
    to ``min_lr`` at ``train_steps``; both outputs state it (module docstring)."""

    lr: float
    min_lr: float
    warmup_steps: int
    train_steps: int


def default_train_steps(model: ModelSpec, train: TrainSpec) -> int:
    """Steps of ``TOKENS_PER_PARAMETER`` tokens per parameter (Hoffmann et al. 2022, parameters
    as ``ModelSpec.num_params`` counts them): ``ceil(20 N / tokens per step)``, at least
    ``MIN_WARMUP_STEPS + 1`` so that the shortest warm-up leaves a decay. Integer arithmetic:
    no float rounding can move a ceiling."""
    steps = -(-TOKENS_PER_PARAMETER * model.num_params() // train.tokens_per_step)
    return max(MIN_WARMUP_STEPS + 1, steps)


def lr_schedule(
    model: ModelSpec, train: TrainSpec, optimizer: OptimizerSettings | None = None
) -> LRSchedule:
    """The schedule of ``optimizer`` with its defaults filled in, checked.

    ``train_steps``: :func:`default_train_steps`; ``warmup_steps``:
    ``ceil(WARMUP_PERCENT x train_steps / 100)``, at least ``MIN_WARMUP_STEPS`` (DeepSpeed would
    silently lengthen a 1-step warm-up to 2, Megatron-LM would not); ``min_lr``:
    ``MIN_LR_RATIO x lr`` to 12 significant digits. Refused, naming the ``ds-stpar plan`` flag: a non-positive or
    non-finite ``lr``, ``min_lr`` outside ``[0, lr]``, a warm-up shorter than 2 steps or not
    shorter than the run (Megatron-LM asserts ``lr_warmup_steps < lr_decay_steps``).
    """
    opt = optimizer or OptimizerSettings()
    if not (math.isfinite(opt.lr) and opt.lr > 0):
        raise ConfigError(f"--lr must be a positive number, got {opt.lr}")
    # 12 significant digits: 3e-05, not 0.1 x 3e-4 = 2.9999999999999997e-05
    min_lr = float(f"{MIN_LR_RATIO * opt.lr:.12g}") if opt.min_lr is None else opt.min_lr
    if not (math.isfinite(min_lr) and 0 <= min_lr <= opt.lr):
        raise ConfigError(f"--min-lr must be between 0 and --lr {opt.lr}, got {min_lr}")
    steps = default_train_steps(model, train) if opt.train_steps is None else opt.train_steps
    if opt.warmup_steps is None:
        warmup = max(MIN_WARMUP_STEPS, -(-WARMUP_PERCENT * steps // 100))
    else:
        warmup = opt.warmup_steps
    if warmup < MIN_WARMUP_STEPS:
        raise ConfigError(
            f"--warmup-steps must be at least {MIN_WARMUP_STEPS} (DeepSpeed's warm-up "
            f"schedulers run at least {MIN_WARMUP_STEPS} steps), got {warmup}"
        )
    if steps <= warmup:
        raise ConfigError(
            f"--train-steps {steps} leaves no decay after a {warmup}-step warm-up; use "
            f"--train-steps > {warmup} or fewer --warmup-steps"
        )
    return LRSchedule(lr=opt.lr, min_lr=min_lr, warmup_steps=warmup, train_steps=steps)


# --------------------------------------------------------------------------------------
# Checks shared by both outputs
# --------------------------------------------------------------------------------------


def _megatron_sp(strategy: Strategy) -> Strategy:
    """Sequence parallelism is meaningless at t = 1: Megatron-LM turns it off there (with a
    warning) and so do the outputs, rather than refusing the strategy (rule 9)."""
    if strategy.layout.tp == 1 and strategy.sequence_parallel:
        return dataclasses.replace(strategy, sequence_parallel=False)
    return strategy


def _check(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, strategy: Strategy) -> None:
    """The rules of planner.md and ours (:func:`rules.check`), then what only the outputs need."""
    rules.check(model, cluster, train, strategy)
    if model.position_embedding == "learned" and train.seq_len > model.max_position_embeddings:
        raise ConfigError(
            f"seq_len {train.seq_len} exceeds the {model.max_position_embeddings} learned "
            f"positions of {model.name}; use --seq-len <= {model.max_position_embeddings}"
        )
    if strategy.vpp_layers and (strategy.first_stage_layers or strategy.last_stage_layers):
        raise ConfigError(
            "interleaved pipelining with uneven first/last stages is not emitted (Megatron-LM "
            "then needs --num-virtual-stages-per-pipeline-rank); drop one of the two"
        )


# --------------------------------------------------------------------------------------
# DeepSpeed
# --------------------------------------------------------------------------------------


def _precision_section(dtype: str) -> dict[str, Any]:
    if dtype == "fp16":
        # loss_scale 0 selects dynamic loss scaling.
        return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}}
    return {"bf16": {"enabled": dtype == "bf16"}}


def _optimizer_section(name: str, opt: OptimizerSettings) -> dict[str, Any]:
    """DeepSpeed optimizer block; ``torch_adam`` avoids the fused-Adam JIT build."""
    if name == "sgd":
        # Not a DeepSpeed optimizer name: the engine builds torch.optim.SGD.
        return {"type": "SGD", "params": {"lr": opt.lr, "weight_decay": opt.weight_decay}}
    params: dict[str, Any] = {
        "lr": opt.lr,
        "betas": list(opt.betas),
        "eps": opt.eps,
        "weight_decay": opt.weight_decay,
        "torch_adam": True,
    }
    if name == "adam":
        params["adam_w_mode"] = False  # DeepSpeed's "Adam" means AdamW unless told otherwise
    return {"type": "AdamW" if name == "adamw" else "Adam", "params": params}


def _scheduler_section(schedule: LRSchedule) -> dict[str, Any]:
    """DeepSpeed's ``WarmupCosineLR``: its peak is the optimizer's ``lr``, its bounds ratios of
    it; ``warmup_type`` must be said, DeepSpeed's default warm-up is logarithmic."""
    return {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": schedule.train_steps,
            "warmup_num_steps": schedule.warmup_steps,
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": schedule.min_lr / schedule.lr,
            "warmup_type": "linear",
        },
    }


def deepspeed_config(
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    strategy: Strategy,
    *,
    buckets: Sequence[Bucket] | None = None,
    home_micro_batches: int | None = None,
    optimizer: OptimizerSettings | None = None,
    steps_per_print: int = 10,
    extra: dict | None = None,
    calibration: Calibration | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config dict for ``strategy`` (the home layout) with the "ds_stpar" section.

    ``buckets`` (sorted by length, the last one's strategy being ``strategy``) defaults to one
    bucket of ``train.seq_len``. ``home_micro_batches``: for a bucketed plan, the home
    bucket's micro-batches per DP rank and step, written as GAS (module docstring, "Bucketed
    plans"); each bucket's strategy is then checked at its own edge. Without it GAS is
    ``B / (b d)``. ``extra`` lands in the section's ``extra`` next to the GPU figures the plan
    was made with. The ZeRO bucket size is the one the cost model assumed
    (``calibration.dp_bucket_elements``, DeepSpeed's default 5e8 unless calibrated), and
    ``overlap_comm`` follows its ``overlap_grad_reduce`` where DeepSpeed can overlap (ZeRO >= 1).
    The ``scheduler`` is :func:`lr_schedule` of ``optimizer`` (module docstring).
    """
    strategy = _megatron_sp(strategy)
    buckets = (
        tuple(Bucket(b.max_len, _megatron_sp(b.strategy)) for b in buckets)
        if buckets
        else (Bucket(train.seq_len, strategy),)
    )
    if buckets[-1].strategy != strategy:
        raise ConfigError("the longest bucket's strategy must be the home strategy")
    if home_micro_batches is None:
        _check(model, cluster, train, strategy)
        gas = micro_batches(train, strategy)
    else:
        if home_micro_batches < 1:
            raise ConfigError(f"home micro-batches must be positive, got {home_micro_batches}")
        gas = home_micro_batches
        for bucket in buckets:
            rows = bucket.strategy.micro_batch * bucket.strategy.layout.dp
            rows *= gas if bucket is buckets[-1] else 1
            at_edge = dataclasses.replace(train, seq_len=bucket.max_len, global_batch=rows)
            _check(model, cluster, at_edge, bucket.strategy)
    zero = strategy.zero
    cal = calibration or Calibration.load_default(cluster.gpu.name)
    section = StparConfig(
        model=model,
        train=train,
        buckets=buckets,
        gpu=cluster.gpu.name,
        gpus_per_node=cluster.gpus_per_node,
        extra={"num_gpus": cluster.num_gpus, "gpu_spec": dataclasses.asdict(cluster.gpu)}
        | (extra or {}),
    )
    opt = optimizer or OptimizerSettings()
    return {
        "train_batch_size": strategy.micro_batch * gas * strategy.layout.dp,
        "train_micro_batch_size_per_gpu": strategy.micro_batch,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": opt.gradient_clipping,
        "steps_per_print": steps_per_print,
        "wall_clock_breakdown": False,
        **_precision_section(train.dtype),
        "zero_optimization": {
            "stage": zero,
            "overlap_comm": cal.overlap_grad_reduce and zero >= 1 and strategy.layout.dp > 1,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": cal.dp_bucket_elements,
            "allgather_bucket_size": cal.dp_bucket_elements,
        },
        **({"zero_allow_untested_optimizer": True} if train.optimizer == "sgd" else {}),
        "optimizer": _optimizer_section(train.optimizer, opt),
        "scheduler": _scheduler_section(lr_schedule(model, train, opt)),
        "ds_stpar": section.to_dict(),
    }


# --------------------------------------------------------------------------------------
# Megatron-LM
# --------------------------------------------------------------------------------------


def megatron_env(train: TrainSpec, strategy: Strategy) -> dict[str, str]:
    """Environment Megatron-LM expects with this strategy.

    Rule 12: CUDA_DEVICE_MAX_CONNECTIONS=1 when t > 1 (TP communication is then scheduled
    ahead of the GEMMs that need it; Blackwell no longer needs it). Ring/Cannon layers read
    their mode from DS_STPAR_TP_MODE when Megatron calls the spec function with no argument,
    and a ring's MLP fusion from DS_STPAR_FUSED_RING_MLP (set when the strategy turns it off),
    and the interleaved layer's pieces from DS_STPAR_INTERLEAVE.
    """
    env = dict(rules.megatron_options(train, strategy).env or {})
    if strategy.layout.tp > 1 and strategy.layout.tp_mode != "megatron":
        env["DS_STPAR_TP_MODE"] = strategy.layout.tp_mode
        if strategy.runs_interleaved:
            env["DS_STPAR_INTERLEAVE"] = str(strategy.interleave)
        elif strategy.layout.tp_mode == "ring" and not strategy.fused_ring_mlp:
            env["DS_STPAR_FUSED_RING_MLP"] = "0"
    return env


def megatron_args(
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    strategy: Strategy,
    optimizer: OptimizerSettings | None = None,
) -> list[str]:
    """Megatron-LM ``pretrain_gpt.py`` arguments (argv tokens) for ``strategy``.

    The switches a strategy does not carry come from :func:`rules.megatron_options`, the
    values the rules were checked with: full recompute as ``uniform`` with one layer per
    checkpoint (every layer keeps only its input, the 2sbh of the memory table), or as
    ``block`` with the strategy's ``recompute_layers`` per stage (the others keep all), selective
    recompute with no method; the distributed optimizer for ZeRO >= 1; the overlap flags
    only with data parallelism, ``--overlap-param-gather`` only next to the distributed
    optimizer and ``--overlap-grad-reduce``. Sequence parallelism is dropped at t = 1.
    Interleaving relies on Megatron's default overlapped P2P (so p > 1 suffices, rule 4).
    The learning-rate schedule is :func:`lr_schedule`'s, as in the DeepSpeed config (linear
    warm-up from 0, cosine decay to ``--min-lr`` at ``--train-iters``, which is also
    Megatron-LM's default ``--lr-decay-iters``). Tokenizer and data flags are the user's.
    """
    strategy = _megatron_sp(strategy)
    _check(model, cluster, train, strategy)
    opts = rules.megatron_options(train, strategy)
    opt = optimizer or OptimizerSettings()
    layout = strategy.layout
    t, p = layout.tp, layout.pp
    args = [
        "--num-layers", str(model.num_layers),
        "--hidden-size", str(model.hidden_size),
        "--ffn-hidden-size", str(model.ffn_hidden_size),
        "--num-attention-heads", str(model.num_attention_heads),
    ]  # fmt: skip
    if model.kv_channels * model.num_attention_heads != model.hidden_size:
        args += ["--kv-channels", str(model.kv_channels)]
    if model.num_query_groups != model.num_attention_heads:
        args += ["--group-query-attention", "--num-query-groups", str(model.num_query_groups)]
    if model.gated:
        args.append("--swiglu")
    args += ["--normalization", "RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm"]
    if not model.add_bias_linear:
        args.append("--disable-bias-linear")
    if not model.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    # Megatron-LM defaults both dropouts to 0.1: state the model's.
    args += ["--hidden-dropout", repr(model.dropout), "--attention-dropout", repr(model.dropout)]
    rope = model.position_embedding == "rope"
    args += [
        "--position-embedding-type", "rope" if rope else "learned_absolute",
        "--seq-length", str(train.seq_len),
        # Megatron asserts max_position_embeddings >= seq_length even for RoPE.
        "--max-position-embeddings",
        str(max(model.max_position_embeddings, train.seq_len) if rope
            else model.max_position_embeddings),
        "--tensor-model-parallel-size", str(t),
        "--pipeline-model-parallel-size", str(p),
    ]  # fmt: skip
    if strategy.sequence_parallel:
        args.append("--sequence-parallel")
    if strategy.first_stage_layers:
        args += ["--decoder-first-pipeline-num-layers", str(strategy.first_stage_layers)]
    if strategy.last_stage_layers:
        args += ["--decoder-last-pipeline-num-layers", str(strategy.last_stage_layers)]
    if strategy.vpp_layers:
        args += ["--num-layers-per-virtual-pipeline-stage", str(strategy.vpp_layers)]
    args += [
        "--micro-batch-size", str(strategy.micro_batch),
        "--global-batch-size", str(train.global_batch),
    ]  # fmt: skip
    if strategy.recompute != "none":
        args += ["--recompute-granularity", strategy.recompute]
    if opts.recompute_method:
        args += ["--recompute-method", opts.recompute_method]
        args += ["--recompute-num-layers", str(opts.recompute_num_layers)]
    for flag, on in (
        ("--use-distributed-optimizer", opts.distributed_optimizer),
        ("--overlap-grad-reduce", opts.overlap_grad_reduce),
        ("--overlap-param-gather", opts.overlap_param_gather),
        ("--bf16", opts.bf16),
        ("--fp16", opts.fp16),
    ):
        if on:
            args.append(flag)
    schedule = lr_schedule(model, train, opt)
    args += [
        "--optimizer", "sgd" if train.optimizer == "sgd" else "adam",
        "--lr", repr(opt.lr),
        "--min-lr", repr(schedule.min_lr),
        "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(schedule.warmup_steps),
        "--train-iters", str(schedule.train_steps),
        "--weight-decay", repr(opt.weight_decay),
        "--clip-grad", repr(opt.gradient_clipping),
    ]  # fmt: skip
    if train.optimizer != "sgd":
        args += [
            "--adam-beta1", repr(opt.betas[0]),
            "--adam-beta2", repr(opt.betas[1]),
            "--adam-eps", repr(opt.eps),
        ]  # fmt: skip
    if t > 1 and layout.tp_mode != "megatron":
        args += ["--spec", *MEGATRON_SPEC]
    return args


def megatron_args_text(
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    strategy: Strategy,
    optimizer: OptimizerSettings | None = None,
    prediction: Estimate | None = None,
) -> str:
    """megatron_args.txt: comment header (with ``prediction``'s numbers when given),
    ``NAME=value`` env lines (with a prediction that has ring hops, the
    ``DS_STPAR_RING_TRANSPORT`` it priced; with one of the interleaved layer,
    ``DS_STPAR_TRANSFER_TRANSPORT=nccl``), then one flag per line. A prediction that priced
    a ring layout's transfers or hops by the copy engines through host memory is refused:
    they need more than one hardware queue, and Megatron-LM asserts
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with TP."""
    args = megatron_args(model, cluster, train, strategy, optimizer)
    strategy = _megatron_sp(strategy)
    lines = [
        f"# Megatron-LM arguments from ds-stpar for {model.name} on {cluster.num_gpus} x "
        f"{cluster.gpu.name}, seq {train.seq_len}, global batch {train.global_batch}",
        f"# strategy: {strategy.short()}",
        "# use: export $(grep -E '^[A-Z_]+=' megatron_args.txt)",
        "#      torchrun ... pretrain_gpt.py $(grep '^--' megatron_args.txt) <data/tokenizer flags>",
    ]
    if prediction is not None:
        lines.append(
            f"# predicted: {prediction.step_time_s:.3f} s per step, "
            f"{prediction.tokens_per_s:,.0f} tokens/s, peak {prediction.peak_memory_gib:.1f} of "
            f"{prediction.memory_capacity_gib:.1f} GiB per GPU"
            + ("" if prediction.fits else " - does NOT fit")
        )
    if strategy.zero >= 2:
        lines.append(
            f"# ZeRO-{strategy.zero} maps to --use-distributed-optimizer (ZeRO-1): gradients "
            "and weights stay unsharded under Megatron-LM, so memory exceeds the plan's estimate"
        )
    if train.optimizer == "adam":
        lines.append("# Megatron-LM's adam is AdamW (decoupled weight decay)")
    env = megatron_env(train, strategy)
    if prediction is not None and "host-staged" in (prediction.transfers, prediction.ring_hops):
        raise ConfigError(
            "the prediction prices the ring layout's transfers by the copy engines through "
            "host memory (calibration transfer_transport), which need "
            "CUDA_DEVICE_MAX_CONNECTIONS above 1; Megatron-LM asserts it is 1 with tensor "
            "parallelism: estimate the Megatron-LM run with transfer_transport nccl"
        )
    if prediction is not None and prediction.transfers:
        env["DS_STPAR_TRANSFER_TRANSPORT"] = prediction.transfers
    lines += [f"{key}={value}" for key, value in env.items()]
    if prediction is not None and prediction.ring_hops:
        # the transport the estimate priced: auto takes the copy engines where it found them
        transport = "nccl" if prediction.ring_hops == "nccl" else "auto"
        lines.append(f"DS_STPAR_RING_TRANSPORT={transport}")
    for token in args:
        if token.startswith("--"):
            lines.append(token)
        else:
            lines[-1] += f" {token}"
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """Markdown table; columns without letters (numbers) right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    text = [any(ch.isalpha() for row in cells for ch in row[i]) for i in range(len(headers))]
    align = ["---" if is_text else "---:" for is_text in text]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in cells]
    return out


def inputs_summary(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> list[tuple]:
    """(name, description) rows for the model, the cluster and the training setup."""
    gpu = cluster.gpu
    heads = f"{model.num_attention_heads} heads"
    if model.num_query_groups != model.num_attention_heads:
        heads += f" ({model.num_query_groups} KV groups)"
    return [
        (
            "model",
            f"{model.name}: {model.num_params() / 1e9:.2f} B parameters, {model.num_layers} layers, "
            f"hidden {model.hidden_size}, {heads}, FFN {model.ffn_hidden_size} "
            f"({model.activation}), vocab {model.vocab_size}",
        ),
        (
            "cluster",
            f"{cluster.num_gpus} x {gpu.name} ({cluster.gpus_per_node} per node): "
            f"{gpu.peak_tflops:g} TFLOP/s, {gpu.hbm_gib:.1f} GiB, NVLink {gpu.nvlink_gbs:g} GB/s, "
            f"network {gpu.internode_gbs:g} GB/s per GPU"
            + (", measured profile" if cluster.profile is not None else ""),
        ),
        (
            "training",
            f"seq {train.seq_len}, global batch {train.global_batch} sequences = "
            f"{train.tokens_per_step:,} tokens per step, {train.dtype}, {train.optimizer}",
        ),
    ]


def ranked_rows(estimates: Sequence[Estimate]) -> list[tuple]:
    return [
        (
            i,
            e.strategy.short(),
            f"{e.step_time_s:.3f}",
            f"{e.tokens_per_s:,.0f}",
            f"{e.model_tflops_per_gpu:.1f}",
            f"{e.mfu:.1%}",
            f"{e.hfu:.1%}",
            f"{e.peak_memory_gib:.1f} / {e.memory_capacity_gib:.1f}",
        )
        for i, e in enumerate(estimates, 1)
    ]


RANKED_HEADERS = (
    "#",
    "strategy",
    "step (s)",
    "tokens/s",
    "model TFLOP/s/GPU",
    "MFU",
    "HFU",
    "peak GiB / capacity",
)


def _breakdown(est: Estimate, train: TrainSpec) -> list[str]:
    total = est.step_time_s
    time_rows = [
        (name, f"{sec:.4f}", f"{sec / total:.1%}" if total else "-")
        for name, sec in est.time_breakdown.items()
    ]
    mem_rows = [(name, f"{gib:.2f}") for name, gib in est.memory_breakdown.items()]
    gas = micro_batches(train, est.strategy)
    lines = [
        f"{gas} micro-batches of {est.strategy.micro_batch} per rank per step; "
        f"{est.hardware_tflops_per_gpu:.1f} hardware TFLOP/s per GPU; "
        f"{'fits' if est.fits else 'does NOT fit'} "
        f"({est.peak_memory_gib:.1f} of {est.memory_capacity_gib:.1f} GiB).",
        "",
        *_md_table(("time per step", "seconds", "share"), time_rows),
        "",
        *_md_table(("memory per GPU (peak)", "GiB"), mem_rows),
    ]
    return lines


BUCKET_HEADERS = (
    "bucket (tokens)",
    "docs",
    "tokens",
    "tokens/step",
    "rows/step",
    "strategy",
    "mb/rank",
    "time (s)",
    "switch (s)",
    "peak GiB",
)


def bucket_rows(plan: BucketPlan) -> list[tuple]:
    """One row per bucket of a :class:`~ds_stpar.planner.buckets.BucketPlan` (BUCKET_HEADERS)."""
    return [
        (
            f"{b.lo + 1}-{b.edge}",
            f"{b.documents:,}",
            f"{b.tokens:,}",
            f"{b.tokens_per_step:,.0f}",
            f"{b.rows:.1f}",
            b.strategy.short(),
            f"{b.micro_batches:.1f}",
            f"{b.time_s:.3f}",
            f"{b.switch_s:.4f}",
            f"{b.peak_memory_gib:.1f}",
        )
        for b in plan.buckets
    ]


def bucket_summary(plan: BucketPlan) -> list[str]:
    """The data, the static baseline, the bucketed step and the speedup, one line each."""
    st, seq_len = plan.static, plan.home.edge
    lines = [
        f"data: {plan.num_documents:,} documents ({plan.num_split_documents:,} longer than "
        f"{seq_len} cut into pieces), {plan.num_tokens:,} tokens; steps of "
        f"{plan.tokens_per_step:,} tokens"
        + (
            " (more than the dataset holds: steps are drawn from its length distribution)"
            if plan.tokens_per_step > plan.num_tokens
            else ""
        ),
        f"static: {st.strategy.short()}: {st.step_s:.3f} s per step ({st.rows:.1f} packed rows of "
        f"{seq_len}, attention {st.attention_ratio:.2f} of full rows)",
        f"bucketed: {plan.bucketed_step_s:.3f} s per step = buckets "
        f"{sum(b.time_s for b in plan.buckets):.3f} + switch {plan.switch_s:.4f} + home DP "
        f"reduction and optimizer {plan.update_s:.4f}",
        f"speedup: {plan.speedup:.3f}x",
    ]
    if plan.note:
        lines.append(f"note: {plan.note}")
    return lines


def report_markdown(
    result: SearchResult | Sequence[Estimate],
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    detail: int = 3,
    outputs: Sequence[tuple[str, str]] = (),
    buckets: BucketPlan | None = None,
    schedule: LRSchedule | None = None,
) -> str:
    """plan.md: inputs (with the learning-rate ``schedule`` when given), which strategy each
    output file holds (``outputs``), the sequence-length buckets when planned (``buckets``),
    ranked layouts, time/memory breakdowns of the best ``detail``, rejected layout families
    with reasons, and the closest layout when nothing fits."""
    if isinstance(result, SearchResult):
        top, rejected, closest, considered = (
            result.top,
            result.rejected,
            result.closest,
            result.considered,
        )
    else:
        top, rejected, closest, considered = list(result), {}, None, len(result)
    lines = [f"# ds-stpar plan: {model.name} on {cluster.num_gpus} x {cluster.gpu.name}", ""]
    inputs = inputs_summary(model, cluster, train)
    if schedule is not None:
        inputs.append(
            (
                "learning rate",
                f"peak {schedule.lr:g}, linear warm-up over {schedule.warmup_steps:,} steps, "
                f"cosine decay to {schedule.min_lr:g} at step {schedule.train_steps:,} "
                f"({schedule.train_steps * train.tokens_per_step:,} tokens)",
            )
        )
    lines += _md_table(("input", "value"), inputs)
    lines += ["", f"{considered} strategies considered, {len(top)} ranked below.", ""]
    if outputs:
        lines += ["## Outputs", "", *_md_table(("file", "strategy"), outputs), ""]
    if buckets is not None:
        lines += ["## Sequence-length buckets", ""]
        lines += [f"- {line}" for line in bucket_summary(buckets)]
        lines += ["", *_md_table(BUCKET_HEADERS, bucket_rows(buckets)), ""]
        lines += [
            "Per step, expected: packed rows and micro-batches run per DP rank (padding "
            "ones included; they cost a few pad tokens), forward + backward seconds of the "
            "real tokens, switch seconds (weights in, gradients "
            "out), peak memory per GPU while the bucket runs, its switches included "
            "(docs/seqbucket.md). The ranked layouts below are for full-length sequences.",
            "",
        ]
    if top:
        lines += ["## Ranked layouts", "", *_md_table(RANKED_HEADERS, ranked_rows(top)), ""]
        for i, est in enumerate(top[:detail], 1):
            lines += [f"## {i}. {est.strategy.short()}", "", *_breakdown(est, train), ""]
    elif closest is not None:
        lines += [f"## Nothing fits; closest: {closest.strategy.short()}", ""]
        lines += [*_breakdown(closest, train), ""]
    if rejected:
        lines += ["## Rejected layout families", ""]
        lines += _md_table(("family", "reason"), sorted(rejected.items()))
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------


def megatron_estimate(
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    tp_modes: Sequence[str] = TP_MODES,
    calibration: Calibration | None = None,
    allow_tp_across_nodes: bool | None = None,
    interleave: bool = False,
) -> Estimate | None:
    """The fastest strategy as Megatron-LM runs it, for megatron_args.txt (``None`` if none fits);
    ``interleave``: ring layouts are tried as the interleaved layer too (``plan --interleave``).

    Megatron-LM shards only the optimizer state (ZeRO-1, ``--use-distributed-optimizer``) and
    keeps fp32 main gradients, so the search is redone with 4-byte gradients
    (``Calibration.grad_bytes``) and only ZeRO <= 1 strategies are taken: a ZeRO-2/3 layout
    that DeepSpeed fits can run out of memory under Megatron-LM.
    """
    cal = (calibration or Calibration.load_default(cluster.gpu.name)).replace(grad_bytes=4)
    return _fastest(
        model,
        cluster,
        train,
        tp_modes,
        allow_tp_across_nodes,
        lambda s: s.zero <= 1,
        cal,
        interleave,
    )


def _fastest(
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    tp_modes: Sequence[str],
    allow_tp_across_nodes: bool | None,
    keep: Callable[[Strategy], bool],
    calibration: Calibration | None = None,
    interleave: bool = False,
) -> Estimate | None:
    """The fastest fitting strategy ``keep`` accepts, from a search keeping every strategy."""
    found = search(
        model,
        cluster,
        train,
        top_k=ALL,
        tp_modes=tuple(tp_modes),
        calibration=calibration,
        allow_tp_across_nodes=allow_tp_across_nodes,
        interleave=interleave,
    )
    return next((e for e in found.top if keep(e.strategy)), None)


def loop_estimate(
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    tp_modes: Sequence[str] = TP_MODES,
    allow_tp_across_nodes: bool | None = None,
) -> Estimate | None:
    """The fastest fitting strategy of ds_stpar's training loop, for ds_stpar.json (``None``
    if none fits): ``launch/pretrain.py`` runs it as a home layout
    (:func:`~ds_stpar.planner.buckets.runnable`: ZeRO 0-2, pipelines in non-interleaved 1F1B
    over even stages; ``StparTrainer`` runs transformers models without pipelines and refuses
    a pp > 1 plan), on
    megatron-core's local modules, so the search is redone with that stack's calibration
    (``megatron-core-local``: its times and memory, within 1% of the allocation measured on
    H100, where the published Megatron-LM stack that ``plan`` ranks for under-counts) and a
    layout ranked first that the loop cannot run (ZeRO-3, interleaved or uneven stages) goes
    to megatron_args.txt and plan.md, not to the file the loop reads."""
    from ds_stpar.planner.buckets import runnable

    cal = Calibration.load_default(cluster.gpu.name, stack=LOCAL_STACK)
    return _fastest(
        model,
        cluster,
        train,
        tp_modes,
        allow_tp_across_nodes,
        runnable,
        cal,
    )


def bucketed_deepspeed_config(
    plan: BucketPlan,
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    optimizer: OptimizerSettings | None = None,
) -> dict[str, Any]:
    """:func:`deepspeed_config` for a bucketed plan: its buckets in the "ds_stpar" section, the
    home bucket's micro-batches as GAS, and the prediction in ``extra.predicted``."""
    predicted = {
        "step_time_s": plan.bucketed_step_s,
        "static_step_time_s": plan.static_step_s,
        "speedup": plan.speedup,
        "static_strategy": plan.static.strategy.short(),
        "switch_s": plan.switch_s,
        "update_s": plan.update_s,
        "tokens_per_step": plan.tokens_per_step,
        "stack": plan.stack,
        "buckets": [
            {
                key: getattr(b, key)
                for key in (
                    "edge",
                    "tokens_per_step",
                    "rows",
                    "micro_batches",
                    "time_s",
                    "switch_s",
                    "peak_memory_gib",
                )
            }
            for b in plan.buckets
        ],
    }
    return deepspeed_config(
        model,
        cluster,
        train,
        plan.home.strategy,
        buckets=plan.stpar_buckets(),
        home_micro_batches=plan.home_micro_batches,
        optimizer=optimizer,
        extra={"predicted": predicted},
    )


def hops_note(est: Estimate) -> str:
    """``, ring hops by the copy engines`` (or by NCCL, or through host memory) where the
    estimate has ring hops: the transport it assumed, which ``DS_STPAR_RING_TRANSPORT`` (peer
    links) and ``DS_STPAR_TRANSFER_TRANSPORT`` (host memory) on the GPUs must leave it; for
    the interleaved layer, what it took to carry its transfers
    (``DS_STPAR_TRANSFER_TRANSPORT``)."""
    names = {
        "nccl": "NCCL",
        "copy engines": "the copy engines",
        "host-staged": "the copy engines through host memory",
    }
    if est.transfers:
        return f", transfers by {names[est.transfers]}"
    return f", ring hops by {names[est.ring_hops]}" if est.ring_hops else ""


def plan_files(
    result: SearchResult | Sequence[Estimate],
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    optimizer: OptimizerSettings | None = None,
    tp_modes: Sequence[str] = TP_MODES,
    allow_tp_across_nodes: bool | None = None,
    buckets: BucketPlan | None = None,
    loop: Estimate | None = None,
    interleave: bool = False,
) -> dict[str, str]:
    """The contents of the three plan files: ds_stpar.json for ``loop`` (the CLI passes
    :func:`loop_estimate`; default: the first fitting estimate of ``result`` that the training
    loop runs, :func:`~ds_stpar.planner.buckets.runnable`) or, given ``buckets``, the
    bucketed plan (:func:`bucketed_deepspeed_config`),
    megatron_args.txt for :func:`megatron_estimate`'s (the best one with ZeRO capped at 1
    and a "does NOT fit" warning when nothing fits Megatron-LM; Megatron-LM has no buckets),
    plan.md for all of ``result`` and the buckets (``interleave``: Megatron-LM's search tries
    the interleaved layer too, as ``plan --interleave`` ranks it). When nothing of the ranking fits (the
    published Megatron-LM stack counts more memory than the loop's local modules) but
    ``loop`` or ``buckets`` is given, ds_stpar.json is still written and megatron_args.txt
    holds the ranking's closest layout, marked as not fitting."""
    from ds_stpar.planner.buckets import runnable
    from ds_stpar.seqbucket.runner import LOOP_RULE, loop_refusal

    top = result.top if isinstance(result, SearchResult) else list(result)
    fitting = [e for e in top if e.fits]
    closest = result.closest if isinstance(result, SearchResult) else (top[0] if top else None)
    if not fitting and ((loop is None and buckets is None) or closest is None):
        raise DoesNotFitError(f"no layout of {model.name} fits; nothing to write")
    best = fitting[0] if fitting else closest
    if buckets is None:
        if loop is None:
            loop = next((e for e in fitting if runnable(e.strategy)), None)
        if loop is None:
            raise DoesNotFitError(
                f"no layout of {model.name} that launch/pretrain.py runs fits: the best, "
                f"{best.strategy.short()}, is one it cannot run "
                f"({loop_refusal(best.strategy)}); "
                "train with Megatron-LM or DeepSpeed from the ranking"
            )
    if buckets is not None:
        ds = bucketed_deepspeed_config(buckets, model, cluster, train, optimizer)
        ds_label = (
            f"{len(buckets.buckets)} bucket(s) "
            + ", ".join(f"<={b.edge}: {b.strategy.short()}" for b in buckets.buckets)
            + f" (DeepSpeed, home {buckets.home.strategy.short()})"
        )
    else:
        predicted = {
            key: getattr(loop, key)
            for key in ("step_time_s", "tokens_per_s", "mfu", "hfu", "peak_memory_gib")
        }
        predicted["stack"] = loop.stack
        if loop.ring_hops:  # the transport the estimate assumed (DS_STPAR_RING_TRANSPORT)
            predicted["ring_hops"] = loop.ring_hops
        ds = deepspeed_config(
            model,
            cluster,
            train,
            loop.strategy,
            optimizer=optimizer,
            extra={"predicted": predicted},
        )
        ds_label = (
            f"{loop.strategy.short()} (DeepSpeed): {loop.step_time_s:.3f} s, "
            f"{loop.peak_memory_gib:.1f} GiB for the {loop.stack} stack{hops_note(loop)}, "
            f"{LOOP_RULE}" + (", ranked 1" if loop.strategy == best.strategy else "")
        )
    mega = megatron_estimate(
        model,
        cluster,
        train,
        tp_modes,
        allow_tp_across_nodes=allow_tp_across_nodes,
        interleave=interleave,
    )
    if mega is None:
        capped = dataclasses.replace(best.strategy, zero=min(best.strategy.zero, 1))
        cal = Calibration.load_default(cluster.gpu.name).replace(grad_bytes=4)
        mega = estimate(model, cluster, train, capped, cal)
    outputs = [
        ("ds_stpar.json", ds_label),
        (
            "megatron_args.txt",
            f"{mega.strategy.short()} (Megatron-LM: ZeRO <= 1, fp32 main grads): "
            f"{mega.step_time_s:.3f} s, {mega.peak_memory_gib:.1f} GiB{hops_note(mega)}"
            + ("" if mega.fits else " - does NOT fit"),
        ),
    ]
    return {
        "ds_stpar.json": json.dumps(ds, indent=2) + "\n",
        "megatron_args.txt": megatron_args_text(
            model, cluster, train, mega.strategy, optimizer, prediction=mega
        ),
        "plan.md": report_markdown(
            result,
            model,
            cluster,
            train,
            outputs=outputs,
            buckets=buckets,
            schedule=lr_schedule(model, train, optimizer),
        ),
    }


def write_files_atomically(out_dir: str | os.PathLike, files: dict[str, str]) -> list[Path]:
    """Write ``files`` (name -> text) into ``out_dir`` all-or-nothing.

    Everything is first written into a temporary directory next to ``out_dir`` (same file
    system, so renames are atomic). A new ``out_dir`` appears in one ``rename`` of that
    directory; in an existing one each file is ``os.replace``d after checking every target is
    a plain file or absent, so no replacement can fail half-way for a foreseeable reason.
    On error nothing of the new plan is left behind.
    """
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out_dir}: exists and is not a directory; choose another --out")
    for name in files:
        if (out / name).exists() and not (out / name).is_file():
            raise ConfigError(f"{out / name}: exists and is not a file; remove it first")
    anchor = out.parent
    while not anchor.exists():
        anchor = anchor.parent
    if not anchor.is_dir():
        raise ConfigError(f"{out_dir}: {anchor} is a file, not a directory")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".ds_stpar-", dir=anchor))
    except OSError as err:
        raise ConfigError(f"cannot write into {anchor}: {err.strerror}") from None
    try:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        if out.is_dir():
            for name in files:
                os.replace(tmp / name, out / name)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a plan dir is not
            out.parent.mkdir(parents=True, exist_ok=True)
            os.rename(tmp, out)
    except OSError as err:
        raise ConfigError(f"cannot write the plan to {out_dir}: {err}; nothing written") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / name for name in files]


def write_plan(
    out_dir: str | os.PathLike,
    result: SearchResult | Sequence[Estimate],
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    optimizer: OptimizerSettings | None = None,
    tp_modes: Sequence[str] = TP_MODES,
    allow_tp_across_nodes: bool | None = None,
    buckets: BucketPlan | None = None,
) -> list[Path]:
    """Write ds_stpar.json, megatron_args.txt and plan.md into ``out_dir``, all or nothing
    (``buckets``: a bucketed plan for ds_stpar.json and plan.md, :func:`plan_files`).

    All three texts are built in memory first (any rule violation raises before the disk is
    touched), then written with :func:`write_files_atomically`.
    """
    files = plan_files(
        result, model, cluster, train, optimizer, tp_modes, allow_tp_across_nodes, buckets
    )
    return write_files_atomically(out_dir, files)
