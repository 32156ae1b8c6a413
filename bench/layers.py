"""Tensor-parallel MLP blocks and transformer layers side by side on 2 GPUs (bf16, fwd+bwd).

Run (the lead sets CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron's SP backward overlap needs)::

    torchrun --nproc_per_node 2 bench/layers.py --label nvlink --out layers-nvlink.json
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node 2 bench/layers.py --label slow --out slow.json
    # subsets: --cases mlp --hidden 8192 --tokens 16K,32K --variants megatron-tp2-sp,ring
    # CPU smoke run of every code path but async-TP (gloo, tiny shapes; numbers mean nothing):
    torchrun --nproc_per_node 2 bench/layers.py --cpu --hidden 64 --head-dim 16 --tokens 64 --seq 32

Blocks: ``mlp`` is y = fc2(gelu(fc1(x))), fc1 h -> 4h, fc2 4h -> h, no bias, on T tokens.
``layer`` is one megatron-core ``TransformerLayer`` from ds_stpar's
``get_gpt_layer_stpar_spec(tp_mode)`` (LayerNorm, causal SDPA attention with head dim 128,
gelu MLP, no bias) on ``T / seq`` sequences of ``seq`` tokens (input [seq, T/seq, h]).

Variants, all in one process group of 2 ranks, each timed on its own:

- ``megatron-tp2-sp``: megatron-core ColumnParallelLinear/RowParallelLinear, TP=2,
  sequence_parallel=True: input [T/2, b, h]; all-gather before fc1, reduce-scatter after fc2,
  the mirror in backward (Megatron overlaps the re-gather and the dX reduce-scatter with GEMMs).
- ``megatron-tp2``: the same without sequence parallelism: input replicated [T, b, h];
  all-reduce after fc2 forward and of fc1's dX backward.
- ``no-comm``: the per-GPU GEMMs of TP=2 and nothing else -- fc1 h -> 2h and fc2 2h -> h on
  all T tokens (plain F.linear); for the layer a TP=1 Megatron layer of half width (heads/2,
  ffn 2h, same QKV/proj shard shapes) on all tokens. The limit perfect overlap could reach.
- ``async-tp``: MLP only. PyTorch symmetric memory (torch.ops.symm_mem): fused all-gather +
  GEMM for fc1 forward and fc2's dX, fused GEMM + reduce-scatter for fc2 forward and fc1's dX;
  fc1 keeps the gathered input for its dW (as the compiled async-TP does). "n/a" when the ops
  are missing or fail, and for the layer (no layer spec for it).
- ``ring``: ds_stpar TemporalColumnParallelLinear/TemporalRowParallelLinear, tp_mode="ring".
- ``one-gpu``: the whole block (full weights) on one GPU; both GPUs run it at once.

Measured per variant: ms/step = median over ``--repeats`` steps (CUDA events around each
step, after ``--warmup`` steps; inputs and output gradients rotate over ``--pool`` random sets),
then the max over the 2 ranks. TFLOP/s per GPU counts model FLOPs / GPUs (MLP 48 T h^2; layer
72 T h^2 + 6 T seq h, causal attention counted half; "one-gpu" divides by 1, all others by 2).
Peak GiB = torch.cuda.max_memory_allocated during the steps minus the memory allocated before
the variant's module was built (its input pool excluded): weights, gradients, activations and
Megatron's gather buffer (reset per variant); NCCL and symmetric-memory buffers are not counted.
"vs TP2+SP" = Megatron TP2+SP's ms / the variant's ms (> 1: faster).

Before timing each case, outputs are compared with Megatron TP2+SP on identical weights and
inputs (ring, async-tp, megatron-tp2): relative norm error of the output (the layer's residual
branch, output - input), the input gradient and every linear's weight gradient must be < 2e-2.
Both sides run bf16 GEMMs with fp32 accumulation, so they differ by bf16 rounding (~4e-3 per
rounding) only; a wrong block or index gives O(1).

Ring overlap calibration (MLP cases): (i) one neighbour hop of a [T/2, h] chunk alone (the
ring's own start_p2p), (ii) the chunk GEMM [T/2, h] x [h, 2h] alone, (iii) one ring step (hop
started, GEMM, wait). hop hidden = (hop + gemm - step) / hop clipped to [0, 1]: the planner's
``ring_hop_overlap``. Also the forward of the fc1 column alone: ring, Megatron AG+GEMM, async-TP
fused AG+GEMM, GEMM only, and the pass-level hidden share of the ring forward. Saved under
"ring_overlap" in --out; ring_overlap.ring_hop_overlap is the median over cases.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

TP = 2
VARIANTS = ("megatron-tp2-sp", "megatron-tp2", "no-comm", "async-tp", "ring", "one-gpu")
REFERENCE = "megatron-tp2-sp"
CHECKED = ("megatron-tp2", "ring", "async-tp")  # compared with REFERENCE before timing
CHECK_TOL = 2e-2
BLOCKS = ("mlp", "layer")
DTYPE = torch.bfloat16
INIT_STD = 0.02  # Megatron's default init_method_normal(0.02)


# ----------------------------------------------------------------------------- pure helpers


def parse_tokens(text: str) -> int:
    """'8K' / '8k' -> 8192, '32768' -> 32768."""
    text = text.strip()
    scale = 1024 if text[-1:] in "kK" and text[:-1] else 1
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) <= 0:
        raise argparse.ArgumentTypeError(f"bad token count {text!r} (use e.g. 8192 or 8K)")
    return int(digits) * scale


def parse_list(text: str, item: Callable[[str], object]) -> list:
    items = [item(part) for part in text.split(",") if part.strip()]
    if not items:
        raise argparse.ArgumentTypeError("empty list")
    return items


def parse_choices(text: str, choices: tuple[str, ...]) -> list[str]:
    items = parse_list(text, str.strip)
    bad = [item for item in items if item not in choices]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
    return items


def mlp_flops(tokens: int, hidden: int) -> float:
    """fwd+bwd model FLOPs of fc2(gelu(fc1(x))), fc1 h -> 4h: 3 x 2 GEMMs x 2 T h 4h."""
    return 12.0 * tokens * hidden * 4 * hidden


def layer_flops(tokens: int, hidden: int, seq: int) -> float:
    """fwd+bwd model FLOPs of one GPT layer (MHA, 4h gelu MLP): linears 3 x 24 T h^2; causal
    attention 3 x (QK^T + AV = 4 T seq h) / 2 (half the scores are masked)."""
    return 72.0 * tokens * hidden * hidden + 6.0 * tokens * seq * hidden


def hidden_fraction(hop: float, gemm: float, step: float) -> float:
    """Share of a hop hidden behind a concurrent GEMM: (hop + gemm - step) / hop in [0, 1]."""
    if hop <= 0:
        return 0.0
    return min(1.0, max(0.0, (hop + gemm - step) / hop))


@dataclass(frozen=True)
class Case:
    """One block at one size; ``seq`` x ``batch`` = ``tokens`` (the MLP has batch 1)."""

    block: str
    hidden: int
    tokens: int
    seq: int
    head_dim: int

    @property
    def batch(self) -> int:
        return self.tokens // self.seq

    @property
    def heads(self) -> int:
        return self.hidden // self.head_dim

    def flops(self) -> float:
        if self.block == "mlp":
            return mlp_flops(self.tokens, self.hidden)
        return layer_flops(self.tokens, self.hidden, self.seq)


def make_cases(
    blocks: list[str], hiddens: list[int], tokens: list[int], seq: int, head_dim: int
) -> list[Case]:
    """Every (block, h, T); raises ValueError naming the fix for a shape TP=2 cannot split."""
    cases = []
    for block in blocks:
        for hidden in hiddens:
            for count in tokens:
                s = count if block == "mlp" else min(seq, count)
                case = Case(block, hidden, count, s, head_dim)
                if count % s:
                    raise ValueError(f"layer: tokens {count} must be a multiple of --seq {s}")
                if s % TP:
                    raise ValueError(f"{block}: sequence length {s} must be a multiple of TP={TP}")
                if hidden % (head_dim * TP):
                    raise ValueError(
                        f"hidden {hidden} must be a multiple of head_dim x TP = {head_dim * TP}"
                    )
                cases.append(case)
    return cases


@dataclass
class Row:
    """One timed variant of one case (ms None: not run, see status/note)."""

    label: str
    block: str
    variant: str
    hidden: int
    tokens: int
    seq: int
    gpus: int
    ms: float | None = None
    tflops_per_gpu: float | None = None
    peak_gib: float | None = None
    vs_reference: float | None = None
    status: str = "ok"
    note: str = ""
    times_ms: list[float] = field(default_factory=list)


def finish_rows(rows: list[Row], flops: float) -> None:
    """Fill TFLOP/s per GPU and the speed ratio against REFERENCE (same case)."""
    ref = next((r.ms for r in rows if r.variant == REFERENCE and r.ms), None)
    for row in rows:
        if row.ms:
            row.tflops_per_gpu = flops / row.gpus / (row.ms * 1e-3) / 1e12
            row.vs_reference = ref / row.ms if ref else None


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def format_table(rows: list[Row]) -> str:
    lines = [
        "| link | block | variant | h | tokens | ms/step | TFLOP/s/GPU | peak GiB | vs TP2+SP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = _fmt(r.ms, ".2f") if r.status == "ok" else f"{r.status}: {r.note}"[:60]
        variant = f"{r.variant} ({r.note})" if r.status == "ok" and r.note else r.variant
        lines.append(
            f"| {r.label} | {r.block} | {variant} | {r.hidden} | {r.tokens} | {ms} "
            f"| {_fmt(r.tflops_per_gpu, '.0f')} | {_fmt(r.peak_gib, '.2f')} "
            f"| {_fmt(r.vs_reference, '.3f', 'x')} |"
        )
    return "\n".join(lines)


OVERLAP_COLUMNS = (
    ("hop_ms", "hop ms"),
    ("gemm_ms", "chunk GEMM ms"),
    ("step_ms", "step ms"),
    ("hop_hidden", "hop hidden"),
    ("ring_fwd_ms", "ring fwd ms"),
    ("megatron_fwd_ms", "Megatron AG+GEMM ms"),
    ("async_tp_fwd_ms", "async-TP fused ms"),
    ("gemm_only_ms", "GEMM only ms"),
    ("pass_hidden", "ring pass hidden"),
)


def format_overlap(cases: list[dict]) -> str:
    head = "| link | h | tokens | " + " | ".join(title for _, title in OVERLAP_COLUMNS) + " |"
    lines = [head, "|" + "---|" * (3 + len(OVERLAP_COLUMNS))]
    for c in cases:
        cells = []
        for key, _ in OVERLAP_COLUMNS:
            spec = ".2f" if key.endswith("hidden") else ".3f"
            cells.append(_fmt(c.get(key), spec))
        lines.append(
            f"| {c['label']} | {c['hidden']} | {c['tokens']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def format_checks(checks: list[dict]) -> str:
    lines = ["| link | block | h | tokens | variant | max rel. error | worst tensor | result |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for c in checks:
        lines.append(
            f"| {c['label']} | {c['block']} | {c['hidden']} | {c['tokens']} | {c['variant']} "
            f"| {_fmt(c.get('max_error'), '.2e')} | {c.get('worst', '')} | {c['result']} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- runtime


@dataclass
class Runtime:
    """This rank's device, groups and timing settings."""

    device: torch.device
    rank: int
    tp_group: dist.ProcessGroup
    solo_group: dist.ProcessGroup
    warmup: int
    repeats: int
    pool: int
    label: str

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reduce(self, values: list[float], op=dist.ReduceOp.MAX) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op, group=self.tp_group)
        return t.tolist()

    def all_ok(self, ok: bool) -> bool:
        return self.reduce([1.0 if ok else 0.0], dist.ReduceOp.MIN)[0] == 1.0

    def time_ms(self, step: Callable[[int], None], repeats: int | None = None) -> list[float]:
        """Per-step milliseconds of ``step(i)`` after warm-up (CUDA events; CPU: wall clock)."""
        repeats = repeats or self.repeats
        for i in range(self.warmup):
            step(i)
        self.sync()
        self.reduce([0.0])  # both ranks start the timed steps together
        self.sync()
        if not self.cuda:
            times = []
            for i in range(repeats):
                start = time.perf_counter()
                step(self.warmup + i)
                times.append((time.perf_counter() - start) * 1e3)
            return times
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for i, (start, end) in enumerate(events):
            start.record()
            step(self.warmup + i)
            end.record()
        torch.cuda.synchronize(self.device)
        return [start.elapsed_time(end) for start, end in events]

    def median_ms(self, step: Callable[[int], None], repeats: int | None = None) -> float:
        """Median step time, the slower rank's."""
        return self.reduce([statistics.median(self.time_ms(step, repeats))])[0]

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else 0

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def randn(self, shape: tuple[int, ...], seed: int, scale: float = 1.0) -> Tensor:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        out = torch.randn(shape, generator=gen, device=self.device, dtype=DTYPE)
        return out.mul_(scale) if scale != 1.0 else out


