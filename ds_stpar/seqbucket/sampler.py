"""A seeded, resumable sampler that turns an epoch of documents into mini-batch plans.

Per epoch ``e``: documents are shuffled with ``numpy.random.default_rng([seed, e])``, cut
into pieces (:func:`~ds_stpar.seqbucket.lengths.split_lengths`, context = the last edge),
and the piece sequence is cut greedily into mini-batches of at most ``global_batch_tokens``
tokens. Every piece lands in exactly one mini-batch, so every token of the epoch is used
exactly once; the last mini-batch of an epoch may be smaller.

Per mini-batch (:meth:`BucketSampler.plan`, a pure function of the epoch and the index, so
every rank computes the same plan with no communication):

1. a piece's own bucket is the one whose edge is the smallest ``>=`` its length;
2. each bucket's pieces are packed best-fit-decreasing into rows of its edge
   (:func:`~ds_stpar.seqbucket.packing.pack_buckets`);
3. rows are dealt to the bucket strategy's ``dp`` ranks by predicted cost
   (:func:`balance_rows`) and grouped into micro-batches of ``strategy.micro_batch`` rows; a
   rank short of rows gets padding rows (no pieces: zero weight), so every DP rank runs the
   same number of micro-batches (the collectives inside a micro-batch keep the ranks in
   step). No row is dropped. A micro-batch runs its rows' pieces end to end without their
   padding (:func:`~ds_stpar.seqbucket.packing.collate`): a padding row costs nothing, a
   micro-batch of padding rows a few pad tokens.

The plan carries the mini-batch's number of target tokens: the loss divisor
(:func:`~ds_stpar.seqbucket.loss.token_loss`) that makes the gradient independent of the
bucketing, packing and layouts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ds_stpar.config import Bucket, Strategy
from ds_stpar.errors import ConfigError, DataError
from ds_stpar.seqbucket.lengths import check_edges, split_lengths
from ds_stpar.seqbucket.packing import Piece, RowPlan, pack_buckets

RowCostFn = Callable[[RowPlan], float]


@dataclass(frozen=True)
class RowCost:
    """Predicted compute of a row, in token-equivalents: ``tokens + sum(l**2) / (12 h)``.

    Per layer and token a transformer spends ``24 h**2`` FLOPs in its linear layers (QKV,
    output, 4h MLP) and, with causal attention over a segment of ``l`` tokens, ``2 l h`` in
    scores and values; their ratio gives the quadratic term. Padding is left out: the
    runner does not compute it (:func:`~ds_stpar.seqbucket.packing.collate`).
    """

    hidden_size: int = 4096

    def __call__(self, row: RowPlan) -> float:
        quadratic = sum(p.length * p.length for p in row.pieces)
        return row.num_tokens + quadratic / (12.0 * self.hidden_size)


@dataclass(frozen=True)
class MicroBatch:
    """``strategy.micro_batch`` rows of one bucket's edge length (padding rows included; they
    are not computed, :func:`~ds_stpar.seqbucket.packing.collate`)."""

    rows: tuple[RowPlan, ...]

    @property
    def num_targets(self) -> int:
        return sum(row.num_targets for row in self.rows)

    @property
    def is_padding(self) -> bool:
        """All rows are padding: zero weight in the loss (run only to keep ranks in step)."""
        return not any(row.pieces for row in self.rows)


@dataclass(frozen=True)
class BucketPlan:
    """One bucket of one mini-batch: its strategy and each DP rank's micro-batches.

    ``ranks[d]`` are the micro-batches of DP index ``d`` of ``strategy.layout`` (its TP and
    PP peers run the same ones); all ``ranks[d]`` have the same length, possibly 0 when the
    mini-batch has no piece in this bucket.
    """

    edge: int
    strategy: Strategy
    ranks: tuple[tuple[MicroBatch, ...], ...]

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per DP rank."""
        return len(self.ranks[0])

    @property
    def num_targets(self) -> int:
        return sum(mb.num_targets for rank in self.ranks for mb in rank)

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) tokens over all DP ranks."""
        return sum(row.num_tokens for rank in self.ranks for mb in rank for row in mb.rows)

    def micro_batches(self, dp_rank: int) -> tuple[MicroBatch, ...]:
        return self.ranks[dp_rank]


@dataclass(frozen=True)
class MiniBatchPlan:
    """Mini-batch ``index`` of ``epoch``: one :class:`BucketPlan` per bucket, shortest first.

    ``num_targets``: target tokens (labels != -100) of the whole mini-batch, all buckets,
    micro-batches and DP ranks; ``num_tokens``: its real (non-pad) input tokens.
    """

    epoch: int
    index: int
    buckets: tuple[BucketPlan, ...]
    num_targets: int
    num_tokens: int


def balance_rows(
    rows: Sequence[RowPlan], edge: int, dp: int, micro_batch: int, cost: RowCostFn
) -> tuple[tuple[MicroBatch, ...], ...]:
    """Deal ``rows`` to ``dp`` ranks, then group each rank's rows into micro-batches.

    Rows go in rounds of ``dp``, costliest first; within a round the costliest row goes to
    the least-loaded rank. Counts then differ by at most one row, and the spread of rank
    costs never exceeds the costliest row: if loads ``L_i <= L_j`` get rows ``a_i >= a_j``,
    the new difference ``(L_j - L_i) - (a_i - a_j)`` lies within ``max(L_j - L_i, a_i -
    a_j)``, so the spread stays below the largest within-round cost range. Each rank is then
    padded with empty rows up to ``m * micro_batch`` rows, ``m`` the same for all ranks.
    """
    costs = [cost(row) for row in rows]
    order = sorted(range(len(rows)), key=lambda i: -costs[i])
    load = [0.0] * dp
    dealt: list[list[RowPlan]] = [[] for _ in range(dp)]
    for first in range(0, len(order), dp):
        ranks = sorted(range(dp), key=lambda r: (load[r], r))
        for i, rank in zip(order[first : first + dp], ranks):
            dealt[rank].append(rows[i])
            load[rank] += costs[i]
    per_rank = math.ceil(max(len(d) for d in dealt) / micro_batch)
    padding = RowPlan(edge)
    plan = []
    for rank_rows in dealt:
        rank_rows = rank_rows + [padding] * (per_rank * micro_batch - len(rank_rows))
        plan.append(
            tuple(
                MicroBatch(tuple(rank_rows[k : k + micro_batch]))
                for k in range(0, len(rank_rows), micro_batch)
            )
        )
    return tuple(plan)


@dataclass
class _Epoch:
    """The pieces of one shuffled epoch and where its mini-batches start."""

    doc: np.ndarray  # int64 [P]
    start: np.ndarray  # int64 [P]
    length: np.ndarray  # int64 [P]
    final: np.ndarray  # bool [P]
    bounds: np.ndarray  # int64 [M + 1], mini-batch k = pieces bounds[k]:bounds[k+1]


class BucketSampler:
    """Mini-batch plans over epochs of documents with token ``lengths``; resumable.

    ``buckets``: the plan's buckets (edges strictly increasing; the last edge is the
    context). ``cost``: a row's predicted compute for DP balancing (default :class:`RowCost`).
    Iterating yields the remaining mini-batches of the current epoch, then moves to the next
    epoch. ``state_dict()`` after ``k`` yielded plans resumes with plan ``k``.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        buckets: Sequence[Bucket],
        global_batch_tokens: int,
        seed: int = 0,
        cost: RowCostFn | None = None,
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or (self.lengths < 0).any():
            raise DataError("document lengths must be a 1-D array of non-negative counts")
        if not self.lengths.any():
            raise DataError(f"no tokens to train on in {len(self.lengths)} documents")
        self.buckets = tuple(buckets)
        self.edges = check_edges([b.max_len for b in self.buckets])
        if global_batch_tokens < self.edges[-1]:
            raise ConfigError(
                f"global batch of {global_batch_tokens} tokens is below the longest bucket "
                f"edge {self.edges[-1]}; raise the global batch or lower the context"
            )
        self.global_batch_tokens = int(global_batch_tokens)
        self.seed = int(seed)
        self.cost = cost if cost is not None else RowCost()
        self.epoch = 0
        self.position = 0
        self._cache: tuple[int, _Epoch] | None = None

    # ---- epoch structure -------------------------------------------------------------
    def _epoch(self, epoch: int) -> _Epoch:
        if self._cache is None or self._cache[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))
            doc, start, length = split_lengths(self.lengths[order], self.edges[-1], docs=order)
            cum = np.cumsum(length)
            bounds = [0]
            while bounds[-1] < len(length):
                done = cum[bounds[-1] - 1] if bounds[-1] else 0
                bounds.append(int(np.searchsorted(cum, done + self.global_batch_tokens, "right")))
            self._cache = (
                epoch,
                _Epoch(
                    doc=doc,
                    start=start,
                    length=length,
                    final=start + length == self.lengths[doc],
                    bounds=np.asarray(bounds, dtype=np.int64),
                ),
            )
        return self._cache[1]

    def num_mini_batches(self, epoch: int | None = None) -> int:
        return len(self._epoch(self.epoch if epoch is None else epoch).bounds) - 1

    def __len__(self) -> int:
        return self.num_mini_batches()

    def plan(self, index: int, epoch: int | None = None) -> MiniBatchPlan:
        """The plan of mini-batch ``index`` of ``epoch`` (default: the current epoch)."""
        epoch = self.epoch if epoch is None else epoch
        ep = self._epoch(epoch)
        if not 0 <= index < len(ep.bounds) - 1:
            raise IndexError(f"mini-batch {index} outside 0..{len(ep.bounds) - 2}")
        lo, hi = int(ep.bounds[index]), int(ep.bounds[index + 1])
        pieces = [
            Piece(int(ep.doc[i]), int(ep.start[i]), int(ep.length[i]), bool(ep.final[i]))
            for i in range(lo, hi)
        ]
        plans = []
        for bucket, rows in zip(self.buckets, pack_buckets(pieces, self.edges)):
            strategy = bucket.strategy
            ranks = balance_rows(
                rows, bucket.max_len, strategy.layout.dp, strategy.micro_batch, self.cost
            )
            plans.append(BucketPlan(bucket.max_len, strategy, ranks))
        length, final = ep.length[lo:hi], ep.final[lo:hi]
        return MiniBatchPlan(
            epoch=epoch,
            index=index,
            buckets=tuple(plans),
            num_targets=int(length.sum() - final.sum()),
            num_tokens=int(length.sum()),
        )

    # ---- iteration and resume --------------------------------------------------------
    def __iter__(self) -> Iterator[MiniBatchPlan]:
        while self.position < len(self):
            plan = self.plan(self.position)
            self.position += 1  # before yielding: a state saved now resumes after this plan
            yield plan
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_documents": len(self.lengths),
            "num_tokens": int(self.lengths.sum()),
            "global_batch_tokens": self.global_batch_tokens,
            "edges": list(self.edges),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next plan is the one after the last plan yielded before saving.

        The data and the batching must match the saved run, else the order would differ.
        """
        mine = self.state_dict()
        for key in ("num_documents", "num_tokens", "global_batch_tokens", "edges"):
            if state.get(key) != mine[key]:
                raise ConfigError(
                    f"sampler state was saved with {key}={state.get(key)}, this run has "
                    f"{mine[key]}; resume with the same data, global batch and buckets"
                )
        self.seed = int(state["seed"])
        self._cache = None
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
