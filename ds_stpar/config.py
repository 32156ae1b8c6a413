"""Typed, validated inputs: the one place that turns JSON and CLI flags into objects.

- :class:`ModelSpec` — a decoder-only transformer (GPT-2/3 style or LLaMA style), from a
  preset name, a HuggingFace ``config.json`` (model_type gpt2, llama, mistral, qwen2) or our
  own model JSON (the fields of :class:`ModelSpec`).
- :class:`GPUSpec` / :class:`ClusterSpec` — a GPU preset with every figure overridable,
  nodes x GPUs per node, and optionally a measured :class:`~ds_stpar.planner.profile.Profile`.
- :class:`TrainSpec` — sequence length, global batch, dtype, optimizer.
- :class:`Layout` — the parallel structure (dp, tp, pp, tp_mode): a value, never global state.
- :class:`Strategy` — a layout plus the knobs the planner chooses with it (ZeRO stage,
  micro-batch, recompute, sequence parallel, virtual pipeline stages).

Bad input raises :class:`~ds_stpar.errors.ConfigError` with a message that names the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ds_stpar.errors import ConfigError

TP_MODES = ("megatron", "ring", "cannon")
RECOMPUTE_MODES = ("none", "selective", "full")
DTYPES = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "adam", "sgd")
#: what carries the ring's hops (DS_STPAR_RING_TRANSPORT, ds_stpar/layers/symmetric.py)
RING_TRANSPORTS = ("auto", "nccl", "symmetric-memory")
#: what carries the interleaved layer's transfers and, without peer links, the ring layers'
#: hops (DS_STPAR_TRANSFER_TRANSPORT, ds_stpar/layers/host_staged.py)
TRANSFER_TRANSPORTS = ("auto", "nccl", "host-staged")
GiB = 1024**3


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file; a syntax error names the file, line and column."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}:{err.colno}: malformed JSON: {err.msg}") from None


def _check_positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(
                f"{type(obj).__name__}.{name} must be a positive integer, got {value!r}"
            )


def _hf_model_name(config: dict, path: str) -> str:
    """A HF config's model name: its ``_name_or_path``, else the folder of a ``config.json``
    (a model's own folder), else the file's stem (``bench/models/llama-4b.json``)."""
    if config.get("_name_or_path"):
        return str(config["_name_or_path"])
    path = os.path.abspath(path)
    if os.path.basename(path) == "config.json":
        return os.path.basename(os.path.dirname(path))
    return os.path.splitext(os.path.basename(path))[0]


def _from_dict(cls: type, data: dict, where: str):
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys by name."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
    try:
        return cls(**data)
    except TypeError as err:
        raise ConfigError(f"{where}: {err}") from None


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    ``activation`` is "gelu" (a 2-matrix MLP h -> f -> h) or "swiglu" (gate and up
    projections h -> 2f, then f -> h). ``num_query_groups`` < heads means GQA.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    ffn_hidden_size: int = 0  # 0: 4h for gelu
    num_query_groups: int = 0  # 0: same as heads (MHA)
    kv_channels: int = 0  # head dim; 0: hidden / heads
    activation: str = "gelu"
    normalization: str = "layernorm"
    add_bias_linear: bool = True
    tied_embeddings: bool = True
    position_embedding: str = "learned"  # "learned" adds max_position_embeddings x h params
    max_position_embeddings: int = 2048
    dropout: float = 0.0  # hidden and attention dropout; > 0 keeps 1-byte masks (planner memory)

    def __post_init__(self) -> None:
        if not self.ffn_hidden_size:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if not self.num_query_groups:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if not self.kv_channels:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"model {self.name}: hidden_size {self.hidden_size} is not divisible by "
                    f"num_attention_heads {self.num_attention_heads}; set kv_channels"
                )
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        _check_positive(
            self,
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "vocab_size",
            "ffn_hidden_size",
            "num_query_groups",
            "kv_channels",
            "max_position_embeddings",
        )
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"model {self.name}: num_attention_heads {self.num_attention_heads} must be a "
                f"multiple of num_query_groups {self.num_query_groups}"
            )
        if self.activation not in ("gelu", "swiglu"):
            raise ConfigError(
                f"model {self.name}: activation must be gelu or swiglu, got {self.activation!r}"
            )
        if self.normalization not in ("layernorm", "rmsnorm"):
            raise ConfigError(
                f"model {self.name}: normalization must be layernorm or rmsnorm, got {self.normalization!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model {self.name}: dropout must be in [0, 1), got {self.dropout}")
        if self.position_embedding not in ("learned", "rope"):
            raise ConfigError(
                f"model {self.name}: position_embedding must be learned or rope, got {self.position_embedding!r}"
            )

    # ---- derived sizes -------------------------------------------------------------
    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_size(self) -> int:
        return self.num_query_groups * self.kv_channels

    def params_per_layer(self) -> int:
        """Weights and biases of one transformer block (attention, MLP, two norms)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        qkv = h * (self.q_size + 2 * self.kv_size)
        proj = self.q_size * h
        mlp = h * f * (3 if self.gated else 2)
        norms = 2 * h * (2 if self.normalization == "layernorm" else 1)
        biases = 0
        if self.add_bias_linear:
            biases = (self.q_size + 2 * self.kv_size) + h + (2 * f if self.gated else f) + h
        return qkv + proj + mlp + norms + biases

    def embedding_params(self) -> int:
        """Input embedding (+ learned positions); the LM head when untied is counted apart."""
        pos = (
            self.max_position_embeddings * self.hidden_size
            if self.position_embedding == "learned"
            else 0
        )
        return self.vocab_size * self.hidden_size + pos

    def lm_head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    def final_norm_params(self) -> int:
        return self.hidden_size * (2 if self.normalization == "layernorm" else 1)

    def num_params(self) -> int:
        return (
            self.num_layers * self.params_per_layer()
            + self.embedding_params()
            + self.lm_head_params()
            + self.final_norm_params()
        )

    # ---- loading -------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, data: dict, name: str = "hf-model") -> ModelSpec:
        """From a HuggingFace config dict (gpt2, llama, mistral, qwen2)."""
        model_type = data.get("model_type")
        try:
            if model_type == "gpt2":
                h = data["n_embd"]
                return cls(
                    name=name,
                    num_layers=data["n_layer"],
                    hidden_size=h,
                    num_attention_heads=data["n_head"],
                    vocab_size=data["vocab_size"],
                    ffn_hidden_size=data.get("n_inner") or 4 * h,
                    activation="gelu",
                    normalization="layernorm",
                    add_bias_linear=True,
                    tied_embeddings=data.get("tie_word_embeddings", True),
                    position_embedding="learned",
                    max_position_embeddings=data.get("n_positions", 1024),
                    dropout=data.get("resid_pdrop", 0.1),
                )
            if model_type in ("llama", "mistral", "qwen2"):
                heads = data["num_attention_heads"]
                return cls(
                    name=name,
                    num_layers=data["num_hidden_layers"],
                    hidden_size=data["hidden_size"],
                    num_attention_heads=heads,
                    num_query_groups=data.get("num_key_value_heads") or heads,
                    kv_channels=data.get("head_dim") or data["hidden_size"] // heads,
                    vocab_size=data["vocab_size"],
                    ffn_hidden_size=data["intermediate_size"],
                    activation="swiglu",
                    normalization="rmsnorm",
                    # qwen2 has biases on q/k/v only; counted as no linear bias (< 0.01%).
                    add_bias_linear=False,
                    tied_embeddings=data.get("tie_word_embeddings", False),
                    position_embedding="rope",
                    max_position_embeddings=data.get("max_position_embeddings", 4096),
                    dropout=data.get("attention_dropout", 0.0),
                )
        except KeyError as err:
            raise ConfigError(
                f"{name}: HF config of model_type {model_type!r} lacks key {err}"
            ) from None
        raise ConfigError(
            f"{name}: unsupported HF model_type {model_type!r}; supported: gpt2, llama, mistral, qwen2"
        )

    @classmethod
    def load(cls, spec: str | dict | ModelSpec) -> ModelSpec:
        """A preset name, a path to a HF config.json or our model JSON, or a dict."""
        if isinstance(spec, ModelSpec):
            return spec
        if isinstance(spec, dict):
            if "model_type" in spec:
                return cls.from_hf_config(spec, spec.get("_name_or_path") or "hf-model")
            return _from_dict(cls, spec, "model JSON")
        if spec in MODEL_PRESETS:
            return MODEL_PRESETS[spec]
        if os.path.exists(spec) or spec.endswith(".json"):
            data = read_json(spec)
            if not isinstance(data, dict):
                raise ConfigError(f"{spec}: a model JSON must be an object")
            if "model_type" in data:
                return cls.from_hf_config(data, _hf_model_name(data, spec))
            data.setdefault("name", os.path.splitext(os.path.basename(spec))[0])
            return _from_dict(cls, data, spec)
        raise ConfigError(
            f"unknown model {spec!r}; presets: {', '.join(MODEL_PRESETS)}; or a path to a config JSON"
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, vocab_size=50257, max_position_embeddings=2048)


def _llama(
    name: str, layers: int, hidden: int, heads: int, groups: int, ffn: int, vocab: int, ctx: int
) -> ModelSpec:
    return ModelSpec(
        name,
        layers,
        hidden,
        heads,
        vocab_size=vocab,
        ffn_hidden_size=ffn,
        num_query_groups=groups,
        activation="swiglu",
        normalization="rmsnorm",
        add_bias_linear=False,
        tied_embeddings=False,
        position_embedding="rope",
        max_position_embeddings=ctx,
    )


# GPT-3 sizes from Brown et al. 2020 (Table 2.1; 1.3B with 16 heads of 128 as Megatron runs it).
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _gpt("gpt3-125m", 12, 768, 12),
        _gpt("gpt3-350m", 24, 1024, 16),
        _gpt("gpt3-760m", 24, 1536, 16),
        _gpt("gpt3-1.3b", 24, 2048, 16),
        _gpt("gpt3-2.7b", 32, 2560, 32),
        _gpt("gpt3-6.7b", 32, 4096, 32),
        _gpt("gpt3-13b", 40, 5120, 40),
        _gpt("gpt3-175b", 96, 12288, 96),
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
        _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    )
}