def reset_megatron_buffer() -> None:
    """Drop Megatron's persistent SP all-gather buffer, so each variant allocates its own."""
    from megatron.core import parallel_state

    parallel_state.destroy_global_memory_buffer()
    parallel_state._set_global_memory_buffer()


# ----------------------------------------------------------------------------- modules


class MLPBlock(torch.nn.Module):
    """y = fc2(gelu(fc1(x))); fc1/fc2 return (output, bias) as Megatron's linears do."""

    def __init__(self, fc1: torch.nn.Module, fc2: torch.nn.Module):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x: Tensor) -> Tensor:
        hidden, _ = self.fc1(x)
        out, _ = self.fc2(F.gelu(hidden))
        return out


class PlainLinear(torch.nn.Module):
    """F.linear with an [out, in] weight and no communication; returns (y, None)."""

    def __init__(self, out_features: int, in_features: int, device: torch.device):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=DTYPE)
        )

    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        return F.linear(x, self.weight), None


class _AsyncTPColumn(torch.autograd.Function):
    """forward: y [s, b, N/P] = AG(x_shard_m [s/P, b, K]) W^T, the all-gather fused with the
    GEMM; backward: dX = RS(dY W) fused, dW = dY^T AG(x) from the saved gathered input."""

    @staticmethod
    def forward(ctx, x_shard_m: Tensor, w_shard_n: Tensor, group_name: str) -> Tensor:
        x_tokens = x_shard_m.reshape(-1, x_shard_m.shape[-1])
        x_gathered, outs = torch.ops.symm_mem.fused_all_gather_matmul(
            x_tokens, [w_shard_n.t()], 0, group_name
        )
        ctx.save_for_backward(x_gathered, w_shard_n)
        ctx.group_name, ctx.x_shape = group_name, x_shard_m.shape
        return outs[0].view(-1, *x_shard_m.shape[1:-1], w_shard_n.shape[0])

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        x_gathered, w_shard_n = ctx.saved_tensors
        dy_tokens = grad_output.reshape(-1, w_shard_n.shape[0]).contiguous()
        dx_tokens = torch.ops.symm_mem.fused_matmul_reduce_scatter(
            dy_tokens, w_shard_n, "sum", 0, ctx.group_name
        )
        return dx_tokens.view(ctx.x_shape), dy_tokens.t() @ x_gathered, None


