"""Search every valid strategy of a world and rank the ones that fit by throughput.

Enumeration (by construction, so every candidate passes :func:`rules.violations`):

    tp | world (inside a node unless allowed)  x  pp | world / tp  x  dp = world / (tp pp)
    x tp_mode in {megatron, ring (tp > 1), cannon (tp = q^2)}  x  ZeRO 0-3 (0-1 with pp > 1,
    0 with dp = 1)  x  sequence parallel (off/on with Megatron tp > 1; on for ring/Cannon)
    x  recompute none / selective / full  x  micro-batch | B / dp (<= MAX_MICRO_BATCH)
    x  vpp_layers (0, or a divisor of the layers per stage when m % pp == 0)

and, for each fitting full-recompute candidate without interleaving whose no-recompute twin
does not fit, the block method with the fewest layers per stage recomputed that fits
(:func:`least_block_recompute`): it spends what memory is left on skipping recompute.

Layers that do not split over pp get one uneven split (lighter first and last stages, which
also carry the embedding and LM head). A layout family is (tp, mode, pp, ZeRO); a family whose
base breaks a rule is rejected with that rule's message, one whose model states alone exceed
the memory is rejected before any activation is counted, and inside a family the micro-batch
loop stops at the first size that does not fit (memory grows with it). Only candidates that
fit get a time estimate. With flash attention, selective recompute keeps the same memory as
none and only adds time, so it is skipped.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from ds_stpar.config import (
    TP_MODES,
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
from ds_stpar.planner import rules
from ds_stpar.planner.cost import Estimate, Evaluator
from ds_stpar.planner.profile import Calibration

MAX_MICRO_BATCH = 64


@dataclass
class SearchResult:
    """``top``: fitting estimates, best first by tokens/s. ``rejected``: one reason per layout
    family with no fitting member. ``closest``: the smallest-memory estimate when nothing
    fits. ``considered``: strategies looked at (memory checked or estimated)."""

    top: list[Estimate]
    rejected: dict[str, str] = field(default_factory=dict)
    closest: Estimate | None = None
    considered: int = 0


def divisors(n: int) -> list[int]:
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def stage_split(num_layers: int, pp: int) -> tuple[int, int] | None:
    """(first, last) stage layers: (0, 0) when pp divides the layers, else the heaviest
    equal first/last stages no larger than the middle ones that leave a divisible rest;
    ``None`` when there is none."""
    if num_layers % pp == 0:
        return 0, 0
    if pp == 2:
        return (num_layers + 1) // 2, num_layers // 2
    for edge in range(num_layers // pp, 0, -1):
        rest = num_layers - 2 * edge
        if rest % (pp - 2) == 0 and edge <= rest // (pp - 2):
            return edge, edge
    return None


def family_name(tp: int, mode: str, pp: int, zero: int) -> str:
    tag = f"/{mode}" if mode != "megatron" else ""
    return f"tp{tp}{tag}-pp{pp} zero{zero}"


@dataclass(frozen=True)
class _Family:
    layout: Layout
    zero: int
    first: int
    last: int

    @property
    def name(self) -> str:
        lay = self.layout
        return family_name(lay.tp, lay.tp_mode, lay.pp, self.zero)

    def strategy(self, **knobs) -> Strategy:
        return Strategy(
            self.layout,
            zero=self.zero,
            first_stage_layers=self.first,
            last_stage_layers=self.last,
            **knobs,
        )


def _modes(tp: int, tp_modes: Sequence[str]) -> list[str]:
    out = ["megatron"] if "megatron" in tp_modes or tp == 1 else []
    if tp > 1 and "ring" in tp_modes:
        out.append("ring")
    q = math.isqrt(tp)
    if q >= 2 and q * q == tp and "cannon" in tp_modes:
        out.append("cannon")
    return out


def families(
    model: ModelSpec, cluster: ClusterSpec, tp_modes: Sequence[str], allow_tp_across: bool
) -> Iterator[_Family | tuple[str, str]]:
    """Every (layout, ZeRO) family; a family that cannot exist comes as (name, reason)."""
    world, node = cluster.num_gpus, cluster.node_size
    for tp in divisors(world):
        if not allow_tp_across and (tp > node or node % tp):
            continue
        for pp in divisors(world // tp):
            if pp > model.num_layers:
                continue
            dp = world // (tp * pp)
            split = stage_split(model.num_layers, pp)
            zeros = (0,) if dp == 1 else ((0, 1) if pp > 1 else (0, 1, 2, 3))
            for mode in _modes(tp, tp_modes):
                layout = Layout(dp=dp, tp=tp, pp=pp, tp_mode=mode)
                for zero in zeros:
                    if split is None:
                        name = family_name(tp, mode, pp, zero)
                        yield (
                            name,
                            f"rule 2: num_layers {model.num_layers} has no split over pp {pp}",
                        )
                        continue
                    yield _Family(layout, zero, *split)


def knob_grid(layout: Layout, flash: bool) -> Iterator[tuple[bool, str, bool]]:
    """(sequence_parallel, recompute, fused_ring_mlp) of ``layout``, as the search and the
    bucket planner enumerate them: SP both ways for Megatron tp > 1, always on for ring/Cannon
    (rules 14, 15), off for tp 1 (rule 9); selective only without flash; the ring's MLP fused
    and as the two ring linears' passes (which wins depends on the link)."""
    tp, mode = layout.tp, layout.tp_mode
    sps = (True,) if mode != "megatron" and tp > 1 else ((False, True) if tp > 1 else (False,))
    recomputes = ("none", "full") if flash else ("none", "selective", "full")
    fusions = (True, False) if mode == "ring" and tp > 1 else (True,)
    for sp in sps:
        for rc in recomputes:
            for fused in fusions:
                yield sp, rc, fused


