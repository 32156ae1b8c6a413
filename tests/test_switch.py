"""Hot switching: sharding descriptors, HotSPa Algorithm 1 plans, executed weight and gradient
switches over gloo (2 and 4 ranks), Megatron's swap_model_weights on the same layouts, and the
descriptors against the ring and Cannon temporal layers' own weights (strided ones included)."""

from __future__ import annotations

import math
import zlib
from collections import Counter

import pytest
import torch

from ds_stpar.config import MODEL_PRESETS, ClusterSpec, Layout, Strategy, load_gpu
from ds_stpar.errors import ConfigError
from ds_stpar.seqbucket.shards import (
    ParamSpec,
    Placement,
    grad_class,
    local_shape,
    model_param_specs,
    param_stages,
    rank_pieces,
    tp_pieces,
)
from ds_stpar.seqbucket.switch import SwitchPlanner, switch, switch_cost_s, switch_grads
from tests.distributed import run_workers

DP4, DP2TP2, TP4 = Layout(dp=4), Layout(dp=2, tp=2), Layout(tp=4)
RING4, CANNON4, TP2PP2 = (
    Layout(tp=4, tp_mode="ring"),
    Layout(tp=4, tp_mode="cannon"),
    Layout(tp=2, pp=2),
)

# A two-layer toy model covering every kind of sharding: column (+bias), row, GLU fc1
# (stride 2), replicated norms with sequence-parallel gradients, and tied embeddings on the
# first and last pipeline stage. Shapes are divisible by 2 x stride and by 2 x 2 Cannon blocks.
SPECS = {
    "emb": ParamSpec((16, 8), True, 0, stages="first+last"),
    "final_norm": ParamSpec((8,), sequence_parallel_grad=True, stages="last"),
}
for _i in range(2):
    SPECS |= {
        f"l{_i}.norm": ParamSpec((8,), sequence_parallel_grad=True, layer=_i),
        f"l{_i}.qkv": ParamSpec((12, 8), True, 0, cannon_blocks=True, layer=_i),
        f"l{_i}.qkv_bias": ParamSpec((12,), True, 0, layer=_i),
        f"l{_i}.fc1": ParamSpec((16, 8), True, 0, 2, cannon_blocks=True, layer=_i),
        f"l{_i}.fc2": ParamSpec((8, 8), True, 1, cannon_blocks=True, layer=_i),
        f"l{_i}.fc2_bias": ParamSpec((8,), sequence_parallel_grad=True, layer=_i),
    }
DTYPES = {name: torch.float32 if "norm" in name else torch.bfloat16 for name in SPECS}


# --------------------------------------------------------------------------------------
# Descriptors (pure)
# --------------------------------------------------------------------------------------


def _local(full: torch.Tensor, spec: ParamSpec, placement: Placement, rank: int) -> torch.Tensor:
    """This rank's local tensor cut from ``full`` by the descriptors."""
    out = torch.empty(local_shape(spec, placement.layout), dtype=full.dtype)
    for piece in rank_pieces(spec, placement, rank):
        out[piece.local_slices(piece.box)] = full[tuple(slice(a, b) for a, b in piece.box)]
    return out


def test_megatron_pieces_match_chunking():
    # Reference: Megatron's own split (torch.chunk along partition_dim; GLU fc1 holds
    # [gate_r; up_r]), independent of the box arithmetic.
    full = torch.arange(16 * 6.0).view(16, 6)
    tp2 = Placement.of(Layout(tp=2), 0)
    col, row = ParamSpec((16, 6), True, 0), ParamSpec((16, 6), True, 1)
    glu = ParamSpec((16, 6), True, 0, partition_stride=2)
    gate, up = full.chunk(2, dim=0)
    for r in range(2):
        assert torch.equal(_local(full, col, tp2, r), full.chunk(2, 0)[r])
        assert torch.equal(_local(full, row, tp2, r), full.chunk(2, 1)[r])
        want = torch.cat([gate.chunk(2, 0)[r], up.chunk(2, 0)[r]])
        assert torch.equal(_local(full, glu, tp2, r), want)
        assert torch.equal(_local(full, ParamSpec((16, 6)), tp2, r), full)


def _megatron_index(n: int, size: int, stride: int, rank: int) -> torch.Tensor:
    """Megatron's shard of n features: n/(size*stride) pieces, rank d takes pieces d, d+size,
    ... (stride 2: [gate_d; up_d]); written from Megatron's definition, not our helpers."""
    width = n // (size * stride)
    return torch.cat(
        [
            torch.arange((k * size + rank) * width, (k * size + rank + 1) * width)
            for k in range(stride)
        ]
    )