# --------------------------------------------------------------------------------------
# Hardware
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model. Bandwidths are per GPU and per direction, in GB/s (1e9 B/s).

    ``nvlink_gbs`` is the intra-node bus bandwidth a collective can reach (nccl-tests
    "busbw" convention), ``internode_gbs`` the same across nodes (one NIC per GPU).
    """

    name: str
    peak_tflops: float  # dense bf16
    hbm_gib: float
    hbm_gbs: float
    nvlink_gbs: float
    internode_gbs: float
    intra_latency_us: float = 8.0
    inter_latency_us: float = 15.0


# Datasheet figures (planner.md "Hardware defaults"); NVLink 600/900 GB/s bidirectional
# -> 300/450 per direction; nccl reaches ~75% of it as busbw (measured: 330 GB/s on H100).
# Node network 8 x 200 / 400 Gb/s -> 25 / 50 GB/s per GPU, ~85% reachable.
# Memory: what torch.cuda reports as total_memory where we measured it (metrics.jsonl's
# device_gib): H100 80GB HBM3 85,017,493,504 B = 79.18 GiB (BENCHMARKS.md tenth session; a plan
# predicted at 79.5 GiB in all ran there at 72.7 allocated, 76.1 reserved), H200
# 150,109,880,320 B = 139.80 GiB (eleventh session, call 45); else the datasheet's decimal GB.
H100_MEASURED_GIB = 79.1787109375
H200_MEASURED_GIB = 139.80072021484375
GPU_PRESETS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("a100-40g", 312.0, 40 * 1e9 / GiB, 1555.0, 230.0, 21.0),
        GPUSpec("a100-80g", 312.0, 80 * 1e9 / GiB, 2039.0, 230.0, 21.0),
        GPUSpec("h100-80g", 989.0, H100_MEASURED_GIB, 3350.0, 330.0, 42.0),
        GPUSpec("h200-141g", 989.0, H200_MEASURED_GIB, 4800.0, 330.0, 42.0),
    )
}


def load_gpu(name: str, **overrides: float) -> GPUSpec:
    """A GPU preset with the given figures replaced (``None`` values are ignored)."""
    if name not in GPU_PRESETS:
        raise ConfigError(f"unknown GPU {name!r}; presets: {', '.join(GPU_PRESETS)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    for key, value in changes.items():
        if value <= 0:
            raise ConfigError(f"GPU figure {key} must be positive, got {value}")
    return dataclasses.replace(GPU_PRESETS[name], **changes)


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` x ``gpus_per_node`` GPUs of one kind, optionally with a measured profile.

    ``tp_across_nodes`` lets the search place tensor-parallel groups across nodes.
    """

    gpu: GPUSpec
    num_gpus: int
    gpus_per_node: int = 8
    profile: Any = None  # ds_stpar.planner.profile.Profile
    tp_across_nodes: bool = False

    def __post_init__(self) -> None:
        _check_positive(self, "num_gpus", "gpus_per_node")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ConfigError(
                f"{self.num_gpus} GPUs is not a whole number of nodes of {self.gpus_per_node} GPUs; "
                f"use a multiple of {self.gpus_per_node} or set --gpus-per-node"
            )

    @property
    def node_size(self) -> int:
        """GPUs that share NVLink: a node, or the whole cluster when it is smaller."""
        return min(self.num_gpus, self.gpus_per_node)

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)


