"""The planner's analytical cost model: step time and peak memory per GPU of one strategy.

Pure functions of (model, cluster, train, strategy, calibration): no process group, no torch.
One step of global batch B sequences of s tokens runs m = B / (d b) micro-batches of b
sequences through p pipeline stages; per micro-batch and stage the time is

    t_i = layers_i x (block forward + backward + recompute + exposed TP communication)
          + embedding (first stage) + LM head and loss (last stage) + pipeline P2P,

the block costs coming from :mod:`~ds_stpar.planner.compute` (GEMMs by shape, attention,
memory-bound kernels) and :mod:`~ds_stpar.planner.tensor_parallel` (Megatron, ring, Cannon).
The pipeline runs (planner.md "Pipeline", with the slowest stage setting the pace)

    T_pipe = m max_i t_i + (sum_i t_i - max_i t_i) / v

which is (m + p - 1) t for p equal stages under 1F1B, bubble (p - 1)/m, and m t + (p - 1) t / v
interleaved, bubble (p - 1)/(v m). The step adds the slowest stage's exposed DP gradient
reduction (per ZeRO stage, overlapped with backward) and its optimizer update (memory-bound
over the optimizer state). Memory per GPU is the largest stage's model states (per ZeRO
stage), in-flight activations, transient buffers and allocator headroom (:mod:`memory`).

Software stack (``Calibration.stack``): the default ``"fused"`` is the stack of the published
Megatron-LM runs; ``"megatron-core-local"`` (megatron-core's local modules, no Transformer
Engine or Apex) prices its unfused elementwise kernels (:mod:`compute`'s ``local_*``),
Megatron DDP's fp32 main-gradient accumulation per micro-batch, PyTorch's foreach AdamW with
Megatron's per-tensor clipping, the fp32 cross entropy's memory, and a host (CPU) time per
layer and collective: a micro-batch of a stage then takes ``max(GPU, host)``. Every stack
charges the ring's own host time per hop (``host_ring_hop_s``: ds_stpar's Python and P2P
batch, whatever Megatron's stack), the published one as its only host time.

FLOPs (planner.md "FLOPs"): model FLOPs per step = 3 x forward, with forward per token
2 x (weights of the four linears) + 4 s a d_h per layer (full s^2, the 72-formula) and 2 h V
for the LM head; hardware FLOPs add what recompute runs again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ds_stpar.config import (
    ClusterSpec,
    GiB,
    Layout,
    ModelSpec,
    Strategy,
    TrainSpec,
    stage_layers,
)
from ds_stpar.errors import ConfigError
from ds_stpar.planner import memory as mem
from ds_stpar.planner.comm import (
    GB,
    Link,
    Placement,
    placement,
    ring_copy_engines,
    staged_transfers,
)
from ds_stpar.planner.compute import (
    Phase,
    Speed,
    attention_core,
    block_elementwise,
    block_linears,
    embedding,
    head_chunk,
    main_grad_accumulation,
)
from ds_stpar.planner.compute import lm_head as lm_head_time
from ds_stpar.planner.profile import Calibration
from ds_stpar.planner.tensor_parallel import (
    BlockTP,
    cannon_block,
    head_seqs,
    interleaved_block,
    megatron_block,
    ring_block,
    ring_mlp_pieces,
    sharded_boundary,
)

# --------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------


def linear_flops_per_token(model: ModelSpec) -> float:
    """Forward FLOPs of the four linears of one block per token: 2 x their weights,
    2h(a d_h + 2 g d_h) + 2 a d_h h + 2 h f (x 3/2 for SwiGLU). Biases are not counted."""
    h, f = model.hidden_size, model.ffn_hidden_size
    qkv = model.q_size + 2 * model.kv_size
    return 2.0 * (h * qkv + model.q_size * h + (3 if model.gated else 2) * h * f)


def attention_flops_per_token(model: ModelSpec, seq: int) -> float:
    """Forward FLOPs of Q K^T and softmax.V per token, full s^2 convention: 4 s a d_h."""
    return 4.0 * seq * model.q_size


def model_flops_per_step(model: ModelSpec, train: TrainSpec) -> float:
    """3 x forward FLOPs of one step. For GPT (MHA, 4h GeLU) this is planner.md's
    72 B s l h^2 (1 + s/(6h) + V/(12 l h))."""
    s = train.seq_len
    per_token = (
        model.num_layers * (linear_flops_per_token(model) + attention_flops_per_token(model, s))
        + 2.0 * model.hidden_size * model.vocab_size
    )
    return 3.0 * train.global_batch * s * per_token


def recompute_flops_per_step(model: ModelSpec, train: TrainSpec, strategy: Strategy) -> float:
    """FLOPs that recompute runs again: full -> one more forward of every block (not the LM
    head), giving planner.md's 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), of the blocks that
    recompute under the block method; selective -> one forward of the attention core,
    4 B s^2 l a d_h. (Korthikanti's s/(3h) selective formula counts the core's forward and
    backward again; we count what actually reruns.)"""
    tokens = train.global_batch * train.seq_len
    attention = attention_flops_per_token(model, train.seq_len)
    if strategy.recompute == "full":
        blocks = sum(map(strategy.recomputed_layers, stage_layers(model.num_layers, strategy)))
        return tokens * blocks * (linear_flops_per_token(model) + attention)
    if strategy.recompute == "selective":
        return tokens * model.num_layers * attention
    return 0.0


def hardware_flops_per_step(model: ModelSpec, train: TrainSpec, strategy: Strategy) -> float:
    return model_flops_per_step(model, train) + recompute_flops_per_step(model, train, strategy)


def total_params(model: ModelSpec) -> float:
    """The model's parameters by this module's per-stage accounting (one GPU, no split)."""
    return sum(mem.stage_params(model, Strategy(layout=Layout())))


# --------------------------------------------------------------------------------------
# Estimate
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """Predicted step time and peak memory per GPU of one strategy.

    ``time_breakdown`` (seconds, sums to ``step_time_s``): compute, recompute,
    tp_comm_exposed, pp_p2p, host_bound (what the host's launch time adds over the GPU's
    on the critical stage; local stack only), pp_bubble, dp_comm_exposed, optimizer.
    ``memory_breakdown`` (GiB, of the stage with the highest peak; sums to
    ``peak_memory_gib``): weights, grads, optimizer, activations, comm_buffers,
    optimizer_step (what the optimizer's transient needs beyond the freed activations; local
    stack only), allocator_headroom, runtime_reserved (CUDA context, cuBLAS workspace, NCCL
    buffers: not seen by ``torch.cuda.max_memory_allocated``, nor is the allocator headroom).
    ``micro_batches``: m per step; ``peak_stage``: the pipeline stage of the peak;
    ``tp_collectives_s``: raw seconds per step of each TP collective kind on the first stage's
    blocks (all_reduce / all_gather / reduce_scatter / p2p / all_to_all), before any overlap.
    ``ring_hops``: what the estimate takes to carry the ring linears' or Cannon's neighbour
    hops, ``"copy engines"`` (peer links, :func:`~ds_stpar.planner.comm.ring_copy_engines`;
    a fused ring MLP's hops go by NCCL there), ``"host-staged"`` (the copy engines through
    host memory, every ring hop, :func:`~ds_stpar.planner.comm.staged_transfers`) or
    ``"nccl"``; the interleaved layer and Megatron's layouts have none: ``""``.
    ``transfers``: what the estimate takes to carry the interleaved layer's transfers,
    ``"host-staged"`` (the copy engines through host memory,
    :func:`~ds_stpar.planner.comm.staged_transfers`, priced as hiding wholly behind the
    GEMMs they run beside) or ``"nccl"``; ``""`` where the layer does not run.
    """

    strategy: Strategy
    step_time_s: float
    tokens_per_s: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    hfu: float
    peak_memory_gib: float
    memory_capacity_gib: float
    fits: bool
    time_breakdown: dict[str, float]
    memory_breakdown: dict[str, float]
    micro_batches: int = 0
    peak_stage: int = 0
    tp_collectives_s: dict[str, float] = field(default_factory=dict)
    stack: str = "fused"  # the calibration's software stack the figures are for
    ring_hops: str = ""
    transfers: str = ""

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["strategy"] = self.strategy.to_dict()
        data["short"] = self.strategy.short()
        return data


@dataclass(frozen=True)
class BlockCost:
    """One block, one micro-batch, one GPU: seconds."""

    fwd: float  # compute
    bwd: float
    recompute: float
    comm_fwd: float  # exposed TP communication
    comm_bwd: float
    recompute_comm: float
    collectives: dict[str, float]


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage, one micro-batch: seconds (compute includes embedding / LM head).

    ``host``: CPU seconds to issue the stage's work (Python + kernel launches). The GPU
    runs the queue while the host fills it, so a micro-batch takes the longer of the two:
    ``total = max(gpu, host)``."""

    compute: float
    recompute: float
    tp_comm: float
    p2p: float
    fwd_window: float  # forward compute a DP all-gather can hide behind
    bwd_window: float  # backward compute a DP reduction can hide behind
    host: float = 0.0

    @property
    def gpu(self) -> float:
        return self.compute + self.recompute + self.tp_comm + self.p2p

    @property
    def total(self) -> float:
        return max(self.gpu, self.host)


