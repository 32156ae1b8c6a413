"""What the cost model knows about the hardware beyond its datasheet.

Two objects, both plain data (no torch import at module level: the planner runs anywhere):

- :class:`Calibration` — a handful of global constants of the efficiency model: one GEMM
  efficiency curve (:meth:`Calibration.gemm_efficiency`), the fraction of HBM bandwidth that
  memory-bound kernels reach, flash-attention efficiency, how much of a neighbour hop a
  ring/Cannon step hides, how much DP gradient reduction hides behind backward, allocator
  headroom. Defaults live in ``ds_stpar/data/calibration.json`` (per-GPU overrides on top of
  one ``default`` block); :meth:`Calibration.load_default` reads them.
- :class:`Profile` — measurements of one machine (:func:`measure`, run by ``ds-stpar
  profile`` on a GPU box): achieved bf16 GEMM TFLOP/s over a grid of (M, N, K) shapes and
  bus bandwidth per collective and group size (nccl-tests "busbw"
  convention, planner.md "Collectives"). When a cluster carries a profile the cost model
  looks shapes and group sizes up in it (:meth:`Profile.gemm_tflops`,
  :meth:`Profile.bus_bandwidth`) and falls back to the calibration curve and the datasheet
  outside the measured range.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from ds_stpar.config import GPU_PRESETS, RING_TRANSPORTS, TRANSFER_TRANSPORTS, read_json
from ds_stpar.errors import ConfigError, StparError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
LOCAL_STACK = "megatron-core-local"
STACKS = ("fused", LOCAL_STACK)
HOST_FIELDS = (
    "host_layer_s",
    "host_collective_s",
    "host_ring_hop_s",
    "host_op_s",
    "host_interleave_piece_s",
)

# --------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """Global constants of the efficiency model (see ``ds_stpar/data/calibration.json``).

    GEMM curve (one for every GEMM, :meth:`gemm_efficiency`)::

        eff(M, N, K) = e_max * M/(M + x0) * N/(N + x0) * K/(K + x0)

    ``e_max`` = ``gemm_peak_fraction`` (what a huge GEMM reaches), ``x0`` =
    ``gemm_half_dim`` (a dimension of x0 halves the efficiency: tile under-fill for small or
    skinny GEMMs). The cost model applies it under a roofline: a GEMM takes at least its
    bytes over ``memory_efficiency`` x HBM bandwidth.

    Overlap: ``overlap_fraction`` is the share of a concurrent GEMM's time that hides NCCL
    communication (DP reduction behind backward, Megatron's async TP backward);
    ``ring_hop_overlap`` the share of a ring/Cannon neighbour hop hidden behind its step's
    sub-GEMM when NCCL carries it, ``ring_hop_overlap_copy_engines`` when the GPUs' copy
    engines do (``layers/symmetric.py``; 0: ``ring_hop_overlap``); ``ring_mlp_pass_s`` the
    least exposed time of one fused ring MLP pass (what the pass loses to stream waits and
    partial-sum bookkeeping even where its hops hide).

    Software stack (``stack``, :data:`STACKS`): ``"fused"`` is the stack of the published
    Megatron-LM runs (fused bias-GeLU / bias-dropout-add / softmax kernels, gradient
    accumulation fused into the weight-gradient GEMM, fused Adam; its elementwise kernels
    reach ``memory_efficiency`` and its host launches hide behind the GPU); ``"megatron-core-
    local"`` is megatron-core's local modules without Transformer Engine or Apex (what
    ``bench/planner_accuracy.py`` runs): unfused PyTorch kernels (bias and residual adds,
    GeLU, norms, fp32 cross entropy), a separate fp32 main-gradient accumulation per
    micro-batch (the adds and this accumulation run at the measured ``elementwise_efficiency``
    of HBM, the rest at ``memory_efficiency``), PyTorch's foreach AdamW with
    Megatron's per-tensor gradient clipping, and a host (Python + launch) time per layer
    that can exceed the GPU time. Host constants, in seconds of CPU per call:
    ``host_layer_s`` (one transformer layer, forward + backward, one micro-batch, no TP
    communication; includes the per-micro-batch embedding/loss/schedule overhead spread over
    the layers), ``host_collective_s`` (one Megatron TP collective with its autograd
    wrapper), ``host_ring_hop_s`` (one ring/Cannon step with a hop: P2P batch, stream waits,
    the extra sub-GEMM launch), ``host_op_s`` (one small PyTorch op, for the optimizer's
    per-tensor work), ``host_interleave_piece_s`` (one piece of the interleaved layer,
    forward + backward, with its collectives: it takes the place of ``host_layer_s`` there;
    0 means ``host_layer_s`` per piece). Zero host constants mean host time is not modelled;
    the shipped defaults set ``host_ring_hop_s`` for every stack (the ring's host work is
    ds_stpar's whatever Megatron's stack), the others for the local stack only.

    Flash attention: ``flash_fraction`` of peak for head dims 64 and 128 (PyTorch's SDPA
    runs cuDNN's kernel there), ``flash_fraction_other_dims`` for any other head dim
    (PyTorch runs FlashAttention-2 with the head dim padded to a multiple of 8; 0 means the
    same as ``flash_fraction``).

    Stack facts (what the software does, not measured speed): ``flash_attention`` (fused
    attention that skips masked blocks; otherwise Megatron's unfused softmax path with s^2
    score tensors), ``overlap_grad_reduce`` (DP reduction overlapped with backward, as
    Megatron's --overlap-grad-reduce and DeepSpeed's overlap_comm do),
    ``tp_async_backward`` (Megatron overlaps the backward TP collectives of column-parallel
    linears with the GEMMs, needs CUDA_DEVICE_MAX_CONNECTIONS=1), ``grad_bytes`` (bytes
    per gradient element, 2 for bf16/fp16 gradients as DeepSpeed keeps them and planner.md
    counts them; 4 for Megatron's fp32 main grads), ``dp_bucket_elements`` (DeepSpeed's
    reduce/all-gather bucket; planner/emit.py writes the same), ``ring_transport`` (what
    ``DS_STPAR_RING_TRANSPORT`` says on the GPUs: ``auto`` lets the copy engines carry the
    ring linears' hops for a TP group in one node whose GPUs reach each other's memory,
    :attr:`Profile.peer_copies`; ``nccl`` and ``symmetric-memory`` force either; the fused
    ring MLP's and Cannon's hops stay NCCL's over peer links), ``transfer_transport`` (how
    the ring layouts' transfers run, the interleaved layer's and, without peer links, the
    ring layers' hops,
    ``DS_STPAR_TRANSFER_TRANSPORT``: ``nccl``, the default, as Megatron-LM runs them, whose
    ``pretrain_gpt.py`` asserts ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with TP, under which the
    layers keep NCCL's; ``auto`` prices the copy engines through host memory
    (``layers/host_staged.py``) for a TP group in one node whose GPUs do not reach each
    other's memory, as a megatron-core model run in-process with more hardware queues takes
    them, the hops hidden as the copy engines' are; ``host-staged`` forces them),
    ``staged_link_gbs`` (the staged transfers' rate as the TP link's bus bandwidth, GB/s; 0:
    the profile's NCCL rate).
    """

    gemm_peak_fraction: float = 0.8
    gemm_half_dim: float = 56.0
    memory_efficiency: float = 0.7
    flash_attention: bool = True
    flash_fraction: float = 0.45
    flash_fraction_other_dims: float = 0.0
    ring_hop_overlap: float = 0.25
    ring_hop_overlap_copy_engines: float = 0.0
    overlap_fraction: float = 0.8
    overlap_grad_reduce: bool = True
    tp_async_backward: bool = True
    grad_bytes: int = 2
    dp_bucket_elements: int = 500_000_000
    allocator_fraction: float = 0.1
    runtime_reserved_gib: float = 1.5
    stack: str = "fused"
    elementwise_efficiency: float = 0.7
    host_layer_s: float = 0.0
    host_collective_s: float = 0.0
    host_ring_hop_s: float = 0.0
    host_op_s: float = 0.0
    host_interleave_piece_s: float = 0.0
    ring_mlp_pass_s: float = 0.0
    ring_transport: str = "auto"
    transfer_transport: str = "nccl"
    staged_link_gbs: float = 0.0

    def __post_init__(self) -> None:
        if self.stack not in STACKS:
            raise ConfigError(f"calibration stack must be one of {STACKS}, got {self.stack!r}")
        if self.ring_transport not in RING_TRANSPORTS:
            raise ConfigError(
                f"calibration ring_transport must be one of {RING_TRANSPORTS}, "
                f"got {self.ring_transport!r}"
            )
        if self.transfer_transport not in TRANSFER_TRANSPORTS:
            raise ConfigError(
                f"calibration transfer_transport must be one of {TRANSFER_TRANSPORTS}, "
                f"got {self.transfer_transport!r}"
            )
        for name in (*HOST_FIELDS, "ring_mlp_pass_s"):  # seconds
            if getattr(self, name) < 0:
                raise ConfigError(f"calibration {name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "gemm_peak_fraction",
            "memory_efficiency",
            "flash_fraction",
            "elementwise_efficiency",
        ):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"calibration {name} must be in (0, 1], got {value}")
        for name in (
            "ring_hop_overlap",
            "ring_hop_overlap_copy_engines",
            "overlap_fraction",
            "allocator_fraction",
            "flash_fraction_other_dims",
        ):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ConfigError(f"calibration {name} must be in [0, 1], got {value}")
        if self.staged_link_gbs < 0:
            raise ConfigError(
                f"calibration staged_link_gbs must be >= 0, got {self.staged_link_gbs}"
            )
        if self.gemm_half_dim < 0 or self.runtime_reserved_gib < 0:
            raise ConfigError("calibration gemm_half_dim and runtime_reserved_gib must be >= 0")
        if self.grad_bytes not in (2, 4):
            raise ConfigError(f"calibration grad_bytes must be 2 or 4, got {self.grad_bytes}")

    @property
    def local(self) -> bool:
        """Whether this is megatron-core's local (unfused, host-heavy) stack."""
        return self.stack == LOCAL_STACK

    def ring_overlap(self, copy_engines: bool) -> float:
        """The share of a ring linear's hop hidden behind its sub-GEMM, by its transport."""
        if copy_engines and self.ring_hop_overlap_copy_engines:
            return self.ring_hop_overlap_copy_engines
        return self.ring_hop_overlap

    def gemm_efficiency(self, m: float, n: float, k: float) -> float:
        """Fraction of peak a (m x k) @ (k x n) GEMM reaches, compute-bound part only."""
        x0 = self.gemm_half_dim
        return self.gemm_peak_fraction * (m / (m + x0)) * (n / (n + x0)) * (k / (k + x0))

    def replace(self, **changes: Any) -> Calibration:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "calibration") -> Calibration:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json(
        cls, path: str | os.PathLike, gpu: str | None = None, stack: str = "fused"
    ) -> Calibration:
        """A calibration file: flat fields, or ``{"default": {...}, "gpus": {name: {...}},
        "stacks": {name: {...}}}`` (later layers override earlier ones)."""
        data = read_json(path)
        return cls._from_layered(data, gpu, stack, os.fspath(path))

    @classmethod
    def load_default(cls, gpu: str | None = None, stack: str = "fused") -> Calibration:
        """The shipped defaults (``ds_stpar/data/calibration.json``) with ``gpu``'s and then
        ``stack``'s overrides."""
        text = resources.files("ds_stpar").joinpath("data/calibration.json").read_text("utf-8")
        return cls._from_layered(json.loads(text), gpu, stack, "ds_stpar/data/calibration.json")

    @classmethod
    def _from_layered(cls, data: Any, gpu: str | None, stack: str, where: str) -> Calibration:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: a calibration must be a JSON object")
        if stack not in STACKS:
            raise ConfigError(f"{where}: stack must be one of {STACKS}, got {stack!r}")
        if "default" not in data:
            flat = {k: v for k, v in data.items() if not k.startswith("_")}
            return cls.from_dict({**flat, "stack": stack} if stack != "fused" else flat, where)
        merged = dict(data["default"])
        merged.update(data.get("gpus", {}).get(gpu, {}))
        if stack != "fused":
            merged.update(data.get("stacks", {}).get(stack, {}))
            merged["stack"] = stack
        return cls.from_dict({k: v for k, v in merged.items() if not k.startswith("_")}, where)


# --------------------------------------------------------------------------------------
# Profile
# --------------------------------------------------------------------------------------


@dataclass
class Profile:
    """Measurements of one machine.

    ``gemm``: rows ``(m, n, k, tflops)`` of achieved bf16 TFLOP/s for an (m x k) @ (k x n)
    product. ``bus_bandwidth_gbs[collective][n]``: nccl-tests bus bandwidth in GB/s of a
    collective over ``n`` GPUs of one node (``p2p``: plain bandwidth between two GPUs).
    ``peer_copies``: whether the GPUs of a node all reach each other's memory (CUDA peer
    access, ``NCCL_P2P_DISABLE`` not 1), where the ring's ``auto`` transport takes the copy
    engines, and where not, the interleaved layer's ``auto`` transfer transport stages
    through host memory; true when not measured (NVLink nodes).
    """

    gpu: str
    peak_tflops: float = 0.0
    gemm: list[tuple[int, int, int, float]] = field(default_factory=list)
    bus_bandwidth_gbs: dict[str, dict[int, float]] = field(default_factory=dict)
    peer_copies: bool = True

    # ---- lookups used by the cost model ------------------------------------------------
    def gemm_tflops(self, m: float, n: float, k: float) -> float | None:
        """Achieved TFLOP/s for this shape by inverse-distance weighting of the measured
        shapes nearest in log2(m, n, k); ``None`` outside the measured grid (more than a
        factor 2 beyond it in any dimension), where the calibration curve applies."""
        if not self.gemm:
            return None
        query = (math.log2(m), math.log2(n), math.log2(k))
        for axis in range(3):
            values = [math.log2(row[axis]) for row in self.gemm]
            if not min(values) - 1 <= query[axis] <= max(values) + 1:
                return None
        scored = sorted(
            (math.dist(query, (math.log2(r[0]), math.log2(r[1]), math.log2(r[2]))), r[3])
            for r in self.gemm
        )[:4]
        if scored[0][0] < 1e-9:
            return scored[0][1]
        weights = [1.0 / d**2 for d, _ in scored]
        return sum(w * t for w, (_, t) in zip(weights, scored)) / sum(weights)

    def bus_bandwidth(self, collective: str, n: int) -> float | None:
        """Measured busbw (GB/s) for ``n`` GPUs, linear in n between measured sizes; ``None``
        when the collective or a bracketing size was not measured."""
        table = self.bus_bandwidth_gbs.get(collective) or {}
        if n in table:
            return table[n]
        below = [size for size in table if size < n]
        above = [size for size in table if size > n]
        if not below or not above:
            return None
        lo, hi = max(below), min(above)
        return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)

    # ---- JSON ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "gpu": self.gpu,
            "peak_tflops": self.peak_tflops,
            "gemm": [
                {
                    "m": m,
                    "n": n,
                    "k": k,
                    "tflops": t,
                    **({"efficiency": t / self.peak_tflops} if self.peak_tflops else {}),
                }
                for m, n, k, t in self.gemm
            ],
            "bus_bandwidth_gbs": {
                name: {str(size): bw for size, bw in sorted(table.items())}
                for name, table in self.bus_bandwidth_gbs.items()
            },
            "peer_copies": self.peer_copies,
        }

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2)
            handle.write("\n")

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> Profile:
        if not isinstance(data, dict) or "gpu" not in data:
            raise ConfigError(f'{where}: a profile is a JSON object with a "gpu" key')
        try:
            gemm = [
                (int(r["m"]), int(r["n"]), int(r["k"]), float(r["tflops"]))
                for r in data.get("gemm", [])
            ]
            busbw = {
                name: {int(size): float(bw) for size, bw in table.items()}
                for name, table in data.get("bus_bandwidth_gbs", {}).items()
            }
            profile = cls(
                gpu=str(data["gpu"]),
                peak_tflops=float(data.get("peak_tflops", 0.0)),
                gemm=gemm,
                bus_bandwidth_gbs=busbw,
                peer_copies=data.get("peer_copies", True),
            )
            if not isinstance(profile.peer_copies, bool):
                raise TypeError(f"peer_copies must be true or false, got {profile.peer_copies!r}")
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ConfigError(f"{where}: malformed profile ({type(err).__name__}: {err})") from None
        profile._validate(where)
        return profile

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Profile:
        return cls.from_dict(read_json(path), os.fspath(path))

    @classmethod
    def from_layers_benchmark(cls, data: dict, gpu: str, latency_s: float) -> Profile:
        """The link bandwidths that ``bench/layers.py`` measured on ``P`` GPUs (``data["world"]``,
        2 for files that predate it; its ``ring_overlap`` cases, ``--out`` JSON):
        point-to-point = one hop's ``T/P x h`` bf16 chunk over ``hop_ms``; all-gather bus
        bandwidth = the ``(P - 1) T/P x h`` bf16 bytes each rank receives while gathering
        ``T x h``, over the all-gather's share of Megatron's column forward
        (``megatron_fwd_ms - gemm_only_ms``), used for reduce-scatter and all-reduce too for
        want of separate figures; each less the per-step ``latency_s`` the cost model adds
        back, median over the cases (a case whose timings leave no positive time for the
        transfer, run-to-run noise when the GEMM alone timed slower, is skipped). Entered for
        group size ``P``. Peer copies unless the run's ``env`` had ``NCCL_P2P_DISABLE=1``."""
        try:
            world = int(data.get("world", 2))
            cases = data["ring_overlap"]["cases"]
            p2p, gather = [], []
            for c in cases:
                chunk = 2 * c["tokens"] * c["hidden"] / world  # bytes of T/P x h bf16
                hop_s = c["hop_ms"] * 1e-3 - latency_s
                ag_s = (c["megatron_fwd_ms"] - c["gemm_only_ms"]) * 1e-3 - latency_s
                if hop_s > 0:
                    p2p.append(chunk / hop_s / 1e9)
                if ag_s > 0:
                    gather.append((world - 1) * chunk / ag_s / 1e9)
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"layers benchmark: no ring_overlap cases ({err})") from None
        if world < 2 or not p2p or not gather:
            raise ConfigError("layers benchmark: ring_overlap cases give no positive bandwidth")
        busbw = statistics.median(gather)
        table = {name: {world: busbw} for name in ("all_reduce", "all_gather", "reduce_scatter")}
        peer = (data.get("env") or {}).get("NCCL_P2P_DISABLE") != "1"
        p2p_table = {"p2p": {world: statistics.median(p2p)}}
        return cls(gpu, bus_bandwidth_gbs={**table, **p2p_table}, peer_copies=peer)

    def _validate(self, where: str) -> None:
        unknown = sorted(set(self.bus_bandwidth_gbs) - set(COLLECTIVES))
        if unknown:
            raise ConfigError(f"{where}: unknown collective(s) {unknown}; known: {COLLECTIVES}")
        bad_gemm = [r for r in self.gemm if min(r) <= 0]
        bad_bw = [
            (name, size)
            for name, table in self.bus_bandwidth_gbs.items()
            for size, bw in table.items()
            if size < 2 or bw <= 0
        ]
        if bad_gemm or bad_bw or self.peak_tflops < 0:
            raise ConfigError(
                f"{where}: profile figures must be positive (GEMM rows {bad_gemm[:3]}, "
                f"bandwidth entries {bad_bw[:3]})"
            )