def _megatron_order(n: int, size: int, stride: int) -> torch.Tensor:
    """Feature order of W', the concatenation of Megatron's shards in rank order."""
    return torch.cat([_megatron_index(n, size, stride, d) for d in range(size)])


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_cannon_home_blocks_are_pre_skewed(stride):
    # Reference (layers/cannon.py, layers/linear.py): the weight is stored Megatron-style
    # [out, in] = [N, K]; W' reorders the partitioned dim so Megatron's P = q*q shards are
    # consecutive; rank (r, c) holds W'[N-block c, K-block (r+c) % q]. A column bias is
    # Megatron's shard of rank r*q + c.
    q, P, n, k = 3, 9, 9 * stride * 2, 6
    cannon = Placement.of(Layout(tp=9, tp_mode="cannon"), 0)
    column_w, row_w = torch.randn(n, k), torch.randn(k, n)
    column_ordered = column_w[_megatron_order(n, P, stride)]
    row_ordered = row_w[:, _megatron_order(n, P, stride)]
    column = ParamSpec((n, k), True, 0, stride, cannon_blocks=True)
    row = ParamSpec((k, n), True, 1, stride, cannon_blocks=True)
    bias, b = ParamSpec((n,), True, 0, stride), torch.randn(n)
    for t in range(P):
        r, c = divmod(t, q)
        want = column_ordered.chunk(q, 0)[c].chunk(q, 1)[(r + c) % q]
        assert torch.equal(_local(column_w, column, cannon, t), want)
        want = row_ordered.chunk(q, 0)[c].chunk(q, 1)[(r + c) % q]
        assert torch.equal(_local(row_w, row, cannon, t), want)
        assert torch.equal(_local(b, bias, cannon, t), b[_megatron_index(n, P, stride, t)])
    # without cannon_blocks a TP parameter is split 1-d over all q*q ranks, as in Megatron
    emb = ParamSpec((18, 4), True, 0)
    assert [p.box for p in tp_pieces(emb, cannon.layout, 4)] == [((8, 10), (0, 4))]


@pytest.mark.parametrize("layout", [DP4, DP2TP2, TP4, RING4, CANNON4, TP2PP2])
def test_regions_tile_every_parameter(layout):
    # Within one model replica (the ranks of dp index 0), each stage that owns a parameter
    # holds every element of it exactly once per TP copy: once for TP-split parameters, tp
    # times when replicated.
    placement = Placement.of(layout, 2)
    for name, spec in SPECS.items():
        count = torch.zeros(spec.shape, dtype=torch.int64)
        for rank in range(layout.tp * layout.pp):
            for piece in rank_pieces(spec, placement, rank):
                count[tuple(slice(a, b) for a, b in piece.box)] += 1
        tp_copies = 1 if spec.tensor_model_parallel else layout.tp
        stages = len(param_stages(spec, placement))
        assert torch.equal(count, torch.full(spec.shape, stages * tp_copies)), name


def test_pipeline_stage_ownership():
    layers = 8
    even = Placement.of(Layout(pp=4), layers)
    assert even.layer_stages == (0, 0, 1, 1, 2, 2, 3, 3)
    uneven = Placement.of(Strategy(Layout(pp=3), first_stage_layers=2, last_stage_layers=2), layers)
    assert uneven.layer_stages == (0, 0, 1, 1, 1, 1, 2, 2)
    vpp = Placement.of(Strategy(Layout(pp=2), vpp_layers=2), layers)
    assert vpp.layer_stages == (0, 0, 1, 1, 0, 0, 1, 1)
    assert param_stages(SPECS["emb"], even) == (0, 3)
    assert param_stages(SPECS["final_norm"], even) == (3,)
    assert param_stages(ParamSpec((2,), layer=6), uneven) == (2,)
    # rank 2 of dp1-tp2-pp2 is stage 1: it holds layer 1 and the tied embedding copy only
    tp2pp2 = Placement.of(TP2PP2, 2)
    held = {n for n, s in SPECS.items() if rank_pieces(s, tp2pp2, 2)}
    assert held == {"emb", "final_norm"} | {n for n in SPECS if n.startswith("l1.")}
    with pytest.raises(ConfigError, match="vpp_layers"):
        Placement.of(Strategy(Layout(pp=2), vpp_layers=3), layers)