class _Context:
    """What every part of one estimate needs: resolved inputs, links, the shared speed."""

    def __init__(self, ev: Evaluator, strategy: Strategy) -> None:
        model, train = ev.model, ev.train
        self.model, self.cluster, self.train, self.cal = model, ev.cluster, train, ev.cal
        self.strategy = strategy
        layout = strategy.layout
        self.t, self.p, self.d = layout.tp, layout.pp, layout.dp
        self.mode = layout.tp_mode if layout.tp > 1 else "megatron"
        self.e = ev.speed.e
        self.tokens = strategy.micro_batch * train.seq_len
        self.m = micro_batches(train, strategy)
        self.v = virtual_stages(model, strategy)
        self.layers = stage_layers(model.num_layers, strategy)
        self.sharded = sharded_boundary(self.t, self.mode, strategy.sequence_parallel)
        self.links: Placement = placement(layout, ev.cluster)
        #: the ring linears' hops go by the copy engines (layers/symmetric.py)
        self.copy_engines = ring_copy_engines(layout, ev.cluster, ev.cal.ring_transport)
        self.speed = ev.speed
        #: the MLP runs as one fused ring pass (layers/ring_mlp.py)
        self.fused_mlp = strategy.runs_fused_ring_mlp
        #: the local stack's GLU is megatron-core's fused SwiGLU (integrations.megatron.fused_swiglu)
        self.fused_glu = ev.cal.local and strategy.runs_fused_swiglu(model)
        #: the MLP's two ring passes in one node (layers/ring_mlp.py)
        self.two_pass_mlp = strategy.runs_ring_two_pass_mlp(model)
        #: pieces of the interleaved layer (layers/interleave.py), 0 when it does not run
        self.interleave = strategy.interleave if strategy.runs_interleaved else 0
        #: the ring layouts' transfers and hops go by the copy engines through host memory
        #: (layers/host_staged.py)
        self.staged = staged_transfers(strategy, ev.cluster, ev.cal.transfer_transport)
        #: what a staged transfer crosses where the calibration has a staged rate (None: the
        #: profile's links, as NCCL's transfers)
        self.staged_link: Link | None = None
        if self.staged and ev.cal.staged_link_gbs:
            self.staged_link = Link(self.t, ev.cal.staged_link_gbs * GB, self.links.tp_p2p.alpha)
        #: interleaved layers that hand their pieces on in one block: a model chunk's, the
        #: smallest stage's with uneven stages (not under full recompute, whose layer
        #: checkpoints take plain tensors)
        self.hand_on_layers = 1
        if self.interleave and strategy.recompute != "full":
            self.hand_on_layers = max(1, int(min(self.layers) // self.v))
        self.activations = ev.activations
        if self.interleave:
            acts = (
                mem.fused_glu_activations(ev.activations, model, self.e)
                if self.fused_glu
                else mem.ring_mlp_activations(ev.activations, model, self.e, ev.cal.local)
            )
            self.activations = mem.interleaved_activations(acts, model, self.e, ev.cal.local)
        elif self.fused_mlp:
            self.activations = mem.fused_ring_mlp_activations(
                ev.activations, model, self.e, ev.cal.local
            )
        elif self.fused_glu:
            self.activations = mem.fused_glu_activations(ev.activations, model, self.e)
        elif self.two_pass_mlp:
            self.activations = mem.ring_mlp_activations(ev.activations, model, self.e, ev.cal.local)
        if self.mode == "cannon" and self.t > 1:
            self.activations = mem.cannon_activations(self.activations, model, self.e)
        elif self.mode == "ring" and not self.interleave:
            self.activations = mem.ring_norm_recipe_activations(
                self.activations, model, self.e, self.t, self.fused_mlp
            )


def micro_batches(train: TrainSpec, strategy: Strategy) -> int:
    """m = B / (d b); a remainder breaks Megatron's rule 6."""
    per = strategy.micro_batch * strategy.layout.dp
    if train.global_batch % per:
        raise ConfigError(
            f"rule 6: global batch {train.global_batch} % (micro-batch {strategy.micro_batch} "
            f"* DP {strategy.layout.dp}) != 0"
        )
    return train.global_batch // per


def virtual_stages(model: ModelSpec, strategy: Strategy) -> int:
    """v = (L / p) / vpp_layers (1 without interleaving)."""
    if not strategy.vpp_layers or strategy.layout.pp == 1:
        return 1
    return max(1, (model.num_layers // strategy.layout.pp) // strategy.vpp_layers)


def block_tp(ctx: _Context) -> BlockTP:
    model, t, speed, cal = ctx.model, ctx.t, ctx.speed, ctx.cal
    if ctx.mode == "ring":
        linears = ring_linear_hops(ctx)
        mlp_link, mlp_overlap = fused_mlp_hops(ctx)
        return ring_block(
            model,
            ctx.tokens,
            t,
            linears[0],
            speed,
            linears[1],
            ctx.fused_mlp,
            ctx.two_pass_mlp,
            mlp_overlap=mlp_overlap,
            mlp_link=mlp_link,
        )
    if ctx.mode == "cannon":
        return cannon_block(model, ctx.tokens, t, ctx.links.tp_p2p, speed, cal.ring_hop_overlap)
    return megatron_block(
        model,
        ctx.tokens,
        t,
        ctx.strategy.sequence_parallel,
        ctx.links.tp,
        speed,
        cal.tp_async_backward,
        cal.overlap_fraction,
    )


def ring_linear_hops(ctx: _Context) -> tuple[Link, float]:
    """(link, hidden share) of the ring linears' hops (``comm.ring_pass``): the copy engines
    over peer links (``layers/symmetric.py``), else staged through host memory where the
    transport stages (``layers/host_staged.py``), else NCCL's."""
    if ctx.copy_engines:
        return ctx.links.tp_p2p, ctx.cal.ring_overlap(True)
    if ctx.staged:
        return ctx.staged_link or ctx.links.tp_p2p, ctx.cal.ring_overlap(True)
    return ctx.links.tp_p2p, ctx.cal.ring_overlap(False)


def fused_mlp_hops(ctx: _Context) -> tuple[Link, float]:
    """(link, hidden share) of the fused ring MLP's hops (``comm.start_ring_hop``): staged
    through host memory where the transport stages, NCCL's elsewhere (peer links or not)."""
    if ctx.staged:
        return ctx.staged_link or ctx.links.tp_p2p, ctx.cal.ring_overlap(True)
    return ctx.links.tp_p2p, ctx.cal.ring_hop_overlap


def interleaved_recompute(ctx: _Context) -> float:
    """Backward seconds the interleaved layer adds on every token: the two norms' outputs
    recomputed (read + write e h each), and act(A) for fc2's weight gradient where the MLP
    saved A only (read e f1 / t, write e f / t; not with megatron-core's fused SwiGLU)."""
    model, e, speed = ctx.model, ctx.e, ctx.speed
    norms = speed.memory(2 * 2 * e * ctx.tokens * model.hidden_size)
    if ctx.fused_glu:
        return norms
    _, _, fc1, fc2 = block_linears(model)
    return norms + speed.elementwise(e * ctx.tokens * (fc1.n + fc2.k) / ctx.t)


def block_cost(ctx: _Context) -> BlockCost:
    """Forward, backward and recompute seconds of one block for one micro-batch."""
    attention = attention_core(
        ctx.model,
        ctx.train.seq_len,
        head_seqs(ctx.strategy.micro_batch, ctx.model, ctx.t),
        ctx.speed,
    )
    if ctx.interleave:  # norms and residual adds on every token, the transfers per piece
        elementwise = block_elementwise(
            ctx.model, ctx.tokens, ctx.t, False, ctx.speed, ctx.fused_glu
        ) + Phase(0.0, interleaved_recompute(ctx))
        linears = interleaved_block(
            ctx.model,
            ctx.tokens,
            ctx.t,
            ctx.staged_link or ctx.links.tp,
            ctx.speed,
            1.0 if ctx.staged else ctx.cal.overlap_fraction,  # no SMs: the GEMMs keep theirs
            ctx.interleave,
            attention,
            elementwise,
            ctx.hand_on_layers,
        )
    else:
        elementwise = block_elementwise(
            ctx.model, ctx.tokens, ctx.t, ctx.sharded, ctx.speed, ctx.fused_glu
        )
        linears = block_tp(ctx)
    work = linears.gemm + attention + elementwise
    recompute, recompute_comm = 0.0, 0.0
    if ctx.strategy.recompute == "full":
        recompute, recompute_comm = work.fwd, linears.comm.fwd
    elif ctx.strategy.recompute == "selective":
        recompute = attention.fwd
    return BlockCost(
        work.fwd,
        work.bwd,
        recompute,
        linears.comm.fwd,
        linears.comm.bwd,
        recompute_comm,
        linears.collectives,
    )


def edge_comm(ctx: _Context) -> tuple[float, float]:
    """Exposed TP communication of the vocab-parallel embedding (first stage: reduction of
    its output, all-reduce or reduce-scatter) and LM head (last stage: gather of its input
    and reduction of its input gradient, plus the vocab-parallel cross entropy's all-reduces:
    three of T fp32, or on the local stack two per chunk of C tokens, of C and 2C fp32)."""
    if ctx.t == 1:
        return 0.0, 0.0
    link = ctx.links.tp
    size = ctx.e * ctx.tokens * ctx.model.hidden_size
    if ctx.cal.local:
        chunk = head_chunk(ctx.model, ctx.tokens, ctx.t, ctx.e)
        chunks = math.ceil(ctx.tokens / chunk)
        loss = chunks * (link.all_reduce(4 * chunk) + link.all_reduce(8 * chunk))
    else:
        loss = 3 * link.all_reduce(4 * ctx.tokens)
    if ctx.sharded:
        return link.reduce_scatter(size), link.all_gather(size) + link.reduce_scatter(size) + loss
    return link.all_reduce(size), link.all_reduce(size) + loss


# --------------------------------------------------------------------------------------
# Host time (megatron-core local stack)
# --------------------------------------------------------------------------------------

OPTIMIZER_HOST_OPS_PER_TENSOR = 6
"""Host ops per parameter tensor in Megatron's optimizer step on the local stack (no Apex):
the per-tensor ``torch.norm`` of the local l2-norm fallback and its ``.item()``, the clip's
``src * scale`` and ``dst.copy_``, the main -> model parameter copy, and the per-tensor
Python of the grad hand-over (``_copy_model_grads_to_main_grads``)."""


def layer_host_calls(ctx: _Context, again: bool) -> tuple[float, int]:
    """(TP collectives, ring/Cannon hop steps) one layer issues per micro-batch, forward +
    backward (+ the recomputed forward when the layer recomputes, ``again``).

    Megatron with SP: forward 2 all-gathers + 2 reduce-scatters, backward 2 all-gathers of
    the row linears' output gradient, 2 re-gathers and 2 reduce-scatters in the column
    linears: 10 (recompute +4). Without SP: 2 forward and 2 backward all-reduces (+2).
    Ring: every linear runs one forward ``ring_pass``; a row's backward is one pass, a
    column's two (the dX accumulator's, then the X rotation's for dW), P - 1 hops each:
    10 (P - 1) (recompute +4 (P - 1)); with the fused MLP the two MLP linears' 5 (P - 1)
    become (P - 1) (1 + k) P2P batches per pass (one rotation, k partial-sum pieces per step),
    forward and backward (recompute + one pass). Cannon, per linear: q - 1 shift batches forward and q
    backward (the last carries the dX accumulator alone), and two re-layouts each way, each
    one P2P batch: 4 (2q + 3) (recompute +4 (q + 1)); no collective. The interleaved layer,
    per piece: a gather, an all-reduce and a reduce-scatter each way: 6k (recompute +3k);
    handing on through a block of n layers, two all-reduces each way and the block's ends'
    gather and reduction shared: 2 (2 + 1/n) k."""
    if ctx.t == 1:
        return 0, 0
    if ctx.interleave:  # per piece two all-reduces, the block's ends shared, each way
        return (2 + 1 / ctx.hand_on_layers) * ctx.interleave * (2 + (1 if again else 0)), 0
    if ctx.mode == "ring":
        if ctx.fused_mlp:
            mlp_pass = 1 + ring_mlp_pieces(ctx.model, ctx.tokens, ctx.t)
            passes = (5 + (2 if again else 0)) + (2 + (1 if again else 0)) * mlp_pass
            return 0, passes * (ctx.t - 1)
        return 0, (10 + (4 if again else 0)) * (ctx.t - 1)
    if ctx.mode == "cannon":
        q = math.isqrt(ctx.t)
        forward = (q - 1) + 2
        return 0, 4 * (forward + q + 2 + (forward if again else 0))
    if ctx.sharded:
        return 10 + (4 if again else 0), 0
    return 4 + (2 if again else 0), 0


def edge_host_calls(ctx: _Context, first: bool, last: bool) -> int:
    """TP collectives (and pipeline P2P batches) of a stage outside its layers, per
    micro-batch: the embedding's reduction (first stage), the LM head's input gather and its
    backward re-gather and reduce-scatter with a sharded boundary, or its backward all-reduce
    (last stage), and one P2P batch each way with pp > 1."""
    calls = 0
    if ctx.t > 1:
        calls += int(first) + ((3 if ctx.sharded else 1) if last else 0)
    if ctx.p > 1:
        calls += 2
    return calls


def stage_host(ctx: _Context, layers: int, first: bool, last: bool) -> float:
    """Host seconds of one stage per micro-batch: ``layers`` x ``host_layer_s`` + each
    layer's collectives x ``host_collective_s`` + its hops x ``host_ring_hop_s`` (more in the
    layers that recompute) + the edge calls. The interleaved layer, where the calibration
    has ``host_interleave_piece_s``: ``k`` x it per layer (fitted with its forward and
    backward collectives in it) + the recomputed forward's 3k collectives in the layers that
    recompute (the pieces' recomputed Python is not priced, as no layer's is). Zero unless
    the calibration sets host constants (the local stack; every stack sets the ring's per
    hop)."""
    cal = ctx.cal
    again = ctx.strategy.recomputed_layers(layers)
    calls = 0.0
    for count, recomputes in ((again, True), (layers - again, False)):
        collectives, hops = layer_host_calls(ctx, recomputes)
        calls += count * (collectives * cal.host_collective_s + hops * cal.host_ring_hop_s)
    edges = edge_host_calls(ctx, first, last) * cal.host_collective_s
    if ctx.interleave and cal.host_interleave_piece_s:  # its modules run once per piece
        recomputed = again * 3 * ctx.interleave * cal.host_collective_s
        return layers * ctx.interleave * cal.host_interleave_piece_s + recomputed + edges
    return layers * max(1, ctx.interleave) * cal.host_layer_s + calls + edges


def stage_costs(ctx: _Context, block: BlockCost) -> list[StageCost]:
    """Per micro-batch cost of each stage; p2p: forward activation + backward gradient of
    e T h / t bytes each (Megatron scatters across the TP ranks), on the critical path
    under 1F1B and hidden (but for the fill and drain) when interleaved. On the local stack
    the backward also adds the stage's weight gradients into the fp32 main gradients and the
    host time (:func:`stage_host`) is set beside the GPU time."""
    first_comm, last_comm = edge_comm(ctx)
    emb = embedding(ctx.model, ctx.tokens, ctx.speed, ctx.t)
    head = lm_head_time(ctx.model, ctx.tokens, ctx.t, ctx.speed)
    psis = mem.stage_params(ctx.model, ctx.strategy)
    p2p = 0.0
    if ctx.p > 1 and ctx.v == 1:
        p2p = 2 * ctx.links.pp_p2p.p2p(ctx.e * ctx.tokens * ctx.model.hidden_size / ctx.t)
    made: dict[tuple[int, bool, bool], StageCost] = {}  # middle stages are all alike
    stages = []
    for i, n in enumerate(ctx.layers):
        key = (n, i == 0, i == ctx.p - 1)
        if key not in made:
            extra, extra_comm = Phase(0.0, main_grad_accumulation(psis[i], ctx.speed)), 0.0
            if key[1]:
                extra, extra_comm = extra + emb, extra_comm + first_comm
            if key[2]:
                extra, extra_comm = extra + head, extra_comm + last_comm
            # block.recompute* are per layer: selective reruns every layer's attention core
            s = ctx.strategy
            again = n if s.recompute == "selective" else s.recomputed_layers(n)
            made[key] = StageCost(
                compute=n * (block.fwd + block.bwd) + extra.fwd + extra.bwd,
                recompute=again * block.recompute,
                tp_comm=n * (block.comm_fwd + block.comm_bwd)
                + again * block.recompute_comm
                + extra_comm,
                p2p=p2p,
                fwd_window=n * block.fwd,
                bwd_window=n * block.bwd,
                host=stage_host(ctx, n, key[1], key[2]),
            )
        stages.append(made[key])
    return stages


def distinct_stages(p: int) -> list[int]:
    """Stages that can differ from one another: the first, the first middle one and the last.
    Middle stages hold equal layers and parameters, and the in-flight activations fall with
    the stage index, so every maximum over stages is reached on one of these."""
    return sorted({0, min(1, p - 1), p - 1})


def pipeline_parts(stages: list[StageCost], m: int, v: int) -> dict[str, float]:
    """T_pipe = m max_i t_i + (sum_i t_i - max_i t_i) / v, split into named parts; for p
    equal stages of t: (m + p - 1) t (1F1B) and m t + (p - 1) t / v (interleaved)."""
    critical = max(stages, key=lambda st: st.total)
    rest = sum(st.total for st in stages) - critical.total
    return {
        "compute": m * critical.compute,
        "recompute": m * critical.recompute,
        "tp_comm_exposed": m * critical.tp_comm,
        "pp_p2p": m * critical.p2p,
        "host_bound": m * (critical.total - critical.gpu),
        "pp_bubble": rest / v,
    }


def pipeline_time(ctx: _Context, stages: list[StageCost]) -> tuple[float, dict[str, float]]:
    """:func:`pipeline_parts` plus, when interleaved, the P2P of the fill and drain (the
    steady-state transfers overlap compute: Megatron's overlapped P2P)."""
    parts = pipeline_parts(stages, ctx.m, ctx.v)
    if ctx.p > 1 and ctx.v > 1:
        hop = ctx.links.pp_p2p.p2p(ctx.e * ctx.tokens * ctx.model.hidden_size / ctx.t)
        parts["pp_p2p"] += 2 * (ctx.p - 1) * hop
    return sum(parts.values()), parts


def dp_comm_exposed(ctx: _Context, psi: float, stage: StageCost, layers: int) -> float:
    """Exposed DP communication of one stage per step.

    ZeRO-0: all-reduce of the gradients (grad_bytes Psi) once per step; ZeRO-1: reduce-scatter
    once, then all-gather of the updated e Psi weights; ZeRO-2: reduce-scatter every
    micro-batch (gradients are partitioned), all-gather after the step; ZeRO-3: per layer and
    micro-batch, all-gather of its weights before forward and again before backward, and
    reduce-scatter of its gradients.

    With ``overlap_grad_reduce`` a reduction runs in buckets during the backward of its
    micro-batch and hides up to ``overlap_fraction`` of that backward, but the last bucket
    (``dp_bucket_elements``) is always exposed; ZeRO-3 prefetches layer i+1's weights during
    layer i, so one layer's gather is exposed per pass. The ZeRO-1/2 weight gather after the
    step is exposed.
    """
    link, cal = ctx.links.dp, ctx.cal
    if ctx.d == 1:
        return 0.0
    grad_bytes = 4 if ctx.e == 4 else cal.grad_bytes
    grads, weights = grad_bytes * psi, ctx.e * psi
    last_bucket = link.reduce_scatter(grad_bytes * min(cal.dp_bucket_elements, psi))

    def reduce(comm: float) -> float:
        if not cal.overlap_grad_reduce:
            return comm
        return max(comm - cal.overlap_fraction * stage.bwd_window, min(comm, last_bucket))

    zero = ctx.strategy.zero
    if zero == 0:
        return reduce(link.all_reduce(grads))
    if zero == 1:
        return reduce(link.reduce_scatter(grads)) + link.all_gather(weights)
    if zero == 2:
        return ctx.m * reduce(link.reduce_scatter(grads)) + link.all_gather(weights)
    n = max(layers, 1)
    gather, scatter = link.all_gather(weights / n), link.reduce_scatter(grads / n)
    fwd_layer, bwd_layer = stage.fwd_window / n, stage.bwd_window / n
    hidden = cal.overlap_fraction if cal.overlap_grad_reduce else 0.0
    fwd = gather + (n - 1) * max(0.0, gather - hidden * fwd_layer)
    bwd = gather + scatter + (n - 1) * max(0.0, gather + scatter - hidden * bwd_layer)
    return ctx.m * (fwd + bwd)


LOCAL_ADAM_BYTES = 8 + 12 + 8 + 12 + 8 + 8 + 8 + 16
"""fp32 bytes per parameter of PyTorch's foreach AdamW: weight decay (r+w 8), lerp of m
(12), v *= beta2 (8), addcmul into v (12), sqrt(v) into a new tensor (8), its division
(8) and + eps (8), addcdiv into the parameter (16)."""
LOCAL_CLIP_NORM_BYTES = 4 + 8 + 8  # the norm reads the gradient; clip: src * scale, copy_


def optimizer_time(ctx: _Context, stage: int, psi: float) -> float:
    """Memory-bound update over this GPU's optimizer shard: per parameter it reads the
    gradient three times (unscale/cast, norm, update) and writes it once (zeroing), reads and
    writes the optimizer state, and writes the e-byte weight.

    Local stack (Megatron's distributed optimizer over PyTorch's AdamW, no Apex): per shard
    parameter :data:`LOCAL_ADAM_BYTES`, the norm and clip (:data:`LOCAL_CLIP_NORM_BYTES`) and
    the main -> model copy (4 + e); per parameter the zeroing of the fp32 gradient buffer (4).
    Its host issues :data:`OPTIMIZER_HOST_OPS_PER_TENSOR` ops per parameter tensor; the step
    takes the longer of the GPU and the host."""
    local = psi / (ctx.d if ctx.strategy.zero >= 1 else 1)
    if ctx.cal.local:
        gpu = ctx.speed.memory(
            local * (LOCAL_ADAM_BYTES + LOCAL_CLIP_NORM_BYTES + 4 + ctx.e) + 4 * psi
        )
        host = tensors_per_stage(ctx, stage) * OPTIMIZER_HOST_OPS_PER_TENSOR * ctx.cal.host_op_s
        return max(gpu, host)
    grad = 4 if ctx.e == 4 else ctx.cal.grad_bytes
    per_param = 4 * grad + 2 * mem.optimizer_state_bytes(ctx.train) + ctx.e
    return ctx.speed.memory(local * per_param)


def tensors_per_stage(ctx: _Context, stage: int) -> int:
    """Parameter tensors of ``stage`` (for the per-tensor host work of the optimizer): per
    layer two norms (weight, and bias for LayerNorm), four linear weights and with biases four
    biases; the first stage adds the word (and learned position) embedding, the last the
    final norm and an untied (or pipeline-split) LM head."""
    model = ctx.model
    per_norm = 2 if model.normalization == "layernorm" else 1
    per_layer = 2 * per_norm + 4 + (4 if model.add_bias_linear else 0)
    count = ctx.layers[stage] * per_layer
    if stage == 0:
        count += 2 if model.position_embedding == "learned" else 1
    if stage == ctx.p - 1:
        count += per_norm + (1 if (not model.tied_embeddings or ctx.p > 1) else 0)
    return count


# --------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------


def tp_buffer_bytes(ctx: _Context) -> float:
    """Transient TP buffers: Megatron's gathered input (and, with SP, the unreduced output)
    of e T h each; ring: three T/t chunk buffers (two spare chunks and an accumulator with
    NCCL's hops; the copy engines' buffer, one chunk at t = 2 and two above, outside the
    caching allocator, takes their place: counted the same, a chunk or two over); Cannon:
    double-buffered activation and weight blocks, and the received pieces of the widest
    re-layout (column out of fc1, e T f' / t, f' the fc1 width) beside its output."""
    if ctx.t == 1:
        return 0.0
    e, h, tokens = ctx.e, ctx.model.hidden_size, ctx.tokens
    if ctx.mode == "ring":
        return 3 * e * tokens / ctx.t * h
    if ctx.mode == "cannon":
        q = math.isqrt(ctx.t)
        widest = max(ctx.model.ffn_hidden_size * (2 if ctx.model.gated else 1), h)
        blocks = 2 * e * (tokens / q) * (h / q) + 2 * e * (h / q) * (widest / q)
        return blocks + e * tokens * widest / ctx.t
    return (2 if ctx.sharded else 1) * e * tokens * h


def stage_memory(ctx: _Context, stage: int, psi: float) -> dict[str, float]:
    """Bytes on one GPU of ``stage`` at its peak, by kind."""
    model, train, cal = ctx.model, ctx.train, ctx.cal
    states = mem.model_state_bytes(psi, ctx.strategy.zero, ctx.d, train, cal.grad_bytes)
    if cal.local and model.tied_embeddings and ctx.p > 1 and stage in (0, ctx.p - 1):
        # launch/pretrain.py parks each stage's copy of the tied embedding's gradient in
        # fp32 until the two are summed (seqbucket/tied.py)
        states = dataclasses.replace(
            states, grads=states.grads + mem.FP32 * model.vocab_size * model.hidden_size / ctx.t
        )
    acts, strategy = ctx.activations, ctx.strategy
    per_layer = mem.layer_activation_bytes(acts, ctx.tokens, ctx.t, ctx.sharded, strategy.recompute)
    layers = ctx.layers[stage]
    inflight = mem.inflight_layers(stage, layers, ctx.p, ctx.m, ctx.v)
    kept = layers - strategy.recomputed_layers(layers)
    if strategy.recompute == "full" and kept:  # block method: the other layers keep all
        whole = mem.layer_activation_bytes(acts, ctx.tokens, ctx.t, ctx.sharded, "none")
        per_layer += kept / layers * (whole - per_layer)
    activations = inflight * per_layer
    r = ctx.t if ctx.sharded else 1
    h = model.hidden_size
    if stage == 0 and model.dropout > 0:  # embedding dropout mask per in-flight micro-batch
        activations += inflight / max(layers, 1) * ctx.tokens * h / r
    # the transient peak on top of the in-flight activations: the last stage's logits and
    # their loss (end of forward, and the head's backward), and under full recompute one
    # block's tensors at a time (the blocks' backward, after the head's): the larger of the two
    recomputed = 0.0
    if strategy.recomputed_layers(layers):
        recomputed = mem.layer_activation_bytes(acts, ctx.tokens, ctx.t, ctx.sharded, "none")
    head = head_bytes(ctx) if stage == ctx.p - 1 else 0.0
    activations += max(recomputed, head)
    buffers = tp_buffer_bytes(ctx)
    if ctx.p > 1:
        buffers += 2 * ctx.e * ctx.tokens * h / ctx.t
    if ctx.d > 1 and not cal.local:  # Megatron DDP reduces inside its own gradient buffer
        buffers += min(cal.dp_bucket_elements, psi) * cal.grad_bytes
    if ctx.strategy.zero == 3 and ctx.d > 1:
        buffers += 2 * ctx.e * mem.layer_params_per_gpu(model, ctx.t)
    step = optimizer_step_bytes(ctx, psi)  # the update runs after the activations are gone
    return {
        "weights": states.weights,
        "grads": states.grads,
        "optimizer": states.optimizer,
        "activations": activations,
        "comm_buffers": buffers,
        "optimizer_step": max(0.0, step - activations - buffers),
        "allocator_headroom": cal.allocator_fraction * max(activations + buffers, step),
        "runtime_reserved": cal.runtime_reserved_gib * GiB,
    }


def head_bytes(ctx: _Context) -> float:
    """Bytes held at the loss on the last stage, beside its in-flight activations.

    Fused stack: the e-byte logits, their fp32 softmax and its gradient (2e + 4 per logit),
    with the final norm's output and the head's input (2e per hidden element, [T/t] each
    under sequence parallelism). Local stack (:mod:`ds_stpar.layers.cross_entropy`): one
    chunk of C tokens' logit tensors (2e + 4 per logit), the fp32 weight gradient and one
    chunk's e-byte contribution ((4 + e) V h / t), the head's input (e T h / t under sequence
    parallelism, which it gathers: e T h more) and the full input gradient (e T h).
    """
    model, e, t, tokens = ctx.model, ctx.e, ctx.t, ctx.tokens
    h, vocab = model.hidden_size, model.vocab_size / t
    r = t if ctx.sharded else 1
    if not ctx.cal.local:
        return tokens * (2 * e * h / r + (2 * e + 4) * vocab)
    chunk = head_chunk(model, tokens, t, e)
    hidden = e * tokens * h * (1 / r + (1 if r > 1 else 0) + 1)
    return hidden + (4 + e) * vocab * h + (2 * e + 4) * chunk * vocab


def optimizer_step_bytes(ctx: _Context, psi: float) -> float:
    """Transient bytes of the optimizer step: PyTorch's foreach AdamW (local stack) allocates
    sqrt(v) for every shard parameter, 4 bytes each; the fused optimizers work in place."""
    if not ctx.cal.local:
        return 0.0
    return 4 * psi / (ctx.d if ctx.strategy.zero >= 1 else 1)


# --------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------


def block_key(ctx: _Context) -> tuple:
    """What one block's cost depends on beyond the evaluator's model, train and calibration:
    the strategy less its data-parallel, pipeline, ZeRO and block-recompute knobs (every
    per-layer switch, such as the ring's MLP form or the interleaved layer, follows from the
    rest and the model), the TP links the layout is placed on and what carries its ring's
    hops."""
    s = ctx.strategy
    layer = dataclasses.replace(
        s,
        layout=dataclasses.replace(s.layout, dp=1, pp=1),
        zero=0,
        vpp_layers=0,
        first_stage_layers=0,
        last_stage_layers=0,
        recompute_layers=0,
    )
    return layer, ctx.links.tp, ctx.links.tp_p2p, ctx.copy_engines, ctx.staged_link, ctx.staged


class Evaluator:
    """Estimates strategies of one (model, cluster, train) with shared caches: GEMM seconds by
    shape (one :class:`Speed`) and block costs by :func:`block_key`. :func:`estimate` is one
    call of it; the search keeps one for all candidates."""

    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        train: TrainSpec,
        calibration: Calibration | None = None,
    ) -> None:
        self.model, self.cluster, self.train = model, cluster, train
        self.cal = calibration or Calibration.load_default(cluster.gpu.name)
        self.speed = Speed(cluster.gpu, self.cal, cluster.profile, mem.element_bytes(train))
        self._blocks: dict[tuple, BlockCost] = {}
        self._memory: dict[Strategy, tuple[int, dict[str, float]]] = {}
        self._stages: dict[Strategy, dict[int, dict[str, float]]] = {}
        self.activations = mem.layer_activations(
            model, train.seq_len, self.speed.e, self.cal.flash_attention, self.cal.local
        )

    def _block(self, ctx: _Context) -> BlockCost:
        """The block cost, cached per :func:`block_key`."""
        key = block_key(ctx)
        cost = self._blocks.get(key)
        if cost is None:
            cost = self._blocks[key] = block_cost(ctx)
        return cost

    def stage_bytes(self, strategy: Strategy) -> dict[int, dict[str, float]]:
        """Memory breakdown in bytes of one GPU of each :func:`distinct_stages` stage, by
        stage: every maximum over stages is reached on one of them."""
        cached = self._stages.get(strategy)
        if cached is None:
            ctx = _Context(self, strategy)
            psis = mem.stage_params(self.model, strategy)
            cached = {i: stage_memory(ctx, i, psis[i]) for i in distinct_stages(ctx.p)}
            self._stages[strategy] = cached
        return cached

    def memory(self, strategy: Strategy) -> tuple[int, dict[str, float]]:
        """(peak stage, its memory breakdown in GiB): the cheap half of an estimate."""
        cached = self._memory.get(strategy)
        if cached is None:
            stages = self.stage_bytes(strategy)
            peak = max(stages, key=lambda i: sum(stages[i].values()))
            cached = self._memory[strategy] = (peak, {k: v / GiB for k, v in stages[peak].items()})
        return cached

    def estimate(self, strategy: Strategy) -> Estimate:
        """Step time, throughput, FLOPs, MFU/HFU and peak memory per GPU of ``strategy``."""
        model, train, cluster = self.model, self.train, self.cluster
        ctx = _Context(self, strategy)
        block = self._block(ctx)
        stages = stage_costs(ctx, block)
        pipe, parts = pipeline_time(ctx, stages)
        psis = mem.stage_params(model, strategy)
        dp = {
            i: dp_comm_exposed(ctx, psis[i], stages[i], ctx.layers[i])
            for i in distinct_stages(ctx.p)
        }
        opt = {i: optimizer_time(ctx, i, psis[i]) for i in dp}
        slow = max(dp, key=lambda i: dp[i] + opt[i])
        parts["dp_comm_exposed"], parts["optimizer"] = dp[slow], opt[slow]
        step = pipe + dp[slow] + opt[slow]

        peak_stage, memory = self.memory(strategy)
        peak = sum(memory.values())
        per_gpu = step * strategy.layout.world_size
        peak_flops = cluster.gpu.peak_tflops * 1e12
        model_flops = model_flops_per_step(model, train)
        hw_flops = hardware_flops_per_step(model, train, strategy)
        return Estimate(
            strategy=strategy,
            step_time_s=step,
            tokens_per_s=train.tokens_per_step / step,
            model_flops_per_step=model_flops,
            hardware_flops_per_step=hw_flops,
            model_tflops_per_gpu=model_flops / per_gpu / 1e12,
            hardware_tflops_per_gpu=hw_flops / per_gpu / 1e12,
            mfu=model_flops / per_gpu / peak_flops,
            hfu=hw_flops / per_gpu / peak_flops,
            peak_memory_gib=peak,
            memory_capacity_gib=cluster.gpu.hbm_gib,
            fits=peak <= cluster.gpu.hbm_gib,
            time_breakdown=parts,
            memory_breakdown=memory,
            micro_batches=ctx.m,
            peak_stage=peak_stage,
            tp_collectives_s={k: ctx.m * ctx.layers[0] * v for k, v in block.collectives.items()},
            stack=self.cal.stack,
            ring_hops=ring_hops(ctx),
            transfers=("host-staged" if ctx.staged else "nccl") if ctx.interleave else "",
        )


def ring_hops(ctx: _Context) -> str:
    """What carries the layout's neighbour hops (:attr:`Estimate.ring_hops`)."""
    if ctx.mode == "ring" and not ctx.interleave:
        return "copy engines" if ctx.copy_engines else "host-staged" if ctx.staged else "nccl"
    return "nccl" if ctx.mode == "cannon" else ""


def estimate(
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    strategy: Strategy,
    calibration: Calibration | None = None,
) -> Estimate:
    """Step time, throughput, FLOPs, MFU/HFU and peak memory per GPU of ``strategy``.

    The strategy is assumed valid (:func:`ds_stpar.planner.rules.violations` is empty);
    ``calibration`` defaults to :meth:`Calibration.load_default` for the cluster's GPU.
    """
    return Evaluator(model, cluster, train, calibration).estimate(strategy)