# --------------------------------------------------------------------------------------
# Measuring (GPU only)
# --------------------------------------------------------------------------------------

GEMM_M = (512, 2048, 8192, 32768)
GEMM_NK = (128, 1024, 4096, 8192, 16384)
COLLECTIVE_MIB = 256
COLLECTIVE_CALLS = 20  # the same on every rank: a collective's call count must match


def preset_for(device_name: str, total_bytes: int) -> str | None:
    """Our GPU preset for a CUDA device name, e.g. "NVIDIA H100 80GB HBM3" -> h100-80g."""
    name = device_name.lower()
    for token, preset in (("h200", "h200-141g"), ("h100", "h100-80g")):
        if token in name:
            return preset
    if "a100" in name:
        return "a100-80g" if total_bytes > 50 * 1024**3 else "a100-40g"
    return None


def _time_calls(torch: Any, fn: Any, calls: int) -> float:
    """Seconds per call of ``fn`` over ``calls`` calls after 3 warm-up calls (CUDA events)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / 1e3 / calls


def _time_cuda(torch: Any, fn: Any, min_seconds: float = 0.05) -> float:
    """Seconds per call of a local ``fn``, with enough calls to run ``min_seconds``. Not for
    collectives: the call count depends on this rank's timing (use :func:`_time_calls`)."""
    calls = 1
    while True:
        seconds = _time_calls(torch, fn, calls) * calls
        if seconds >= min_seconds or calls >= 1024:
            return seconds / calls
        calls *= 4


