"""Document lengths and the per-bucket histogram, straight from Arrow columns.

Lengths come from the offsets of the ``input_ids`` list column
(``pyarrow.compute.list_value_length``): no Python loop over rows and no token is read, so
10 M documents take well under a second (``bench/lengths.py``).

The splitting rule lives here, once, for the histogram, the sampler and the packer alike:
a document of length ``L`` becomes ``ceil(L / E)`` pieces, where ``E`` is the longest bucket
edge (the context): ``L // E`` pieces of ``E`` tokens and one of ``L % E`` if that is
non-zero. Nothing is dropped or truncated. A piece of length ``l`` goes to the bucket whose
edge is the smallest one ``>= l``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ds_stpar.errors import ConfigError, DataError


def list_column(data, column: str = "input_ids") -> pa.ChunkedArray:
    """The list column ``column`` of a ``datasets.Dataset``, ``pa.Table`` or Arrow array.

    A Dataset is read through its Arrow format (zero-copy unless it carries an indices
    mapping from ``select``/``shuffle``, which Arrow then applies with one ``take``).
    """
    if isinstance(data, pa.Array):
        return pa.chunked_array([data])
    if isinstance(data, pa.ChunkedArray):
        return data
    if isinstance(data, pa.Table):
        if column not in data.column_names:
            raise DataError(f"no column {column!r}; columns found: {data.column_names}")
        return data.column(column)
    if column not in data.column_names:
        raise DataError(f"no column {column!r}; columns found: {data.column_names}")
    array = data.with_format("arrow")[column]
    return array if isinstance(array, pa.ChunkedArray) else pa.chunked_array([array])


def document_lengths(data, column: str = "input_ids") -> np.ndarray:
    """Tokens per document, int64 ``[N]``, from the list offsets alone."""
    array = list_column(data, column)
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
        raise DataError(f"column {column!r} holds {array.type}, not lists of token ids")
    if array.null_count:
        raise DataError(f"column {column!r} has {array.null_count} null rows")
    lengths = pc.list_value_length(array)
    if lengths.num_chunks == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([chunk.to_numpy() for chunk in lengths.chunks]).astype(np.int64)


def check_edges(edges: Sequence[int]) -> tuple[int, ...]:
    """Bucket edges as a tuple of strictly increasing positive ints (else ConfigError)."""
    edges = tuple(int(e) for e in edges)
    if not edges or edges[0] < 1 or any(a >= b for a, b in zip(edges, edges[1:])):
        raise ConfigError(f"bucket edges must be positive and strictly increasing, got {edges}")
    return edges


def split_lengths(
    lengths: np.ndarray, max_len: int, docs: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of documents no longer than ``max_len``: ``(doc, start, length)``, int64 ``[P]``.

    ``lengths[i]`` is the length of document ``docs[i]`` (default ``i``). Pieces come in the
    order of ``lengths``, a document's pieces consecutive and in token order; a document of
    length 0 has none. ``P = sum(ceil(lengths / max_len))``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = -(-lengths // max_len)  # ceil, 0 for empty documents
    total = int(counts.sum())
    first = np.cumsum(counts) - counts  # index of each document's first piece
    owner = np.repeat(np.arange(len(lengths)), counts)
    start = (np.arange(total, dtype=np.int64) - first[owner]) * max_len
    length = np.minimum(max_len, lengths[owner] - start)
    doc = owner if docs is None else np.asarray(docs, dtype=np.int64)[owner]
    return doc, start, length


def bucket_index(lengths: np.ndarray, edges: Sequence[int]) -> np.ndarray:
    """Index of the smallest edge ``>= length`` for every piece length (all ``<= edges[-1]``)."""
    lengths = np.asarray(lengths)
    if lengths.size and lengths.max() > edges[-1]:
        raise ValueError(f"a piece of {lengths.max()} tokens exceeds the last edge {edges[-1]}")
    return np.searchsorted(np.asarray(edges), lengths, side="left")


@dataclass(frozen=True)
class LengthHistogram:
    """Pieces and tokens per bucket, after splitting documents longer than ``edges[-1]``.

    ``pieces[k]`` / ``tokens[k]``: pieces (documents or chunks) of length in
    ``(edges[k-1], edges[k]]`` and their tokens; ``tokens.sum() == num_tokens``.
    """

    edges: tuple[int, ...]
    pieces: np.ndarray  # int64 [B]
    tokens: np.ndarray  # int64 [B]
    num_documents: int
    num_tokens: int
    num_split_documents: int  # documents longer than edges[-1], cut into several pieces

    def to_dict(self) -> dict:
        return {
            "edges": list(self.edges),
            "pieces": self.pieces.tolist(),
            "tokens": self.tokens.tolist(),
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "num_split_documents": self.num_split_documents,
        }


def bucket_histogram(lengths: np.ndarray, edges: Sequence[int]) -> LengthHistogram:
    """Histogram of document ``lengths`` over bucket ``edges`` (numpy only, no row loop)."""
    edges = check_edges(edges)
    lengths = np.asarray(lengths, dtype=np.int64)
    _, _, piece_len = split_lengths(lengths, edges[-1])
    index = bucket_index(piece_len, edges)
    pieces = np.bincount(index, minlength=len(edges)).astype(np.int64)
    tokens = np.bincount(index, weights=piece_len, minlength=len(edges))
    return LengthHistogram(
        edges=edges,
        pieces=pieces,
        tokens=np.rint(tokens).astype(np.int64),  # float64 sums of ints are exact below 2**53
        num_documents=len(lengths),
        num_tokens=int(lengths.sum()),
        num_split_documents=int((lengths > edges[-1]).sum()),
    )
