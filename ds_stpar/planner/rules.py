"""Validity rules of a strategy: Megatron-LM's 12 (numbered as planner.md) plus ours.

Each rule is a small function returning the violation message (naming the rule and the
numbers, and the fix) or ``None``. :func:`violations` runs them all; :func:`check` raises
:class:`~ds_stpar.errors.ConfigError`.

Megatron-only switches that a :class:`~ds_stpar.config.Strategy` does not carry
(context parallelism, recompute method, overlap flags, precision flags, environment) come
in a :class:`MegatronOptions`; :func:`megatron_options` gives the values ds-stpar emits
(planner/emit.py writes the same), which satisfy rules 10-12 by construction.

| rule | what |
|---|---|
| 1 | world % (t p c) == 0 and d t p c == world |
| 2 | num_layers % p == 0 (or uneven first/last stages that split the rest evenly) |
| 3 | one virtual-pipeline argument at most; layers per stage % vpp_layers == 0 |
| 4 | interleaving needs p > 2 (p > 1 with overlapped P2P, the default) |
| 5 | interleaved: m >= p and m % p == 0 |
| 6 | global batch % (micro-batch x d) == 0 |
| 7 | heads % t == 0; query groups % t == 0 or t % groups == 0; not fp16 and bf16 together |
| 8 | seq_len % (2c) == 0 when c > 1 |
| 9 | sequence parallel is off when t == 1 (and needs seq_len % t == 0); TP comm overlap needs SP |
| 10 | full recompute needs a method and 1 <= recompute_num_layers <= layers per stage; selective none |
| 11 | overlap-param-gather needs the distributed optimizer and overlap-grad-reduce |
| 12 | CUDA_DEVICE_MAX_CONNECTIONS=1 when t > 1 or c > 1 (before Blackwell) |
| 13 | DeepSpeed's PipelineEngine refuses ZeRO-2/3: with p > 1, zero is 0 or 1 |
| 14 | ring: sequence parallel on (its boundary layout) and seq_len % t == 0 |
| 15 | Cannon: t = q^2, q >= 2; SP on; seq_len % t, hidden % q, FFN % t, QKV width % t == 0 |
| 16 | a TP group stays inside a node unless TP across nodes is allowed |
| 17 | interleaved layer: ring with t > 1, micro-batch % pieces == 0, no dropout |
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ds_stpar.config import ClusterSpec, ModelSpec, Strategy, TrainSpec, stage_layers
from ds_stpar.errors import ConfigError

PRE_BLACKWELL = ("a100", "h100", "h200")


@dataclass(frozen=True)
class MegatronOptions:
    """Megatron-LM switches beyond the strategy. ``None`` fields take ds-stpar's emitted
    value (:func:`megatron_options`). ``env``: the launch environment (None: as emitted)."""

    context_parallel: int = 1
    virtual_stages_per_rank: int = 0  # --num-virtual-stages-per-pipeline-rank
    recompute_method: str | None = None  # uniform | block
    recompute_num_layers: int | None = None
    distributed_optimizer: bool | None = None
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    overlap_p2p_comm: bool = True
    tp_comm_overlap: bool = False
    fp16: bool | None = None
    bf16: bool | None = None
    env: Mapping[str, str] | None = None


def megatron_options(train: TrainSpec, strategy: Strategy) -> MegatronOptions:
    """What ds-stpar emits: full recompute as uniform, one layer per checkpoint, or with
    ``recompute_layers`` as block, that many layers per stage; the
    distributed optimizer for ZeRO >= 1; overlapped grad reduction with DP and param gather
    with it and the distributed optimizer; the precision flag of the dtype;
    CUDA_DEVICE_MAX_CONNECTIONS=1 with TP."""
    full = strategy.recompute == "full"
    d = strategy.layout.dp
    dist_opt = strategy.zero >= 1
    return MegatronOptions(
        recompute_method=("block" if strategy.recompute_layers else "uniform") if full else None,
        recompute_num_layers=(strategy.recompute_layers or 1) if full else None,
        distributed_optimizer=dist_opt,
        overlap_grad_reduce=d > 1,
        overlap_param_gather=d > 1 and dist_opt,
        fp16=train.dtype == "fp16",
        bf16=train.dtype == "bf16",
        env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if strategy.layout.tp > 1 else {},
    )


def _resolve(
    train: TrainSpec, strategy: Strategy, options: MegatronOptions | None
) -> MegatronOptions:
    """Fill ``None`` fields of ``options`` with the emitted defaults."""
    emitted = megatron_options(train, strategy)
    if options is None:
        return emitted
    fields = {
        name: getattr(emitted, name) if getattr(options, name) is None else getattr(options, name)
        for name in MegatronOptions.__dataclass_fields__
    }
    return MegatronOptions(**fields)


@dataclass(frozen=True)
class _Case:
    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    strategy: Strategy
    opts: MegatronOptions
    allow_tp_across_nodes: bool

    @property
    def t(self) -> int:
        return self.strategy.layout.tp

    @property
    def p(self) -> int:
        return self.strategy.layout.pp

    @property
    def d(self) -> int:
        return self.strategy.layout.dp

    @property
    def c(self) -> int:
        return self.opts.context_parallel

    def stages(self) -> list[int] | None:
        try:
            return stage_layers(self.model.num_layers, self.strategy)
        except ConfigError:
            return None


# --------------------------------------------------------------------------------------
# The rules
# --------------------------------------------------------------------------------------


def rule_1(x: _Case) -> str | None:
    world, t, p, c = x.cluster.num_gpus, x.t, x.p, x.c
    if world % (t * p * c):
        return f"rule 1: world {world} % (tp {t} * pp {p} * cp {c}) = {world % (t * p * c)} != 0"
    if x.d * t * p * c != world:
        return (
            f"rule 1: dp {x.d} * tp {t} * pp {p} * cp {c} = {x.d * t * p * c} != world {world} "
            f"(use dp {world // (t * p * c)})"
        )
    return None


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def rule_2(x: _Case) -> str | None:
    s = x.strategy
    layers = x.model.num_layers
    if s.first_stage_layers or s.last_stage_layers:
        if x.stages() is None:
            rest = layers - s.first_stage_layers - s.last_stage_layers
            middle = x.p - bool(s.first_stage_layers) - bool(s.last_stage_layers)
            return (
                f"rule 2: num_layers {layers} - first {s.first_stage_layers} - last "
                f"{s.last_stage_layers} = {rest} does not split over {middle} middle stages"
            )
        return None
    if layers % x.p:
        ok = ", ".join(str(k) for k in _divisors(layers)[:8])
        return (
            f"rule 2: num_layers {layers} % pp {x.p} != 0 (use --first/last stage layers or "
            f"pp in {{{ok},...}})"
        )
    return None


def rule_3(x: _Case) -> str | None:
    n = x.strategy.vpp_layers
    if n and x.opts.virtual_stages_per_rank:
        return (
            f"rule 3: vpp_layers {n} and virtual stages per rank {x.opts.virtual_stages_per_rank}"
            " both set; give one virtual-pipeline argument"
        )
    stages = x.stages()
    if n and stages:
        bad = [k for k in stages if k % n]
        if bad:
            return f"rule 3: layers per stage {bad[0]} % vpp_layers {n} != 0"
    return None


def rule_4(x: _Case) -> str | None:
    if not x.strategy.vpp_layers:
        return None
    need = 1 if x.opts.overlap_p2p_comm else 2
    if x.p <= need:
        return (
            f"rule 4: interleaving (vpp_layers {x.strategy.vpp_layers}) needs pp > {need}, "
            f"got pp {x.p}"
        )
    return None


def _micro_batches(x: _Case) -> int | None:
    per = x.strategy.micro_batch * x.d
    return None if x.train.global_batch % per else x.train.global_batch // per


def rule_5(x: _Case) -> str | None:
    m = _micro_batches(x)
    if not x.strategy.vpp_layers or x.p == 1 or m is None:
        return None
    if m < x.p or m % x.p:
        return f"rule 5: interleaved schedule needs micro-batches m {m} >= pp {x.p} and m % pp == 0"
    return None


def rule_6(x: _Case) -> str | None:
    b, B = x.strategy.micro_batch, x.train.global_batch
    if B % (b * x.d):
        return f"rule 6: global batch {B} % (micro-batch {b} * dp {x.d}) = {B % (b * x.d)} != 0"
    return None


def rule_7(x: _Case) -> str | None:
    a, g, t = x.model.num_attention_heads, x.model.num_query_groups, x.t
    if x.opts.fp16 and x.opts.bf16:
        return "rule 7: fp16 and bf16 both set; choose one"
    if a % t:
        return f"rule 7: num_attention_heads {a} % tp {t} != 0"
    if g % t and t % g:
        return f"rule 7: num_query_groups {g} and tp {t}: neither divides the other"
    return None


def rule_8(x: _Case) -> str | None:
    if x.c > 1 and x.train.seq_len % (2 * x.c):
        return f"rule 8: seq_len {x.train.seq_len} % (2 * cp {x.c}) != 0"
    return None


def rule_9(x: _Case) -> str | None:
    sp = x.strategy.sequence_parallel
    if sp and x.t == 1:
        return "rule 9: sequence_parallel with tp 1; turn it off"
    if sp and x.train.seq_len % x.t:
        return f"rule 9: sequence_parallel needs seq_len {x.train.seq_len} % tp {x.t} == 0"
    if x.opts.tp_comm_overlap and not sp:
        return "rule 9: tp_comm_overlap needs sequence_parallel"
    return None


def rule_10(x: _Case) -> str | None:
    o, rc = x.opts, x.strategy.recompute
    if rc == "full":
        if o.recompute_method not in ("uniform", "block"):
            return f"rule 10: full recompute needs recompute_method uniform or block, got {o.recompute_method}"
        stages = x.stages() or [x.model.num_layers // x.p]
        n = o.recompute_num_layers
        if n is None or not 1 <= n <= min(stages):
            return f"rule 10: recompute_num_layers {n} not in [1, {min(stages)}] (layers per stage)"
    elif rc == "selective" and (o.recompute_method or o.recompute_num_layers):
        return "rule 10: selective recompute takes no recompute_method / recompute_num_layers"
    return None


def rule_11(x: _Case) -> str | None:
    o = x.opts
    if o.overlap_param_gather and not (o.distributed_optimizer and o.overlap_grad_reduce):
        return (
            "rule 11: overlap_param_gather needs the distributed optimizer (zero >= 1) and "
            f"overlap_grad_reduce (got distributed_optimizer={o.distributed_optimizer}, "
            f"overlap_grad_reduce={o.overlap_grad_reduce})"
        )
    return None


def rule_12(x: _Case) -> str | None:
    if x.t == 1 and x.c == 1:
        return None
    if not any(tag in x.cluster.gpu.name.lower() for tag in PRE_BLACKWELL):
        return None
    value = (x.opts.env or {}).get("CUDA_DEVICE_MAX_CONNECTIONS")
    if value != "1":
        return (
            f"rule 12: tp {x.t} / cp {x.c} on {x.cluster.gpu.name} expects "
            f"CUDA_DEVICE_MAX_CONNECTIONS=1, got {value}"
        )
    return None


def rule_13(x: _Case) -> str | None:
    if x.p > 1 and x.strategy.zero >= 2:
        return (
            f"rule 13: DeepSpeed's PipelineEngine refuses ZeRO-{x.strategy.zero} with pp {x.p}; "
            "use zero 0 or 1"
        )
    return None


def rule_14(x: _Case) -> str | None:
    if x.strategy.layout.tp_mode != "ring" or x.t == 1:
        return None
    if not x.strategy.sequence_parallel:
        return f"rule 14: ring (tp {x.t}) exchanges sequence-parallel shards; set sequence_parallel"
    if x.train.seq_len % x.t:
        return f"rule 14: ring needs seq_len {x.train.seq_len} % tp {x.t} == 0"
    return None


def rule_15(x: _Case) -> str | None:
    """What ``layers/cannon.py`` (through ``layers/linear.py``) needs: a square group; the SP
    boundary layout, whose sequence chunks are the token blocks (s % t; the batch is never
    split); hidden (the unsharded dim of all four linears) cut into q blocks; the sharded
    dims (FFN, QKV width) cut into t Megatron shards, q of them per block. Attention keeps
    Megatron's split of heads and query groups over all t ranks (rule 7)."""
    if x.strategy.layout.tp_mode != "cannon":
        return None
    t, q = x.t, math.isqrt(x.t)
    if q * q != t or q < 2:
        return f"rule 15: Cannon needs tp = q*q with q >= 2, got tp {t}"
    if not x.strategy.sequence_parallel:
        return "rule 15: Cannon exchanges sequence-parallel shards; set sequence_parallel"
    m, s = x.model, x.train.seq_len
    if s % t:
        return f"rule 15: Cannon needs seq_len {s} % tp {t} == 0 (pad to a multiple of {t})"
    if m.hidden_size % q:
        return f"rule 15: Cannon (q {q}) needs hidden_size {m.hidden_size} % q == 0"
    if m.ffn_hidden_size % t:
        return f"rule 15: Cannon needs ffn_hidden_size {m.ffn_hidden_size} % tp {t} == 0"
    qkv = m.q_size + 2 * m.kv_size
    if qkv % t:
        return f"rule 15: Cannon needs the QKV width {qkv} (q + 2 kv) % tp {t} == 0"
    return None


