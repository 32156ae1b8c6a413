"""Sequence-length buckets: edges and a strategy per bucket, against the best static layout.

Given the token lengths of a dataset's documents, a model, a cluster and a training setup
(context ``s`` = ``train.seq_len``, ``T`` = ``train.tokens_per_step`` tokens per optimizer
step), :func:`plan_buckets` chooses up to ``max_buckets`` bucket edges ``e_1 < ... < e_k = s``
and a strategy ``S_i`` per bucket, every one over the whole world (``dp tp pp`` = GPUs),
minimising the expected step time of seqbucket/runner.py's loop::

    step = sum_i bucket_i  +  sum_{i < k} (W(S_k -> S_i) + G(S_i -> S_k))  +  update(S_k)

- ``bucket_i``: forward + backward of bucket ``i``'s packed rows under ``S_i``: the cost
  model's pipeline time (:func:`~ds_stpar.planner.cost.estimate`'s step minus its DP
  communication and optimizer, :func:`pass_seconds`) for ``m_i`` micro-batches of ``b_i``
  rows of ``e_i`` tokens per DP rank; with ``pp > 1`` that is 1F1B, ``m_i`` times the slowest
  stage plus the fill and drain once per bucket (:func:`fill_seconds`);
- ``W``, ``G``: the switch planner's bandwidth bound (:class:`SwitchCosts`, HotSPa's
  Algorithm 1 in :mod:`~ds_stpar.seqbucket.switch`) for the ``e``-byte weights home -> ``S_i``
  before bucket ``i`` and its fp32 gradient back after it. The home layout ``S_k`` (the
  longest bucket's, where fp32 master weights and optimizer state live) moves nothing.
  A bucket whose model is the home's (:func:`~ds_stpar.config.model_key`: the home layout
  and sequence parallelism, any micro-batch, full recompute or none: the runner turns
  recompute on and off in the same model) runs on the home model under the home's engine and
  moves nothing: the typical case is a short bucket without recompute beside a long one that
  needs it. Other non-home buckets have distinct models (two sharing one would differ only in
  packing budget and micro-batch, and cost an extra gradient carry) and switch once each way
  per step, every step (a bucket is charged even in steps that happen to hold none of its
  documents);
- ``update``: the home layout's exposed DP gradient reduction and optimizer step, once.

Rows per step. Documents longer than ``s`` are cut into pieces
(:func:`~ds_stpar.seqbucket.lengths.split_lengths`); a piece of length ``l`` belongs to the
bucket ``(e_{i-1}, e_i]`` holding it, and each bucket's pieces of a step are packed
best-fit-decreasing into rows of its edge (:func:`~ds_stpar.seqbucket.packing.pack_buckets`,
as the sampler does). Bucket ``i`` carries ``T_i = T share_i`` tokens per step (``share_i``:
its pieces' share of the dataset's tokens) in ``rows_i = T_i / (e_i eff_i)`` rows. The packing
efficiency ``eff_i`` is measured for each edge set, not assumed (:func:`pack_stats`): steps of
``T x pieces / tokens`` pieces are drawn from the dataset's pieces and packed, the same draws
for every edge set, up to :data:`PACK_PIECES` pieces per step (a larger step packs a subset
of that size, slightly pessimistic).

Work. The runner feeds a micro-batch's rows end to end without their padding
(:func:`~ds_stpar.seqbucket.packing.collate`), so the work is the real tokens: per DP rank,
the slowest rank's ``E[ceil(R / dp)]`` rows of ``eff_i e_i`` tokens on average, in
micro-batches of ``b`` full rows (:func:`work_micro_batches`); padding rows and padding
micro-batches (a rank short of rows) cost nothing. Micro-batches *run* per rank,
``ceil(R / u)`` with ``u = dp b``, expected ``rows / u + (u - 1) / (2u)``
(:func:`bucket_micro_batches`), count where something happens per micro-batch whatever its
size (ZeRO-2's reduce-scatter) and give ds_stpar.json's GAS. The static baseline is the same
loop with one bucket and is charged the same way. The cost model is affine in the
micro-batch count (:func:`affine_timing`), so expected counts are evaluated exactly.

Attention over packed rows. Rows run varlen flash attention over their segments (the
documents, ``cu_seqlens``), which costs ``sum_j l_j^2`` of a full row's ``e^2``. The measured
``attention_ratio = sum l_j^2 / (rows e^2)``, over the work's full rows ``/ eff``
(:func:`executed_ratio`), scales the cost model's flash-attention time
(:func:`packed_estimate`). Unfused attention masks a full ``e x e`` matrix and is left as
is. The static baseline is scaled the same way.

Memory, per GPU (what the runner allocates; seqbucket/runner.py), bucket by bucket in the
order they run (:meth:`_Planner.bucket_peaks_gib`). A GPU sits on one pipeline stage of the
home layout and, perhaps, another of a bucket's layout, so with ``pp > 1`` every term below
is taken at its largest stage (``Psi``: the largest stage's parameters per GPU), which bounds
the sum from above; the home bucket alone is counted at the home layout's peak stage:

- always: the home layout's model states as the cost model counts them for its ZeRO stage
  (bf16 weights, gradients, fp32 master weights + Adam moments);
- a bucket on a model of its own holds that model only while it runs and switches:
  ``e Psi_i`` weights and ``4 Psi_i`` fp32 gradient accumulators (``Psi``: parameters per
  GPU of that layout), plus the cost model's activations, communication buffers, allocator
  headroom and runtime reserve for ``S_i`` at ``e_i`` (no DP reduction bucket: its gradient
  leaves through the switch; no optimizer step), or, while its weights come in, the
  switch's buffers instead of the activations (:func:`switch_buffer_bytes`: the runner
  switches in rounds). When another such bucket ran since the last home-model bucket, the
  *carry* (fp32 gradients of the home layout's local shapes, ``4 Psi_k``) is held too;
  carrying the gradient home holds the carry, the bucket's gradients and the switch's
  buffers, its weights already released;
- a bucket on the home model (the home one, or one differing only in recompute or
  micro-batch): the home states and its activations; the carry went into ``.grad`` before
  its first forward. ZeRO-2's reduce-scatter per micro-batch is charged to the home bucket's
  micro-batches only.

Every bucket must fit. Keeping every layout's model resident for the whole step, as a first
version did, charged the home bucket at the context with every short layout's weights and
gradients; at 32K tokens that decides whether a DP layout for short rows fits beside a TP
home at all.

What the runner executes (:func:`runnable`) restricts the bucketed strategies to home ZeRO
<= 2 (ZeRO-3 shards the parameters that the switch reads), pipelines in non-interleaved 1F1B
over even stages (``vpp_layers = 0``, no uneven first/last stage), and power-of-two
micro-batches; non-home buckets hold no optimizer state (ZeRO 0). A model that ties its
embedding and LM head may pipeline any layout: a pipelined home holds the tied weight on its
first and last stage and sums their gradients before DeepSpeed reduces them, through an fp32
accumulator of the weight on both stages (``seqbucket/tied.py``; the local stack's memory
counts it, ``planner.cost.stage_memory``); a non-home pipeline's copies go home through the
switch, which adds them. (Rule 13 still keeps ZeRO-2 off pipelines: the search and the
options take ZeRO 0-1 there.)

Static baseline: :func:`~ds_stpar.planner.search.search` at ``s`` for the whole step packed
best-fit into rows of ``s``, each fitting candidate timed with its attention ratio
(:meth:`_Planner.static`), among the strategies the training loop runs as its home layout
(:func:`runnable`; the plan is what ``launch/pretrain.py`` executes, so both sides of the
comparison must run there). When a layout the loop cannot run is predicted faster (ZeRO-3,
interleaved or uneven stages), the plan's ``note`` names it and why
(:func:`~ds_stpar.seqbucket.runner.loop_refusal`; DeepSpeed/Megatron-LM can run it as a
static layout). A
bucketed plan must beat it by ``min_gain`` per bucket beyond the first (default 1%: closer
predictions are within the cost model's error, and every bucket costs a model, memory and
a switch); otherwise the plan IS the static layout: one bucket, no switching.

Search: branch and bound over (home strategy, edge set). Per candidate edge and strategy,
two estimates give the forward + backward time per micro-batch (and a pipeline's fill and
drain per pass) with no attention and with full-row attention; a bucket at attention ratio
``r`` is interpolated between them (exact while the GPU bounds the micro-batch and, with
``pp > 1``, one stage is the slowest at both; the cost model's host time, when it binds, or
a change of slowest stage makes this an upper bound). A lower bound per (home, edge set)
sums the home bucket (its DP reduction bounded below at full attention) and each non-home
bucket's fastest option; items are taken in bound order, and each is solved by enumerating non-home combinations in order of bucket
time (distinct models, memory, switch costs added exactly), until the bound passes the best
plan found. Switch costs come from the real switch planner on versions of the model with
``L1 = lcm(pp of both layouts)`` and ``2 L1`` layers, extrapolated linearly in the layer
count (every block has the same parameters, and every stage holds the same share of them
as in the full model; tests/test_buckets.py checks it against the full model, pipelines
included). The plan reported is evaluated directly with the cost model
(:meth:`_Planner.timing`).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ds_stpar.config import (
    TP_MODES,
    Bucket,
    ClusterSpec,
    GiB,
    Layout,
    ModelSpec,
    Strategy,
    TrainSpec,
    model_key,
)
from ds_stpar.errors import ConfigError, DataError, DoesNotFitError
from ds_stpar.planner import memory as mem
from ds_stpar.planner import rules
from ds_stpar.planner.compute import Speed
from ds_stpar.planner.cost import Estimate, Evaluator
from ds_stpar.planner.profile import Calibration
from ds_stpar.planner.search import (
    MAX_MICRO_BATCH,
    families,
    knob_grid,
    least_block_recompute,
    search,
)
from ds_stpar.seqbucket.lengths import split_lengths
from ds_stpar.seqbucket.packing import Piece, pack_buckets
from ds_stpar.seqbucket.runner import LOOP_ZERO, loop_refusal
from ds_stpar.seqbucket.shards import Placement, model_param_specs
from ds_stpar.seqbucket.switch import SwitchPlanner, switch_buffer_bytes

DEFAULT_MAX_BUCKETS = 4
DEFAULT_MIN_EDGE = 256
HALF_STEP_OCTAVES = 3
"""Octaves below the context where :func:`candidate_edges` adds the half steps."""
DEFAULT_MIN_GAIN = 0.01  # each bucket beyond the first must buy 1% of the step
PACK_PIECES = 4096  # pieces per simulated step at most (a larger step packs a subset)
PACK_DRAWN = 8192  # pieces drawn in all: as many simulated steps as make about this many
MAX_PACK_GROUPS = 64  # simulated steps at most
MAX_COMBINATIONS = 4096  # non-home combinations examined per (home, edge set)
GRAD_BYTES = 4  # the runner accumulates and carries gradients in fp32
ALL = 1 << 30  # a search top_k that keeps every fitting strategy


# --------------------------------------------------------------------------------------
# Data: piece lengths and packing
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Pieces:
    """A dataset's pieces (documents, those longer than ``seq_len`` cut into chunks), by length.

    ``lengths``: int64 ``[P]`` ascending; ``cum_tokens``: int64 ``[P + 1]`` prefix sums.
    """

    lengths: np.ndarray
    cum_tokens: np.ndarray
    seq_len: int
    num_documents: int
    num_split_documents: int

    @classmethod
    def of(cls, document_lengths: np.ndarray, seq_len: int) -> Pieces:
        lengths = np.asarray(document_lengths, dtype=np.int64)
        if lengths.ndim != 1 or (lengths < 0).any():
            raise DataError("document lengths must be a 1-D array of non-negative token counts")
        if not lengths.any():
            raise DataError(f"no tokens in {len(lengths)} documents; nothing to plan buckets for")
        _, _, piece = split_lengths(lengths, seq_len)
        piece = np.sort(piece)
        return cls(
            lengths=piece,
            cum_tokens=np.concatenate([[0], np.cumsum(piece)]),
            seq_len=int(seq_len),
            num_documents=len(lengths),
            num_split_documents=int((lengths > seq_len).sum()),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.cum_tokens[-1])

    def span(self, lo: int, hi: int) -> tuple[int, int]:
        """Indices ``[i, j)`` of the pieces with ``lo < length <= hi``."""
        i = int(np.searchsorted(self.lengths, lo, side="right"))
        j = int(np.searchsorted(self.lengths, hi, side="right"))
        return i, j

    def count(self, lo: int, hi: int) -> tuple[int, int]:
        """(pieces, tokens) with ``lo < length <= hi``."""
        i, j = self.span(lo, hi)
        return j - i, int(self.cum_tokens[j] - self.cum_tokens[i])


@dataclass(frozen=True)
class PackStats:
    """Bucket ``(lo, hi]`` of one edge set, its rows of ``hi`` tokens per step.

    ``documents`` / ``tokens``: the dataset's pieces and tokens in the range;
    ``tokens_per_step``: their expected tokens per step; ``efficiency``: those tokens over
    ``rows x hi``; ``attention_ratio``: ``sum l^2`` over the pieces over ``rows x hi^2`` (the
    rows' padding is not computed); ``rows``: expected packed rows per step.
    """

    lo: int
    hi: int
    documents: int
    tokens: int
    tokens_per_step: float
    efficiency: float
    attention_ratio: float

    @property
    def rows(self) -> float:
        return self.tokens_per_step / (self.hi * self.efficiency)


def draw_steps(
    pieces: Pieces, tokens_per_step: int, seed: int, strata: Sequence[int]
) -> tuple[np.ndarray, ...]:
    """The piece lengths of simulated steps, drawn stratified by length (:func:`pack_stats`):
    a step holds ``n_r = T x pieces_r / tokens`` pieces of each range ``r`` of ``strata``
    (increasing, the last the context) on average, rounded up or down at random to keep that
    mean, drawn with replacement from the range's pieces (seeded by ``seed`` alone), at most
    :data:`PACK_PIECES` in all (a larger step draws that share of each range); as many steps
    as draw about :data:`PACK_DRAWN` pieces (at most :data:`MAX_PACK_GROUPS`)."""
    spans = [pieces.span(lo, hi) for lo, hi in zip((0, *strata[:-1]), strata)]
    per_step = np.array([(j - i) for i, j in spans]) * tokens_per_step / pieces.num_tokens
    per_step *= min(1.0, PACK_PIECES / per_step.sum())
    groups = min(MAX_PACK_GROUPS, max(1, round(PACK_DRAWN / max(per_step.sum(), 1.0))))
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(groups):
        counts = np.floor(per_step + rng.random(len(spans))).astype(np.int64)
        draws.append(
            np.concatenate(
                [
                    pieces.lengths[rng.integers(i, j, size=c)]
                    for (i, j), c in zip(spans, counts)
                    if c
                ]
                or [np.zeros(0, dtype=np.int64)]
            )
        )
    return tuple(draws)


def bucket_packing(draws: Sequence[np.ndarray], lo: int, hi: int) -> tuple[int, int, int]:
    """(rows, sum of squared piece lengths, tokens) of the pieces of ``draws`` in ``(lo, hi]``
    packed best-fit-decreasing into rows of ``hi`` (:func:`pack_buckets`), summed over the
    steps. A bucket packs its own pieces only, so this is the same in every edge set that
    has the bucket: :class:`_Planner` computes it once per bucket."""
    rows = square = packed = 0
    for draw in draws:
        own = draw[(draw > lo) & (draw <= hi)]
        if not own.size:
            continue
        (bucket_rows,) = pack_buckets([Piece(n, 0, int(n), True) for n in own], (hi,))
        rows += len(bucket_rows)
        for row in bucket_rows:
            square += sum(p.length**2 for p in row.pieces)
            packed += row.num_tokens
    return rows, square, packed


def pack_stats(
    pieces: Pieces,
    edges: Sequence[int],
    tokens_per_step: int,
    seed: int = 0,
    strata: Sequence[int] | None = None,
    packing: Callable[[int, int], tuple[int, int, int]] | None = None,
) -> tuple[PackStats, ...]:
    """Measure the packing of a step into buckets ``edges`` (increasing, the last the
    context), one :class:`PackStats` per bucket (module docstring, "Rows per step").

    Simulated steps (:func:`draw_steps` over ``strata``, default ``edges``: with the same
    strata, every edge set packs the same draws) are packed with
    :func:`~ds_stpar.seqbucket.packing.pack_buckets` (:func:`bucket_packing`, or
    ``packing(lo, hi)``, the same for those draws, e.g. cached). Each bucket packs its own
    pieces, so it carries ``T_i = T share_i`` tokens per step, ``share_i`` the exact share of
    its pieces in the dataset's tokens; the draws give its efficiency and attention ratio. A
    bucket whose rows the draws never opened: efficiency and attention ratio 1.
    """
    edges = tuple(int(e) for e in edges)
    if packing is None:
        strata = tuple(int(e) for e in (strata or edges))
        draws = draw_steps(pieces, tokens_per_step, seed, strata)

        def packing(lo: int, hi: int) -> tuple[int, int, int]:
            return bucket_packing(draws, lo, hi)

    out = []
    for lo, hi in zip((0, *edges[:-1]), edges):
        documents, tokens = pieces.count(lo, hi)
        rows, square, packed = packing(lo, hi)
        opened = rows * hi
        out.append(
            PackStats(
                lo=lo,
                hi=hi,
                documents=documents,
                tokens=tokens,
                tokens_per_step=tokens_per_step * tokens / pieces.num_tokens,
                efficiency=float(packed / opened) if opened else 1.0,
                attention_ratio=float(square / (opened * hi)) if opened else 1.0,
            )
        )
    return tuple(out)


def candidate_edges(seq_len: int, min_edge: int = DEFAULT_MIN_EDGE) -> tuple[int, ...]:
    """Powers of two ``2^k`` from ``min_edge`` up to (not including) ``seq_len``, then
    ``seq_len``; in the top :data:`HALF_STEP_OCTAVES` octaves below ``seq_len`` also the
    steps half-way between them in ratio, ``3 x 2^(k-1)``.

    The half steps matter where memory decides, near the context: at 32K on 80 GB cards a
    row of 24K tokens may run without recompute where one of 32K may not, so an edge at 24K
    lets the documents between 16K and 24K skip it (BENCHMARKS.md, eleventh session). Lower
    down, rows fit either way and a finer edge only moves a little packing efficiency; each
    candidate there would multiply the edge sets the search examines."""
    if min_edge < 1:
        raise ConfigError(f"the smallest bucket edge must be positive, got {min_edge}")
    edges = []
    edge = 1 << max(0, math.ceil(math.log2(min_edge)))
    while edge < seq_len:
        edges.append(edge)
        half_step = edge * 3 // 2
        if edge * 2**HALF_STEP_OCTAVES >= seq_len and min_edge <= half_step < seq_len:
            edges.append(half_step)
        edge *= 2
    return (*edges, seq_len)


# --------------------------------------------------------------------------------------
# The cost model on packed rows
# --------------------------------------------------------------------------------------


class _PackedSpeed(Speed):
    """:class:`Speed` whose flash attention does ``ratio`` of a full row's ``s^2`` work."""

    def __init__(self, base: Speed, cluster: ClusterSpec, ratio: float) -> None:
        super().__init__(cluster.gpu, base.cal, cluster.profile, base.e)
        self.ratio = ratio

    def flash(self, flops: float, head_dim: int = 128) -> float:
        return super().flash(flops * self.ratio, head_dim)


def packed_evaluator(
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    attention_ratio: float = 1.0,
    calibration: Calibration | None = None,
) -> Evaluator:
    """An :class:`Evaluator` for rows of packed documents: flash attention over the rows'
    segments costs ``attention_ratio`` of full ``seq_len``-token rows (1: the cost model)."""
    if not 0.0 <= attention_ratio <= 1.0:
        raise ConfigError(f"attention_ratio must be in [0, 1], got {attention_ratio}")
    ev = Evaluator(model, cluster, train, calibration)
    ev.speed = _PackedSpeed(ev.speed, cluster, attention_ratio)
    return ev


def packed_estimate(
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    strategy: Strategy,
    attention_ratio: float = 1.0,
    calibration: Calibration | None = None,
) -> Estimate:
    """:func:`~ds_stpar.planner.cost.estimate` for packed rows (see :func:`packed_evaluator`)."""
    return packed_evaluator(model, cluster, train, attention_ratio, calibration).estimate(strategy)


def update_seconds(est: Estimate) -> float:
    """The DP gradient reduction and optimizer step of an estimate (once per step)."""
    return est.time_breakdown["dp_comm_exposed"] + est.time_breakdown["optimizer"]


def pass_seconds(est: Estimate) -> float:
    """Forward and backward of all micro-batches: the estimate without :func:`update_seconds`."""
    return est.step_time_s - update_seconds(est)


def fill_seconds(est: Estimate) -> float:
    """The pipeline's fill and drain (the 1F1B bubble; 0 at pp = 1): the part of
    :func:`pass_seconds` that does not grow with the micro-batch count."""
    return est.time_breakdown["pp_bubble"]


def rows_per_round(strategy: Strategy) -> int:
    """Rows one micro-batch takes over the DP ranks: ``u = dp x micro_batch``."""
    return strategy.layout.dp * strategy.micro_batch


def bucket_micro_batches(rows: float, strategy: Strategy) -> float:
    """Expected micro-batches per DP rank of a bucket of ``rows`` expected rows per step.

    The runner deals a step's rows to the ``dp`` ranks in micro-batches of ``b`` and gives
    every rank the same count (seqbucket.sampler.balance_rows), so a step of ``R`` rows runs
    ``ceil(R / u)`` micro-batches, ``u = dp b``. The row count varies from step to step; with
    its remainder modulo ``u`` spread evenly, ``E[ceil(R / u)] = rows / u + (u - 1) / (2u)``;
    at least one (the home bucket runs one every step). ds_stpar.json's GAS; the time
    follows :func:`work_micro_batches`."""
    u = rows_per_round(strategy)
    return max(1.0, rows / u + (u - 1) / (2 * u))


def work_micro_batches(stats: PackStats, strategy: Strategy) -> float:
    """Forward and backward work per DP rank per step, in micro-batches of ``b`` full rows.

    The runner computes a micro-batch's real tokens only (the rows' padding, and padding
    rows, cost nothing: seqbucket.packing.collate), and the slowest DP rank sets the pace.
    Rows are dealt in rounds of ``dp``, so that rank holds ``E[ceil(R / dp)] = rows / dp +
    (dp - 1) / (2 dp)`` rows (as :func:`bucket_micro_batches`), each of ``efficiency x e``
    tokens on average. 0 for a bucket without tokens."""
    if not stats.tokens_per_step:
        return 0.0
    dp = strategy.layout.dp
    rows = stats.rows / dp + (dp - 1) / (2 * dp)
    return rows * stats.efficiency / strategy.micro_batch


def executed_ratio(stats: PackStats) -> float:
    """Attention ratio of the work :func:`work_micro_batches` counts: the pieces' ``sum l^2``
    over ``e^2`` per full row of real tokens, ``attention_ratio / efficiency`` (<= 1)."""
    return min(1.0, stats.attention_ratio / stats.efficiency)


@dataclass(frozen=True)
class Timing:
    """Seconds of one strategy per step at a (possibly fractional) expected number of
    micro-batches per DP rank: ``pass_s`` (forward + backward) and ``update_s`` (DP
    reduction + optimizer)."""

    pass_s: float
    update_s: float

    @property
    def step_s(self) -> float:
        return self.pass_s + self.update_s


def affine_timing(
    first: Estimate, second: Estimate, micro_batches: float, reductions: float | None = None
) -> Timing:
    """:class:`Timing` at ``micro_batches`` (of work, :func:`work_micro_batches`) from exact
    estimates of one strategy at two micro-batch counts, the DP reduction at ``reductions``
    micro-batches run (default the same; :func:`bucket_micro_batches`). The cost model is
    affine in ``m``: ``m`` times the slowest stage plus a constant pipeline fill and drain, a
    DP reduction that is constant (ZeRO 0/1) or ``m`` reduce-scatters (ZeRO-2: one per
    micro-batch run, padding ones too), one optimizer step; so this is exact at any ``m``."""
    m1, m2 = first.micro_batches, second.micro_batches
    w = (micro_batches - m1) / (m2 - m1)
    r = w if reductions is None else (reductions - m1) / (m2 - m1)
    p1, p2 = pass_seconds(first), pass_seconds(second)
    u1, u2 = update_seconds(first), update_seconds(second)
    return Timing(p1 + w * (p2 - p1), u1 + r * (u2 - u1))


def bucket_timing(
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    stats: PackStats,
    strategy: Strategy,
    calibration: Calibration | None = None,
) -> Timing:
    """:class:`Timing` of ``strategy`` running the rows of one bucket (``stats``: rows of
    ``stats.hi`` tokens) as the loop runs them: estimates at the rows rounded up to a multiple
    of ``world x MAX_MICRO_BATCH`` and at twice that, :func:`affine_timing` at the work of
    :func:`work_micro_batches` with the DP reduction at :func:`bucket_micro_batches`, flash
    attention at the rows' :func:`executed_ratio`. The static plan's time (and a check of any
    other static layout against a run)."""
    unit = cluster.num_gpus * MAX_MICRO_BATCH
    rows = math.ceil(stats.rows / unit) * unit
    ratio = executed_ratio(stats)
    first, second = (
        packed_estimate(
            model,
            cluster,
            dataclasses.replace(train, seq_len=stats.hi, global_batch=n),
            strategy,
            ratio,
            calibration,
        )
        for n in (rows, 2 * rows)
    )
    return affine_timing(
        first,
        second,
        work_micro_batches(stats, strategy),
        bucket_micro_batches(stats.rows, strategy),
    )


# --------------------------------------------------------------------------------------
# Switch costs
# --------------------------------------------------------------------------------------


class SwitchCosts:
    """Bandwidth bounds of switching between layouts of one model, from the real switch
    planner on two smaller versions of the model, extrapolated linearly in the layers:
    ``t(L) = t(L1) + (L - L1) / (L2 - L1) (t(L2) - t(L1))`` with ``L1 = lcm(pp of both
    layouts)`` and ``L2 = 2 L1``, the fewest layers every stage of both can hold evenly (so
    each stage holds the same share of the blocks as in the full model: the per-rank bytes,
    and with them the bound, grow linearly with the blocks). Cached per placement pair."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, weight_bytes: int) -> None:
        self.model, self.cluster, self.weight_bytes = model, cluster, weight_bytes
        self._planners: dict[tuple[int, int], SwitchPlanner] = {}
        self._cache: dict[tuple[Placement, Placement], tuple[float, float]] = {}

    def _planner(self, layers: int, tp_lcm: int) -> SwitchPlanner:
        key = (layers, tp_lcm)
        if key not in self._planners:
            small = dataclasses.replace(self.model, num_layers=layers)
            specs = model_param_specs(small, (tp_lcm,))
            self._planners[key] = SwitchPlanner(specs, self.cluster.gpus_per_node, layers)
        return self._planners[key]

    def __call__(self, home: Strategy, away: Strategy) -> tuple[float, float]:
        """(weights home -> away, fp32 gradients away -> home), seconds."""
        layers = self.model.num_layers
        key = (Placement.of(home, layers), Placement.of(away, layers))
        if key not in self._cache:
            tp_lcm = math.lcm(home.layout.tp, away.layout.tp)
            base = math.lcm(home.layout.pp, away.layout.pp)
            gpu = self.cluster.gpu
            times = []
            for n in (base, 2 * base):
                planner = self._planner(n, tp_lcm)
                weights = planner.weights(home, away).stats.time_bound_s(self.weight_bytes, gpu)
                grads = planner.grads(away, home).stats.time_bound_s(GRAD_BYTES, gpu)
                times.append((weights, grads))
            (w1, g1), (w2, g2) = times
            scale = (layers - base) / base
            self._cache[key] = (
                max(0.0, w1 + scale * (w2 - w1)),
                max(0.0, g1 + scale * (g2 - g1)),
            )
        return self._cache[key]


# --------------------------------------------------------------------------------------
# Result
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedBucket:
    """One bucket of a plan, per optimizer step (expected values).

    ``rows``: packed rows; ``micro_batches``: run per DP rank, padding ones included
    (:func:`bucket_micro_batches`); ``attention_ratio``: of the work, the rows' real tokens
    (:func:`executed_ratio`); ``time_s``: forward + backward; ``switch_s``: weights in + gradients
    out (0 for the home bucket); ``peak_memory_gib``: the most held while the bucket runs or
    switches (the home model states, this bucket's model and the carry while they exist, its
    activations and buffers).
    """

    lo: int
    edge: int
    strategy: Strategy
    documents: int
    tokens: int
    tokens_per_step: float
    rows: float
    micro_batches: float
    packing_efficiency: float
    attention_ratio: float
    time_s: float
    switch_s: float
    peak_memory_gib: float

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["strategy"] = self.strategy.to_dict()
        data["layout"] = self.strategy.layout.short()
        data["short"] = self.strategy.short()
        return data


@dataclass(frozen=True)
class StaticPlan:
    """The best static layout for the step: ``rows`` packed rows of ``seq_len`` tokens at
    ``attention_ratio``, ``step_s`` seconds, ``peak_memory_gib`` per GPU."""

    strategy: Strategy
    rows: float
    micro_batches: float
    attention_ratio: float
    step_s: float
    update_s: float
    peak_memory_gib: float


@dataclass(frozen=True)
class BucketPlan:
    """Buckets and strategies for one dataset, model, cluster and step, with predictions.

    ``bucketed_step_s = sum(b.time_s) + switch_s + update_s`` (``update_s``: the home
    layout's DP reduction and optimizer step); ``speedup = static.step_s / bucketed_step_s``
    (1 when the plan is the static layout: one bucket, ``note`` says why). ``considered``:
    bucketed plans whose cost was computed in full; ``stack``: the calibration's software
    stack (``launch/pretrain.py`` runs ``megatron-core-local``).
    """

    buckets: tuple[PlannedBucket, ...]
    switch_s: float
    update_s: float
    bucketed_step_s: float
    static: StaticPlan
    tokens_per_step: int
    num_documents: int
    num_tokens: int
    num_split_documents: int
    considered: int
    note: str = ""
    pieces: Pieces | None = field(default=None, repr=False, compare=False)
    stack: str = "fused"  # the software stack the times and memory are predicted for

    @property
    def edges(self) -> tuple[int, ...]:
        return tuple(b.edge for b in self.buckets)

    @property
    def home(self) -> PlannedBucket:
        return self.buckets[-1]

    @property
    def static_step_s(self) -> float:
        return self.static.step_s

    @property
    def speedup(self) -> float:
        return self.static_step_s / self.bucketed_step_s

    @property
    def home_micro_batches(self) -> int:
        """The home bucket's micro-batches per DP rank, rounded up (to a multiple of pp when
        interleaved, rule 5): ds_stpar.json's GAS (planner/emit.py, "Bucketed plans")."""
        m = math.ceil(self.home.micro_batches - 1e-9)
        s = self.home.strategy
        if s.vpp_layers and s.layout.pp > 1:
            m = math.ceil(m / s.layout.pp) * s.layout.pp
        return m

    def stpar_buckets(self) -> tuple[Bucket, ...]:
        """The plan as :class:`~ds_stpar.config.Bucket` s for the "ds_stpar" section."""
        return tuple(Bucket(b.edge, b.strategy) for b in self.buckets)

    def to_dict(self) -> dict:
        static = dataclasses.asdict(self.static)
        static["strategy"] = self.static.strategy.to_dict()
        static["short"] = self.static.strategy.short()
        return {
            "edges": list(self.edges),
            "buckets": [b.to_dict() for b in self.buckets],
            "switch_s": self.switch_s,
            "update_s": self.update_s,
            "bucketed_step_s": self.bucketed_step_s,
            "static_step_s": self.static_step_s,
            "speedup": self.speedup,
            "static": static,
            "tokens_per_step": self.tokens_per_step,
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "num_split_documents": self.num_split_documents,
            "considered": self.considered,
            "note": self.note,
            "stack": self.stack,
        }


# --------------------------------------------------------------------------------------
# Search
# --------------------------------------------------------------------------------------


_MODEL_NUMBERS: dict[Strategy, int] = {}
"""Model keys numbered in the order first seen (:attr:`_Option.model`)."""


@dataclass(frozen=True)
class _Option:
    """A strategy at an edge: forward + backward seconds per micro-batch without attention
    (``t0``) and with full-row attention (``t1``), and the pipeline's fill and drain once per
    pass (``fill0``, ``fill1``; 0 at pp = 1), the cost model being linear in the attention
    time (up to which stage is the slowest); active and (home) state memory in GiB;
    parameters per GPU (its largest stage); for the home, the DP reduction + optimizer at
    full attention as ``update0 + update_slope x m`` (a lower bound at any smaller ratio: less
    backward to hide the reduction behind)."""

    strategy: Strategy
    t0: float
    t1: float
    fill0: float
    fill1: float
    active_gib: float
    states_gib: float
    params: float
    update0: float = 0.0
    update_slope: float = 0.0
    shared_active_gib: float = 0.0  # a non-home option run on the home model (DP buffers too)

    @functools.cached_property
    def key(self) -> Strategy:
        """The model this option runs on (:func:`~ds_stpar.config.model_key`), computed once:
        the search compares keys for every combination it examines."""
        return model_key(self.strategy)

    @functools.cached_property
    def model(self) -> int:
        """A number naming :attr:`key`: equal keys, equal numbers. The search compares models
        for each of the up to millions of combinations it examines, and comparing two
        strategies field by field took a third of its time."""
        return _MODEL_NUMBERS.setdefault(self.key, len(_MODEL_NUMBERS))

    def seconds(self, stats: PackStats) -> tuple[float, float, float]:
        """(forward + backward seconds, work in micro-batches per rank, attention ratio) of a
        bucket (:func:`work_micro_batches`, :func:`executed_ratio`)."""
        work = work_micro_batches(stats, self.strategy)
        ratio = executed_ratio(stats)
        fill = self.fill0 + ratio * (self.fill1 - self.fill0)
        return work * (self.t0 + ratio * (self.t1 - self.t0)) + fill, work, ratio


def _states_bytes(breakdown: dict[str, float]) -> float:
    """Model states of one stage's memory breakdown: weights, gradients, optimizer state."""
    return breakdown["weights"] + breakdown["grads"] + breakdown["optimizer"]


def _active_bytes(breakdown: dict[str, float]) -> float:
    """The rest of one stage's memory breakdown but the optimizer step's transient memory:
    what a layout that runs no optimizer step (a non-home bucket's) adds to model states."""
    return sum(breakdown.values()) - _states_bytes(breakdown) - breakdown["optimizer_step"]


def away_models(chosen: Sequence[_Option], home: _Option) -> list[Strategy] | None:
    """The models of their own that buckets ``chosen`` (shortest first) switch to, each once;
    ``None`` when buckets sharing one are not adjacent (the runner would hold it across the
    buckets between, which the memory account does not count)."""
    keys: list[Strategy] = []
    numbers: list[int] = []
    previous = home.model
    for option in chosen:
        number = option.model
        if number != home.model and number != previous:
            if number in numbers:
                return None
            numbers.append(number)
            keys.append(option.key)
        previous = number
    return keys


def runnable(strategy: Strategy) -> bool:
    """Whether ds_stpar's training loop runs ``strategy``
    (:func:`~ds_stpar.seqbucket.runner.loop_refusal`: ZeRO 0-2, no interleaving, even
    stages); the static baseline (a home layout) and every bucket are held to it."""
    return not loop_refusal(strategy)


MICRO_BATCH_SIZES = tuple(1 << k for k in range(int(math.log2(MAX_MICRO_BATCH)) + 1))
"""Micro-batches a bucket layout is tried with: powers of two up to MAX_MICRO_BATCH."""


class _Planner:
    def __init__(
        self,
        pieces: Pieces,
        model: ModelSpec,
        cluster: ClusterSpec,
        train: TrainSpec,
        edges: Sequence[int],
        max_buckets: int,
        tp_modes: Sequence[str],
        allow: bool,
        calibration: Calibration | None,
        seed: int,
        min_gain: float,
        min_buckets: int = 1,
    ) -> None:
        self.pieces, self.model, self.cluster, self.train = pieces, model, cluster, train
        self.edges, self.max_buckets, self.seed = tuple(edges), max_buckets, seed
        self.min_buckets = min_buckets
        self.min_gain = min_gain
        self.tp_modes, self.allow = tuple(tp_modes), allow
        self.cal = calibration or Calibration.load_default(cluster.gpu.name)
        self.cal_away = self.cal.replace(dp_bucket_elements=0)
        self.e = mem.element_bytes(train)
        self.capacity = cluster.gpu.hbm_gib
        self.tokens = train.tokens_per_step
        self.base_rows = cluster.num_gpus * MAX_MICRO_BATCH  # every b x dp divides it
        self.layouts: list[Layout] = []  # even stages only (runnable)
        for fam in families(model, cluster, self.tp_modes, allow):
            if not isinstance(fam, tuple) and not fam.first and not fam.last:
                if fam.layout not in self.layouts:
                    self.layouts.append(fam.layout)
        self.switch = SwitchCosts(model, cluster, self.e)
        specs = model_param_specs(dataclasses.replace(model, num_layers=1), (1,))
        self.switch_buffer_gib = {
            n: switch_buffer_bytes(specs, n) / GiB for n in {self.e, GRAD_BYTES}
        }
        self._stats: dict[tuple[int, ...], tuple[PackStats, ...]] = {}
        self._draws: tuple[np.ndarray, ...] | None = None
        self._packings: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._ranked: dict[tuple[tuple[int, ...], int], list[tuple[float, _Option]]] = {}
        self._evaluators: dict[tuple, Evaluator] = {}
        self._home: dict[tuple[_Option, tuple[int, ...]], Timing] = {}
        self.considered = 0

    # ---- pieces and evaluators -------------------------------------------------------
    def stats(self, edge_set: tuple[int, ...]) -> tuple[PackStats, ...]:
        """The packing of every bucket of ``edge_set`` (the non-home edges) and the home one."""
        if edge_set not in self._stats:
            edges = (*edge_set, self.train.seq_len)
            self._stats[edge_set] = pack_stats(
                self.pieces, edges, self.tokens, packing=self.bucket_packing
            )
        return self._stats[edge_set]

    def bucket_packing(self, lo: int, hi: int) -> tuple[int, int, int]:
        """:func:`bucket_packing` of the planner's draws (stratified by its candidate edges),
        once per bucket: the edge sets share their buckets' packings."""
        if self._draws is None:
            self._draws = draw_steps(self.pieces, self.tokens, self.seed, self.edges)
        if (lo, hi) not in self._packings:
            self._packings[lo, hi] = bucket_packing(self._draws, lo, hi)
        return self._packings[lo, hi]

    def train_at(self, edge: int, rows: int) -> TrainSpec:
        return dataclasses.replace(self.train, seq_len=edge, global_batch=rows)

    def evaluator(self, edge: int, rows: int, ratio: float, away: bool = False) -> Evaluator:
        key = (edge, rows, ratio, away)
        if key not in self._evaluators:
            cal = self.cal_away if away else self.cal
            train = self.train_at(edge, rows)
            self._evaluators[key] = packed_evaluator(self.model, self.cluster, train, ratio, cal)
        return self._evaluators[key]

    def timing(
        self, edge: int, strategy: Strategy, work: float, ratio: float, runs: float
    ) -> Timing:
        """Exact :class:`Timing` of a strategy, pipelines included (its estimates at base_rows
        and twice that, :func:`affine_timing` at ``work`` and ``runs`` micro-batches)."""
        first = self.evaluator(edge, self.base_rows, ratio).estimate(strategy)
        second = self.evaluator(edge, 2 * self.base_rows, ratio).estimate(strategy)
        return affine_timing(first, second, work, runs)

    # ---- options ---------------------------------------------------------------------
    def options(self, edge: int, homes: Sequence[_Option] | None = None) -> list[_Option]:
        """Every valid strategy at ``edge`` that the loop runs (:func:`runnable`) and that
        could fit, as :class:`_Option` s: as the home (``homes`` None) or as another bucket
        beside one of ``homes``."""
        home = homes is None
        out = []
        flash = self.cal.flash_attention
        for layout in self.layouts:
            zeros = (0,) if not home or layout.dp == 1 else LOOP_ZERO
            for zero, (sp, rc, fused) in itertools.product(zeros, knob_grid(layout, flash)):
                for b in MICRO_BATCH_SIZES:
                    strategy = Strategy(layout, b, zero, rc, sp, fused_ring_mlp=fused)
                    if not runnable(strategy):
                        break  # at any micro-batch
                    probe = self.train_at(edge, b * layout.dp)
                    if rules.violations(
                        self.model, self.cluster, probe, strategy, None, self.allow
                    ):
                        continue
                    option = self._option(edge, strategy, home)
                    if option is None:
                        break  # a larger micro-batch needs more memory still
                    out.append(option)
                    for block in self.block_recompute(edge, strategy, homes):
                        variant = self._option(edge, block, home)
                        if variant is not None:  # its own memory check may still refuse it
                            out.append(variant)
        return out

    def block_recompute(
        self, edge: int, strategy: Strategy, homes: Sequence[_Option] | None
    ) -> list[Strategy]:
        """Block-method variants of a fitting full-recompute ``strategy`` at ``edge``
        (:func:`~ds_stpar.planner.search.least_block_recompute`), none when no recompute
        fits already. A home option (``homes`` None) gets the one with the fewest layers
        recomputed that fits. A non-home option's memory depends on the home it runs beside
        and on its place (:meth:`bucket_peaks_gib`): one variant per distinct memory it would
        add to over ``homes`` -- the home's states, plus, on a model of its own, its own
        weights and gradients, with or without the home's gradient carry (held from a bucket
        before it) -- so that each home finds the fastest that fits beside it."""
        if strategy.recompute != "full":
            return []  # (least_block_recompute says so too, but after the loop over homes)
        if homes is None:
            block = least_block_recompute(
                strategy, self.model, lambda s: self._memory(edge, s, True)[2]
            )
            return [block] if block is not None else []
        own = self._own_gib(strategy)
        key = model_key(strategy)
        beside = set()
        for h in homes:
            if key == h.key:
                beside.add((True, round(h.states_gib, 6)))
                continue
            carry = GRAD_BYTES * h.params / GiB
            for held in (h.states_gib + own, h.states_gib + own + carry):
                beside.add((False, round(held, 6)))
        found = set()
        for shared, held in sorted(beside):

            def fits(s: Strategy, shared: bool = shared, held: float = held) -> bool:
                return held + self._active_gib(edge, s, shared) <= self.capacity

            block = least_block_recompute(strategy, self.model, fits)
            if block is not None:
                found.add(block)
        return sorted(found, key=lambda s: s.recompute_layers)

    def _own_gib(self, strategy: Strategy) -> float:
        """A non-home layout's own bf16 weights and gradient accumulators (its largest stage)."""
        return (self.e + GRAD_BYTES) * max(mem.stage_params(self.model, strategy)) / GiB

    def _active_gib(self, edge: int, strategy: Strategy, on_home: bool) -> float:
        """GiB a non-home bucket's strategy adds while it runs (:func:`_active_bytes` at its
        largest stage): on the home model with the home's DP buffers, else on its own."""
        stages = self.evaluator(edge, self.base_rows, 0.0, not on_home).stage_bytes(strategy)
        return max(map(_active_bytes, stages.values())) / GiB

    def _memory(self, edge: int, strategy: Strategy, home: bool) -> tuple[float, float, bool]:
        """(states, active GiB, fits) of an option. Memory per GPU takes each term at its
        largest pipeline stage (model states, parameters, activations and buffers; a GPU's
        stage differs from layout to layout), the home's peak at its peak stage; a non-home
        layout holds its own bf16 weights and gradients beside the home's states."""
        stages = self.evaluator(edge, self.base_rows, 0.0, not home).stage_bytes(strategy)
        states = max(map(_states_bytes, stages.values())) / GiB
        if home:
            active = max(sum(b.values()) for b in stages.values()) / GiB - states
        else:  # a non-home layout runs no optimizer step: its transient memory is not counted
            active = max(map(_active_bytes, stages.values())) / GiB
        return (
            states,
            active,
            (states if home else self._own_gib(strategy)) + active <= self.capacity,
        )

    def _option(self, edge: int, strategy: Strategy, home: bool) -> _Option | None:
        """The option's times and memory (:class:`_Option`, :meth:`_memory`); ``None`` when
        it does not fit."""
        away = not home
        states, active, fits = self._memory(edge, strategy, home)
        if not fits:
            return None
        params = max(mem.stage_params(self.model, strategy))
        m = self.base_rows // rows_per_round(strategy)
        none = self.evaluator(edge, self.base_rows, 0.0, away).estimate(strategy)
        full = self.evaluator(edge, self.base_rows, 1.0, away).estimate(strategy)
        t0, t1 = ((pass_seconds(e) - fill_seconds(e)) / m for e in (none, full))
        times = (t0, t1, fill_seconds(none), fill_seconds(full))
        if away:
            shared = self._active_gib(edge, strategy, on_home=True)
            return _Option(strategy, *times, active, 0.0, params, shared_active_gib=shared)
        slope = 0.0
        if strategy.zero == 2:  # ZeRO-2 reduce-scatters every micro-batch
            twice = self.evaluator(edge, 2 * self.base_rows, 1.0).estimate(strategy)
            slope = (update_seconds(twice) - update_seconds(full)) / m
        update0 = update_seconds(full) - slope * m
        return _Option(strategy, *times, active, states, params, update0, slope)

    def ranked(
        self, edge_set: tuple[int, ...], k: int, options: list[_Option]
    ) -> list[tuple[float, _Option]]:
        """Non-home options for bucket ``k`` of ``edge_set``, fastest first."""
        if (edge_set, k) not in self._ranked:
            stats = self.stats(edge_set)[k]
            timed = [(opt.seconds(stats)[0], opt) for opt in options]
            timed.sort(key=lambda item: (item[0], item[1].strategy.short()))
            self._ranked[edge_set, k] = timed
        return self._ranked[edge_set, k]

    # ---- home ------------------------------------------------------------------------
    def home_bound(self, h: _Option, edge_set: tuple[int, ...]) -> float:
        stats = self.stats(edge_set)[-1]
        runs = bucket_micro_batches(stats.rows, h.strategy)
        return h.seconds(stats)[0] + h.update0 + h.update_slope * runs

    def home_timing(self, h: _Option, edge_set: tuple[int, ...]) -> Timing:
        key = (h, edge_set)
        if key not in self._home:
            stats = self.stats(edge_set)[-1]
            _, work, ratio = h.seconds(stats)
            runs = bucket_micro_batches(stats.rows, h.strategy)
            self._home[key] = self.timing(self.train.seq_len, h.strategy, work, ratio, runs)
        return self._home[key]

    # ---- one (home, edge set) --------------------------------------------------------
    @staticmethod
    def bucket_active_gib(h: _Option, o: _Option) -> float:
        """Memory bucket option ``o`` adds while it runs: the home's own, on the home model
        (its key equal to the home's) with the home's DP buffers, otherwise its own layout's."""
        if o is h:
            return h.active_gib
        if o.model == h.model:
            return o.shared_active_gib
        return o.active_gib

    def bucket_peaks_gib(self, h: _Option, chosen: Sequence[_Option]) -> list[float]:
        """Peak memory while each bucket runs, ``chosen`` (shortest first) then the home one,
        switches included (module docstring, "Memory")."""
        states, carry = h.states_gib, GRAD_BYTES * h.params / GiB
        peaks, live = [], False  # live: a carry is held (a non-home model since the home's)
        for k, o in enumerate(chosen):
            if o.model == h.model:  # on the home model: the carry goes into .grad first
                peaks.append(states + self.bucket_active_gib(h, o))
                live = False
                continue
            first = k == 0 or chosen[k - 1].model != o.model  # adjacent buckets share a model
            last = k == len(chosen) - 1 or chosen[k + 1].model != o.model
            held = states + (carry if live else 0.0)
            weights, grads = self.e * o.params / GiB, GRAD_BYTES * o.params / GiB
            switch_in = self.switch_buffer_gib[self.e] if first else 0.0
            peak = held + weights + grads + max(o.active_gib, switch_in)
            if last:
                peak = max(peak, states + carry + grads + self.switch_buffer_gib[GRAD_BYTES])
                live = True
            peaks.append(peak)
        peaks.append(states + h.active_gib)
        return peaks

    def solve(self, h: _Option, edge_set: tuple[int, ...], bound: float, away_options):
        """The best (cost, non-home options) for home ``h`` and ``edge_set`` under ``bound``:
        non-home combinations in order of total bucket time (a k-way merge over the sorted
        lists), the first few thousand at most, skipping shared models and those that do not
        fit; the switch costs are added exactly."""
        home_s = self.home_timing(h, edge_set).step_s
        if not edge_set:
            self.considered += 1
            return (home_s, ()) if home_s < bound else None
        lists = [self.ranked(edge_set, k, away_options[hi]) for k, hi in enumerate(edge_set)]
        best = None
        start = (0,) * len(lists)
        heap = [(sum(lst[0][0] for lst in lists), start)]
        seen = {start}
        for _ in range(MAX_COMBINATIONS):
            if not heap:
                break
            total, index = heapq.heappop(heap)
            if home_s + total >= bound:
                break
            for k in range(len(lists)):
                nxt = index[:k] + (index[k] + 1,) + index[k + 1 :]
                if nxt[k] < len(lists[k]) and nxt not in seen:
                    seen.add(nxt)
                    step = lists[k][nxt[k]][0] - lists[k][index[k]][0]
                    heapq.heappush(heap, (total + step, nxt))
            chosen = [lists[k][i][1] for k, i in enumerate(index)]
            own = away_models(chosen, h)
            if own is None:
                continue
            if max(self.bucket_peaks_gib(h, chosen)) > self.capacity:
                continue
            self.considered += 1
            cost = home_s + total + sum(sum(self.switch(h.strategy, key)) for key in own)
            if cost < bound:
                bound, best = cost, (cost, tuple(chosen))
        return best

    # ---- everything ------------------------------------------------------------------
    def edge_sets(self) -> list[tuple[int, ...]]:
        """Increasing tuples of non-home edges (min_buckets - 1 to max_buckets - 1 of them)
        whose buckets, the home one included, all hold pieces."""
        seq_len = self.train.seq_len
        below = [e for e in self.edges if e < seq_len]
        out = []
        for k in range(self.min_buckets - 1, self.max_buckets):
            for combo in itertools.combinations(below, k):
                bounds = (0, *combo, seq_len)
                if all(self.pieces.count(a, b)[0] for a, b in zip(bounds, bounds[1:])):
                    out.append(combo)
        return out

    def weight(self, edge_set: tuple[int, ...]) -> float:
        """What a plan with these non-home edges must beat the bound by: each bucket beyond
        the first must buy ``min_gain`` of the step (predictions closer than that are noise,
        and every bucket costs a model, memory and a switch)."""
        return (1.0 + self.min_gain) ** len(edge_set)

    def best(self, bound: float):
        """The best bucketed plan (home option, edge set, non-home options) whose cost,
        weighted by :meth:`weight`, is strictly under ``bound``, or ``None``."""
        seq_len = self.train.seq_len
        homes = self.options(seq_len)
        sets = self.edge_sets()
        away = {e: self.options(e, homes) for e in sorted({e for s in sets for e in s})}
        items = []
        for edge_set in sets:
            if any(not away[hi] for hi in edge_set):
                continue
            rest = sum(self.ranked(edge_set, k, away[hi])[0][0] for k, hi in enumerate(edge_set))
            weight = self.weight(edge_set)
            for n, h in enumerate(homes):
                lower = (self.home_bound(h, edge_set) + rest) * weight
                items.append((lower, len(items), n, edge_set))
        items.sort()
        found = None
        for lower, _, n, edge_set in items:
            if lower >= bound:
                break
            weight = self.weight(edge_set)
            solved = self.solve(homes[n], edge_set, bound / weight, away)
            if solved is not None:
                bound = solved[0] * weight
                found = (homes[n], edge_set, solved[1])
        return found

    # ---- the static baseline ---------------------------------------------------------
    def static(self) -> StaticPlan:
        """The best static layout for the whole step packed into rows of ``seq_len``.

        The search runs at the packed row count rounded up to a multiple of ``world x
        MAX_MICRO_BATCH`` rows (so every layout and power-of-two micro-batch is enumerated,
        as for the buckets); each fitting candidate is then timed at its own micro-batch
        count (the loop runs it as one bucket: :func:`work_micro_batches`), from its estimates
        at that row count and twice it (:func:`affine_timing`), flash attention scaled by the
        packed rows' ratio (:func:`executed_ratio`).
        """
        model, cluster, seq_len = self.model, self.cluster, self.train.seq_len
        stats = self.stats(())[0]
        unit = cluster.num_gpus * MAX_MICRO_BATCH
        rows = math.ceil(stats.rows / unit) * unit
        found = search(
            model,
            cluster,
            self.train_at(seq_len, rows),
            top_k=ALL,
            tp_modes=self.tp_modes,
            calibration=self.cal,
            allow_tp_across_nodes=self.allow,
        )
        if not found.top:
            raise DoesNotFitError(
                f"no layout of {model.name} fits {cluster.num_gpus} x {cluster.gpu.name} at seq "
                f"{seq_len}; `ds-stpar plan` names the closest layout and what would fit"
            )
        ratio = executed_ratio(stats)
        best: StaticPlan | None = None
        self.unrunnable = None
        for est in found.top:
            s = est.strategy
            m = bucket_micro_batches(stats.rows, s)
            timing = bucket_timing(model, cluster, self.train, stats, s, self.cal)
            if not runnable(s):
                if self.unrunnable is None or timing.step_s < self.unrunnable[1]:
                    self.unrunnable = (s, timing.step_s)
                continue
            if best is None or (timing.step_s, s.short()) < (best.step_s, best.strategy.short()):
                best = StaticPlan(
                    s, stats.rows, m, ratio, timing.step_s, timing.update_s, est.peak_memory_gib
                )
        if best is None:
            strategy = self.unrunnable[0]
            raise DoesNotFitError(
                f"no layout of {model.name} that ds_stpar's training loop runs fits "
                f"{cluster.num_gpus} x {cluster.gpu.name} at seq {seq_len}: the best that fits, "
                f"{strategy.short()}, is one it cannot run ({loop_refusal(strategy)}); "
                "train with DeepSpeed/Megatron-LM from `ds-stpar plan` without --data"
            )
        return best

    # ---- the result ------------------------------------------------------------------
    def plan(self, found, static: StaticPlan) -> BucketPlan:
        pieces, seq_len = self.pieces, self.train.seq_len
        common = dict(
            static=static,
            tokens_per_step=self.tokens,
            num_documents=pieces.num_documents,
            num_tokens=pieces.num_tokens,
            num_split_documents=pieces.num_split_documents,
            considered=self.considered,
            pieces=pieces,
            stack=self.cal.stack,
        )
        if self.unrunnable is not None and self.unrunnable[1] < static.step_s:
            strategy, step_s = self.unrunnable
            common["note"] = (
                f"{strategy.short()} is predicted faster as a static layout ({step_s:.3f} s "
                "per step), but ds_stpar's training loop cannot run it: " + loop_refusal(strategy)
            )
        if found is None:  # the static layout: one bucket, no switch
            stats = self.stats(())[0]
            bucket = PlannedBucket(
                lo=0,
                edge=seq_len,
                strategy=static.strategy,
                documents=stats.documents,
                tokens=stats.tokens,
                tokens_per_step=stats.tokens_per_step,
                rows=stats.rows,
                micro_batches=static.micro_batches,
                packing_efficiency=stats.efficiency,
                attention_ratio=static.attention_ratio,
                time_s=static.step_s - static.update_s,
                switch_s=0.0,
                peak_memory_gib=static.peak_memory_gib,
            )
            return BucketPlan(
                buckets=(bucket,),
                switch_s=0.0,
                update_s=static.update_s,
                bucketed_step_s=static.step_s,
                **{
                    **common,
                    "note": "; ".join(
                        filter(
                            None,
                            (
                                common.get("note"),
                                "no bucketed plan is faster than the best static layout",
                            ),
                        )
                    ),
                },
            )
        home, edge_set, away = found
        bounds = (0, *edge_set, seq_len)
        peaks = self.bucket_peaks_gib(home, away)
        buckets = []
        switch_total = update = 0.0
        switched = set()  # a model shared by adjacent buckets switches once, with the first
        buckets_stats = self.stats(edge_set)
        for (lo, hi), option, peak, stats in zip(
            zip(bounds, bounds[1:]), (*away, home), peaks, buckets_stats
        ):
            _, work, ratio = option.seconds(stats)
            s = option.strategy
            m = bucket_micro_batches(stats.rows, s)
            timing = self.timing(hi, s, work, ratio, m)
            shared = option is not home and option.key == home.key
            switch = 0.0
            if not (option is home or shared or option.key in switched):
                switch = sum(self.switch(home.strategy, option.key))
                switched.add(option.key)
            switch_total += switch
            if shared:  # runs on the home model, under the home's DeepSpeed engine
                s = dataclasses.replace(s, zero=home.strategy.zero)
            if option is home:
                update = timing.update_s
            buckets.append(
                PlannedBucket(
                    lo=lo,
                    edge=hi,
                    strategy=s,
                    documents=stats.documents,
                    tokens=stats.tokens,
                    tokens_per_step=stats.tokens_per_step,
                    rows=stats.rows,
                    micro_batches=m,
                    packing_efficiency=stats.efficiency,
                    attention_ratio=ratio,
                    time_s=timing.pass_s,
                    switch_s=switch,
                    peak_memory_gib=peak,
                )
            )
        step = sum(b.time_s for b in buckets) + switch_total + update
        return BucketPlan(
            buckets=tuple(buckets),
            switch_s=switch_total,
            update_s=update,
            bucketed_step_s=step,
            **common,
        )


def plan_buckets(
    document_lengths: np.ndarray | Pieces,
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    max_buckets: int = DEFAULT_MAX_BUCKETS,
    min_edge: int = DEFAULT_MIN_EDGE,
    edges: Sequence[int] | None = None,
    tp_modes: Sequence[str] = TP_MODES,
    allow_tp_across_nodes: bool | None = None,
    calibration: Calibration | None = None,
    seed: int = 0,
    min_gain: float = DEFAULT_MIN_GAIN,
    min_buckets: int = 1,
) -> BucketPlan:
    """Bucket edges and strategies for documents of ``document_lengths`` tokens (module
    docstring). ``edges``: candidate edges (default :func:`candidate_edges` from
    ``min_edge``; ``train.seq_len`` is always the last); ``max_buckets``: at most this many
    buckets. ``min_buckets`` > 1 returns the fastest plan with at least that many buckets even
    when the static layout is predicted faster (what bucketing would cost; the benchmark
    measures such plans to check the prediction), its ``note`` saying so. Raises
    :class:`DoesNotFitError` when no layout fits at ``train.seq_len``, or when no plan of
    ``min_buckets`` buckets fits."""
    if max_buckets < 1:
        raise ConfigError(f"--max-buckets must be at least 1, got {max_buckets}")
    if not 1 <= min_buckets <= max_buckets:
        raise ConfigError(
            f"--min-buckets must be between 1 and --max-buckets ({max_buckets}), got {min_buckets}"
        )
    if not 0.0 <= min_gain < 1.0:
        raise ConfigError(f"min_gain must be in [0, 1), got {min_gain}")
    unknown = sorted(set(tp_modes) - set(TP_MODES))
    if unknown or not tp_modes:
        raise ConfigError(f"tp_modes must be among {TP_MODES}, got {list(tp_modes)}")
    seq_len = train.seq_len
    if edges is None:
        edges = candidate_edges(seq_len, min_edge)
    edges = tuple(sorted({int(e) for e in edges if 0 < int(e) < seq_len} | {seq_len}))
    pieces = (
        document_lengths
        if isinstance(document_lengths, Pieces)
        else Pieces.of(document_lengths, seq_len)
    )
    if pieces.seq_len != seq_len:
        raise ConfigError(f"pieces were cut at {pieces.seq_len}, the plan's seq_len is {seq_len}")
    allow = cluster.tp_across_nodes if allow_tp_across_nodes is None else allow_tp_across_nodes
    planner = _Planner(
        pieces,
        model,
        cluster,
        train,
        edges,
        max_buckets,
        tp_modes,
        allow,
        calibration,
        seed,
        min_gain,
        min_buckets,
    )
    static = planner.static()
    if min_buckets > 1:
        found = planner.best(math.inf)
        if found is None:
            raise DoesNotFitError(
                f"no plan of at least {min_buckets} buckets fits: every split of the lengths "
                "leaves a bucket empty or a bucket's layout out of memory; lower --min-buckets "
                "or --min-edge"
            )
        plan = planner.plan(found, static)
        if plan.speedup >= 1.0:
            return plan
        note = (
            f"at least {min_buckets} buckets asked for: predicted {plan.speedup:.3f}x of the "
            "best static layout"
        )
        return dataclasses.replace(plan, note=plan.note + note)
    found = planner.best(static.step_s)
    plan = planner.plan(found, static)
    if found is not None and plan.bucketed_step_s * planner.weight(found[1]) >= static.step_s:
        return planner.plan(None, static)  # the search's interpolation was optimistic
    return plan


# --------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------


def plot_plan(plan: BucketPlan, path: str, title: str = "") -> None:
    """The piece-length histogram (log-x; documents per bin and their share of tokens) with
    the bucket edges and each bucket's layout, as a PNG. Needs matplotlib (``[plot]`` extra)."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed: pip install ds_stpar[plot]"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = plan.pieces.lengths
    low = max(1.0, float(lengths[0]) / 1.5)
    bins = np.logspace(math.log10(low), math.log10(plan.pieces.seq_len * 1.05), 61)
    fig, ax = plt.subplots(figsize=(9, 4.8))
    ax.hist(lengths, bins=bins, color="#8fa8c8", label="documents (pieces)")
    ax.set_xscale("log")
    ax.set_xlabel("tokens per document (documents longer than seq_len cut into pieces)")
    ax.set_ylabel("documents")
    share = ax.twinx()
    tokens, _ = np.histogram(lengths, bins=bins, weights=lengths)
    share.stairs(100 * tokens / max(1, tokens.sum()), bins, color="#c0504d")
    share.set_ylabel("share of tokens (%)", color="#c0504d")
    top = ax.get_ylim()[1]
    for bucket in plan.buckets:
        ax.axvline(bucket.edge, color="black", linestyle="--", linewidth=1)
        label = f"<= {bucket.edge}: {bucket.strategy.short()}"
        ax.text(
            bucket.edge,
            top * 0.98,
            label,
            rotation=90,
            ha="right",
            va="top",
            fontsize=8,
            bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none"},
        )
    ax.set_title(
        title
        or f"{len(plan.buckets)} bucket(s): predicted {plan.bucketed_step_s:.3f} s vs static "
        f"{plan.static_step_s:.3f} s ({plan.speedup:.2f}x)"
    )
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as err:
        raise ConfigError(f"cannot write {path}: {err.strerror}") from None
    finally:
        plt.close(fig)