def least_block_recompute(
    strategy: Strategy, model: ModelSpec, fits: Callable[[Strategy], bool]
) -> Strategy | None:
    """``strategy`` (full recompute, no interleaving) under the block method with the fewest
    layers per stage recomputed that still ``fits``: each layer recomputed keeps only its
    input, so memory falls as k grows and time rises with it, and the least k that fits is
    the fastest. ``None`` for another recompute or an interleaved pipeline, when no recompute
    fits already (nothing to spend memory on), or when even one layer short of the smallest
    stage does not fit (only full recompute does; Megatron-LM takes at most the smallest
    stage's layers, rule 10). A binary search: about log2(layers per stage) memory checks."""
    if strategy.recompute != "full" or strategy.vpp_layers:
        return None
    if fits(dataclasses.replace(strategy, recompute="none")):
        return None
    hi = min(stage_layers(model.num_layers, strategy)) - 1
    if hi < 1 or not fits(dataclasses.replace(strategy, recompute_layers=hi)):
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(dataclasses.replace(strategy, recompute_layers=mid)):
            hi = mid
        else:
            lo = mid + 1
    return dataclasses.replace(strategy, recompute_layers=lo)


def _vpp_options(fam: _Family, model: ModelSpec, m: int) -> list[int]:
    """0 and every proper divisor of the layers per stage when interleaving is allowed
    (rules 3-5; even stages only, as planner/emit.py requires)."""
    pp = fam.layout.pp
    if pp < 2 or fam.first or m < pp or m % pp:
        return [0]
    per_stage = model.num_layers // pp
    return [0] + [n for n in divisors(per_stage) if n < per_stage]


def _micro_batches(fam: _Family, train: TrainSpec) -> list[int]:
    """Micro-batches dividing the per-DP batch (rule 6)."""
    if train.global_batch % fam.layout.dp:
        return []
    per_dp = train.global_batch // fam.layout.dp
    return [b for b in divisors(per_dp) if b <= MAX_MICRO_BATCH]