def rule_16(x: _Case) -> str | None:
    node = x.cluster.node_size
    if x.allow_tp_across_nodes or (x.t <= node and node % x.t == 0):
        return None
    return (
        f"rule 16: tp {x.t} does not fit inside a node of {node} GPUs; use tp dividing {node} "
        "or allow TP across nodes"
    )


def rule_17(x: _Case) -> str | None:
    """What ``layers/interleave.py`` needs to run the strategy's pieces as planned (else it
    runs gcd(batch, k) pieces, or Megatron's layer when that is 1, which the planner would
    have priced wrongly): ring layers in a TP group of more than one rank, a micro-batch of
    whole sequences the pieces divide (a packed row cannot be cut), and no dropout (every
    rank adds the residual to every row, so per-rank dropout masks would differ)."""
    k = x.strategy.interleave
    if k < 2:
        return None
    if x.strategy.layout.tp_mode != "ring" or x.t == 1:
        return (
            f"rule 17: interleave {k} needs ring TP over more than one GPU "
            f"(tp_mode {x.strategy.layout.tp_mode}, tp {x.t})"
        )
    if x.strategy.micro_batch % k:
        return (
            f"rule 17: interleave {k} cuts the micro-batch's sequences into {k} pieces; "
            f"micro-batch {x.strategy.micro_batch} % {k} != 0"
        )
    if x.model.dropout > 0:
        return f"rule 17: interleave needs dropout 0 (the model has {x.model.dropout})"
    return None


