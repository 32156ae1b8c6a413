"""Parallelism hot switching: move weights and gradients between two layouts of one world.

Planner (HotSPa's Algorithm 1, pure Python, no process group)
-------------------------------------------------------------
For each parameter, the distinct regions each layout holds (``shards.rank_pieces``) tile the
full tensor; the *finest common partition* is the set of non-empty intersections
``R_src ∩ R_dst``: every such cell has one owner set (holders of ``R_src`` in the source) and
one needer set (holders of ``R_dst`` in the target). For every (cell, needer), in a fixed order:

1. reuse the local copy when the needer is an owner (no traffic);
2. else take it from an owner on the needer's node (node = rank // gpus_per_node), the one
   with the least intra-node load so far (an owner with no load yet comes first);
3. else from the owner with the least inter-node load across nodes.

Intra- and inter-node send loads are counted apart: links are full duplex and NVLink and the
NIC work in parallel. Ties go to the owner nearest after the needer in rank order, which
spreads replicated parameters over their replicas. Every rank computes the same plan from
the same inputs, so nothing is broadcast. Plans are cached per (from, to) placement pair.

Gradients (:meth:`SwitchPlanner.grads`, :func:`switch_grads`)
---------------------------------------------------------------
Source gradients are as backward left them: nothing reduced. Copies of one region in
different DP replicas, pipeline stages (tied embeddings) or, for sequence-parallel
parameters, TP ranks are partial sums; other copies are identical (``shards.grad_class``).
The total is the sum over the source's partial-sum classes. HotSPa all-reduces over DP and
then moves; here the DP reduction is fused into the move: for each cell the plan picks ONE
target class (the one that makes the fewest transfers, then the least-loaded receiver; a
cell held by n target classes is first cut into n slabs, so that whole parameters spread over
the target's replicas as in a reduce-scatter) and every member of it receives one partial from each source class (local when it holds one),
adding them, in class order, into its gradient accumulator. Traffic per rank is about
(dp-1)/dp of its shard, as for a reduce-scatter, against 2(dp-1)/dp for an all-reduce before
the move, and there is a single batched exchange instead of a collective plus an exchange.
Because the carried sum lands in exactly one class of the target, whatever reduction the
target layout performs after its own micro-batches (Megatron's finalize_model_grads: TP
all-reduce of sequence-parallel grads, embedding-group all-reduce, then DP all-reduce for
ZeRO 0/1 or DP reduce-scatter for ZeRO 2) counts it exactly once: after the home layout's
reduction its gradient equals the sum over all micro-batches of all layouts, replicated
(or reduce-scattered) over the home DP group. ZeRO-3 (parameters themselves sharded over DP)
is not described by the descriptors and is not supported.

Executor
--------
One contiguous buffer per (peer, dtype) packs every piece a rank sends to that peer, in plan
order (a model has one dtype, so one buffer per peer); identical send buffers (the same pieces
to several peers) are packed once and share storage; all sends and receives go out in one
``torch.distributed.batch_isend_irecv`` (gloo and NCCL); received pieces are copied (weights)
or added (gradients) into the target's local tensors. ``async_op=True`` returns a handle whose
``wait()`` finishes the switch, so a caller can overlap it with other work. With
``round_elements`` the plan runs as consecutive exchanges, cut by parameter
(:meth:`SwitchPlan.rounds`), so the buffers never hold more than that many elements per rank
(sent plus received) instead of everything the rank moves: the hot-switching runner moves a
whole model's gradients between buckets, which in one exchange would need buffers of about
a model shard.

Pipeline parallelism
--------------------
Supported on both sides: a parameter lives on the stage(s) ``shards.param_stages`` names
(layer index -> stage through ``config.stage_layers``, uneven first/last stages and
interleaved ``vpp_layers`` included; embeddings, final norm and head by position). Parameter
names must be global (layer indices over the whole model), as Megatron's resharding resolves
them through ``layer_number``.

Compared with megatron.core.resharding.swap_model_weights (0.16.1)
------------------------------------------------------------------
Megatron gathers parameter metadata with all_gather_object, plans on rank 0 and broadcasts
the plan. Per parameter it picks one source DP group by ``dst_rank % n_groups`` (with a single
source DP group, rank 0's copy for everyone), then LCM-tiles the single TP dim (strides
supported); a replicated parameter is copied locally only when the source and target DP
groups are the same list, otherwise it comes from ``src_dp_ranks[dst % len]`` even where the
receiver holds a copy. There is no node awareness and no load accounting; only weights move
(no gradients, no optimizer state); only one TP-sharded dim is expressible, so Cannon's 2-D
pre-skewed blocks cannot be described at all. Its ``GlooCopyService`` cannot be built on a
CPU-only torch (``__init__`` creates a ``torch.cuda.Stream``); with that one line bypassed it
runs our megatron/ring/DP/PP layouts over gloo and yields the same shards bit for bit
(tests/test_switch.py drives it). On that test's model over 4 ranks (elements sent, total /
busiest rank): dp4 -> dp2-tp2: Megatron 1092 / 1092 (rank 0 sends every shard), ours 0 (all
local); dp2-tp2 -> dp4: 2264 / 1132 against 1456 / 364; dp2-tp2 -> tp4: 626 / 364 against
364 / 182; equal where no choice exists (tp4 -> dp4, tp4 -> dp1-tp2-pp2, dp1-tp2-pp2 ->
dp2-tp2). It is never better here, so we do not delegate to it.
"""