def _measure_gemms(torch: Any, device: Any) -> list[tuple[int, int, int, float]]:
    rows = []
    for m in GEMM_M:
        for n in GEMM_NK:
            for k in GEMM_NK:
                a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
                seconds = _time_cuda(torch, lambda a=a, b=b: torch.matmul(a, b))
                rows.append((m, n, k, 2.0 * m * n * k / seconds / 1e12))
                del a, b
    return rows


def _busbw(name: str, n: int, nbytes: int, seconds: float) -> float:
    """nccl-tests bus bandwidth: algbw x 2(n-1)/n (all-reduce), x (n-1)/n (gather/scatter)."""
    algbw = nbytes / seconds / 1e9
    if name == "all_reduce":
        return algbw * 2 * (n - 1) / n
    if name in ("all_gather", "reduce_scatter"):
        return algbw * (n - 1) / n
    return algbw


def _collective_ops(torch: Any, device: Any, nbytes: int, n: int, group: Any) -> dict[str, Any]:
    """Callables running one all-reduce / all-gather / reduce-scatter of ``nbytes`` (full size)."""
    dist = torch.distributed
    shard = torch.empty(nbytes // 2 // n, device=device, dtype=torch.bfloat16)
    full = torch.empty(shard.numel() * n, device=device, dtype=torch.bfloat16)
    return {
        "all_reduce": lambda: dist.all_reduce(full, group=group),
        "all_gather": lambda: dist.all_gather_into_tensor(full, shard, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full, group=group),
    }


def _measure_collectives(torch: Any, device: Any) -> dict[str, dict[int, float]]:
    """busbw of all-reduce / all-gather / reduce-scatter over the first n ranks (n = 2, 4, ...,
    world) and of a send/recv pair; every rank runs every step (new_group is collective)."""
    dist = torch.distributed
    world, rank = dist.get_world_size(), dist.get_rank()
    nbytes = COLLECTIVE_MIB * 1024**2
    sizes = sorted({2**i for i in range(1, world.bit_length()) if 2**i <= world} | {world})
    table: dict[str, dict[int, float]] = {name: {} for name in COLLECTIVES}
    for n in sizes:
        group = dist.new_group(list(range(n)))
        if rank < n:
            for name, op in _collective_ops(torch, device, nbytes, n, group).items():
                seconds = _time_calls(torch, op, COLLECTIVE_CALLS)
                table[name][n] = _busbw(name, n, nbytes, seconds)
        dist.barrier()
    pair = dist.new_group([0, 1])  # collective: every rank creates it
    if rank < 2:
        buf = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
        peer = 1 - rank

        def exchange() -> None:
            op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, buf, peer, group=pair)
            for req in dist.batch_isend_irecv([op]):
                req.wait()

        table["p2p"][2] = _busbw("p2p", 2, nbytes, _time_calls(torch, exchange, COLLECTIVE_CALLS))
    dist.barrier()
    return {name: sizes_bw for name, sizes_bw in table.items() if sizes_bw}