class _AsyncTPRow(torch.autograd.Function):
    """forward: y [s/P, b, N] = RS(x_shard_k [s, b, K/P] W^T) fused; backward: dX = AG(dY) W
    fused, dW = AG(dY)^T x."""

    @staticmethod
    def forward(ctx, x_shard_k: Tensor, w_shard_k: Tensor, group_name: str) -> Tensor:
        x_tokens = x_shard_k.reshape(-1, x_shard_k.shape[-1])
        y_tokens = torch.ops.symm_mem.fused_matmul_reduce_scatter(
            x_tokens, w_shard_k.t(), "sum", 0, group_name
        )
        ctx.save_for_backward(x_shard_k, w_shard_k)
        ctx.group_name = group_name
        return y_tokens.view(-1, *x_shard_k.shape[1:-1], w_shard_k.shape[0])

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        x_shard_k, w_shard_k = ctx.saved_tensors
        dy_tokens = grad_output.reshape(-1, w_shard_k.shape[0]).contiguous()
        dy_gathered, outs = torch.ops.symm_mem.fused_all_gather_matmul(
            dy_tokens, [w_shard_k], 0, ctx.group_name
        )
        dw = dy_gathered.t() @ x_shard_k.reshape(-1, x_shard_k.shape[-1])
        return outs[0].view(x_shard_k.shape), dw, None


