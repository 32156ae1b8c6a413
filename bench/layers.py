"""Tensor-parallel MLP blocks and transformer layers side by side on P GPUs (bf16, fwd+bwd).

P is the world size (2, 4, 8, ...): every tensor-parallel variant runs in one TP group of all
P ranks. Run (the lead sets CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron's SP backward overlap
needs)::

    torchrun --nproc_per_node 4 bench/layers.py --label nvlink --out layers-nvlink.json
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node 4 bench/layers.py --label slow --out slow.json
    # the interleaved layer's transfers by the copy engines through host memory
    # (ds_stpar.layers.host_staged) need more than one hardware queue, where Megatron's
    # overlap wants one: time them in a run of their own and compare with the run above
    NCCL_P2P_DISABLE=1 CUDA_DEVICE_MAX_CONNECTIONS=8 torchrun --nproc_per_node 2 bench/layers.py \
        --cases layer --variants megatron-sp,ring-interleaved --label staged
    # subsets: --cases mlp --hidden 8192 --tokens 16K,32K --variants megatron-sp,ring,cannon
    # GPU timelines of one step per variant, for bench/timeline.py: --trace-dir DIR
    # host time per Python function (small shapes, host-bound), for bench/hoststats.py:
    #   --host-trace DIR
    # what is alive at each variant's peak (bench/memtrace.py), in the JSON rows: --memory-trace
    # every variant's GEMMs through cuBLASLt planned for all SMs but N: --sm-carveout N
    # CPU smoke run of every code path but async-TP (gloo, tiny shapes; numbers mean nothing):
    torchrun --nproc_per_node 4 bench/layers.py --cpu --hidden 64 --head-dim 16 --tokens 64 --seq 32

Blocks: ``mlp`` is y = fc2(gelu(fc1(x))), fc1 h -> 4h, fc2 4h -> h, no bias, on T tokens.
``layer`` is one megatron-core ``TransformerLayer`` from ds_stpar's
``get_gpt_layer_stpar_spec(tp_mode)`` (LayerNorm, causal SDPA attention with head dim 128,
gelu MLP, no bias) on ``T / seq`` sequences of ``seq`` tokens (input [seq, T/seq, h]).
``--layers N`` (N > 1) makes it a megatron-core ``TransformerBlock`` of N such layers (no final
norm), as a model's stage runs them: the rows say ``layer xN``, ms and peak are the block's,
TFLOP/s counts N layers. Interleaved layers then hand their pieces in flight from layer to
layer (``ds_stpar.layers.interleave``: only the block's first gather and last reduction stay
exposed); every other variant runs its layers one after the other as alone.

Variants (named for any P; before P was general they were ``megatron-tp2-sp`` and
``megatron-tp2``, the names in older JSON, still accepted by --variants), each timed on its own:

- ``megatron-sp`` (the reference): megatron-core ColumnParallelLinear/RowParallelLinear, TP=P,
  sequence_parallel=True: input [T/P, b, h]; all-gather before fc1, reduce-scatter after fc2,
  the mirror in backward (Megatron overlaps the re-gather and the dX reduce-scatter with GEMMs).
- ``megatron``: the same without sequence parallelism: input replicated [T, b, h];
  all-reduce after fc2 forward and of fc1's dX backward.
- ``no-comm``: the per-GPU GEMMs of TP=P and nothing else -- fc1 h -> 4h/P and fc2 4h/P -> h
  on all T tokens (plain F.linear); for the layer a TP=1 Megatron layer of 1/P width (heads/P,
  ffn 4h/P, same QKV/proj shard shapes) on all tokens. The limit perfect overlap could reach.
- ``async-tp``: MLP only. PyTorch symmetric memory (torch.ops.symm_mem, any group size):
  fused all-gather + GEMM for fc1 forward and fc2's dX, fused GEMM + reduce-scatter for fc2
  forward and fc1's dX; fc1 keeps the gathered input for its dW (as the compiled async-TP
  does). "n/a" when the ops are missing or fail, and for the layer (no layer spec for it).
- ``ring``: ds_stpar's ring as its Megatron spec runs it: the MLP block as one fused ring pass
  (``ds_stpar.layers.ring_mlp``, what ``StparMLP`` runs, with the closed-form gelu it passes;
  before the twentieth session the block passed a plain ``F.gelu``), the layer's QKV /
  projection as TemporalColumnParallelLinear / TemporalRowParallelLinear with tp_mode="ring".
- ``ring-linear``: fc1's and fc2's ring passes one after the other, in one node that saves
  fc1's output A only and recomputes the activation (``ring_two_pass_mlp``), as ``StparMLP``
  runs them: the layer from the spec with ``fused_ring_mlp=False``.
- ``ring-interleaved``, ``ring-interleaved-4``: layer only.
  ``get_gpt_layer_stpar_spec("ring", interleave=k)``, k = 2 / 4:
  :class:`~ds_stpar.layers.interleave.InterleavedTransformerLayer` runs k pieces of the batch
  (T / seq sequences; "n/a" when k does not divide them) interleaved, each piece's gathers and
  reductions behind the other pieces' attention or MLP; the linears' GEMMs run locally.
- ``cannon``: the same layers with tp_mode="cannon" (a q x q torus, P = q*q; "n/a (P not a
  square)" for P = 2, 8). Same boundary layouts as Megatron SP (column [s/P, b, K] ->
  [s, b, N/P], row [s, b, K/P] -> [s/P, b, N]); the re-layouts to and from the torus blocks
  are inside the layers. The layer: ``get_gpt_layer_stpar_spec("cannon", tp_group)``.
- ``one-gpu``: the whole block (full weights) on one GPU; all P GPUs run it at once.

Weights. Every case has one set of *full* weights W [out, in] (deterministic seeds, the same on
every rank; linear weights N(0, 1/in), see make_full_weights; for the layer the weights of a
TP=1 layer, whose QKV rows are the concatenation of Megatron's per-rank QKV shards, so W is the
Megatron-ordered global weight W' of ds_stpar/layers/linear.py). Each variant takes its own
block of it: Megatron, ring, async-tp and no-comm rank d the slice d of P along the partition
dim (column: rows, row: columns); Cannon rank (r, c) the block its layer declares in
``weight.stpar_shard_offsets``, W[NB_c, KB_(r+c)%q] ([out/q, in/q]); one-gpu all of W; norm
weights are replicated.

Measured per variant: ms/step = median over ``--repeats`` steps (CUDA events around each
step, after ``--warmup`` steps; inputs and output gradients rotate over ``--pool`` random sets),
then the max over the P ranks. TFLOP/s per GPU counts model FLOPs / GPUs (MLP 48 T h^2; layer
72 T h^2 + 6 T seq h, causal attention counted half; "one-gpu" divides by 1, all others by P).
Peak GiB (per GPU, the max over the ranks) = torch.cuda.max_memory_allocated during the steps
minus the memory allocated before the variant's module was built (its input pool and the full
weights excluded): weights, gradients, activations and Megatron's gather buffer (reset per
variant); NCCL's buffers, async-tp's symmetric memory and cuBLAS's workspaces are not counted
(the workspaces, one per stream a GEMM ran on, are freed before each variant and the ones its
steps allocated subtracted: a process pays them once, not per layer; the JSON rows give them
as ``gemm_workspaces_mib``), the ring's copy-engine buffer (``ds_stpar.layers.symmetric``,
where ``DS_STPAR_RING_TRANSPORT`` takes it) is, added to the ring variants' peaks.
"vs megatron-sp" = megatron-sp's ms / the variant's ms (> 1: faster). Host ms (the max over
the ranks) = the median over the timed steps of the host's time in a step's calls. Where it
nears ms/step, either the host sets the pace or the host waited for the GPU inside the
step: a full launch queue, or the ring hops' in-flight bound (``comm.MAX_IN_FLIGHT``, which
``start_ring_hop`` and ``ring_pass`` wait on; ``async_comm``'s transfers have none). A case
where the same code's host ms stays well under its ms/step shows the queue did not fill.

``--shared-gpu`` (a machine with one GPU): every rank on GPU 0 in a gloo world, each its own
process and CUDA context, ``DS_STPAR_TRANSFER_TRANSPORT=host-staged`` (the layers' transfers
and ring hops through host memory; Megatron's collectives go over gloo's CUDA support,
hundreds of ms a step), each timed step synchronised so that no step's host time waits for
an earlier step's GPU work: each rank measures its own peak and host ms (the table: the
max over the ranks); ms/step measures nothing (the ranks share one GPU).

Before timing each case, every variant that computes the global function (megatron, ring,
cannon, one-gpu, async-tp) is compared with megatron-sp on the same full weights and the same
global input: relative norm error, over all ranks, of the output (the layer's residual branch,
output - input) and the input gradient, both in this rank's sequence-parallel chunk, and of
every linear's weight gradient, each rank's block against the same block of megatron-sp's
gradient gathered to full-weight coordinates; must be < 2e-2. Both sides run bf16 GEMMs with
fp32 accumulation, so they differ by bf16 roundings (~4e-3 each: ring and Cannon round their
partial sums to bf16 between steps) only; a wrong block or index gives O(1).

Ring overlap calibration (MLP cases): (i) one ring hop of a [T/P, h] chunk alone (the ring's own
start_p2p: send to rank d-1, receive from d+1), (ii) the chunk GEMM [T/P, h] x [h, 4h/P] alone,
(iii) one ring step (hop started, GEMM, wait). hop hidden = (hop + gemm - step) / hop clipped
to [0, 1]: the planner's ``ring_hop_overlap`` (NCCL's hops). Where the ring's hops may go by the
copy engines (``DS_STPAR_RING_TRANSPORT``), (i)-(iii) again with the copy engines' batch:
copy-engine hop hidden, the planner's ``ring_hop_overlap_copy_engines``. Also the forward of
the fc1 column alone: ring, Megatron AG+GEMM, async-TP fused AG+GEMM, GEMM only, and the
pass-level hidden share of the ring forward. Saved under "ring_overlap" in --out (each case
with its "world" P); ring_overlap.ring_hop_overlap and .ring_hop_overlap_copy_engines are the
medians over the cases (the latter None where the copy engines carried no hop).
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

VARIANTS = (
    "megatron-sp",
    "megatron",
    "no-comm",
    "async-tp",
    "ring",
    "ring-linear",
    "ring-interleaved",
    "ring-interleaved-4",
    "cannon",
    "one-gpu",
)
REFERENCE = "megatron-sp"
INTERLEAVED = {"ring-interleaved": 2, "ring-interleaved-4": 4}  # variant -> pieces
RING_PASSES = ("ring", "ring-linear")  # variants whose hops go through comm.ring_pass
# compared with REFERENCE before timing (no-comm computes a different function); async-tp last
CHECKED = (
    "megatron",
    "ring",
    "ring-linear",
    "ring-interleaved",
    "ring-interleaved-4",
    "cannon",
    "one-gpu",
    "async-tp",
)
SEQUENCE_PARALLEL = (
    "megatron-sp",
    "async-tp",
    "ring",
    "ring-linear",
    "ring-interleaved",
    "ring-interleaved-4",
    "cannon",
)  # input [s/P, b, h]
ALIASES = {"megatron-tp2-sp": "megatron-sp", "megatron-tp2": "megatron"}  # the P=2 names
CHECK_TOL = 2e-2
BLOCKS = ("mlp", "layer")
DTYPE = torch.bfloat16


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


def parse_choices(
    text: str, choices: tuple[str, ...], aliases: dict[str, str] | None = None
) -> list[str]:
    items = [(aliases or {}).get(item, item) for item in parse_list(text, str.strip)]
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
    layers: int = 1  # the layer block: a TransformerBlock of this many layers (mlp: 1)

    @property
    def batch(self) -> int:
        return self.tokens // self.seq

    @property
    def heads(self) -> int:
        return self.hidden // self.head_dim

    def flops(self) -> float:
        if self.block == "mlp":
            return mlp_flops(self.tokens, self.hidden)
        return self.layers * layer_flops(self.tokens, self.hidden, self.seq)

    @property
    def name(self) -> str:
        """The block as the rows show it: ``layer xN`` for a block of N layers."""
        return f"{self.block} x{self.layers}" if self.layers > 1 else self.block


def make_cases(
    blocks: list[str],
    hiddens: list[int],
    tokens: list[int],
    seq: int,
    head_dim: int,
    tp: int,
    layers: int = 1,
) -> list[Case]:
    """Every (block, h, T); raises ValueError naming the fix for a shape TP=``tp`` cannot split
    (Cannon's q x q blocks divide the same dims, q = sqrt(tp))."""
    cases = []
    for block in blocks:
        for hidden in hiddens:
            for count in tokens:
                s = count if block == "mlp" else min(seq, count)
                case = Case(block, hidden, count, s, head_dim, layers if block == "layer" else 1)
                if count % s:
                    raise ValueError(f"layer: tokens {count} must be a multiple of --seq {s}")
                if s % tp:
                    raise ValueError(f"{block}: sequence length {s} must be a multiple of TP={tp}")
                if hidden % (head_dim * tp):
                    raise ValueError(
                        f"hidden {hidden} must be a multiple of head_dim x TP = {head_dim * tp}"
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
    host_ms: float | None = None  # the host's time in a step's calls (median), the slower rank's
    gemm_workspaces_mib: float | None = None  # cuBLAS's, allocated by the steps, not in peak_gib
    memory_trace: dict | None = None  # --memory-trace: rank 0's peak by source line
    # ring variants' hops: "copy engines" (peer links, ds_stpar/layers/symmetric.py),
    # "host-staged" (through host memory, ds_stpar/layers/host_staged.py), both (forced
    # host-staged with peer links: ring_pass's hops the former, the fused MLP's the latter)
    # or "nccl"
    ring_transport: str | None = None


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
        "| link | block | variant | h | tokens | ms/step | TFLOP/s/GPU | peak GiB "
        f"| vs {REFERENCE} | host ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = _fmt(r.ms, ".2f") if r.status == "ok" else f"{r.status} ({r.note})"[:60]
        variant = f"{r.variant} ({r.note})" if r.status == "ok" and r.note else r.variant
        lines.append(
            f"| {r.label} | {r.block} | {variant} | {r.hidden} | {r.tokens} | {ms} "
            f"| {_fmt(r.tflops_per_gpu, '.0f')} | {_fmt(r.peak_gib, '.2f')} "
            f"| {_fmt(r.vs_reference, '.3f', 'x')} | {_fmt(r.host_ms, '.2f')} |"
        )
    return "\n".join(lines)


OVERLAP_COLUMNS = (
    ("hop_ms", "hop ms"),
    ("gemm_ms", "chunk GEMM ms"),
    ("step_ms", "step ms"),
    ("hop_hidden", "hop hidden"),
    ("ce_hop_ms", "copy-engine hop ms"),
    ("ce_gemm_ms", "its chunk GEMM ms"),
    ("ce_step_ms", "copy-engine step ms"),
    ("ce_hop_hidden", "copy-engine hop hidden"),
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
    """This rank's device, groups (``tp_group``: all ``size`` = P ranks) and timing settings."""

    device: torch.device
    rank: int
    size: int
    tp_group: dist.ProcessGroup
    solo_group: dist.ProcessGroup
    warmup: int
    repeats: int
    pool: int
    label: str
    ring_piecing: dict[str, float]  # ring_mlp's pieces / min_piece_flop (unset: its defaults)
    trace_dir: str | None = None  # --trace-dir: trace_steps traced steps per variant there
    trace_steps: int = 1
    host_trace: str | None = None  # --host-trace: HOST_TRACE_STEPS steps with Python stacks
    memory_trace: bool = False  # --memory-trace: one more step under the allocator's history
    shared_gpu: bool = False  # --shared-gpu: every rank on GPU 0, gloo; each step synchronised
    host_ms: list[float] = field(default_factory=list)  # the last timing's host ms per step

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def square(self) -> bool:
        """Whether P = q*q, as Cannon's torus needs."""
        return math.isqrt(self.size) ** 2 == self.size

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reduce(self, values: list[float], op=dist.ReduceOp.MAX) -> list[float]:
        t = torch.tensor(
            values, dtype=torch.float64, device="cpu" if self.shared_gpu else self.device
        )
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
        self.reduce([0.0])  # all ranks start the timed steps together
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
        self.host_ms = []
        for i, (start, end) in enumerate(events):
            start.record()
            issued = time.perf_counter()
            step(self.warmup + i)
            self.host_ms.append((time.perf_counter() - issued) * 1e3)
            end.record()
            if self.shared_gpu:  # the host's time without waiting for a queue the GPU drains
                self.sync()
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

    def release_gemm_workspaces(self) -> int:
        """Free cuBLAS's workspaces (per stream a GEMM ran on: 32 MiB for cuBLAS and 1 MiB for
        cuBLASLt on an H200 with torch 2.11, call 225; Megatron's layer and the interleaved one
        made 64 MiB); returns the bytes they held. A process allocates them once, at
        its first GEMM on each stream, and keeps them: left in, a variant's peak would count
        them or not by whether an earlier case of the same process had run GEMMs on its
        streams (Megatron TP2+SP at h 8192 / 8K measured 2.5636 GiB first in its process and
        2.5011 GiB after h 4096; thirty-fifth session)."""
        if not self.cuda:
            return 0
        held = torch.cuda.memory_allocated(self.device)
        torch._C._cuda_clearCublasWorkspaces()  # no public API; CUDA builds have it
        return held - torch.cuda.memory_allocated(self.device)

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


def _gelu_as_stpar_mlp_passes_it():
    """The activation ``StparMLP`` hands the ring MLPs for Megatron's ``F.gelu``: its closed
    form, whose backward writes dA over A (``ds_stpar.layers.activation``)."""
    from ds_stpar.layers.activation import ClosedFormActivation

    return ClosedFormActivation(F.gelu)


class RingMLPBlock(MLPBlock):
    """The same block over fc1's and fc2's ring weights as one fused ring pass (ring_mlp);
    ``piecing``: its pieces / min_piece_flop (--ring-pieces / --ring-min-piece-flop)."""

    def __init__(self, fc1: torch.nn.Module, fc2: torch.nn.Module, piecing: dict[str, float]):
        super().__init__(fc1, fc2)
        self.piecing = piecing

    def forward(self, x: Tensor) -> Tensor:
        from ds_stpar.layers.ring_mlp import ring_mlp

        fc1, fc2 = self.fc1, self.fc2
        gelu = _gelu_as_stpar_mlp_passes_it()
        return ring_mlp(x, fc1.weight, None, fc2.weight, gelu, fc1.tp_group, **self.piecing)


class RingTwoPassMLPBlock(MLPBlock):
    """The same block as fc1's and fc2's ring passes in one node that recomputes the
    activation (``ring_two_pass_mlp``), as ``StparMLP`` runs ``fused_ring_mlp=False``."""

    def forward(self, x: Tensor) -> Tensor:
        from ds_stpar.layers.ring_mlp import ring_two_pass_mlp

        fc1, fc2 = self.fc1, self.fc2
        gelu = _gelu_as_stpar_mlp_passes_it()
        return ring_two_pass_mlp(x, fc1.weight, None, fc2.weight, gelu, fc1.tp_group)


class PlainLinear(torch.nn.Module):
    """F.linear with an [out, in] weight and no communication; returns (y, None).
    ``partition_dim``: the axis of the full weight its block is cut along (0 for fc1, 1 for fc2)."""

    def __init__(
        self, out_features: int, in_features: int, partition_dim: int, device: torch.device
    ):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=DTYPE)
        )
        self.partition_dim = partition_dim

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
        self.partition_dim = 0 if column else 1
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

Offsets = tuple[tuple[int, int, int], ...]  # ((axis, index, parts), ...) as linear.py's


@dataclass
class Built:
    """A variant ready to step: ``forward(x) -> y`` over ``module``'s parameters.

    ``shard`` = (index, parts): the slice of the full weights its Megatron-style linears hold
    ((rank, P) for the TP variants and no-comm, (0, 1) for one-gpu); Cannon's blocks come from
    the layers themselves (see :func:`weight_offsets`)."""

    module: torch.nn.Module
    forward: Callable[[Tensor], Tensor]
    sp_input: bool  # input [s/P, b, h] (sequence parallel) or the full [s, b, h]
    shard: tuple[int, int]


def _config(case: Case, tp: int, tp_mode: str, sp: bool, parts: int = 1):
    """TransformerConfig for ``case`` through the project's builder (dropout off, no bias,
    LayerNorm, gelu, no initialisation: the weights are loaded). ``parts`` > 1: a TP=1 model
    with one TP=``parts`` rank's shapes (heads / parts, ffn 4h / parts)."""
    from ds_stpar.config import Layout, ModelSpec, Strategy
    from ds_stpar.integrations.megatron import transformer_config

    model = ModelSpec(
        f"bench-{case.hidden}",
        case.layers,
        case.hidden,
        case.heads // parts,
        vocab_size=1024,
        ffn_hidden_size=4 * case.hidden // parts,
        kv_channels=case.head_dim,
        add_bias_linear=False,
    )
    strategy = Strategy(Layout(tp=tp, tp_mode=tp_mode), sequence_parallel=sp)
    return transformer_config(model, strategy, "bf16", perform_initialization=False)


def _pg_collection(tp_group: dist.ProcessGroup):
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "cp"])
    pgs.tp = tp_group
    return pgs


