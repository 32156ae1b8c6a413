"""Best-fit-decreasing packing with document boundaries kept.

A :class:`Piece` is a document or a chunk of one (documents longer than the context are cut
by :func:`~ds_stpar.seqbucket.lengths.split_lengths`, never dropped or truncated). Pieces are
packed best-fit-decreasing (Ding et al. 2024, "Fewer truncations improve language modeling"):
longest piece first, each into the open row with the least room that still holds it, else a
new row. With buckets (:func:`pack_buckets`) each bucket packs its own pieces into rows of
its edge. A row's length bounds what a micro-batch holds (and what memory is planned for);
the work is its real tokens: :func:`collate` feeds a micro-batch's rows end to end without
their padding.

A packed row of length ``T`` (the bucket edge) is a sequence of segments, one per piece,
then one pad segment when the pieces leave room::

    tokens     | d0 d0 d0 d0 | d1 d1 d1 | PAD PAD |
    position   |  0  1  2  3 |  0  1  2 |  0   1  |   restarts at every segment
    labels     | d0[1..3] -100| d1[1..2] -100 | -100 -100 |
    cu_seqlens  0             4          7         9 = T

A micro-batch (:class:`PackedBatch`) has the same layout: the pieces of all its rows, then
one pad segment up to a multiple of :func:`token_multiple` tokens.

The label at position ``i`` is the document's next token, so no target crosses a document
boundary. The last token of a document has no target (-100); the last token of a chunk that
is not the document's end keeps its true next token (the first token of the next chunk: same
document, so nothing crosses). Every document of ``n`` tokens thus gives ``n - 1`` targets
however it is split or packed. Attention stays inside a segment: ``cu_seqlens`` for
flash-attention varlen on GPU, :func:`block_causal_mask` (a ``[T, T]`` matrix) on CPU.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, start + length)`` of document ``doc``; ``final``: they end it."""

    doc: int
    start: int
    length: int
    final: bool

    @property
    def num_targets(self) -> int:
        return self.length - 1 if self.final else self.length


@dataclass(frozen=True)
class RowPlan:
    """The pieces of one packed row of ``length`` tokens; no pieces: a padding row."""

    length: int
    pieces: tuple[Piece, ...] = ()

    def __post_init__(self) -> None:
        if self.num_tokens > self.length:
            raise ValueError(
                f"{self.num_tokens} tokens of pieces overflow a {self.length}-token row"
            )

    @property
    def num_tokens(self) -> int:
        return sum(p.length for p in self.pieces)

    @property
    def num_targets(self) -> int:
        return sum(p.num_targets for p in self.pieces)


def pack_buckets(pieces: Sequence[Piece], edges: Sequence[int]) -> list[list[RowPlan]]:
    """Best-fit-decreasing per bucket: ``rows[k]`` are rows of ``edges[k]`` tokens (edges
    strictly increasing) holding the pieces of bucket ``k`` (``edges[k - 1] < length <=
    edges[k]``), every piece in exactly one row.

    Longest piece first, each into the open row of its own bucket with the least room that
    still holds it, else a new row of that bucket. Pieces never fill a longer bucket's rows:
    rows run without their padding (:func:`collate`), so a short piece in a long row's gap
    would save nothing and run under the long bucket's costlier layout. Deterministic: ties
    in length keep input order; ties in room go to the oldest row. ``O(P log P + P * R)`` for
    ``P`` pieces and ``R`` rows (the insert into a sorted list of free room is a memmove).
    """
    edges = [int(e) for e in edges]
    if not edges or any(a >= b for a, b in zip(edges, edges[1:])):
        raise ValueError(f"bucket edges must be strictly increasing, got {edges}")
    rows: list[list[list[Piece]]] = [[] for _ in edges]
    free: list[list[tuple[int, int]]] = [[] for _ in edges]  # per bucket: (room, row), sorted
    for piece in sorted(pieces, key=lambda p: -p.length):
        if not 0 < piece.length <= edges[-1]:
            raise ValueError(f"piece of {piece.length} tokens does not fit a {edges[-1]}-token row")
        own = bisect.bisect_left(edges, piece.length)
        k = bisect.bisect_left(free[own], (piece.length, -1))
        if k < len(free[own]):
            room, row = free[own].pop(k)
        else:
            room, row = edges[own], len(rows[own])
            rows[own].append([])
        rows[own][row].append(piece)
        if room > piece.length:
            bisect.insort(free[own], (room - piece.length, row))
    return [[RowPlan(edge, tuple(row)) for row in bucket] for edge, bucket in zip(edges, rows)]


