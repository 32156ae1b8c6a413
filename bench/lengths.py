"""Time the length histogram on a synthetic 10 M-document Arrow table (CPU, no GPU).

    .venv/bin/python bench/lengths.py [--rows 10000000] [--edges 2048,8192,32768]

The table is ``list<int32>`` like a tokenized ``input_ids`` column, in chunks of
``--chunk-rows`` rows; lengths are log-normal (median 1,000 tokens, sigma 1.5, at most
400 K: a long tail like code corpora). All chunks share one zero-filled values buffer that
is never read (the lengths come from the offsets), so the table costs little memory.
Prints one table of timings; nothing is asserted.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyarrow as pa

from ds_stpar.seqbucket.lengths import bucket_histogram, document_lengths


def synthetic_table(rows: int, chunk_rows: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(1000.0), 1.5, rows), 1, 400_000).astype(np.int64)
    longest_chunk = max(int(lengths[i : i + chunk_rows].sum()) for i in range(0, rows, chunk_rows))
    if longest_chunk >= 2**31:
        raise SystemExit(f"a chunk of {chunk_rows} rows exceeds int32 offsets; lower --chunk-rows")
    values = pa.array(np.zeros(longest_chunk, dtype=np.int32))  # calloc: pages never touched
    chunks = []
    for i in range(0, rows, chunk_rows):
        offsets = np.zeros(min(chunk_rows, rows - i) + 1, dtype=np.int32)
        np.cumsum(lengths[i : i + chunk_rows], out=offsets[1:])
        chunks.append(pa.ListArray.from_arrays(pa.array(offsets), values[: offsets[-1]]))
    return pa.table({"input_ids": pa.chunked_array(chunks)})


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--chunk-rows", type=int, default=250_000)
    parser.add_argument("--edges", default="2048,8192,32768")
    args = parser.parse_args()
    edges = [int(e) for e in args.edges.split(",")]

    table, build_s = timed(synthetic_table, args.rows, args.chunk_rows)
    from datasets import Dataset

    dataset = Dataset(table, fingerprint="bench-lengths")  # skip hashing 10 M rows
    lengths, table_s = timed(document_lengths, table)
    lengths_ds, dataset_s = timed(document_lengths, dataset)
    assert np.array_equal(lengths, lengths_ds)
    hist, hist_s = timed(bucket_histogram, lengths, edges)

    print(
        f"{args.rows:,} documents, {hist.num_tokens:,} tokens, {table.column(0).num_chunks} chunks"
    )
    print(f"{'step':<44}{'seconds':>10}")
    print("-" * 54)
    for name, seconds in [
        ("build synthetic table (not part of the cost)", build_s),
        ("document_lengths(pa.Table)", table_s),
        ("document_lengths(datasets.Dataset)", dataset_s),
        (f"bucket_histogram(edges={edges})", hist_s),
        ("lengths + histogram (Dataset path)", dataset_s + hist_s),
    ]:
        print(f"{name:<44}{seconds:>10.3f}")
    print()
    print(f"{'bucket edge':>12}{'pieces':>14}{'tokens':>18}")
    for edge, pieces, tokens in zip(hist.edges, hist.pieces, hist.tokens):
        print(f"{edge:>12,}{pieces:>14,}{tokens:>18,}")
    print(f"documents split (> {edges[-1]:,} tokens): {hist.num_split_documents:,}")


if __name__ == "__main__":
    main()