class AsyncTPLinear(torch.nn.Module):
    """Column ([N/P, K] weight) or row ([N, K/P]) linear through symmetric-memory fused ops."""

    def __init__(self, shape: tuple[int, int], column: bool, group_name: str, device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(shape, device=device, dtype=DTYPE))
        self.function = _AsyncTPColumn if column else _AsyncTPRow
        self.group_name = group_name

    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        return self.function.apply(x, self.weight, self.group_name), None


def symm_mem_group_name(group: dist.ProcessGroup) -> str:
    """The group's name with symmetric memory enabled (a no-op on torch versions that
    deprecated the call); raises where the fused ops do not exist."""
    if not torch.cuda.is_available():
        raise RuntimeError("async-TP needs CUDA")
    import torch.distributed._symmetric_memory as symm_mem

    for op in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
        if not hasattr(torch.ops.symm_mem, op):
            raise RuntimeError(f"torch.ops.symm_mem.{op} is missing in torch {torch.__version__}")
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(group.group_name)
    return group.group_name


# ----------------------------------------------------------------------------- building


@dataclass
class Built:
    """A variant ready to step: ``forward(x) -> y`` over ``module``'s parameters."""

    module: torch.nn.Module
    forward: Callable[[Tensor], Tensor]
    sp_input: bool  # input [s/2, b, h] (sequence parallel) or the full [s, b, h]


def _config(case: Case, tp: int, tp_mode: str, sp: bool, init: bool, half_width: bool = False):
    """TransformerConfig for ``case`` through the project's builder (dropout off, no bias,
    LayerNorm, gelu). ``half_width``: a TP=1 model with one TP=2 rank's shapes."""
    from ds_stpar.config import Layout, ModelSpec, Strategy
    from ds_stpar.integrations.megatron import transformer_config

    heads = case.heads // TP if half_width else case.heads
    ffn = 4 * case.hidden // TP if half_width else 4 * case.hidden
    model = ModelSpec(
        f"bench-{case.hidden}",
        1,
        case.hidden,
        heads,
        vocab_size=1024,
        ffn_hidden_size=ffn,
        kv_channels=case.head_dim,
        add_bias_linear=False,
    )
    strategy = Strategy(Layout(tp=tp, tp_mode=tp_mode), sequence_parallel=sp)
    return transformer_config(model, strategy, "bf16", perform_initialization=init)


def _pg_collection(tp_group: dist.ProcessGroup):
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "cp"])
    pgs.tp = tp_group
    return pgs