class _Search:
    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        train: TrainSpec,
        top_k: int,
        calibration: Calibration | None,
        allow: bool,
        interleave: bool = False,
    ) -> None:
        self.model, self.cluster, self.train = model, cluster, train
        self.interleave = interleave
        self.ev = Evaluator(model, cluster, train, calibration)
        self.capacity = cluster.gpu.hbm_gib
        self.allow = allow
        self.top_k = top_k
        self.heap: list[tuple[float, int, Estimate]] = []
        self.rejected: dict[str, str] = {}
        self.closest: tuple[float, Strategy] | None = None
        self.considered = 0

    def states_lower_bound(self, fam: _Family) -> float:
        """GiB of model states + runtime reserve on the heaviest stage."""
        strategy = fam.strategy()
        cal = self.ev.cal
        worst = 0.0
        for psi in mem.stage_params(self.model, strategy):
            st = mem.model_state_bytes(psi, fam.zero, fam.layout.dp, self.train, cal.grad_bytes)
            worst = max(worst, st.weights + st.grads + st.optimizer)
        return worst / GiB + cal.runtime_reserved_gib

    def family_violation(self, fam: _Family) -> str | None:
        sp = fam.layout.tp > 1 and fam.layout.tp_mode != "megatron"
        probe = fam.strategy(sequence_parallel=sp, micro_batch=_micro_batches(fam, self.train)[0])
        found = rules.violations(
            self.model, self.cluster, self.train, probe, allow_tp_across_nodes=self.allow
        )
        return found[0] if found else None

    def keep(self, est: Estimate) -> None:
        item = (est.tokens_per_s, self.considered, est)
        if len(self.heap) < self.top_k:
            heapq.heappush(self.heap, item)
        elif item[0] > self.heap[0][0]:
            heapq.heapreplace(self.heap, item)

    def note_miss(self, strategy: Strategy, peak: float) -> None:
        if self.closest is None or peak < self.closest[0]:
            self.closest = (peak, strategy)

    def peak(self, strategy: Strategy) -> float:
        return sum(self.ev.memory(strategy)[1].values())

    def block_recompute(self, strategy: Strategy) -> Strategy | None:
        """The fastest block-method variant of a fitting ``strategy``
        (:func:`least_block_recompute`); each block variant checked counts as considered
        (the no-recompute twin was counted where it was enumerated)."""

        def fits(candidate: Strategy) -> bool:
            self.considered += candidate.recompute_layers > 0
            return self.peak(candidate) <= self.capacity

        return least_block_recompute(strategy, self.model, fits)

    def run_family(self, fam: _Family) -> None:
        batch, dp = self.train.global_batch, fam.layout.dp
        if batch % dp:
            self.rejected[fam.name] = f"rule 6: global batch {batch} % dp {dp} != 0"
            return
        reason = self.family_violation(fam)
        if reason:
            self.rejected[fam.name] = reason
            return
        bound = self.states_lower_bound(fam)
        if bound > self.capacity:
            lightest = fam.strategy(
                micro_batch=_micro_batches(fam, self.train)[0],
                recompute="full",
                sequence_parallel=fam.layout.tp > 1,
            )
            self.considered += 1
            peak = sum(self.ev.memory(lightest)[1].values())
            self.rejected[fam.name] = (
                f"needs {peak:.1f} GiB, has {self.capacity:.1f} "
                f"(model states alone {bound - self.ev.cal.runtime_reserved_gib:.1f})"
            )
            self.note_miss(lightest, peak)
            return
        smallest = math.inf
        fitted = False
        flash = self.ev.cal.flash_attention
        for sp, rc, fused, pieces in self.knobs(fam.layout, flash):
            for b in _micro_batches(fam, self.train):
                if b % max(1, pieces):
                    continue
                m = self.train.global_batch // (b * fam.layout.dp)
                any_fit = False
                for vpp in _vpp_options(fam, self.model, m):
                    strategy = fam.strategy(
                        micro_batch=b,
                        recompute=rc,
                        sequence_parallel=sp,
                        vpp_layers=vpp,
                        fused_ring_mlp=fused,
                        interleave=pieces,
                    )
                    self.considered += 1
                    peak = self.peak(strategy)
                    if peak > self.capacity:
                        smallest = min(smallest, peak)
                        self.note_miss(strategy, peak)
                        continue
                    any_fit = fitted = True
                    self.keep(self.ev.estimate(strategy))
                    block = self.block_recompute(strategy)
                    if block is not None:
                        self.keep(self.ev.estimate(block))
                if not any_fit:
                    break  # a larger micro-batch needs more memory still
        if not fitted:
            self.rejected[fam.name] = f"needs {smallest:.1f} GiB, has {self.capacity:.1f}"

    def knobs(self, layout: Layout, flash: bool) -> Iterator[tuple[bool, str, bool, int]]:
        """:func:`knob_grid` plus, when asked and rule 17 can hold (a ring layout, no
        dropout), the interleaved layer of 2 pieces (its linears run locally: the MLP
        fusion does not apply). 4 pieces ran 0.5-13% slower than 2 in every measured case
        while the model, which does not price a piece's fixed costs, ranks them 4-5% ahead
        (``tests/test_interleave_plan.py``): the search does not try them."""
        for sp, rc, fused in knob_grid(layout, flash):
            yield sp, rc, fused, 0
            if (
                self.interleave
                and fused
                and layout.tp_mode == "ring"
                and layout.tp > 1
                and self.model.dropout == 0
            ):
                yield sp, rc, fused, 2

    def result(self) -> SearchResult:
        top = [est for _, _, est in sorted(self.heap, key=lambda item: (-item[0], item[1]))]
        closest = None
        if not top and self.closest is not None:
            closest = self.ev.estimate(self.closest[1])
        return SearchResult(top, self.rejected, closest, self.considered)


def search(
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    top_k: int = 5,
    tp_modes: Sequence[str] = ("megatron", "ring", "cannon"),
    calibration: Calibration | None = None,
    allow_tp_across_nodes: bool | None = None,
    interleave: bool = False,
) -> SearchResult:
    """The ``top_k`` fastest strategies that fit, with reasons for the families that do not.
    ``interleave``: also try ring layouts as the interleaved layer of 2 pieces (for
    Megatron-LM runs of unpacked micro-batches of whole sequences; ds_stpar's training loop
    packs rows and cannot run it)."""
    unknown = sorted(set(tp_modes) - set(TP_MODES))
    if unknown or top_k < 1:
        raise ConfigError(f"search: tp_modes must be among {TP_MODES} (got {unknown}), top_k >= 1")
    allow = cluster.tp_across_nodes if allow_tp_across_nodes is None else allow_tp_across_nodes
    run = _Search(model, cluster, train, top_k, calibration, allow, interleave)
    for fam in families(model, cluster, tp_modes, allow):
        if isinstance(fam, tuple):
            run.rejected[fam[0]] = fam[1]
            continue
        run.run_family(fam)
    return run.result()