def _tp_mode(variant: str) -> str:
    ring = ("ring", "ring-linear", *INTERLEAVED)
    return "ring" if variant in ring else "cannon" if variant == "cannon" else "megatron"


def build_mlp(variant: str, case: Case, rt: Runtime, async_name: str | None) -> Built:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from ds_stpar.layers import TemporalColumnParallelLinear, TemporalRowParallelLinear

    h, group, size, tp_shard = case.hidden, rt.tp_group, rt.size, (rt.rank, rt.size)
    if variant in ("megatron-sp", "megatron", "ring", "ring-linear", "cannon"):
        sp, mode = variant != "megatron", _tp_mode(variant)
        cfg = _config(case, size, mode, sp)
        column, row = (
            (TemporalColumnParallelLinear, TemporalRowParallelLinear)
            if mode != "megatron"
            else (ColumnParallelLinear, RowParallelLinear)
        )
        extra = {"tp_mode": mode} if mode != "megatron" else {}
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
        if variant == "ring":
            block = RingMLPBlock(fc1, fc2, rt.ring_piecing)
        elif variant == "ring-linear":
            block = RingTwoPassMLPBlock(fc1, fc2)
        else:
            block = MLPBlock(fc1, fc2)
        block = block.to(rt.device)
        return Built(block, block, sp, tp_shard)
    if variant == "async-tp":
        if async_name is None:
            raise RuntimeError("symmetric memory unavailable")
        fc1 = AsyncTPLinear((4 * h // size, h), True, async_name, rt.device)
        fc2 = AsyncTPLinear((h, 4 * h // size), False, async_name, rt.device)
        block = MLPBlock(fc1, fc2)
        return Built(block, block, True, tp_shard)
    shard = tp_shard if variant == "no-comm" else (0, 1)
    width = 4 * h // shard[1]
    block = MLPBlock(PlainLinear(width, h, 0, rt.device), PlainLinear(h, width, 1, rt.device))
    return Built(block, block, False, shard)


def build_layer(variant: str, case: Case, rt: Runtime) -> Built:
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_block import TransformerBlock

    from ds_stpar.layers.megatron_spec import get_gpt_layer_stpar_spec

    if variant == "async-tp":
        raise NotImplementedError("async-tp is benchmarked on the MLP block only")
    if variant in ("no-comm", "one-gpu"):
        shard = (rt.rank, rt.size) if variant == "no-comm" else (0, 1)
        cfg = _config(case, 1, "megatron", False, parts=shard[1])
        mode, group, sp = "megatron", rt.solo_group, False
    else:
        mode, sp, shard = _tp_mode(variant), variant != "megatron", (rt.rank, rt.size)
        cfg = _config(case, rt.size, mode, sp)
        group = rt.tp_group
    spec = get_gpt_layer_stpar_spec(
        mode, group, fused_ring_mlp=variant != "ring-linear", interleave=INTERLEAVED.get(variant, 0)
    )
    if case.layers > 1:
        block = TransformerBlock(
            cfg, spec, post_layer_norm=False, pg_collection=_pg_collection(group)
        ).to(rt.device)
        return Built(block, lambda x: block(x, attention_mask=None), sp, shard)
    layer = build_module(spec, config=cfg, layer_number=1, pg_collection=_pg_collection(group)).to(
        rt.device
    )
    return Built(layer, lambda x: layer(x, attention_mask=None)[0], sp, shard)


def build(variant: str, case: Case, rt: Runtime, async_name: str | None) -> Built:
    if case.block == "mlp":
        return build_mlp(variant, case, rt, async_name)
    return build_layer(variant, case, rt)


def make_full_weights(case: Case, rt: Runtime) -> dict[str, Tensor]:
    """The case's full weights, the same on every rank (seeded by the case alone): linear
    weights [out, in] N(0, 1/in), norm weights 1 + N(0, 0.01), norm biases N(0, 0.01) (not 1
    and 0, so a misplaced norm parameter shows in the checks).

    Why 1/in and not Megatron's 0.02: activations then stay O(1) through every linear at any
    h, so the layer's residual branch (output - input, what the check compares) is not small
    next to the input. With 0.02 at h=64 the branch is ~3% of the input and the bf16 rounding
    of output = input + branch alone differs by ~2e-2 between two correct variants; with 1/in
    it costs ~5e-3. GEMM timings do not depend on the values."""
    seed = 10_000 * (case.hidden // 64) + case.tokens // 64
    if case.block == "mlp":
        h, width = case.hidden, 4 * case.hidden
        return {
            "fc1.weight": rt.randn((width, h), seed, h**-0.5),
            "fc2.weight": rt.randn((h, width), seed + 1, width**-0.5),
        }
    shapes_ = {n: p.shape for n, p in build_layer("one-gpu", case, rt).module.named_parameters()}
    weights = {}
    for i, (name, shape) in enumerate(shapes_.items()):
        if len(shape) == 2:
            weights[name] = rt.randn(tuple(shape), seed + i, shape[1] ** -0.5)
        else:
            weights[name] = rt.randn(tuple(shape), seed + i, 0.1)
            if name.endswith("weight"):
                weights[name] += 1.0
    return weights


def weight_offsets(built: Built) -> dict[str, Offsets]:
    """Where each sharded weight of ``built`` sits in the full weight: a temporal layer's own
    ``stpar_shard_offsets`` (ring: Megatron's slice, Cannon: its q x q block), else slice
    ``built.shard`` along the partition dim of a Megatron / plain / async-TP linear. Weights
    not listed (norms) are replicated."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    index, parts = built.shard
    found: dict[str, Offsets] = {}
    for prefix, module in built.module.named_modules():
        weight = getattr(module, "weight", None)
        name = f"{prefix}.weight" if prefix else "weight"
        if not isinstance(weight, torch.nn.Parameter):
            continue
        if hasattr(weight, "stpar_shard_offsets"):
            found[name] = tuple(weight.stpar_shard_offsets)
        elif isinstance(module, ColumnParallelLinear):
            found[name] = ((0, index, parts),)
        elif isinstance(module, RowParallelLinear):
            found[name] = ((1, index, parts),)
        elif isinstance(module, (PlainLinear, AsyncTPLinear)):
            found[name] = ((module.partition_dim, index, parts),)
    return found


def load(built: Built, full: dict[str, Tensor]) -> None:
    """Copy each parameter's block of the full weights into ``built``."""
    from ds_stpar.layers.linear import take_block

    offsets = weight_offsets(built)
    with torch.no_grad():
        for name, param in built.module.named_parameters():
            block = take_block(full[name], offsets.get(name, ())) if name in full else None
            if block is None or block.shape != param.shape:
                got = tuple(block.shape) if block is not None else None
                raise RuntimeError(f"no source weight for {name} {tuple(param.shape)} (got {got})")
            param.copy_(block)


def run_step(built: Built, x: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    """One forward+backward from fresh gradients; returns (input leaf, output)."""
    for param in built.module.parameters():
        param.grad = None
    x = x.detach().requires_grad_()
    out = built.forward(x)
    out.backward(dy)
    return x, out


def shapes(case: Case, sp: bool, size: int) -> tuple[int, int, int]:
    return (case.seq // size if sp else case.seq, case.batch, case.hidden)


# ----------------------------------------------------------------------------- checking


def check_results(
    case: Case, built: Built, x_full: Tensor, dy_full: Tensor, rt: Runtime
) -> dict[str, tuple[Tensor, Offsets]]:
    """name -> (tensor, its block in global coordinates): output (the residual branch for the
    layer) and input grad as this rank's sequence-parallel chunk whatever the variant's input
    (offsets () = as is), and every linear weight grad with its block of the full weight."""
    x, dy = x_full, dy_full
    if built.sp_input:
        x, dy = x_full.chunk(rt.size, dim=0)[rt.rank], dy_full.chunk(rt.size, dim=0)[rt.rank]
    leaf, out = run_step(built, x, dy)
    branch = out.detach().float()
    if case.block == "layer":
        branch = branch - leaf.detach().float()
    acts = {"output": branch, "input grad": leaf.grad}
    if not built.sp_input:
        acts = {k: v.chunk(rt.size, dim=0)[rt.rank] for k, v in acts.items()}
    results = {k: (v, ()) for k, v in acts.items()}
    offsets = weight_offsets(built)
    for name, param in built.module.named_parameters():
        if "layernorm" not in name:  # SP norms hold partial grads, non-SP full ones
            results[f"grad {name}"] = (param.grad, offsets.get(name, ()))
    return results


def gather_reference(got: dict[str, tuple[Tensor, Offsets]], rt: Runtime) -> dict[str, Tensor]:
    """The reference's results with its weight-grad slices gathered to full-weight
    coordinates (Megatron: slice ``rank`` of P along one axis); activations stay this rank's
    chunk."""
    ref = {}
    for name in sorted(got):
        tensor, offsets = got[name]
        if offsets:
            ((axis, index, parts),) = offsets
            if (index, parts) != (rt.rank, rt.size):
                raise RuntimeError(f"reference {name}: block {offsets} is not this rank's slice")
            pieces = [torch.empty_like(tensor) for _ in range(parts)]
            dist.all_gather(pieces, tensor.contiguous(), group=rt.tp_group)
            tensor = torch.cat(pieces, dim=axis)
        ref[name] = tensor
    return ref


def squared_norms(ref: dict[str, Tensor], got: dict[str, tuple[Tensor, Offsets]]) -> list[float]:
    """[||got - ref||^2, ||ref||^2] per tensor (sorted names): each of this rank's blocks
    against the same block of the reference. Summed over the ranks the blocks of a sharded
    variant tile the full tensor; one-gpu counts it P times on both sides, so the ratio holds."""
    from ds_stpar.layers.linear import take_block

    sums = []
    for name in sorted(ref):
        tensor, offsets = got[name]
        a, b = tensor.float(), take_block(ref[name], offsets).float()
        if a.shape != b.shape:
            raise RuntimeError(f"{name}: shape {tuple(a.shape)} != reference {tuple(b.shape)}")
        sums += [(a - b).pow(2).sum().item(), b.pow(2).sum().item()]
    return sums


def relative_errors(names: list[str], sums: list[float]) -> dict[str, float]:
    """||got - ref|| / ||ref|| per tensor from the squared norms summed over the ranks."""
    return {
        n: math.sqrt(sums[2 * i] / sums[2 * i + 1]) if sums[2 * i + 1] > 0 else math.inf
        for i, n in enumerate(names)
    }


def not_applicable(variant: str, case: Case, rt: Runtime, async_name: str | None) -> str | None:
    """Why ``variant`` cannot run on this case / group, or None."""
    if variant == "async-tp" and case.block == "layer":
        return "MLP only"
    if variant in INTERLEAVED and case.block == "mlp":
        return "layer only"
    if variant in INTERLEAVED and case.batch % INTERLEAVED[variant]:
        return f"batch not divisible by {INTERLEAVED[variant]}"
    if variant == "async-tp" and async_name is None:
        return "unavailable"
    if variant == "cannon" and not rt.square:
        return "P not a square"
    return None


def run_checks(case, rt, variants, async_name, full) -> tuple[list[dict], set[str]]:
    """Compare every checked variant with REFERENCE; returns (check rows, failed variants)."""
    shape = (case.seq, case.batch, case.hidden)
    x_full = rt.randn(shape, 1)  # same seed on every rank: the same global input
    dy_full = rt.randn(shape, 2)
    checks, failed, built, error = [], set(), None, "failed on another rank"
    got = {}
    try:
        built = build(REFERENCE, case, rt, async_name)
        load(built, full)
        got = check_results(case, built, x_full, dy_full, rt)
        ok = True
    except Exception as err:
        traceback.print_exc()
        ok, error = False, f"{type(err).__name__}: {err}"[:300]
    built = None
    if not rt.all_ok(ok):  # nothing to compare with; the timings still run
        row = {"label": rt.label, "block": case.name, "hidden": case.hidden}
        row.update(tokens=case.tokens, variant=REFERENCE, result="ERROR", error=error)
        return [row], set()
    ref, got = gather_reference(got, rt), None
    for variant in [v for v in CHECKED if v in variants]:
        row = {"label": rt.label, "block": case.name, "hidden": case.hidden}
        row.update(tokens=case.tokens, variant=variant)
        reason = not_applicable(variant, case, rt, async_name)
        if reason == "P not a square":
            checks.append({**row, "result": f"n/a ({reason})"})
        if reason is not None:
            continue
        sums, built = [], None
        try:
            built = build(variant, case, rt, async_name)
            load(built, full)
            sums = squared_norms(ref, check_results(case, built, x_full, dy_full, rt))
            ok = True
        except Exception as err:
            traceback.print_exc()
            row["error"] = f"{type(err).__name__}: {err}"[:300]
            ok = False
        built = None
        rt.free()
        if not rt.all_ok(ok):  # collectives only after all ranks agree
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


def time_variant(variant: str, case: Case, rt: Runtime, async_name, full) -> Row:
    gpus = 1 if variant == "one-gpu" else rt.size
    row = Row(rt.label, case.name, variant, case.hidden, case.tokens, case.seq, gpus)
    ok, note, peak, workspaces = True, "", 0, 0
    try:
        sp = variant in SEQUENCE_PARALLEL
        shape = shapes(case, sp, rt.size)
        seed = 1000 * (rt.rank + 1)
        xs = [rt.randn(shape, seed + i) for i in range(rt.pool)]
        dys = [rt.randn(shape, seed + 100 + i) for i in range(rt.pool)]
        reset_megatron_buffer()
        if rt.cuda:  # the ring's copy-engine buffer, made anew for this variant's shapes
            from ds_stpar.layers.symmetric import release

            release(rt.device)
        rt.free()
        rt.release_gemm_workspaces()
        rt.sync()
        base = rt.allocated()
        built = build(variant, case, rt, async_name)
        if built.sp_input != sp:
            raise RuntimeError(f"{variant}: input layout mismatch (sequence parallel {sp})")
        load(built, full)
        rt.reset_peak()
        times = rt.time_ms(lambda i: run_step(built, xs[i % rt.pool], dys[i % rt.pool]))
        rt.sync()
        peak = rt.peak() - base
        if variant in RING_PASSES and rt.cuda:  # the ring's copy-engine buffer, when in use
            from ds_stpar.layers.host_staged import staged_group
            from ds_stpar.layers.symmetric import workspace_bytes

            held = workspace_bytes(rt.device)
            peak += held
            staged = staged_group(rt.tp_group, rt.device) is not None
            used = [name for name, on in (("copy engines", held), ("host-staged", staged)) if on]
            row.ring_transport = ", ".join(used) or "nccl"  # both: ring_pass's / the fused MLP's
        block = case.name.replace(" ", "")  # "layer", "layerx4", "mlp"
        name = f"{block}-{case.hidden}-{case.tokens}-{variant}-rank-{rt.rank}.json.gz"
        if rt.trace_dir:
            path = os.path.join(rt.trace_dir, f"{rt.label}-{name}")
            profile_steps(built, xs[0], dys[0], rt, path, rt.trace_steps)
        if rt.host_trace:
            path = os.path.join(rt.host_trace, f"host-{name}")
            profile_steps(built, xs[0], dys[0], rt, path, HOST_TRACE_STEPS, host=True)
        if rt.memory_trace and rt.cuda:
            row.memory_trace = memory_trace_step(built, xs[0], dys[0], rt)
        workspaces = rt.release_gemm_workspaces()  # after the traces: their steps find them
        peak -= workspaces
    except Exception as err:
        traceback.print_exc()
        ok, note = False, f"{type(err).__name__}: {err}"[:300]
    built = xs = dys = None
    rt.free()
    if not rt.all_ok(ok):
        row.status, row.note = "failed", note or "failed on another rank"
        return row
    host = statistics.median(rt.host_ms) if rt.cuda else 0.0
    median, peak_max, host_max, workspaces_max = rt.reduce(
        [statistics.median(times), peak / 2**30, host, workspaces / 2**20]
    )
    row.ms, row.peak_gib, row.times_ms = median, peak_max if rt.cuda else None, times
    row.gemm_workspaces_mib = workspaces_max if rt.cuda else None
    row.host_ms = host_max if rt.cuda else None
    return row


HOST_TRACE_STEPS = 5


def profile_steps(
    built: Built, x: Tensor, dy: Tensor, rt: Runtime, path: str, steps: int = 1, host=False
) -> None:
    """``steps`` more steps under torch.profiler, their chrome trace written to ``path``.

    Default (``--trace-dir``): CUDA activity only, as launch/pretrain.py's --trace-step, for
    bench/timeline.py. ``host`` (``--host-trace``): the host's activity too, with Python
    stacks, for bench/hoststats.py (self and inclusive host time per Python function and
    operator); run it at shapes small enough that the GPU waits for the host, which is what
    it explains."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if host:
        activities = [torch.profiler.ProfilerActivity.CPU] + (activities if rt.cuda else [])
    with torch.profiler.profile(activities=activities, with_stack=host) as prof:
        for _ in range(steps):
            run_step(built, x, dy)
        rt.sync()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    prof.export_chrome_trace(path)


def memory_trace_step(built: Built, x: Tensor, dy: Tensor, rt: Runtime) -> dict:
    """One more step under the caching allocator's history: the peak above what was allocated
    when the step began and what is alive there by source line (bench/memtrace.py)."""
    import memtrace

    torch.cuda.memory._record_memory_history(stacks="python")
    try:
        run_step(built, x, dy)
        rt.sync()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return memtrace.summarize(snapshot, rt.device.index)


def ring_overlap(case: Case, rt: Runtime, async_name: str | None, full) -> dict:
    """Hop / chunk GEMM / ring step of the fc1 column forward, and the whole column forward
    of ring, Megatron (AG + GEMM), async-TP (fused) and the GEMM alone."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from ds_stpar.layers import TemporalColumnParallelLinear
    from ds_stpar.layers.comm import Message, start_p2p

    size, h, group = rt.size, case.hidden, rt.tp_group
    rows = case.tokens // size
    weight = full["fc1.weight"].chunk(size, dim=0)[rt.rank].contiguous()  # [4h/P, h]
    xs = [rt.randn((rows, h), 5000 + 10 * rt.rank + i) for i in range(rt.pool)]
    recv = torch.empty_like(xs[0])
    out = torch.empty(rows, weight.shape[0], device=rt.device, dtype=DTYPE)
    # as the ring's chunks travel: to d-1, from d+1 (with P=2 both are the other rank)
    left, right = (rt.rank - 1) % size, (rt.rank + 1) % size
    repeats = max(2 * rt.repeats, 20)  # forward-only ops of a few ms: more repeats

    def hop(i: int):
        return start_p2p([Message(xs[i % rt.pool], left)], [Message(recv, right)], group)

    def gemm(i: int) -> None:
        torch.mm(xs[i % rt.pool], weight.t(), out=out)

    def step(i: int) -> None:
        pending = hop(i)
        gemm(i)
        pending.wait()

    result = {"label": rt.label, "world": size, "hidden": h, "tokens": case.tokens}
    result["hop_ms"] = rt.median_ms(lambda i: hop(i).wait(), repeats)
    result["gemm_ms"] = rt.median_ms(gemm, repeats)
    result["step_ms"] = rt.median_ms(step, repeats)
    result["hop_hidden"] = hidden_fraction(result["hop_ms"], result["gemm_ms"], result["step_ms"])
    result.update(copy_engine_hop(xs, gemm, rt, repeats))

    cfg_ring = _config(case, size, "ring", True)
    cfg_meg = _config(case, size, "megatron", True)
    x3 = [x.view(rows, 1, h) for x in xs]
    gathered = torch.cat([xs[0]] * size)
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
        result["gemm_only_ms"] = rt.median_ms(lambda i: torch.mm(gathered, weight.t()), repeats)
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
    serial = size * result["gemm_ms"] + (size - 1) * result["hop_ms"]
    exposed = result["ring_fwd_ms"] - size * result["gemm_ms"]
    result["pass_hidden"] = hidden_fraction((size - 1) * result["hop_ms"], 0.0, exposed)
    result["pass_serial_ms"] = serial
    xs = recv = out = gathered = x3 = weight = None
    rt.free()
    return result


def copy_engine_hop(xs: list[Tensor], gemm: Callable, rt: Runtime, repeats: int) -> dict:
    """The hop, the chunk GEMM and the step again, in the same order, with the hop by the copy
    engines (``layers/symmetric.py``), where ``DS_STPAR_RING_TRANSPORT`` takes them for this
    group (``auto``: GPUs on one host that reach each other); None elsewhere.
    ``ce_hop_hidden`` is what the planner's ``ring_hop_overlap_copy_engines`` stands for. The
    GEMM is timed again beside its own step, since its time moved by up to 6% between timings
    on 2 x H100 (twenty-fourth session, call 145). At h 8192, where a hop is only 13-15% of
    its GEMM, a swing that size makes one case's share noise; the planner's share is fitted
    to whole blocks instead."""
    from ds_stpar.layers import symmetric

    ring = symmetric.symmetric_ring(rt.tp_group, rt.device) if rt.cuda else None
    if ring is None:
        return {"ce_hop_ms": None, "ce_gemm_ms": None, "ce_step_ms": None, "ce_hop_hidden": None}

    def step(i: int) -> None:
        batch = ring.start([xs[i % rt.pool]])
        gemm(i)
        batch.wait()

    hop_ms = rt.median_ms(lambda i: ring.start([xs[i % rt.pool]]).wait(), repeats)
    gemm_ms = rt.median_ms(gemm, repeats)
    step_ms = rt.median_ms(step, repeats)
    hidden = hidden_fraction(hop_ms, gemm_ms, step_ms)
    return {
        "ce_hop_ms": hop_ms,
        "ce_gemm_ms": gemm_ms,
        "ce_step_ms": step_ms,
        "ce_hop_hidden": hidden,
    }


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
        "--variants",
        type=lambda t: parse_choices(t, VARIANTS, ALIASES),
        default=list(VARIANTS),
        help=f"any of {', '.join(VARIANTS)} (old names: {', '.join(ALIASES)})",
    )
    parser.add_argument("--seq", type=int, default=4096, help="layer sequence length")
    parser.add_argument(
        "--layers", type=int, default=1, help="layer block: a TransformerBlock of this many layers"
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--pool", type=int, default=3, help="rotating input sets")
    parser.add_argument("--label", default=None, help="tag for the rows (default: from env)")
    parser.add_argument("--out", default=None, help="write rows, checks, ring_overlap (JSON)")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    parser.add_argument("--no-overlap", action="store_true", help="skip the ring calibration")
    parser.add_argument(
        "--high-priority-tp",
        action="store_true",
        help="TP group's NCCL streams at high priority (Megatron's --high-priority-stream-groups tp)",
    )
    parser.add_argument(
        "--sm-carveout",
        type=int,
        default=None,
        help="every variant's GEMMs through cuBLASLt planned for all SMs but this many "
        "(torch._C._set_sm_carveout_experimental), room for the NCCL kernels beside them",
    )
    parser.add_argument(
        "--ring-pieces",
        type=int,
        default=None,
        help="MLP block's ring: at most this many row pieces per chunk (default ring_mlp.PIECES)",
    )
    parser.add_argument(
        "--ring-min-piece-flop",
        type=float,
        default=None,
        help="MLP block's ring: forward FLOPs a piece needs at least (default "
        "ring_mlp.MIN_PIECE_FLOP; 0: exactly --ring-pieces)",
    )
    parser.add_argument(
        "--timeout", type=int, default=180, help="seconds before a hung NCCL op aborts"
    )
    parser.add_argument(
        "--trace-dir",
        default=None,
        help="after timing each variant, trace --trace-steps more steps into this folder "
        "(bench/timeline.py)",
    )
    parser.add_argument(
        "--trace-steps",
        type=int,
        default=1,
        help="steps per --trace-dir trace: the first starts from an idle GPU and a "
        "synchronised host, the others back to back, as the timed steps run",
    )
    parser.add_argument(
        "--host-trace",
        default=None,
        help="after timing each variant, trace 5 more steps with host activity and Python "
        "stacks into this folder (bench/hoststats.py); use small shapes, where the host binds",
    )
    parser.add_argument(
        "--memory-trace",
        action="store_true",
        help="after timing each variant, one more step under the CUDA allocator's history: "
        "what is alive at its peak, by source line, in the JSON rows and printed on rank 0",
    )
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU (smoke test only)")
    parser.add_argument(
        "--shared-gpu",
        action="store_true",
        help="every rank on GPU 0 in a gloo world, the layers' transfers staged through host "
        "memory, each step synchronised: each rank measures its own peak and host ms (the "
        "table: their max); ms/step measures nothing (the ranks share the GPU). For the "
        "staged variants on one GPU",
    )
    args = parser.parse_args(argv)
    if min(args.repeats, args.pool, args.seq, args.head_dim, args.layers) < 1 or args.warmup < 0:
        parser.error(
            "--repeats, --pool, --seq, --head-dim, --layers must be >= 1 and --warmup >= 0"
        )
    if args.trace_steps < 1:
        parser.error("--trace-steps must be >= 1")
    if args.trace_steps != 1 and not args.trace_dir:
        parser.error("--trace-steps counts the steps of --trace-dir's traces: give --trace-dir")
    if args.memory_trace and args.cpu:
        parser.error("--memory-trace reads the CUDA allocator's history: not with --cpu")
    if args.sm_carveout is not None and (args.cpu or args.sm_carveout < 0):
        parser.error("--sm-carveout leaves N >= 0 of a GPU's SMs to the transfers: not with --cpu")
    if args.shared_gpu and args.cpu:
        parser.error("--shared-gpu and --cpu: choose one")
    if args.trace_dir and args.cpu:
        parser.error(
            "--trace-dir records GPU activity: not with --cpu (--host-trace records the host's)"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; init_runtime checks it again
    if world < 2:
        parser.error("run under torchrun with --nproc_per_node >= 2 (the TP size P)")
    try:
        args.case_list = make_cases(
            args.cases, args.hidden, args.tokens, args.seq, args.head_dim, world, args.layers
        )
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
        device = torch.device(
            "cuda", 0 if args.shared_gpu else int(os.environ.get("LOCAL_RANK", 0))
        )
        torch.cuda.set_device(device)
        if args.shared_gpu:  # the tensor-parallel transfers through host memory; gloo the rest
            os.environ["DS_STPAR_TRANSFER_TRANSPORT"] = "host-staged"
        dist.init_process_group("gloo" if args.shared_gpu else "nccl", timeout=timeout)
    size = dist.get_world_size()
    if size != int(os.environ.get("WORLD_SIZE", "1")):
        raise SystemExit(f"world size {size} differs from WORLD_SIZE; launch with torchrun")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=size,
        distributed_timeout_minutes=max(1, args.timeout // 60),
        high_priority_stream_groups=["tp"] if args.high_priority_tp else None,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    solo = GroupCache().get(Layout(tp=size)).self_group
    return Runtime(
        device=device,
        rank=dist.get_rank(),
        size=size,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        solo_group=solo,
        warmup=args.warmup,
        repeats=args.repeats,
        pool=args.pool,
        label=args.label,
        trace_dir=args.trace_dir,
        trace_steps=args.trace_steps,
        host_trace=args.host_trace,
        memory_trace=args.memory_trace,
        shared_gpu=args.shared_gpu,
        ring_piecing={
            key: value
            for key, value in (
                ("pieces", args.ring_pieces),
                ("min_piece_flop", args.ring_min_piece_flop),
            )
            if value is not None
        },
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rt = init_runtime(args)
    if args.sm_carveout is not None:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(args.sm_carveout)
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
            for k in (
                "CUDA_DEVICE_MAX_CONNECTIONS",
                "NCCL_P2P_DISABLE",
                "NCCL_NVLS_ENABLE",
                "DS_STPAR_RING_TRANSPORT",
                "DS_STPAR_TRANSFER_TRANSPORT",
            )
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
        full = make_full_weights(case, rt)
        failed: set[str] = set()
        wrong: set[str] = set()
        if not args.no_check:
            case_checks, failed = run_checks(case, rt, args.variants, async_name, full)
            checks += case_checks
            wrong = {c["variant"] for c in case_checks if c["result"] == "FAIL"}
            if lead:
                print(format_checks(case_checks), flush=True)
            if "async-tp" in failed:
                async_name = None
        case_rows = []
        for variant in order:
            gpus = 1 if variant == "one-gpu" else rt.size
            row = Row(rt.label, case.name, variant, case.hidden, case.tokens, case.seq, gpus)
            reason = not_applicable(variant, case, rt, async_name)
            if reason is not None:
                row.status, row.note = "n/a", reason
            elif variant in failed:
                row.status, row.note = "n/a", "check raised an error"
            else:
                row = time_variant(variant, case, rt, async_name, full)
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
                result = ring_overlap(case, rt, async_name, full)
            except Exception:
                traceback.print_exc()
                ok = False
            if rt.all_ok(ok):
                overlap.append(result)
                if lead:
                    print(format_overlap(overlap[-1:]), flush=True)
        full = None
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
            median, ce = _median_hidden(overlap), _median_hidden(overlap, "ce_hop_hidden")
            ce_text = "" if ce is None else f"; by the copy engines {ce:.3f}"
            print(f"\n## ring overlap calibration (median hop hidden = {median:.3f}{ce_text})\n")
            print(format_overlap(overlap))
        if args.out:
            _write(args.out, header, rows, checks, overlap)
            print(f"\nwrote {args.out}")
    dist.destroy_process_group()


def _median_hidden(overlap: list[dict], key: str = "hop_hidden") -> float | None:
    """The median of ``key`` over the cases that have it (the copy engines' rows only where
    they carried a hop); None without any."""
    values = [c[key] for c in overlap if c.get(key) is not None]
    return statistics.median(values) if values else None


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
            "ring_hop_overlap_copy_engines": _median_hidden(overlap, "ce_hop_hidden"),
            "cases": overlap,
        },
    }
    with open(path, "w") as handle:
        json.dump(data, handle, indent=1)


if __name__ == "__main__":
    main()