def test_grad_classes_follow_sequence_parallel():
    norm, col = SPECS["l0.norm"], SPECS["l0.qkv"]
    plain, sp = Placement.of(DP2TP2, 2), Placement.of(Strategy(DP2TP2, sequence_parallel=True), 2)
    # megatron TP without SP: the TP copies of a norm are identical (one class per replica)
    assert grad_class(norm, plain, 0) == grad_class(norm, plain, 1) != grad_class(norm, plain, 2)
    # with SP (and always in ring/Cannon mode) each TP rank holds a partial sum
    assert grad_class(norm, sp, 0) != grad_class(norm, sp, 1)
    assert Placement.of(RING4, 2).sequence_parallel and not Placement.of(TP4, 2).sequence_parallel
    assert grad_class(col, sp, 0) == grad_class(col, sp, 1)


def test_bad_shapes_raise_config_errors():
    with pytest.raises(ConfigError, match="not divisible"):
        tp_pieces(ParamSpec((10, 4), True, 0, partition_stride=2), Layout(tp=4), 0)
    with pytest.raises(ConfigError, match="partition_dim"):
        ParamSpec((4,), True, 1)
    with pytest.raises(ConfigError, match="drop cannon_blocks"):
        ParamSpec((4,), True, 0, cannon_blocks=True)
    with pytest.raises(ConfigError, match="2 Cannon blocks"):
        tp_pieces(ParamSpec((8, 3), True, 0, cannon_blocks=True), CANNON4, 0)
    with pytest.raises(ConfigError, match="same"):
        SwitchPlanner(SPECS, 2).weights(Layout(dp=4), Layout(dp=2))


def test_from_param_reads_megatron_attributes():
    p = torch.nn.Parameter(torch.empty(4, 3))
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 2
    spec = ParamSpec.from_param(p, Layout(tp=2), layer=1)
    assert spec == ParamSpec((8, 3), True, 0, 2, layer=1)
    p.cannon_blocks = True
    assert ParamSpec.from_param(p, CANNON4).shape == (8, 6)


# --------------------------------------------------------------------------------------
# Plans (pure)
# --------------------------------------------------------------------------------------

LAYOUTS = [DP4, DP2TP2, TP4, RING4, CANNON4, TP2PP2]


def _owners(spec, placement, box):
    return [r for r in range(4) if any(p.contains(box) for p in rank_pieces(spec, placement, r))]


def _region(box):
    return tuple(slice(a, b) for a, b in box)