def build_mlp(variant: str, case: Case, rt: Runtime, async_name: str | None) -> Built:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from ds_stpar.layers import TemporalColumnParallelLinear, TemporalRowParallelLinear

    h, group = case.hidden, rt.tp_group
    if variant in ("megatron-tp2-sp", "megatron-tp2", "ring"):
        sp = variant != "megatron-tp2"
        mode = "ring" if variant == "ring" else "megatron"
        cfg = _config(case, TP, mode, sp, init=False)
        column, row = (
            (TemporalColumnParallelLinear, TemporalRowParallelLinear)
            if variant == "ring"
            else (ColumnParallelLinear, RowParallelLinear)
        )
        extra = {"tp_mode": "ring"} if variant == "ring" else {}
        fc1 = column(
            h,
            4 * h,
            config=cfg,
            init_method=cfg.init_method,
            bias=False,
            gather_output=False,
            tp_group=group,
            **extra,
        )
        fc2 = row(
            4 * h,
            h,
            config=cfg,
            init_method=cfg.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=group,
            **extra,
        )
        block = MLPBlock(fc1, fc2).to(rt.device)
        return Built(block, block, sp)
    if variant == "async-tp":
        if async_name is None:
            raise RuntimeError("symmetric memory unavailable")
        fc1 = AsyncTPLinear((4 * h // TP, h), True, async_name, rt.device)
        fc2 = AsyncTPLinear((h, 4 * h // TP), False, async_name, rt.device)
        block = MLPBlock(fc1, fc2)
        return Built(block, block, True)
    width = 4 * h // TP if variant == "no-comm" else 4 * h
    block = MLPBlock(PlainLinear(width, h, rt.device), PlainLinear(h, width, rt.device))
    return Built(block, block, False)


def build_layer(variant: str, case: Case, rt: Runtime, init: bool = False) -> Built:
    from megatron.core.transformer.spec_utils import build_module

    from ds_stpar.layers.megatron_spec import get_gpt_layer_stpar_spec

    if variant == "async-tp":
        raise NotImplementedError("async-tp is benchmarked on the MLP block only")
    if variant in ("no-comm", "one-gpu"):
        cfg = _config(case, 1, "megatron", False, init, half_width=variant == "no-comm")
        mode, group, sp = "megatron", rt.solo_group, False
    else:
        mode = "ring" if variant == "ring" else "megatron"
        sp = variant != "megatron-tp2"
        cfg = _config(case, TP, mode, sp, init)
        group = rt.tp_group
    layer = build_module(
        get_gpt_layer_stpar_spec(mode),
        config=cfg,
        layer_number=1,
        pg_collection=_pg_collection(group),
    ).to(rt.device)
    return Built(layer, lambda x: layer(x, attention_mask=None)[0], sp)


def build(variant: str, case: Case, rt: Runtime, async_name: str | None) -> Built:
    if case.block == "mlp":
        return build_mlp(variant, case, rt, async_name)
    return build_layer(variant, case, rt)


def make_source(case: Case, rt: Runtime, full: bool) -> dict[str, Tensor]:
    """This rank's weights for a case: TP=2 shards (shared by every variant but one-gpu) or,
    with ``full``, the unsharded weights of the one-GPU block."""
    seed = 10_000 * (case.hidden // 64) + case.tokens // 64 + 97 * rt.rank + (7 if full else 0)
    if case.block == "mlp":
        width = 4 * case.hidden // (1 if full else TP)
        return {
            "fc1.weight": rt.randn((width, case.hidden), seed, INIT_STD),
            "fc2.weight": rt.randn((case.hidden, width), seed + 1, INIT_STD),
        }
    torch.manual_seed(seed)
    built = build_layer("one-gpu" if full else REFERENCE, case, rt, init=True)
    return {name: p.detach().clone() for name, p in built.module.named_parameters()}


def load(built: Built, source: dict[str, Tensor]) -> None:
    with torch.no_grad():
        for name, param in built.module.named_parameters():
            if name not in source or source[name].shape != param.shape:
                got = tuple(source[name].shape) if name in source else None
                raise RuntimeError(f"no source weight for {name} {tuple(param.shape)} (got {got})")
            param.copy_(source[name])


def run_step(built: Built, x: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    """One forward+backward from fresh gradients; returns (input leaf, output)."""
    for param in built.module.parameters():
        param.grad = None
    x = x.detach().requires_grad_()
    out = built.forward(x)
    out.backward(dy)
    return x, out


def shapes(case: Case, sp: bool) -> tuple[int, int, int]:
    return (case.seq // TP if sp else case.seq, case.batch, case.hidden)


# ----------------------------------------------------------------------------- checking


def check_results(case: Case, built: Built, x_full: Tensor, dy_full: Tensor, rt: Runtime):
    """Output (the residual branch for the layer), input grad and linear weight grads, in
    the sequence-parallel layout (this rank's token chunk) whatever the variant's input."""
    x, dy = x_full, dy_full
    if built.sp_input:
        x, dy = x_full.chunk(TP, dim=0)[rt.rank], dy_full.chunk(TP, dim=0)[rt.rank]
    leaf, out = run_step(built, x, dy)
    branch = out.detach().float()
    if case.block == "layer":
        branch = branch - leaf.detach().float()
    results = {"output": branch, "input grad": leaf.grad}
    if not built.sp_input:
        results = {k: v.chunk(TP, dim=0)[rt.rank] for k, v in results.items()}
    for name, param in built.module.named_parameters():
        if "layernorm" not in name:  # SP norms hold partial grads, non-SP full ones
            results[f"grad {name}"] = param.grad
    return results


def squared_norms(ref: dict[str, Tensor], got: dict[str, Tensor]) -> list[float]:
    """[||got - ref||^2, ||ref||^2] per tensor (sorted names) of this rank's shards."""
    sums = []
    for name in sorted(ref):
        a, b = got[name].float(), ref[name].float()
        sums += [(a - b).pow(2).sum().item(), b.pow(2).sum().item()]
    return sums


def relative_errors(names: list[str], sums: list[float]) -> dict[str, float]:
    """||got - ref|| / ||ref|| per tensor from the squared norms summed over the ranks."""
    return {
        n: math.sqrt(sums[2 * i] / sums[2 * i + 1]) if sums[2 * i + 1] > 0 else math.inf
        for i, n in enumerate(names)
    }


def run_checks(case, rt, variants, async_name, source) -> tuple[list[dict], set[str]]:
    """Compare every checked variant with REFERENCE; returns (check rows, failed variants)."""
    full = (case.seq, case.batch, case.hidden)
    x_full = rt.randn(full, 1)  # same seed on both ranks: the same global input
    dy_full = rt.randn(full, 2)
    checks, failed, built, error = [], set(), None, "failed on the other rank"
    try:
        built = build(REFERENCE, case, rt, async_name)
        load(built, source)
        ref = check_results(case, built, x_full, dy_full, rt)
        ok = True
    except Exception as err:
        traceback.print_exc()
        ok, error = False, f"{type(err).__name__}: {err}"[:300]
    built = None
    if not rt.all_ok(ok):  # nothing to compare with; the timings still run
        row = {"label": rt.label, "block": case.block, "hidden": case.hidden}
        row.update(tokens=case.tokens, variant=REFERENCE, result="ERROR", error=error)
        return [row], set()
    for variant in [v for v in CHECKED if v in variants]:
        if variant == "async-tp" and (case.block == "layer" or async_name is None):
            continue
        row = {"label": rt.label, "block": case.block, "hidden": case.hidden}
        row.update(tokens=case.tokens, variant=variant)
        sums, built = [], None
        try:
            built = build(variant, case, rt, async_name)
            load(built, source)
            sums = squared_norms(ref, check_results(case, built, x_full, dy_full, rt))
            ok = True
        except Exception as err:
            traceback.print_exc()
            row["error"] = f"{type(err).__name__}: {err}"[:300]
            ok = False
        built = None
        rt.free()
        if not rt.all_ok(ok):  # collectives only after both ranks agree
            row["result"] = "ERROR"
            failed.add(variant)
        else:
            errors = relative_errors(sorted(ref), rt.reduce(sums, dist.ReduceOp.SUM))
            worst = max(errors, key=errors.get)
            row.update(errors=errors, max_error=errors[worst], worst=worst)
            row["result"] = "PASS" if errors[worst] < CHECK_TOL else "FAIL"
        checks.append(row)
    ref = None
    rt.free()
    return checks, failed


# ----------------------------------------------------------------------------- timing


def time_variant(variant: str, case: Case, rt: Runtime, async_name, source) -> Row:
    gpus = 1 if variant == "one-gpu" else TP
    row = Row(rt.label, case.block, variant, case.hidden, case.tokens, case.seq, gpus)
    ok, note = True, ""
    try:
        sp = variant in ("megatron-tp2-sp", "ring", "async-tp")
        shape = shapes(case, sp)
        seed = 1000 * (rt.rank + 1)
        xs = [rt.randn(shape, seed + i) for i in range(rt.pool)]
        dys = [rt.randn(shape, seed + 100 + i) for i in range(rt.pool)]
        reset_megatron_buffer()
        rt.free()
        rt.sync()
        base = rt.allocated()
        built = build(variant, case, rt, async_name)
        if built.sp_input != sp:
            raise RuntimeError(f"{variant}: input layout mismatch (sequence parallel {sp})")
        load(built, source)
        rt.reset_peak()
        times = rt.time_ms(lambda i: run_step(built, xs[i % rt.pool], dys[i % rt.pool]))
        rt.sync()
        peak = rt.peak() - base
    except Exception as err:
        traceback.print_exc()
        ok, note = False, f"{type(err).__name__}: {err}"[:300]
    built = xs = dys = None
    rt.free()
    if not rt.all_ok(ok):
        row.status, row.note = "failed", note or "failed on the other rank"
        return row
    median, peak_max = rt.reduce([statistics.median(times), peak / 2**30])
    row.ms, row.peak_gib, row.times_ms = median, peak_max if rt.cuda else None, times
    return row


def ring_overlap(case: Case, rt: Runtime, async_name: str | None, source) -> dict:
    """Hop / chunk GEMM / ring step of the fc1 column forward, and the whole column forward
    of ring, Megatron (AG + GEMM), async-TP (fused) and the GEMM alone."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from ds_stpar.layers import TemporalColumnParallelLinear
    from ds_stpar.layers.comm import Message, start_p2p

    h, rows, group = case.hidden, case.tokens // TP, rt.tp_group
    weight = source["fc1.weight"]  # [4h/2, h]
    xs = [rt.randn((rows, h), 5000 + 10 * rt.rank + i) for i in range(rt.pool)]
    recv = torch.empty_like(xs[0])
    out = torch.empty(rows, weight.shape[0], device=rt.device, dtype=DTYPE)
    peer = (rt.rank + 1) % TP  # with P=2 the left and the right neighbour are the same rank
    repeats = max(2 * rt.repeats, 20)  # forward-only ops of a few ms: more repeats

    def hop(i: int):
        return start_p2p([Message(xs[i % rt.pool], peer)], [Message(recv, peer)], group)

    def gemm(i: int) -> None:
        torch.mm(xs[i % rt.pool], weight.t(), out=out)

    def step(i: int) -> None:
        pending = hop(i)
        gemm(i)
        pending.wait()

    result = {"label": rt.label, "hidden": h, "tokens": case.tokens}
    result["hop_ms"] = rt.median_ms(lambda i: hop(i).wait(), repeats)
    result["gemm_ms"] = rt.median_ms(gemm, repeats)
    result["step_ms"] = rt.median_ms(step, repeats)
    result["hop_hidden"] = hidden_fraction(result["hop_ms"], result["gemm_ms"], result["step_ms"])

    cfg_ring = _config(case, TP, "ring", True, init=False)
    cfg_meg = _config(case, TP, "megatron", True, init=False)
    x3 = [x.view(rows, 1, h) for x in xs]
    full = torch.cat([xs[0]] * TP)
    columns = {
        "ring_fwd_ms": TemporalColumnParallelLinear(
            h, 4 * h, config=cfg_ring, init_method=cfg_ring.init_method, bias=False,
            tp_group=group, tp_mode="ring",
        ),
        "megatron_fwd_ms": ColumnParallelLinear(
            h, 4 * h, config=cfg_meg, init_method=cfg_meg.init_method, bias=False,
            gather_output=False, tp_group=group,
        ),
    }  # fmt: skip
    with torch.no_grad():
        for key in list(columns):
            column = columns.pop(key).to(rt.device)
            column.weight.copy_(weight)
            result[key] = rt.median_ms(lambda i, c=column: c(x3[i % rt.pool]), repeats)
            column = None
        result["gemm_only_ms"] = rt.median_ms(lambda i: torch.mm(full, weight.t()), repeats)
        result["async_tp_fwd_ms"] = None
        if async_name is not None:
            ok, value = True, 0.0
            try:
                value = rt.median_ms(
                    lambda i: torch.ops.symm_mem.fused_all_gather_matmul(
                        xs[i % rt.pool], [weight.t()], 0, async_name
                    ),
                    repeats,
                )
            except Exception:
                traceback.print_exc()
                ok = False
            if rt.all_ok(ok):
                result["async_tp_fwd_ms"] = value
    # The ring forward is P chunk GEMMs and P-1 hops; serial it would take P g + (P-1) hop.
    serial = TP * result["gemm_ms"] + (TP - 1) * result["hop_ms"]
    exposed = result["ring_fwd_ms"] - TP * result["gemm_ms"]
    result["pass_hidden"] = hidden_fraction((TP - 1) * result["hop_ms"], 0.0, exposed)
    result["pass_serial_ms"] = serial
    xs = recv = out = full = x3 = None
    rt.free()
    return result


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=lambda t: parse_choices(t, BLOCKS), default=list(BLOCKS))
    parser.add_argument("--hidden", type=lambda t: parse_list(t, int), default=[4096, 8192])
    parser.add_argument(
        "--tokens", type=lambda t: parse_list(t, parse_tokens), default=[8192, 16384, 32768]
    )
    parser.add_argument(
        "--variants", type=lambda t: parse_choices(t, VARIANTS), default=list(VARIANTS)
    )
    parser.add_argument("--seq", type=int, default=4096, help="layer sequence length")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--pool", type=int, default=3, help="rotating input sets")
    parser.add_argument("--label", default=None, help="tag for the rows (default: from env)")
    parser.add_argument("--out", default=None, help="write rows, checks, ring_overlap (JSON)")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    parser.add_argument("--no-overlap", action="store_true", help="skip the ring calibration")
    parser.add_argument(
        "--timeout", type=int, default=180, help="seconds before a hung NCCL op aborts"
    )
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU (smoke test only)")
    args = parser.parse_args(argv)
    if min(args.repeats, args.pool, args.seq, args.head_dim) < 1 or args.warmup < 0:
        parser.error("--repeats, --pool, --seq, --head-dim must be >= 1 and --warmup >= 0")
    try:
        args.case_list = make_cases(args.cases, args.hidden, args.tokens, args.seq, args.head_dim)
    except ValueError as err:
        parser.error(str(err))
    if REFERENCE not in args.variants:
        args.variants.insert(0, REFERENCE)  # the checks and ratios need it
    if args.label is None:
        args.label = "p2p-off" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "default"
    return args


def init_runtime(args: argparse.Namespace) -> Runtime:
    from megatron.core import parallel_state, tensor_parallel

    from ds_stpar.config import Layout
    from ds_stpar.parallel import GroupCache

    timeout = timedelta(seconds=args.timeout)
    if args.cpu:
        from ds_stpar.integrations import megatron_cpu

        megatron_cpu.apply()
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench/layers.py needs CUDA GPUs (or --cpu for a smoke run)")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout)
    if dist.get_world_size() != TP:
        raise SystemExit(f"run with exactly {TP} processes (got {dist.get_world_size()})")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=TP,
        distributed_timeout_minutes=max(1, args.timeout // 60),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    solo = GroupCache().get(Layout(tp=TP)).self_group
    return Runtime(
        device=device,
        rank=dist.get_rank(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        solo_group=solo,
        warmup=args.warmup,
        repeats=args.repeats,
        pool=args.pool,
        label=args.label,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rt = init_runtime(args)
    lead = rt.rank == 0
    async_name = None
    if "async-tp" in args.variants:
        try:
            async_name = symm_mem_group_name(rt.tp_group)
        except Exception as err:
            print(f"rank {rt.rank}: async-tp n/a: {type(err).__name__}: {err}", flush=True)
        if not rt.all_ok(async_name is not None):
            async_name = None
    header = {
        "label": rt.label,
        "card": torch.cuda.get_device_name(rt.device) if rt.cuda else "cpu",
        "world": dist.get_world_size(),
        "torch": torch.__version__,
        "megatron_core": _megatron_version(),
        "env": {
            k: os.environ.get(k)
            for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_P2P_DISABLE", "NCCL_NVLS_ENABLE")
        },
        "args": {k: v for k, v in vars(args).items() if k != "case_list"},
    }
    if lead:
        print(json.dumps(header), flush=True)
    rows: list[Row] = []
    checks: list[dict] = []
    overlap: list[dict] = []
    order = [v for v in VARIANTS if v in args.variants and v != "async-tp"]
    if "async-tp" in args.variants:
        order.append("async-tp")  # last: a symmetric-memory failure cannot disturb the others
    for case in args.case_list:
        source = make_source(case, rt, full=False)
        failed: set[str] = set()
        wrong: set[str] = set()
        if not args.no_check:
            case_checks, failed = run_checks(case, rt, args.variants, async_name, source)
            checks += case_checks
            wrong = {c["variant"] for c in case_checks if c["result"] == "FAIL"}
            if lead:
                print(format_checks(case_checks), flush=True)
            if "async-tp" in failed:
                async_name = None
        case_rows = []
        for variant in order:
            row = Row(rt.label, case.block, variant, case.hidden, case.tokens, case.seq, TP)
            if variant == "async-tp" and (case.block == "layer" or async_name is None):
                row.status, row.note = "n/a", "MLP only" if case.block == "layer" else "unavailable"
            elif variant in failed:
                row.status, row.note = "n/a", "check raised an error"
            else:
                weights = source
                if variant == "one-gpu":
                    weights = make_source(case, rt, full=True)
                row = time_variant(variant, case, rt, async_name, weights)
                weights = None
                if variant in wrong and row.status == "ok":
                    row.note = "check FAIL"
            case_rows.append(row)
            if lead:
                print(
                    json.dumps({k: v for k, v in asdict(row).items() if k != "times_ms"}),
                    flush=True,
                )
        finish_rows(case_rows, case.flops())
        rows += sorted(case_rows, key=lambda r: VARIANTS.index(r.variant))
        if case.block == "mlp" and "ring" in args.variants and not args.no_overlap:
            result, ok = None, True
            try:
                result = ring_overlap(case, rt, async_name, source)
            except Exception:
                traceback.print_exc()
                ok = False
            if rt.all_ok(ok):
                overlap.append(result)
                if lead:
                    print(format_overlap(overlap[-1:]), flush=True)
        source = None
        rt.free()
        if lead and args.out:
            _write(args.out, header, rows, checks, overlap)
    if lead:
        print(f"\n## {rt.label}: {header['card']} x {header['world']}, bf16, fwd+bwd per step\n")
        print(format_table(rows))
        if checks:
            print("\n## correctness vs " + REFERENCE + f" (relative norm error < {CHECK_TOL})\n")
            print(format_checks(checks))
        if overlap:
            median = _median_hidden(overlap)
            print(f"\n## ring overlap calibration (median hop hidden = {median:.3f})\n")
            print(format_overlap(overlap))
        if args.out:
            _write(args.out, header, rows, checks, overlap)
            print(f"\nwrote {args.out}")
    dist.destroy_process_group()


def _median_hidden(overlap: list[dict]) -> float | None:
    return statistics.median(c["hop_hidden"] for c in overlap) if overlap else None


def _megatron_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def _write(path: str, header: dict, rows: list[Row], checks: list[dict], overlap) -> None:
    data = {
        **header,
        "rows": [asdict(r) for r in rows],
        "checks": checks,
        "ring_overlap": {
            "label": header["label"],
            "ring_hop_overlap": _median_hidden(overlap),
            "cases": overlap,
        },
    }
    with open(path, "w") as handle:
        json.dump(data, handle, indent=1)


if __name__ == "__main__":
    main()
