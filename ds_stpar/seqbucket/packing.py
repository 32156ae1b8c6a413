"""Best-fit-decreasing packing with document boundaries kept.

A :class:`Piece` is a document or a chunk of one (documents longer than the context are cut
by :func:`~ds_stpar.seqbucket.lengths.split_lengths`, never dropped or truncated). Pieces are
packed best-fit-decreasing (Ding et al. 2024, "Fewer truncations improve language modeling"):
longest piece first, each into the open row with the least room that still holds it, else a
new row. With buckets (:func:`pack_buckets`) a new row gets the edge of the piece's own bucket
(the smallest edge that holds it) as its length, and a piece may also fill the room left in a
longer bucket's row: a short document in the gap of a long row costs what the pad tokens it
replaces cost, while packing each bucket alone leaves that gap padded and runs the short
document in a row of its own.

A packed row of length ``T`` (the bucket edge) is a sequence of segments, one per piece,
then one pad segment when the pieces leave room::

    tokens     | d0 d0 d0 d0 | d1 d1 d1 | PAD PAD |
    position   |  0  1  2  3 |  0  1  2 |  0   1  |   restarts at every segment
    labels     | d0[1..3] -100| d1[1..2] -100 | -100 -100 |
    cu_seqlens  0             4          7         9 = T

The label at position ``i`` is the document's next token, so no target crosses a document
boundary. The last token of a document has no target (-100); the last token of a chunk that
is not the document's end keeps its true next token (the first token of the next chunk: same
document, so nothing crosses). Every document of ``n`` tokens thus gives ``n - 1`` targets
however it is split or packed. Attention stays inside a segment: ``cu_seqlens`` for
flash-attention varlen on GPU, :func:`block_causal_mask` (a ``[T, T]`` matrix) on CPU.
"""

from __future__ import annotations

import bisect
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
    """Best-fit-decreasing over buckets: ``rows[k]`` are rows of ``edges[k]`` tokens (edges
    strictly increasing), every piece in exactly one row.

    A piece of ``l`` tokens opens a row of the smallest edge ``>= l`` only when no open row,
    of any bucket, has room for it. Pieces come longest first, so every row a piece could
    join belongs to its own bucket or a longer one, and the rows opened per bucket are as
    many as packing the bucket's pieces alone would leave after the shorter pieces already
    went into the gaps of longer rows. Deterministic: ties in length keep input order; ties
    in room go to the oldest row. ``O(P log P + P * R)`` for ``P`` pieces and ``R`` rows (the
    insert into the sorted list of free room is a memmove).
    """
    edges = [int(e) for e in edges]
    if not edges or any(a >= b for a, b in zip(edges, edges[1:])):
        raise ValueError(f"bucket edges must be strictly increasing, got {edges}")
    rows: list[list[Piece]] = []
    bucket: list[int] = []  # bucket index of each row
    free: list[tuple[int, int]] = []  # (room left, row index), sorted
    for piece in sorted(pieces, key=lambda p: -p.length):
        if not 0 < piece.length <= edges[-1]:
            raise ValueError(f"piece of {piece.length} tokens does not fit a {edges[-1]}-token row")
        k = bisect.bisect_left(free, (piece.length, -1))
        if k < len(free):
            room, row = free.pop(k)
        else:
            own = bisect.bisect_left(edges, piece.length)
            room, row = edges[own], len(rows)
            rows.append([])
            bucket.append(own)
        rows[row].append(piece)
        if room > piece.length:
            bisect.insort(free, (room - piece.length, row))
    out: list[list[RowPlan]] = [[] for _ in edges]
    for row, k in zip(rows, bucket):
        out[k].append(RowPlan(edges[k], tuple(row)))
    return out


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


@dataclass(frozen=True)
class PackedBatch:
    """A micro-batch of ``b`` packed rows of ``T`` tokens.

    ``cu_seqlens`` (int32) bounds the segments of the flattened ``b * T`` tokens (rows laid
    end to end), the layout flash-attention varlen and Megatron's ``PackedSeqParams``
    (``qkv_format="thd"``) take; ``max_seqlen`` is its longest segment.
    """

    input_ids: torch.Tensor  # int64 [b, T]
    position_ids: torch.Tensor  # int64 [b, T]
    labels: torch.Tensor  # int64 [b, T]
    cu_seqlens: torch.Tensor  # int32 [S + 1], S segments over all rows
    max_seqlen: int
    rows: tuple[PackedRow, ...]

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def attention_mask(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Block-diagonal causal mask ``[b, 1, T, T]``: bool (True = attend), or additive
        in ``dtype`` (0 / lowest value) for attention code that adds the mask to scores.

        HF transformers 5.x takes a 4-D mask as is: bool for ``sdpa``, additive for
        ``eager``. It can also derive the mask from ``position_ids`` alone, but only when no
        KV cache exists: pass ``use_cache=False``, else documents silently attend to each other.
        """
        length = self.input_ids.shape[1]
        mask = torch.stack([block_causal_mask(r.cu_seqlens, length) for r in self.rows])[:, None]
        return mask if dtype is None else additive_mask(mask, dtype)


def collate(
    rows: Sequence[RowPlan], tokens: Callable[[int], np.ndarray], pad_id: int
) -> PackedBatch:
    """Materialise equal-length rows into one :class:`PackedBatch`."""
    packed = tuple(pack_row(row, tokens, pad_id) for row in rows)
    length = rows[0].length
    if any(row.length != length for row in rows):
        raise ValueError(f"rows of one micro-batch differ in length: {[r.length for r in rows]}")
    bounds = [torch.tensor([0], dtype=torch.int32)]
    bounds += [row.cu_seqlens[1:] + i * length for i, row in enumerate(packed)]
    cu_seqlens = torch.cat(bounds)
    return PackedBatch(
        input_ids=torch.stack([r.input_ids for r in packed]),
        position_ids=torch.stack([r.position_ids for r in packed]),
        labels=torch.stack([r.labels for r in packed]),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(torch.diff(cu_seqlens).max()),
        rows=packed,
    )