def _check_weights_plan(plan, gpus_per_node):
    received = {
        (n, r): torch.zeros(s.shape, dtype=torch.int64) for n, s in SPECS.items() for r in range(4)
    }
    for t in plan.transfers:
        owners = _owners(SPECS[t.name], plan.src, t.box)
        assert t.src in owners
        if t.dst in owners:  # local reuse whenever the needer holds the cell
            assert t.src == t.dst
        elif any(o // gpus_per_node == t.dst // gpus_per_node for o in owners):
            assert t.src // gpus_per_node == t.dst // gpus_per_node  # same node first
        received[t.name, t.dst][_region(t.box)] += 1
    # every element a target rank holds arrives exactly once, nothing else arrives
    for (name, rank), count in received.items():
        want = torch.zeros_like(count)
        for piece in rank_pieces(SPECS[name], plan.dst, rank):
            want[_region(piece.box)] = 1
        assert torch.equal(count, want), (name, rank)


@pytest.mark.parametrize("src", LAYOUTS, ids=lambda l: l.short())
def test_weight_plans_follow_algorithm_1(src):
    planner = SwitchPlanner(SPECS, gpus_per_node=2)
    for dst in LAYOUTS:
        _check_weights_plan(planner.weights(src, dst), 2)
    assert sum(planner.weights(src, src).stats.sent_bytes(2)) == 0  # same layout: all local


@pytest.mark.parametrize("min_slab", [1, 1 << 16])
def test_grad_plans_land_each_cell_in_one_class(min_slab):
    planner = SwitchPlanner(SPECS, gpus_per_node=2, min_slab=min_slab)
    for src in LAYOUTS:
        for dst in LAYOUTS:
            plan = planner.grads(src, dst)
            arrivals: dict = {}  # (name, cell) -> Counter of (target rank, source class)
            for t in plan.transfers:
                key = (t.dst, grad_class(SPECS[t.name], plan.src, t.src))
                arrivals.setdefault((t.name, t.box), Counter())[key] += 1
            for (name, box), got in arrivals.items():
                spec = SPECS[name]
                targets = {r for r, _ in got}
                classes = {grad_class(spec, plan.dst, r) for r in targets}
                assert len(classes) == 1  # exactly one partial-sum class of the target...
                members = {
                    r
                    for r in _owners(spec, plan.dst, box)
                    if grad_class(spec, plan.dst, r) in classes
                }
                assert targets == members  # ... and every member of it
                sources = {grad_class(spec, plan.src, r) for r in _owners(spec, plan.src, box)}
                for r in targets:  # one partial from each source class, none twice
                    assert sorted(k for (t, k) in got.elements() if t == r) == sorted(sources)


def test_grad_slabs_balance_like_reduce_scatter():
    # dp4 -> dp4: each parameter is cut into 4 slabs, one per replica; every rank receives
    # the 3 other replicas' partials of its slab: 3/4 of the model, as in a reduce-scatter.
    total = sum(math.prod(s.shape) for s in SPECS.values())
    plan = SwitchPlanner(SPECS, gpus_per_node=4, min_slab=1).grads(DP4, DP4)
    assert plan.stats.received_bytes(1) == [3 * total // 4] * 4
    assert plan.stats.sent_bytes(1) == [3 * total // 4] * 4
    whole = SwitchPlanner(SPECS, gpus_per_node=4).grads(DP4, DP4)  # tiny cells move whole
    assert sum(whole.stats.received_bytes(1)) == 3 * total


def test_load_balance_and_node_preference():
    # dp2-tp2 -> dp4 on one node of 4: each rank misses the other TP half, held by two
    # replicas. Algorithm 1 spreads the senders: every rank sends exactly what it receives.
    one_node = SwitchPlanner(SPECS, gpus_per_node=4).weights(DP2TP2, DP4)
    assert one_node.stats.sent_bytes(2) == one_node.stats.received_bytes(2)
    assert len(set(one_node.stats.sent_bytes(2))) == 1
    # two nodes of 2 (ranks 0-1 | 2-3): both replicas of each half exist on every node, so
    # nothing crosses nodes.
    two_nodes = SwitchPlanner(SPECS, gpus_per_node=2).weights(DP2TP2, DP4)
    assert sum(two_nodes.stats.inter_sent) == 0 and sum(two_nodes.stats.intra_sent) > 0
    # tp4 -> dp4 across 2 nodes: rank 0 gets shard 1 over NVLink and shards 2, 3 over the NIC
    tp_to_dp = SwitchPlanner({"w": ParamSpec((8, 4), True, 0)}, 2).weights(TP4, DP4)
    s = tp_to_dp.stats
    assert s.intra_recv == (8,) * 4 and s.inter_recv == (16,) * 4 and s.local == (8,) * 4
    assert s.max_link == 8
    # rank 1 sends the same shard to ranks 0, 2 and 3: one send buffer, shared by the three
    sends = tp_to_dp.program(1).sends
    assert [[(n, b) for n, b, _ in sends[p]] for p in (0, 2, 3)] == [[("w", ((2, 4), (0, 4)))]] * 3


def test_plan_cache_and_stats():
    planner = SwitchPlanner(SPECS, gpus_per_node=2)
    a = planner.weights(DP2TP2, TP4)
    assert planner.weights(DP2TP2, TP4) is a
    # micro-batch and ZeRO do not change where parameters live: same plan object
    assert planner.weights(Strategy(DP2TP2, micro_batch=4, zero=2), TP4) is a
    assert planner.grads(DP2TP2, TP4) is not a
    gpu = load_gpu("h100-80g")
    w = SwitchPlanner({"w": ParamSpec((8, 4), True, 0)}, 2).weights(TP4, DP4)
    # busiest port: 16 elements x 2 bytes over the NIC (15 us + 32 B / 42 GB/s)
    assert w.stats.time_bound_s(2, gpu) == pytest.approx(15e-6 + 32 / 42e9)
    assert w.stats.max_link_bytes(4) == 32


@pytest.mark.parametrize("kind", ["weights", "grads"])
@pytest.mark.parametrize("bound", [1, 40, 200, 10**9])
def test_rounds_partition_the_plan_under_the_bound(kind, bound):
    planner = SwitchPlanner(SPECS, gpus_per_node=2, min_slab=1)
    plan = getattr(planner, kind)(Strategy(DP2TP2), Strategy(RING4))
    rounds = plan.rounds(bound)
    assert plan.rounds(bound) is rounds  # kept per bound
    # every transfer exactly once, in plan order within each parameter
    by_name = lambda ts: {n: [t for t in ts if t.name == n] for n in SPECS}  # noqa: E731
    flat = [t for r in rounds for t in r.transfers]
    assert sorted(map(repr, flat)) == sorted(map(repr, plan.transfers))
    assert by_name(flat) == by_name(plan.transfers)
    for r in rounds:
        names = {t.name for t in r.transfers}
        load = [s + v for s, v in zip(r.stats.sent_bytes(1), r.stats.received_bytes(1))]
        assert max(load) <= bound or len(names) == 1, (bound, names, load)
        assert r.kind == plan.kind and r.specs is plan.specs
    # a parameter is never cut across rounds
    first = {}
    for k, r in enumerate(rounds):
        for t in r.transfers:
            assert first.setdefault(t.name, k) == k
    moved = max(s + v for s, v in zip(plan.stats.sent_bytes(1), plan.stats.received_bytes(1)))
    assert (len(rounds) == 1) == (bound >= moved)


def test_switch_cost_matches_closed_form():
    # tp8 -> dp8 on one node: every rank receives the 7/8 of each TP-split weight it lacks
    # over NVLink; replicated parameters stay local. Bound = alpha + bytes / B_nvlink.
    model, cluster = MODEL_PRESETS["gpt3-1.3b"], ClusterSpec(load_gpu("h100-80g"), 8)
    specs = model_param_specs(model, (8,))
    split = sum(math.prod(s.shape) for s in specs.values() if s.tensor_model_parallel)
    want = 8e-6 + split * 7 / 8 * 2 / 330e9
    assert switch_cost_s(Layout(tp=8), Layout(dp=8), model, cluster) == pytest.approx(want)
    assert switch_cost_s(Layout(dp=8), Layout(dp=8), model, cluster, grad_bytes=4) > 0  # DP reduce
    assert switch_cost_s(Layout(dp=8), Layout(tp=8), model, cluster) == 0  # all local


# --------------------------------------------------------------------------------------
# Executed switches (gloo)
# --------------------------------------------------------------------------------------


def _full_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s.shape, generator=gen).to(DTYPES[n]) for n, s in SPECS.items()}


def _locals(full, placement: Placement, rank: int) -> dict[str, torch.Tensor]:
    return {
        n: _local(full[n], s, placement, rank)
        for n, s in SPECS.items()
        if rank_pieces(s, placement, rank)
    }


def _contributions(layout_idx: int, placement: Placement, rank: int):
    """Unreduced gradients of one layout on ``rank`` (float32 locals) and, for the
    reference, every class's full-size contribution with the mask of what that class holds.
    Members of one class hold identical copies, so the contribution is seeded by class."""
    world = placement.layout.world_size
    local, classes = {}, {}
    for n, spec in SPECS.items():
        for r in range(world):
            pieces = rank_pieces(spec, placement, r)
            if not pieces:
                continue
            key = grad_class(spec, placement, r)
            if key not in classes.setdefault(n, {}):
                seed = zlib.crc32(repr((layout_idx, n, key)).encode())
                g = torch.rand(spec.shape, generator=torch.Generator().manual_seed(seed))
                classes[n][key] = [g, torch.zeros(spec.shape, dtype=torch.bool)]
            for p in pieces:
                classes[n][key][1][tuple(slice(a, b) for a, b in p.box)] = True
            if r == rank:
                local[n] = _local(classes[n][key][0], spec, placement, r)
    return local, classes


def _home_reduce(grads, strategy, rank, groups):
    """What the home layout's engine does after its own micro-batches (Megatron's
    finalize_model_grads): TP all-reduce of sequence-parallel grads, then DP all-reduce."""
    import torch.distributed as dist

    g = groups.get(strategy.layout)
    placement = Placement.of(strategy, 2)
    for n, t in grads.items():
        if (
            placement.sequence_parallel
            and SPECS[n].sequence_parallel_grad
            and not SPECS[n].tensor_model_parallel
        ):
            dist.all_reduce(t, group=g.tp_group)
        if SPECS[n].stages == "first+last" and strategy.layout.pp > 1:
            raise AssertionError("home layouts in this test have pp == 1")
        dist.all_reduce(t, group=g.dp_group)


def _chain_worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    from ds_stpar.parallel import GroupCache

    planner = SwitchPlanner(SPECS, gpus_per_node=2, min_slab=1)  # slabs: exercise them
    groups = GroupCache()
    full = _full_tensors(0)

    # Weights: home -> every layout -> home, bit-exact at every hop (no arithmetic happens).
    chain = [DP4, DP2TP2, TP4, RING4, CANNON4, TP2PP2, CANNON4, DP2TP2, TP2PP2, DP4]
    current = _locals(full, planner.placement(chain[0]), rank)
    start = {n: t.clone() for n, t in current.items()}
    for i, (a, b) in enumerate(zip(chain, chain[1:])):
        plan = planner.weights(a, b)
        target = {
            n: torch.full_like(t, float("nan")) for n, t in _locals(full, plan.dst, rank).items()
        }
        rounds = 40 if i % 3 == 2 else None  # some hops in rounds of at most 40 elements
        pending = switch(current, target, plan, async_op=i % 2 == 1, round_elements=rounds)
        if pending is not None:
            pending.wait()
        expect = _locals(full, plan.dst, rank)
        assert target.keys() == expect.keys()
        for n in expect:
            assert torch.equal(target[n], expect[n]), (a.short(), b.short(), n)
        current = target
    assert all(torch.equal(current[n], start[n]) for n in start)  # round trip = identity

    # Gradients carried bucket to bucket into the home layout, then the home reduction.
    # Reference: float64 sum of every class's contribution over every layout.
    # Tolerance: all contributions are positive (uniform [0, 1)), so each fp32 addition, in
    # whatever order, errs by at most 2^-24 of the final sum; at most 13 terms per element
    # (the norms of the first chain: 4 + 4 + 1 + 4 classes) -> 12 * 2^-24 = 7.2e-7 < 1e-6.
    for layouts, rounds in (
        (
            [
                Strategy(DP4),
                Strategy(CANNON4),
                Strategy(TP2PP2),
                Strategy(DP2TP2, sequence_parallel=True),
            ],
            None,
        ),
        ([Strategy(DP2TP2), Strategy(RING4), Strategy(DP4)], 40),
    ):
        reference = {n: torch.zeros(s.shape, dtype=torch.float64) for n, s in SPECS.items()}
        acc = None
        for i, strategy in enumerate(layouts):
            placement = planner.placement(strategy)
            local, classes = _contributions(i, placement, rank)
            for n, per_class in classes.items():
                for g, mask in per_class.values():
                    reference[n] += g.double() * mask
            if acc is not None:
                plan = planner.grads(layouts[i - 1], strategy)
                switch_grads(acc, local, plan, round_elements=rounds)
            acc = local
        _home_reduce(acc, layouts[-1], rank, groups)
        expect = _locals(reference, planner.placement(layouts[-1]), rank)
        for n in expect:
            torch.testing.assert_close(acc[n].double(), expect[n], rtol=1e-6, atol=0)

    # A plan over 2 ranks executed inside the subgroup {2, 3}: plan ranks are group ranks.
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    sub = SwitchPlanner(SPECS, gpus_per_node=2)
    plan = sub.weights(Layout(dp=2), Layout(tp=2))
    me = rank % 2
    src = _locals(full, plan.src, me)
    dst = {n: torch.zeros_like(t) for n, t in _locals(full, plan.dst, me).items()}
    switch(src, dst, plan, group=pair[rank // 2])
    assert all(torch.equal(dst[n], t) for n, t in _locals(full, plan.dst, me).items())

    _megatron_compare(rank, groups, full)
    _check_temporal_layers(rank)  # same launch: a launch costs seconds of start-up


def _megatron_compare(rank: int, groups, full) -> None:
    """megatron.core.resharding on the layouts it can express (1-d TP, DP, PP): the same
    shards as ours, and at least as many elements sent (total and busiest rank)."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.resharding import build_centralized_reshard_plan, execute_reshard_plan
    from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService

    class CpuGlooCopyService(GlooCopyService):
        """Megatron's gloo service minus the torch.cuda.Stream its __init__ creates, which a
        CPU-only torch cannot build (run() skips the stream when it is None)."""

        def __init__(self) -> None:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.gloo_pg = dist.new_group(backend="gloo")
            self.send_ops, self.recv_ops, self._copy_stream = [], [], None

    def module(layout, tensors):
        # names without dots: Megatron matches parameters by name across the two modules
        m, g = torch.nn.Module(), groups.get(layout)
        m.pg_collection = ProcessGroupCollection(tp=g.tp_group, dp=g.dp_group, pp=g.pp_group)
        m.params = torch.nn.ParameterDict()
        for n, t in tensors.items():
            p = torch.nn.Parameter(t.clone(), requires_grad=False)
            s = SPECS[n]
            p.tensor_model_parallel, p.partition_dim = s.tensor_model_parallel, s.partition_dim
            p.partition_stride = s.partition_stride
            m.params[n.replace(".", "_")] = p
        return m

    service, planner = CpuGlooCopyService(), SwitchPlanner(SPECS, gpus_per_node=2)
    pairs = [
        (DP4, DP2TP2),
        (DP2TP2, TP4),
        (DP2TP2, DP4),
        (TP4, DP4),
        (TP4, TP2PP2),
        (TP2PP2, DP2TP2),
    ]
    for a, b in pairs:
        plan = planner.weights(a, b)
        src = module(a, _locals(full, plan.src, rank))
        dst = module(b, {n: torch.zeros_like(t) for n, t in _locals(full, plan.dst, rank).items()})
        theirs = build_centralized_reshard_plan(src, dst)
        execute_reshard_plan(theirs, src, dst, service)
        for n, t in _locals(full, plan.dst, rank).items():
            assert torch.equal(dst.params[n.replace(".", "_")].data, t), (a.short(), b.short(), n)
        sent = sum(
            src.params[op.param_name.split(".", 1)[1]].data[op.my_slice].numel()
            for op in theirs.send_ops
            if op.peer_rank != rank
        )
        mine = plan.stats.sent_bytes(1)
        counts = torch.zeros(4, 2, dtype=torch.int64)
        counts[rank] = torch.tensor([mine[rank], sent])
        dist.all_reduce(counts)
        ours_max, theirs_max = counts.max(0).values.tolist()
        ours_sum, theirs_sum = counts.sum(0).tolist()
        assert ours_max <= theirs_max and ours_sum <= theirs_sum, (a.short(), b.short(), counts)
        if (a, b) in ((DP4, DP2TP2), (DP2TP2, TP4)):
            # Megatron sends what the receiver already holds (dp4 -> dp2-tp2 all comes from
            # rank 0; replicated norms in dp2-tp2 -> tp4): strictly more traffic
            assert ours_sum < theirs_sum


@pytest.mark.dist
def test_switch_chain_on_4_ranks():
    """Weight and gradient chains, Megatron's resharding, and the descriptors against the
    temporal layers (``_check_temporal_layers``), in one launch of 4 gloo ranks."""
    run_workers(_chain_worker, 4)


def _two_rank_worker(rank: int, world: int) -> None:
    planner = SwitchPlanner(SPECS, gpus_per_node=1)  # every rank its own node: all inter-node
    full = _full_tensors(1)
    a, b = Layout(dp=2), Layout(tp=2)
    for src, dst in ((a, b), (b, a), (b, b)):
        plan = planner.weights(src, dst)
        out = {n: torch.zeros_like(t) for n, t in _locals(full, plan.dst, rank).items()}
        switch(_locals(full, plan.src, rank), out, plan)
        assert all(torch.equal(out[n], t) for n, t in _locals(full, plan.dst, rank).items())
    # bad input: a missing parameter and a wrong local shape name the fix
    plan = planner.weights(a, b)
    src = _locals(full, plan.src, rank)
    good = {n: torch.zeros_like(t) for n, t in _locals(full, plan.dst, rank).items()}
    with pytest.raises(ConfigError, match="missing"):
        switch({n: t for n, t in src.items() if n != "emb"}, good, plan)
    with pytest.raises(ConfigError, match="shape"):
        switch(src, {**good, "emb": torch.zeros(16, 8, dtype=torch.bfloat16)}, plan)
    with pytest.raises(ConfigError, match="grads plan"):
        switch_grads(src, good, plan)
    # one dtype per parameter on both sides: peers size their messages by it
    with pytest.raises(ConfigError, match="emb: source is torch.bfloat16, target torch.float64"):
        switch(src, {**good, "emb": good["emb"].double()}, plan)
    # source and target may share one storage (an arena) but must not overlap
    one = SwitchPlanner({"w": ParamSpec((8, 4), True, 0)}, gpus_per_node=1).weights(a, b)
    w = torch.arange(32.0).view(8, 4)
    arena = torch.zeros(12, 4)
    arena[:8] = w
    switch({"w": arena[:8]}, {"w": arena[8:]}, one)
    assert torch.equal(arena[8:], w.chunk(2)[rank]) and torch.equal(arena[:8], w)
    with pytest.raises(ConfigError, match="overlap"):
        switch({"w": arena[:8]}, {"w": arena[4:8]}, one)


@pytest.mark.dist
def test_switch_on_2_ranks():
    run_workers(_two_rank_worker, 2)


# --------------------------------------------------------------------------------------
# Descriptors against the temporal layers themselves (gloo)
# --------------------------------------------------------------------------------------

# Tolerance of the forward checks: max |fp32 - fp64| <= 1e-5 * max |fp64|. The layers compute
# in fp32 from fp32 weights (exact copies) and the fp64 input rounded to fp32 (2^-24
# relative); each output is a length-8 dot product plus a bias, so its rounding error is about
# 9 * 2^-24 ~ 5e-7 of the terms' magnitude, which Cannon and the ring only reorder; 1e-5 is
# > 10x that, while a scrambled weight or bias errs by O(1).
RTOL = 1e-5


def _temporal(kind: str, mode: str, stride: int, full: torch.Tensor, group):
    """A temporal linear whose master weight is ``full`` [out, in], sharded by the layer's own
    construction path (use_cpu_initialization: master -> Megatron order -> this rank's block)."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    from ds_stpar.layers import TemporalColumnParallelLinear, TemporalRowParallelLinear

    config = ModelParallelConfig(
        tensor_model_parallel_size=group.size(), sequence_parallel=True, use_cpu_initialization=True
    )
    out_features, in_features = full.shape
    common = {
        "config": config,
        "init_method": lambda master: master.copy_(full),
        "stride": stride,
        "tp_group": group,
        "tp_mode": mode,
    }
    if kind == "column":
        return TemporalColumnParallelLinear(in_features, out_features, **common)
    return TemporalRowParallelLinear(
        in_features, out_features, bias=True, input_is_parallel=True, skip_bias_add=False, **common
    )


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err = (actual.double() - expected).abs().max().item()
    assert err <= RTOL * expected.abs().max().item(), (what, err)


def _check_temporal_layers(rank: int) -> None:
    """The descriptors against real ring and Cannon layers on the 4-rank world."""
    import torch.nn.functional as F

    from ds_stpar.parallel import GroupCache

    group = GroupCache().get(CANNON4).tp_group  # the world: RING4 and CANNON4 share it
    # 1. Every rank's local weight is exactly the pieces the descriptor (read from the
    # parameter) names. Distinct integer values (exact in fp32) expose any reordering.
    n, k = 24, 8  # partitioned dim divisible by 4 ranks x stride 1, 2, 3; the other by q = 2
    cases = [("column", "cannon", s) for s in (1, 2, 3)]
    cases += [("column", "ring", 2), ("row", "cannon", 1), ("row", "cannon", 2)]
    for kind, mode, stride in cases:
        layout = CANNON4 if mode == "cannon" else RING4
        dim = 0 if kind == "column" else 1
        shape = (n, k) if kind == "column" else (k, n)
        full = torch.arange(float(n * k)).view(shape)
        layer = _temporal(kind, mode, stride, full, group)
        spec = ParamSpec.from_param(layer.weight, layout, layer=0)
        assert spec == ParamSpec(shape, True, dim, stride, cannon_blocks=True, layer=0)
        local = _local(full, spec, Placement.of(layout, 1), rank)
        assert torch.equal(layer.weight.data, local), (kind, mode, stride)
        if kind == "column":
            bias = ParamSpec.from_param(layer.bias, layout, layer=0)
            assert bias == ParamSpec((n,), True, 0, stride, layer=0)
            assert local_shape(bias, layout) == tuple(layer.bias.shape)
        with pytest.raises(ConfigError, match="not one of layout"):  # built for the other mode
            ParamSpec.from_param(layer.weight, RING4 if mode == "cannon" else CANNON4)

    # 2. dp4 -> cannon4 -> ring4 for GLU fc1 (stride 2) with its bias: the switched layers
    # compute the full linear. Reference: float64 F.linear on one device; the column output
    # of TP rank t is Megatron's shard t of the output features.
    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(8, 2, k, generator=gen, dtype=torch.float64)  # [s, b, K]
    ref = F.linear(x, weight.double(), bias.double())[..., _megatron_index(n, 4, 2, rank)]
    nan = torch.full_like(weight, float("nan"))
    layers = {
        layout: _temporal("column", m, 2, nan, group)
        for layout, m in ((CANNON4, "cannon"), (RING4, "ring"))
    }
    specs = {
        "fc1.weight": ParamSpec.from_param(layers[CANNON4].weight, CANNON4, layer=0),
        "fc1.bias": ParamSpec.from_param(layers[CANNON4].bias, CANNON4, layer=0),
    }
    # one descriptor per parameter, whichever layout's layer it is read from
    assert ParamSpec.from_param(layers[RING4].weight, RING4, layer=0) == specs["fc1.weight"]
    assert ParamSpec.from_param(layers[RING4].bias, RING4, layer=0) == specs["fc1.bias"]
    planner = SwitchPlanner(specs, gpus_per_node=2)
    current = {"fc1.weight": weight.clone(), "fc1.bias": bias.clone()}
    for src, dst in ((DP4, CANNON4), (CANNON4, RING4)):
        layer = layers[dst]
        target = {"fc1.weight": layer.weight.data, "fc1.bias": layer.bias.data}
        target["fc1.bias"].fill_(float("nan"))
        switch(current, target, planner.weights(src, dst))
        with torch.no_grad():
            y, _ = layer(x.chunk(4)[rank].float())  # [s/P, b, K] -> [s, b, N/P]
        _close(y, ref, f"{src.short()} -> {dst.short()}")
        current = target