@dataclass(frozen=True)
class PackedRow:
    """One packed row of ``T`` tokens (see the module docstring for the layout).

    ``cu_seqlens`` (int32 ``[S + 1]``) bounds the ``S`` segments: ``pieces[k]`` occupies
    ``cu_seqlens[k]:cu_seqlens[k + 1]``; a final pad segment follows when the pieces leave room.
    """

    input_ids: torch.Tensor  # int64 [T]
    position_ids: torch.Tensor  # int64 [T]
    labels: torch.Tensor  # int64 [T], IGNORE_INDEX where there is no target
    cu_seqlens: torch.Tensor  # int32 [S + 1], cu_seqlens[-1] == T
    pieces: tuple[Piece, ...]

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def pack_row(row: RowPlan, tokens: Callable[[int], np.ndarray], pad_id: int) -> PackedRow:
    """Materialise ``row``; ``tokens(doc)`` returns the document's ids (e.g. ``Documents``)."""
    input_ids = np.full(row.length, pad_id, dtype=np.int64)
    labels = np.full(row.length, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.empty(row.length, dtype=np.int64)
    bounds = [0]
    for piece in row.pieces:
        doc = tokens(piece.doc)
        at, end = bounds[-1], bounds[-1] + piece.length
        input_ids[at:end] = doc[piece.start : piece.start + piece.length]
        labels[at : at + piece.num_targets] = doc[
            piece.start + 1 : piece.start + 1 + piece.num_targets
        ]
        position_ids[at:end] = np.arange(piece.length)
        bounds.append(end)
    if bounds[-1] < row.length:
        position_ids[bounds[-1] :] = np.arange(row.length - bounds[-1])
        bounds.append(row.length)
    return PackedRow(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(position_ids),
        labels=torch.from_numpy(labels),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        pieces=row.pieces,
    )


def block_causal_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """Bool ``[T, T]``: ``mask[i, j]`` is True when query ``i`` may attend key ``j``, i.e.
    ``j <= i`` and both lie in the same segment of ``cu_seqlens``."""
    index = torch.arange(length)
    segment = torch.searchsorted(cu_seqlens[1:].to(torch.int64), index, right=True)
    same = segment[:, None] == segment[None, :]
    return same & (index[None, :] <= index[:, None])


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as an additive one: 0 where True, the dtype's lowest value where False."""
    zero = torch.zeros((), dtype=dtype)
    return torch.where(mask, zero, torch.finfo(dtype).min)


TOKEN_MULTIPLE = 8
"""A micro-batch is fed as a multiple of this many tokens (and of the TP degree): tensor-core
tiles, and sequence parallelism splits the tokens evenly over the TP ranks."""


def token_multiple(tp: int) -> int:
    """The multiple a micro-batch's length is rounded up to under ``tp``-way TP."""
    return math.lcm(TOKEN_MULTIPLE, tp)


def micro_batch_length(rows: Sequence[RowPlan], multiple: int) -> int:
    """Tokens of the micro-batch of ``rows`` as :func:`collate` feeds it: their pieces end to
    end, rounded up to a multiple of ``multiple`` (one multiple for padding rows alone)."""
    tokens = sum(row.num_tokens for row in rows)
    return max(1, math.ceil(tokens / multiple)) * multiple


@dataclass(frozen=True)
class PackedBatch:
    """A micro-batch: the pieces of its rows end to end, then a pad segment up to ``T`` =
    :func:`micro_batch_length` tokens (the layout of :class:`PackedRow`, one row).

    The rows' own padding is dropped: each segment attends only within itself, so where a
    row ends changes nothing but the work, and pad tokens cost as much as real ones. A
    micro-batch of padding rows (a DP rank short of rows) is ``multiple`` pad tokens. Row
    lengths (the bucket edge) still bound the micro-batch, which is what memory is planned for.
    ``cu_seqlens`` is the layout flash-attention varlen and Megatron's ``PackedSeqParams``
    (``qkv_format="thd"``) take; ``max_seqlen`` is its longest segment.
    """

    input_ids: torch.Tensor  # int64 [1, T]
    position_ids: torch.Tensor  # int64 [1, T]
    labels: torch.Tensor  # int64 [1, T]
    cu_seqlens: torch.Tensor  # int32 [S + 1], cu_seqlens[-1] == T
    max_seqlen: int
    pieces: tuple[Piece, ...]  # pieces[k] occupies cu_seqlens[k]:cu_seqlens[k + 1]

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def attention_mask(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Block-diagonal causal mask ``[1, 1, T, T]``: bool (True = attend), or additive
        in ``dtype`` (0 / lowest value) for attention code that adds the mask to scores.

        HF transformers 5.x takes a 4-D mask as is: bool for ``sdpa``, additive for
        ``eager``. It can also derive the mask from ``position_ids`` alone, but only when no
        KV cache exists: pass ``use_cache=False``, else documents silently attend to each other.
        """
        mask = block_causal_mask(self.cu_seqlens, self.input_ids.shape[1])[None, None]
        return mask if dtype is None else additive_mask(mask, dtype)


def collate(
    rows: Sequence[RowPlan], tokens: Callable[[int], np.ndarray], pad_id: int, multiple: int = 1
) -> PackedBatch:
    """Materialise the micro-batch of ``rows`` as one :class:`PackedBatch` of
    :func:`micro_batch_length` tokens (``multiple``: :func:`token_multiple` of the layout)."""
    pieces = tuple(piece for row in rows for piece in row.pieces)
    length = micro_batch_length(rows, multiple)
    row = pack_row(RowPlan(length, pieces), tokens, pad_id)
    return PackedBatch(
        input_ids=row.input_ids[None],
        position_ids=row.position_ids[None],
        labels=row.labels[None],
        cu_seqlens=row.cu_seqlens,
        max_seqlen=int(torch.diff(row.cu_seqlens).max()),
        pieces=pieces,
    )