# --------------------------------------------------------------------------------------
# Training setup
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainSpec:
    """Sequence length, global batch in sequences, numeric format and optimizer."""

    seq_len: int
    global_batch: int
    dtype: str = "bf16"
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        _check_positive(self, "seq_len", "global_batch")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")

    @classmethod
    def from_tokens(cls, seq_len: int, global_batch_tokens: int, **kw: Any) -> TrainSpec:
        if global_batch_tokens % seq_len:
            raise ConfigError(
                f"global batch of {global_batch_tokens} tokens is not a whole number of "
                f"{seq_len}-token sequences"
            )
        return cls(seq_len, global_batch_tokens // seq_len, **kw)

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


# --------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How one world of ``dp * pp * tp`` ranks is arranged. A value, not global state.

    Rank order is TP innermost, then PP, then DP (Megatron's default order):
    ``rank = (dp_index * pp + pp_index) * tp + tp_index``. With ``tp_mode="cannon"`` the
    TP group is a q x q torus (tp = q*q) in row-major order.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    tp_mode: str = "megatron"

    def __post_init__(self) -> None:
        _check_positive(self, "dp", "tp", "pp")
        if self.tp_mode not in TP_MODES:
            raise ConfigError(f"tp_mode must be one of {TP_MODES}, got {self.tp_mode!r}")
        if self.tp_mode == "cannon" and math.isqrt(self.tp) ** 2 != self.tp:
            raise ConfigError(
                f"tp_mode=cannon needs a square TP degree (4, 9, 16, ...), got tp={self.tp}"
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_index, pp_index, tp_index) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} outside a world of {self.world_size}")
        tp_index = rank % self.tp
        pp_index = (rank // self.tp) % self.pp
        dp_index = rank // (self.tp * self.pp)
        return dp_index, pp_index, tp_index

    def rank_of(self, dp_index: int, pp_index: int, tp_index: int) -> int:
        return (dp_index * self.pp + pp_index) * self.tp + tp_index

    def tp_groups(self) -> list[list[int]]:
        return [
            [self.rank_of(d, p, t) for t in range(self.tp)]
            for d in range(self.dp)
            for p in range(self.pp)
        ]

    def dp_groups(self) -> list[list[int]]:
        return [
            [self.rank_of(d, p, t) for d in range(self.dp)]
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def pp_groups(self) -> list[list[int]]:
        return [
            [self.rank_of(d, p, t) for p in range(self.pp)]
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def short(self) -> str:
        mode = "" if self.tp_mode == "megatron" or self.tp == 1 else f"/{self.tp_mode}"
        return f"dp{self.dp}-tp{self.tp}{mode}-pp{self.pp}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Layout:
        return _from_dict(cls, data, "layout")


@dataclass(frozen=True)
class Strategy:
    """A layout plus the per-layout training knobs the planner chooses.

    ``vpp_layers``: layers per virtual pipeline stage (Megatron's
    --num-layers-per-virtual-pipeline-stage); 0 means no interleaving.
    ``fused_ring_mlp`` (ring layouts only; other modes ignore it): run each MLP block as one
    fused ring pass (``layers/ring_mlp.py``) instead of the two ring linears' passes
    (``ring_two_pass_mlp``).
    ``first_stage_layers`` / ``last_stage_layers``: uneven pipeline stages (Megatron's
    --decoder-first/last-pipeline-num-layers); 0 means even.
    ``interleave`` (ring layouts only): k >= 2 runs each layer as
    :class:`~ds_stpar.layers.interleave.InterleavedTransformerLayer`, k pieces of the
    micro-batch's sequences whose collectives hide behind each other's compute (0: off). The
    micro-batch must hold a multiple of k sequences (rule 17).
    ``recompute_layers`` (full recompute only): recompute the first k layers of each
    pipeline stage and keep every activation of the others (Megatron's --recompute-method
    block --recompute-num-layers k); a stage of at most k layers recomputes them all. 0 means
    every layer (--recompute-method uniform, one layer per checkpoint). Between no recompute
    and full, it spends the memory a layout has left on skipping recompute.
    """

    layout: Layout
    micro_batch: int = 1
    zero: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    vpp_layers: int = 0
    first_stage_layers: int = 0
    last_stage_layers: int = 0
    fused_ring_mlp: bool = True
    recompute_layers: int = 0
    interleave: int = 0

    def __post_init__(self) -> None:
        _check_positive(self, "micro_batch")
        if self.interleave < 0 or self.interleave == 1:
            raise ConfigError(
                f"interleave must be 0 (off) or a piece count >= 2, got {self.interleave}"
            )
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if self.vpp_layers < 0 or self.first_stage_layers < 0 or self.last_stage_layers < 0:
            raise ConfigError("vpp_layers and first/last stage layers must be >= 0")
        if self.recompute_layers < 0:
            raise ConfigError(f"recompute_layers must be >= 0, got {self.recompute_layers}")
        if self.recompute_layers and self.recompute != "full":
            raise ConfigError(
                f"recompute_layers={self.recompute_layers} needs recompute 'full' (the block "
                f"method recomputes whole layers), got {self.recompute!r}"
            )
        if self.recompute_layers and self.vpp_layers:
            raise ConfigError(
                "recompute_layers with vpp_layers is not supported: Megatron's block method "
                "counts layers per virtual stage, which the planner does not model"
            )

    def recomputed_layers(self, stage_layers: int) -> int:
        """Layers of a stage of ``stage_layers`` that recompute: all under full recompute
        (``recompute_layers`` 0, or a stage of at most that many), the first
        ``recompute_layers`` under the block method, none otherwise."""
        if self.recompute != "full":
            return 0
        return min(self.recompute_layers or stage_layers, stage_layers)

    @property
    def runs_interleaved(self) -> bool:
        """Whether each layer runs as the interleaved layer: a ring layout over more than one
        GPU with ``interleave`` pieces."""
        return self.layout.tp > 1 and self.layout.tp_mode == "ring" and self.interleave > 1

    @property
    def runs_fused_ring_mlp(self) -> bool:
        """Whether the MLP runs as one fused ring pass: a ring layout over more than one GPU
        with ``fused_ring_mlp`` on, outside the interleaved layer (whose linears run their
        local GEMMs between its own collectives)."""
        return (
            self.layout.tp > 1
            and self.layout.tp_mode == "ring"
            and self.fused_ring_mlp
            and not self.runs_interleaved
        )

    def runs_fused_swiglu(self, model: ModelSpec) -> bool:
        """Whether a GPU run of ``model`` under this strategy uses megatron-core's fused SwiGLU:
        a gated MLP not run as the fused ring pass, which computes its own activation
        (:func:`~ds_stpar.integrations.megatron.fused_swiglu`; the planner prices the same)."""
        return model.gated and not self.runs_fused_ring_mlp

    def runs_ring_two_pass_mlp(self, model: ModelSpec) -> bool:
        """Whether the MLP runs as the ring's two passes in one node
        (:func:`~ds_stpar.layers.ring_mlp.ring_two_pass_mlp`): a ring layout over more than
        one GPU without the fused pass, unless megatron-core's fused SwiGLU runs the gated
        MLP over the two ring linears (:meth:`runs_fused_swiglu`)."""
        return (
            self.layout.tp > 1
            and self.layout.tp_mode == "ring"
            and not self.fused_ring_mlp
            and not self.runs_interleaved
            and not self.runs_fused_swiglu(model)
        )

    def short(self) -> str:
        parts = [self.layout.short(), f"mb{self.micro_batch}", f"z{self.zero}"]
        if self.recompute_layers:
            parts.append(f"rc-block{self.recompute_layers}")
        elif self.recompute != "none":
            parts.append(f"rc-{self.recompute}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.vpp_layers:
            parts.append(f"vpp{self.vpp_layers}")
        if self.runs_interleaved:
            parts.append(f"interleave{self.interleave}")
        elif self.layout.tp_mode == "ring" and not self.fused_ring_mlp:
            parts.append("ring-linear-mlp")
        return " ".join(parts)

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["layout"] = self.layout.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Strategy:
        data = dict(data)
        layout = Layout.from_dict(data.pop("layout", {}))
        return _from_dict(cls, {**data, "layout": layout}, "strategy")


def model_key(strategy: Strategy) -> Strategy:
    """What a layout's model depends on: the strategy without its batch and ZeRO knobs, and
    with full recompute, of every layer or a block of them, as none (a runtime switch of one
    megatron-core model,
    :func:`ds_stpar.integrations.megatron.set_full_recompute`). Buckets whose keys are equal
    share one model: a short bucket without recompute in the home layout of a fully
    recomputed long bucket runs on the home model, with no switch."""
    recompute = "none" if strategy.recompute == "full" else strategy.recompute
    return dataclasses.replace(
        strategy, micro_batch=1, zero=0, recompute=recompute, recompute_layers=0
    )


def stage_layers(num_layers: int, strategy: Strategy) -> list[int]:
    """Transformer layers on each pipeline stage (uneven first/last stages allowed)."""
    pp = strategy.layout.pp
    if pp == 1:
        return [num_layers]
    first, last = strategy.first_stage_layers, strategy.last_stage_layers
    middle_stages = pp - (1 if first else 0) - (1 if last else 0)
    rest = num_layers - first - last
    if middle_stages == 0:
        if rest:
            raise ConfigError(
                f"first ({first}) + last ({last}) stage layers must equal num_layers {num_layers}"
            )
        return [first, last]
    if rest < middle_stages or rest % middle_stages:
        raise ConfigError(
            f"num_layers {num_layers} minus first/last stage layers ({first}+{last}) = {rest} "
            f"is not divisible by the {middle_stages} remaining pipeline stages"
        )
    per = rest // middle_stages
    layers = [per] * middle_stages
    if first:
        layers.insert(0, first)
    if last:
        layers.append(last)
    return layers


@dataclass(frozen=True)
class Bucket:
    """A sequence-length bucket: packed rows of at most ``max_len`` tokens under ``strategy``."""

    max_len: int
    strategy: Strategy

    def to_dict(self) -> dict:
        return {"max_len": self.max_len, "strategy": self.strategy.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> Bucket:
        return cls(int(data["max_len"]), Strategy.from_dict(data["strategy"]))


@dataclass(frozen=True)
class StparConfig:
    """The "ds_stpar" section of ds_stpar.json: what to train, and how.

    ``buckets`` sorted by ``max_len``; the last (longest) bucket's strategy is the home
    layout where fp32 master weights and optimizer state live. A static plan has one bucket.
    """

    model: ModelSpec
    train: TrainSpec
    buckets: tuple[Bucket, ...]
    gpu: str = "h100-80g"
    gpus_per_node: int = 8
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.buckets:
            raise ConfigError("ds_stpar section: at least one bucket is needed")
        edges = [b.max_len for b in self.buckets]
        if edges != sorted(edges) or len(set(edges)) != len(edges):
            raise ConfigError(f"ds_stpar section: bucket edges must increase strictly, got {edges}")
        if edges[-1] != self.train.seq_len:
            raise ConfigError(
                f"ds_stpar section: the last bucket edge {edges[-1]} must equal seq_len {self.train.seq_len}"
            )
        worlds = {b.strategy.layout.world_size for b in self.buckets}
        if len(worlds) != 1:
            raise ConfigError(
                f"ds_stpar section: every bucket layout must use the same world size, got {sorted(worlds)}"
            )

    @property
    def home(self) -> Strategy:
        return self.buckets[-1].strategy

    @property
    def world_size(self) -> int:
        return self.home.layout.world_size

    def to_dict(self) -> dict:
        return {
            "model": self.model.to_dict(),
            "train": dataclasses.asdict(self.train),
            "buckets": [b.to_dict() for b in self.buckets],
            "gpu": self.gpu,
            "gpus_per_node": self.gpus_per_node,
            **({"extra": self.extra} if self.extra else {}),
        }

    @classmethod
    def from_dict(cls, data: dict, where: str = "ds_stpar section") -> StparConfig:
        try:
            return cls(
                model=ModelSpec.load(data["model"]),
                train=_from_dict(TrainSpec, data["train"], f"{where}.train"),
                buckets=tuple(Bucket.from_dict(b) for b in data["buckets"]),
                gpu=data.get("gpu", "h100-80g"),
                gpus_per_node=data.get("gpus_per_node", 8),
                extra=data.get("extra", {}),
            )
        except KeyError as err:
            raise ConfigError(f"{where}: missing key {err}") from None

    @classmethod
    def from_deepspeed_json(cls, path: str) -> StparConfig:
        data = read_json(path)
        if not isinstance(data, dict) or "ds_stpar" not in data:
            raise ConfigError(
                f'{path}: no "ds_stpar" section; write one with `ds-stpar plan --out DIR`'
            )
        return cls.from_dict(data["ds_stpar"], f"{path}: ds_stpar")