from __future__ import annotations

import functools
import math
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ds_stpar.config import ClusterSpec, GPUSpec, Layout, ModelSpec, Strategy
from ds_stpar.errors import ConfigError
from ds_stpar.seqbucket.shards import (
    Box,
    ParamSpec,
    Placement,
    box_numel,
    described_layers,
    grad_class,
    intersect,
    local_shape,
    model_param_specs,
    rank_pieces,
    regions,
)


@dataclass(frozen=True)
class Transfer:
    """Cell ``box`` of parameter ``name`` goes from rank ``src`` to rank ``dst`` (src == dst:
    a local copy)."""

    name: str
    box: Box
    src: int
    dst: int


@dataclass(frozen=True)
class SwitchStats:
    """Element counts per rank of one plan; multiply by the element size for bytes."""

    gpus_per_node: int
    intra_sent: tuple[int, ...]
    inter_sent: tuple[int, ...]
    intra_recv: tuple[int, ...]
    inter_recv: tuple[int, ...]
    local: tuple[int, ...]
    max_link: int  # elements over the busiest ordered pair of ranks

    @classmethod
    def of(cls, transfers: tuple[Transfer, ...], world: int, gpus_per_node: int) -> SwitchStats:
        counts = {k: [0] * world for k in ("intra_s", "inter_s", "intra_r", "inter_r", "local")}
        links: Counter = Counter()
        for t in transfers:
            n = box_numel(t.box)
            if t.src == t.dst:
                counts["local"][t.dst] += n
                continue
            kind = "intra" if t.src // gpus_per_node == t.dst // gpus_per_node else "inter"
            counts[f"{kind}_s"][t.src] += n
            counts[f"{kind}_r"][t.dst] += n
            links[t.src, t.dst] += n
        return cls(
            gpus_per_node,
            *(tuple(counts[k]) for k in ("intra_s", "inter_s", "intra_r", "inter_r", "local")),
            max(links.values(), default=0),
        )

    def sent_bytes(self, itemsize: int) -> list[int]:
        return [(a + b) * itemsize for a, b in zip(self.intra_sent, self.inter_sent)]

    def received_bytes(self, itemsize: int) -> list[int]:
        return [(a + b) * itemsize for a, b in zip(self.intra_recv, self.inter_recv)]

    def max_link_bytes(self, itemsize: int) -> int:
        return self.max_link * itemsize

    def time_bound_s(self, itemsize: int, gpu: GPUSpec) -> float:
        """Bandwidth bound of the exchange: the busiest rank's busiest port.

        Per rank, NVLink and the NIC run in parallel, each full duplex:
        ``t_r = max(alpha_intra + max(intra out, intra in) / B_nvlink,
        alpha_inter + max(inter out, inter in) / B_nic)`` (a term only where bytes flow);
        the switch takes ``max_r t_r``. Bandwidths are ``gpu.nvlink_gbs`` and
        ``gpu.internode_gbs`` (GB/s per GPU and direction).
        """
        worst = 0.0
        for r in range(len(self.local)):
            t = 0.0
            intra = max(self.intra_sent[r], self.intra_recv[r]) * itemsize
            inter = max(self.inter_sent[r], self.inter_recv[r]) * itemsize
            if intra:
                t = gpu.intra_latency_us * 1e-6 + intra / (gpu.nvlink_gbs * 1e9)
            if inter:
                t = max(t, gpu.inter_latency_us * 1e-6 + inter / (gpu.internode_gbs * 1e9))
            worst = max(worst, t)
        return worst