RULES: dict[int, Callable[[_Case], str | None]] = {
    number: fn
    for number, fn in enumerate(
        (
            rule_1,
            rule_2,
            rule_3,
            rule_4,
            rule_5,
            rule_6,
            rule_7,
            rule_8,
            rule_9,
            rule_10,
            rule_11,
            rule_12,
            rule_13,
            rule_14,
            rule_15,
            rule_16,
            rule_17,
        ),
        start=1,
    )
}


def violations(
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    strategy: Strategy,
    options: MegatronOptions | None = None,
    allow_tp_across_nodes: bool | None = None,
) -> list[str]:
    """Every rule ``strategy`` breaks, in rule order (empty when valid)."""
    allow = cluster.tp_across_nodes if allow_tp_across_nodes is None else allow_tp_across_nodes
    case = _Case(model, cluster, train, strategy, _resolve(train, strategy, options), allow)
    return [msg for rule in RULES.values() if (msg := rule(case)) is not None]


def check(
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    strategy: Strategy,
    options: MegatronOptions | None = None,
    allow_tp_across_nodes: bool | None = None,
) -> None:
    """Raise :class:`ConfigError` listing every violated rule."""
    found = violations(model, cluster, train, strategy, options, allow_tp_across_nodes)
    if found:
        raise ConfigError(f"strategy {strategy.short()}: " + "; ".join(found))