def measure(device: Any = None) -> Profile:
    """Measure this machine: bf16 GEMMs over ``GEMM_M x GEMM_NK x GEMM_NK`` and (only when
    torch.distributed is initialised with world > 1) collectives over the GPUs of the world.
    Raises :class:`StparError` without a CUDA GPU."""
    try:
        import torch
    except ImportError:
        raise StparError(
            "ds-stpar profile needs PyTorch with CUDA; torch is not installed"
        ) from None
    if not torch.cuda.is_available():
        raise StparError(
            "ds-stpar profile needs a CUDA GPU and none is visible (torch.cuda.is_available() "
            "is False); run it on the GPU machines, then pass the JSON with --profile"
        )
    device = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
    props = torch.cuda.get_device_properties(device)
    preset = preset_for(props.name, props.total_memory)
    profile = Profile(
        gpu=preset or props.name,
        peak_tflops=GPU_PRESETS[preset].peak_tflops if preset else 0.0,
        gemm=_measure_gemms(torch, device),
    )
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        profile.bus_bandwidth_gbs = _measure_collectives(torch, device)
        profile.peer_copies = _peer_copies(device)
    return profile


def _peer_copies(device: Any) -> bool:
    """Whether every GPU of the world reaches every other's memory, as the ring's ``auto``
    transport asks of a group (``layers.symmetric.peer_links``; false when the world spans
    hosts). Collective over the world."""
    import torch.distributed as dist

    from ds_stpar.layers.symmetric import peer_links

    return peer_links(dist.group.WORLD, device)