@dataclass(frozen=True, eq=False)
class SwitchPlan:
    """Every transfer of one switch, in execution order, for all ranks of the world."""

    kind: str
    src: Placement
    dst: Placement
    specs: Mapping[str, ParamSpec]
    transfers: tuple[Transfer, ...]
    stats: SwitchStats
    _programs: dict = field(default_factory=dict, repr=False)
    _rounds: dict = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return self.src.layout.world_size

    def program(self, rank: int) -> _Program:
        """What ``rank`` sends, receives and copies (built on first use, then kept)."""
        if rank not in self._programs:
            self._programs[rank] = _Program.build(self, rank)
        return self._programs[rank]

    def rounds(self, max_elements: int) -> tuple[SwitchPlan, ...]:
        """This plan cut by parameter into consecutive exchanges that each move at most
        ``max_elements`` into and out of any one rank (sent plus received: the executor's
        buffers), a parameter above that alone being one round. The plan is global, so
        every rank cuts it the same way. Kept per bound."""
        if max_elements in self._rounds:
            return self._rounds[max_elements]
        by_name: dict[str, list[Transfer]] = defaultdict(list)
        for t in self.transfers:
            by_name[t.name].append(t)
        world = self.world_size
        groups: list[list[Transfer]] = []
        load = [0] * world
        for transfers in by_name.values():
            extra = [0] * world
            for t in transfers:
                if t.src != t.dst:
                    extra[t.src] += box_numel(t.box)
                    extra[t.dst] += box_numel(t.box)
            if groups and max(a + b for a, b in zip(load, extra)) <= max_elements:
                groups[-1].extend(transfers)
                load = [a + b for a, b in zip(load, extra)]
            else:
                groups.append(list(transfers))
                load = extra
        gpus_per_node = self.stats.gpus_per_node
        out = tuple(
            SwitchPlan(
                self.kind,
                self.src,
                self.dst,
                self.specs,
                tuple(g),
                SwitchStats.of(tuple(g), world, gpus_per_node),
            )
            for g in groups
        )
        self._rounds[max_elements] = out
        return out


class _Loads:
    """Per-rank send/receive loads (elements) while a plan is built; Algorithm 1's choice."""

    def __init__(self, world: int, gpus_per_node: int) -> None:
        self.world, self.gpn = world, gpus_per_node
        self.intra_sent, self.inter_sent = [0] * world, [0] * world
        self.received = [0] * world

    def pick(self, owners: list[int], needer: int, size: int) -> int:
        """The owner that sends ``size`` elements to ``needer``; records its load."""
        node = needer // self.gpn
        same = [o for o in owners if o // self.gpn == node]
        loads = self.intra_sent if same else self.inter_sent
        owner = min(same or owners, key=lambda o: (loads[o], (o - needer) % self.world))
        loads[owner] += size
        self.received[needer] += size
        return owner


def _regions(spec: ParamSpec, placement: Placement, name: str) -> dict[Box, list[int]]:
    """``shards.regions``, checked to tile the full tensor."""
    held = regions(spec, placement)
    if sum(box_numel(b) for b in held) != math.prod(spec.shape):
        raise ConfigError(
            f"{name}: the regions held under {placement.layout.short()} do not tile the full "
            f"tensor {spec.shape}; check its tensor-parallel attributes"
        )
    return held


def _cells(spec: ParamSpec, src: Placement, dst: Placement, name: str):
    """(cell, owners, needers) of the finest common partition, in a fixed order."""
    src_regions, dst_regions = _regions(spec, src, name), _regions(spec, dst, name)
    for dbox, needers in dst_regions.items():
        for sbox, owners in src_regions.items():
            cell = intersect(sbox, dbox)
            if cell is not None:
                yield cell, owners, needers


def _plan_weights(specs, src: Placement, dst: Placement, loads: _Loads) -> list[Transfer]:
    out = []
    for name, spec in specs.items():
        for cell, owners, needers in _cells(spec, src, dst, name):
            size = box_numel(cell)
            for t in needers:
                owner = t if t in owners else loads.pick(owners, t, size)
                out.append(Transfer(name, cell, owner, t))
    return out


def _classes(spec: ParamSpec, placement: Placement, ranks: list[int]) -> list[list[int]]:
    groups: dict[tuple, list[int]] = defaultdict(list)
    for r in ranks:
        groups[grad_class(spec, placement, r)].append(r)
    return [groups[k] for k in sorted(groups)]


def _split(cell: Box, parts: int) -> list[Box]:
    """``cell`` cut into up to ``parts`` near-equal slabs along its longest dim."""
    dim = max(range(len(cell)), key=lambda d: cell[d][1] - cell[d][0])
    lo, hi = cell[dim]
    cuts = sorted({lo + (hi - lo) * i // parts for i in range(parts + 1)})
    return [cell[:dim] + ((a, b),) + cell[dim + 1 :] for a, b in zip(cuts, cuts[1:])]


def _plan_grads(
    specs, src: Placement, dst: Placement, loads: _Loads, min_slab: int
) -> list[Transfer]:
    out = []
    for name, spec in specs.items():
        for cell, owners, needers in _cells(spec, src, dst, name):
            sources, targets = _classes(spec, src, owners), _classes(spec, dst, needers)

            def cost(target: list[int], sources=sources) -> tuple[int, int]:
                moved = sum(t not in k for t in target for k in sources)
                return moved, max(loads.received[t] for t in target)

            # one slab per target class (slabs of at least min_slab elements), so whole
            # parameters (an embedding under pure DP) spread over the target replicas as a
            # reduce-scatter would
            parts = min(len(targets), max(1, box_numel(cell) // min_slab))
            for slab in _split(cell, parts):
                size = box_numel(slab)
                target = min(targets, key=cost)
                for t in target:
                    for k in sources:
                        src_rank = t if t in k else loads.pick(k, t, size)
                        out.append(Transfer(name, slab, src_rank, t))
    return out


def _slices(spec: ParamSpec, placement: Placement, rank: int, box: Box) -> tuple[slice, ...]:
    for piece in rank_pieces(spec, placement, rank):
        if piece.contains(box):
            return piece.local_slices(box)
    raise AssertionError(f"rank {rank} holds no piece containing {box}")  # planner invariant


@dataclass
class _Program:
    """One rank's part of a plan: pieces to send per peer, and arrivals in plan order, each
    (name, target slices, source rank, source slices; source == self means a local copy)."""

    sends: dict[int, list[tuple[str, Box, tuple[slice, ...]]]]
    arrivals: list[tuple[str, Box, tuple[slice, ...], int, tuple[slice, ...] | None]]
    holds_src: set[str]
    holds_dst: set[str]

    @classmethod
    def build(cls, plan: SwitchPlan, rank: int) -> _Program:
        sends: dict[int, list] = defaultdict(list)
        arrivals = []
        for t in plan.transfers:
            spec = plan.specs[t.name]
            if t.src == rank and t.dst != rank:
                sends[t.dst].append((t.name, t.box, _slices(spec, plan.src, rank, t.box)))
            if t.dst == rank:
                local = _slices(spec, plan.src, rank, t.box) if t.src == rank else None
                arrivals.append((t.name, t.box, _slices(spec, plan.dst, rank, t.box), t.src, local))
        held = [
            {n for n, s in plan.specs.items() if rank_pieces(s, p, rank)}
            for p in (plan.src, plan.dst)
        ]
        return cls(dict(sends), arrivals, *held)


class SwitchPlanner:
    """Builds and caches switch plans for one model's parameters on one world.

    ``specs``: every parameter to move, by global name (layer indices over the whole model).
    ``num_layers``: transformer layers (default: 1 + the largest ``layer`` in ``specs``).
    ``min_slab``: gradient cells are cut into slabs of at least this many elements to balance
    the receivers (smaller cells move whole: their imbalance costs less than the extra
    messages and planning time).
    """

    def __init__(
        self,
        specs: Mapping[str, ParamSpec],
        gpus_per_node: int,
        num_layers: int | None = None,
        min_slab: int = 1 << 16,
    ) -> None:
        if gpus_per_node < 1:
            raise ConfigError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
        self.specs = dict(specs)
        self.gpus_per_node = gpus_per_node
        self.min_slab = max(1, min_slab)
        self.num_layers = described_layers(self.specs) if num_layers is None else num_layers
        self._cache: dict[tuple, SwitchPlan] = {}

    def placement(self, strategy: Strategy | Layout) -> Placement:
        return Placement.of(strategy, self.num_layers)

    def weights(self, src: Strategy | Layout, dst: Strategy | Layout) -> SwitchPlan:
        """Plan that gives every target holder its pieces of every parameter."""
        return self._plan("weights", src, dst)

    def grads(self, src: Strategy | Layout, dst: Strategy | Layout) -> SwitchPlan:
        """Plan that adds the source's total gradient into one partial-sum class of the
        target, per cell (module docstring)."""
        return self._plan("grads", src, dst)

    def _plan(self, kind: str, src: Strategy | Layout, dst: Strategy | Layout) -> SwitchPlan:
        a, b = self.placement(src), self.placement(dst)
        key = (kind, a, b)
        if key in self._cache:
            return self._cache[key]
        if a.layout.world_size != b.layout.world_size:
            raise ConfigError(
                f"cannot switch {a.layout.short()} ({a.layout.world_size} ranks) to "
                f"{b.layout.short()} ({b.layout.world_size} ranks): the world must be the same"
            )
        world = a.layout.world_size
        loads = _Loads(world, self.gpus_per_node)
        if kind == "weights":
            transfers = tuple(_plan_weights(self.specs, a, b, loads))
        else:
            transfers = tuple(_plan_grads(self.specs, a, b, loads, self.min_slab))
        stats = SwitchStats.of(transfers, world, self.gpus_per_node)
        plan = SwitchPlan(kind, a, b, self.specs, transfers, stats)
        self._cache[key] = plan
        return plan


@functools.lru_cache(maxsize=16)
def _model_planner(model: ModelSpec, tp_lcm: int, gpus_per_node: int) -> SwitchPlanner:
    return SwitchPlanner(model_param_specs(model, (tp_lcm,)), gpus_per_node, model.num_layers)


def switch_cost_s(
    src: Strategy | Layout,
    dst: Strategy | Layout,
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    weight_bytes: int = 2,
    grad_bytes: int = 0,
) -> float:
    """Bandwidth bound (seconds) of switching ``model`` from ``src`` to ``dst`` on ``cluster``:
    the weights (``weight_bytes`` per element, bf16 by default) and, when ``grad_bytes`` > 0,
    the gradients (4 for fp32 main grads) as two exchanges. Pure Python, plans cached."""
    tps = [s.tp if isinstance(s, Layout) else s.layout.tp for s in (src, dst)]
    planner = _model_planner(model, math.lcm(*tps), cluster.gpus_per_node)
    cost = planner.weights(src, dst).stats.time_bound_s(weight_bytes, cluster.gpu)
    if grad_bytes:
        cost += planner.grads(src, dst).stats.time_bound_s(grad_bytes, cluster.gpu)
    return cost


# --------------------------------------------------------------------------------------
# Executor
# --------------------------------------------------------------------------------------

SWITCH_ROUND_BYTES = 256 << 20
"""The hot-switching runner's round (``round_elements`` = this / element size): at most this
many bytes into and out of a rank per exchange, beyond a single larger parameter."""


def switch_buffer_bytes(specs: Mapping[str, ParamSpec], itemsize: int) -> int:
    """Upper bound of one rank's executor buffers (sent plus received) for a switch run in
    rounds of ``SWITCH_ROUND_BYTES``: a round holds at most that, or one parameter, of which a
    rank sends at most its copy and receives at most its target, each at most the whole."""
    largest = max((math.prod(s.shape) for s in specs.values()), default=0)
    return max(SWITCH_ROUND_BYTES, 2 * largest * itemsize)


class PendingSwitch:
    """A switch whose messages are in flight; :meth:`wait` completes it."""

    def __init__(self, works, finish) -> None:
        self._works, self._finish = works, finish

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        if self._finish is not None:
            self._finish()
            self._finish = None


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two tensors intersect (conservative for strided views)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:  # bytes [first, past the last element)
        first = t.storage_offset()
        last = first + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        return first * t.element_size(), (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _check_locals(
    tensors: Mapping[str, torch.Tensor], held: set[str], plan: SwitchPlan, placement, what: str
) -> None:
    names = set(tensors)
    if names != held:
        missing, extra = sorted(held - names), sorted(names - held)
        raise ConfigError(
            f"{what} under {placement.layout.short()} must hold exactly this rank's parameters: "
            f"missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for name in held:
        want = local_shape(plan.specs[name], placement.layout)
        if tuple(tensors[name].shape) != want:
            raise ConfigError(
                f"{what}[{name!r}] has shape {tuple(tensors[name].shape)}, the layout "
                f"{placement.layout.short()} holds {want} of it"
            )


def _execute(src_t, dst_t, plan: SwitchPlan, group, accumulate: bool, async_op: bool):
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world != plan.world_size:
        raise ConfigError(f"plan is for {plan.world_size} ranks, the group has {world}")
    prog = plan.program(rank)
    _check_locals(src_t, prog.holds_src, plan, plan.src, "source tensors")
    _check_locals(dst_t, prog.holds_dst, plan, plan.dst, "target tensors")
    for name in prog.holds_src & prog.holds_dst:
        if _overlap(src_t[name], dst_t[name]):
            raise ConfigError(f"{name}: source and target tensors overlap in memory")
        if src_t[name].dtype != dst_t[name].dtype:  # peers would size their messages apart
            raise ConfigError(
                f"{name}: source is {src_t[name].dtype}, target {dst_t[name].dtype}; both "
                "layouts' tensors must have one dtype"
            )

    ops, packed = [], {}
    for peer in sorted(prog.sends):
        by_dtype: dict[torch.dtype, list] = defaultdict(list)
        for name, box, sl in prog.sends[peer]:
            by_dtype[src_t[name].dtype].append((name, box, sl))
        for dtype in sorted(by_dtype, key=str):
            items = by_dtype[dtype]
            key = (dtype, tuple((n, b) for n, b, _ in items))
            if key not in packed:  # identical send buffers share storage
                packed[key] = torch.cat([src_t[n][sl].reshape(-1) for n, _, sl in items])
            ops.append(dist.P2POp(dist.isend, packed[key], group=group, group_peer=peer))

    sizes: dict[tuple[int, torch.dtype], int] = defaultdict(int)
    places = []  # per arrival: (peer, dtype, offset) for remote, None for local
    for name, box, _, src, _ in prog.arrivals:
        if src == rank:
            places.append(None)
            continue
        dtype = dst_t[name].dtype
        places.append((src, dtype, sizes[src, dtype]))
        sizes[src, dtype] += box_numel(box)
    device = next(iter(dst_t.values())).device if dst_t else torch.device("cpu")
    buffers = {k: torch.empty(n, dtype=k[1], device=device) for k, n in sizes.items()}
    for peer, dtype in sorted(buffers, key=lambda k: (k[0], str(k[1]))):
        ops.append(dist.P2POp(dist.irecv, buffers[peer, dtype], group=group, group_peer=peer))
    works = dist.batch_isend_irecv(ops) if ops else []

    def finish() -> None:
        with torch.no_grad():
            for (name, box, dst_sl, _, src_sl), place in zip(prog.arrivals, places):
                target = dst_t[name][dst_sl]
                if place is None:
                    piece = src_t[name][src_sl]
                else:
                    peer, dtype, offset = place
                    shape = tuple(b - a for a, b in box)
                    piece = buffers[peer, dtype][offset : offset + box_numel(box)].view(shape)
                if accumulate:
                    target.add_(piece)
                else:
                    target.copy_(piece)

    pending = PendingSwitch(works, finish)
    if async_op:
        return pending
    pending.wait()
    return None


def _execute_rounds(src_t, dst_t, plan, group, accumulate, async_op, round_elements):
    """:func:`_execute` once, or round by round (:meth:`SwitchPlan.rounds`), all but the last
    waited for."""
    parts = plan.rounds(round_elements) if round_elements else (plan,)
    for part in parts[:-1]:
        _execute(src_t, dst_t, part, group, accumulate, False)
    return _execute(src_t, dst_t, parts[-1], group, accumulate, async_op)


def switch(
    params_from: Mapping[str, torch.Tensor],
    params_to: Mapping[str, torch.Tensor],
    plan: SwitchPlan,
    group: dist.ProcessGroup | None = None,
    *,
    async_op: bool = False,
    round_elements: int | None = None,
) -> PendingSwitch | None:
    """Fill this rank's local shards ``params_to`` (target layout) from ``params_from``
    (source layout) on every rank of ``group`` (default: the world; plan ranks are group
    ranks). Both dicts hold exactly this rank's parameters by global name; they must not share
    storage. Collective over ``group``; with ``async_op`` returns a handle to ``wait()`` on
    (for the last round). ``round_elements``: exchange in rounds moving at most that many
    elements into and out of a rank (:meth:`SwitchPlan.rounds`; the same on every rank),
    which bounds the buffers; default one exchange.
    NCCL: ranks with nothing to exchange skip ``batch_isend_irecv``, so the group must have
    run a collective before (PyTorch requires every rank in a group's first batched P2P)."""
    if plan.kind != "weights":
        raise ConfigError("switch() needs a weights plan: SwitchPlanner.weights(src, dst)")
    return _execute_rounds(params_from, params_to, plan, group, False, async_op, round_elements)


def switch_grads(
    grads_from: Mapping[str, torch.Tensor],
    grads_to: Mapping[str, torch.Tensor],
    plan: SwitchPlan,
    group: dist.ProcessGroup | None = None,
    *,
    async_op: bool = False,
    round_elements: int | None = None,
) -> PendingSwitch | None:
    """Add the source layout's total gradient (``grads_from``: unreduced accumulators) into
    ``grads_to`` (target accumulators) so that each cell is added into exactly one partial-sum
    class of the target (module docstring). ``grads_from`` is only read. ``async_op``,
    ``round_elements``: as for :func:`switch`."""
    if plan.kind != "grads":
        raise ConfigError("switch_grads() needs a grads plan: SwitchPlanner.grads(src, dst)")
    return _execute_rounds(grads_from, grads_to, plan, group, True, async_op, round_elements)
