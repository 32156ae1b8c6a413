"""The sampler: every token exactly once per epoch, splitting, balancing, resume, loss count.

The coverage check runs over a real corpus (300 standard-library files, byte-level ids, a
long tail up to ~60 K tokens) and rebuilds every document token by token from the packed
rows, against ``text.encode("utf-8") + EOS`` computed independently of the pipeline.
"""

import itertools
import json
import math
from collections import defaultdict

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ds_stpar.config import Bucket, Layout, Strategy
from ds_stpar.errors import ConfigError, DataError
from ds_stpar.seqbucket.corpus import stdlib_corpus
from ds_stpar.seqbucket.data import Documents
from ds_stpar.seqbucket.lengths import bucket_histogram
from ds_stpar.seqbucket.packing import (
    IGNORE_INDEX,
    Piece,
    RowPlan,
    collate,
    micro_batch_length,
    pack_buckets,
    token_multiple,
)
from ds_stpar.seqbucket.sampler import BucketSampler, RowCost, balance_rows
from ds_stpar.seqbucket.tokenize import BYTE_EOS_ID, BYTE_PAD_ID, ByteTokenizer, tokenize_dataset
from tests.distributed import run_workers

BUCKETS = (
    Bucket(256, Strategy(Layout(dp=4), micro_batch=2)),
    Bucket(1024, Strategy(Layout(dp=2, tp=2), micro_batch=2)),
    Bucket(4096, Strategy(Layout(dp=2, pp=2), micro_batch=1)),
)


@pytest.fixture(scope="module")
def corpus():
    raw = stdlib_corpus(max_files=300)
    return raw["text"], Documents(tokenize_dataset(raw, ByteTokenizer()))


def synthetic_lengths(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.0, 1.3, n).astype(np.int64), 0, 20_000)


def _own_edge(piece, edges):
    """The smallest bucket edge that holds ``piece``: the bucket whose rows it goes to."""
    return next(e for e in edges if piece.length <= e)


def test_every_token_of_every_document_used_exactly_once(corpus):
    texts, docs = corpus
    sampler = BucketSampler(docs.lengths, BUCKETS, global_batch_tokens=1 << 17, seed=7)
    seen = defaultdict(list)  # doc -> [(start, tokens, labels)]
    per_bucket = np.zeros(len(BUCKETS), dtype=np.int64)  # pieces by their own bucket
    plans = list(sampler)
    assert sampler.epoch == 1 and len(plans) >= math.ceil(docs.num_tokens / (1 << 17))
    # greedy cut: a mini-batch closes only when the next piece (<= 4096 tokens) would overflow
    assert all((1 << 17) - 4096 < p.num_tokens <= 1 << 17 for p in plans[:-1])
    padded = 0  # micro-batches with a trailing pad segment
    for plan in plans:
        targets = tokens = 0
        for b, bucket in enumerate(plan.buckets):
            assert bucket.edge == BUCKETS[b].max_len and bucket.strategy == BUCKETS[b].strategy
            assert len(bucket.ranks) == bucket.strategy.layout.dp
            # lcm(8, tp): 8 for every TP degree here
            multiple = math.lcm(8, bucket.strategy.layout.tp)
            assert token_multiple(bucket.strategy.layout.tp) == multiple
            bucket_tokens = 0
            for rank in bucket.ranks:
                assert len(rank) == bucket.num_micro_batches
                for mb in rank:
                    # b rows of the bucket's edge, every piece in a row of its own bucket
                    assert len(mb.rows) == bucket.strategy.micro_batch
                    assert all(row.length == bucket.edge for row in mb.rows)
                    pieces = [p for row in mb.rows for p in row.pieces]
                    assert all(_own_edge(p, sampler.edges) == bucket.edge for p in pieces)
                    # fed as one row: the pieces end to end, then pad to a multiple
                    real = sum(p.length for p in pieces)
                    length = max(1, math.ceil(real / multiple)) * multiple
                    batch = collate(mb.rows, docs.__getitem__, BYTE_PAD_ID, multiple)
                    assert batch.input_ids.shape == (1, length)
                    assert micro_batch_length(mb.rows, multiple) == length
                    assert batch.pieces == tuple(pieces)
                    assert int(batch.cu_seqlens[len(pieces)]) == real
                    assert (batch.input_ids[0, real:] == BYTE_PAD_ID).all()
                    assert (batch.labels[0, real:] == IGNORE_INDEX).all()
                    padded += length > real
                    targets += batch.num_targets
                    bucket_tokens += real
                    if mb.is_padding:
                        assert not pieces and length == multiple
                    for k, piece in enumerate(batch.pieces):
                        lo, hi = int(batch.cu_seqlens[k]), int(batch.cu_seqlens[k + 1])
                        assert hi - lo == piece.length
                        per_bucket[b] += 1
                        seen[piece.doc].append(
                            (
                                piece.start,
                                batch.input_ids[0, lo:hi].tolist(),
                                batch.labels[0, lo:hi].tolist(),
                            )
                        )
            assert bucket.num_tokens == bucket_tokens
            tokens += bucket_tokens
        assert targets == plan.num_targets == sum(b.num_targets for b in plan.buckets)
        assert tokens == plan.num_tokens
    assert sorted(seen) == list(range(len(texts)))
    split = 0
    for doc, text in enumerate(texts):
        reference = list(text.encode("utf-8")) + [BYTE_EOS_ID]
        pieces = sorted(seen[doc])
        assert len(pieces) == math.ceil(len(reference) / 4096)
        assert [p[0] for p in pieces] == list(range(0, len(reference), 4096))
        assert sum((p[1] for p in pieces), []) == reference
        assert sum((p[2] for p in pieces), []) == reference[1:] + [IGNORE_INDEX]
        split += len(pieces) > 1
    assert split > 50  # the corpus's long tail really was cut (and nothing dropped)
    assert per_bucket.tolist() == bucket_histogram(docs.lengths, sampler.edges).pieces.tolist()
    assert padded > 50  # the pad segment really was exercised
    total_targets = sum(p.num_targets for p in plans)
    assert total_targets == docs.num_tokens - len(texts)  # n - 1 targets per document


def test_long_documents_split_not_dropped():
    lengths = np.array([0, 1, 64, 65, 200, 64 * 3 + 5])
    buckets = (Bucket(16, Strategy(Layout())), Bucket(64, Strategy(Layout())))
    sampler = BucketSampler(lengths, buckets, global_batch_tokens=64, seed=1)
    pieces = sorted(
        (p.doc, p.start, p.length, p.final)
        for plan in sampler
        for bucket in plan.buckets
        for mb in bucket.ranks[0]
        for row in mb.rows
        for p in row.pieces
    )
    assert pieces == [
        (1, 0, 1, True),
        (2, 0, 64, True),
        (3, 0, 64, False),
        (3, 64, 1, True),
        (4, 0, 64, False),
        (4, 64, 64, False),
        (4, 128, 64, False),
        (4, 192, 8, True),
        (5, 0, 64, False),
        (5, 64, 64, False),
        (5, 128, 64, False),
        (5, 192, 5, True),
    ]


def _piece_multiset(plan):
    return sorted(
        (p.doc, p.start)
        for bucket in plan.buckets
        for rank in bucket.ranks
        for mb in rank
        for row in mb.rows
        for p in row.pieces
    )


@pytest.mark.parametrize("cost", [RowCost(hidden_size=64), lambda row: float(row.num_tokens) ** 2])
def test_dp_ranks_balanced_equal_counts_no_row_dropped(cost):
    buckets = (
        Bucket(128, Strategy(Layout(dp=3), micro_batch=2)),
        Bucket(512, Strategy(Layout(dp=2, tp=2), micro_batch=3)),
        Bucket(2048, Strategy(Layout(dp=4), micro_batch=1)),
    )
    sampler = BucketSampler(synthetic_lengths(), buckets, global_batch_tokens=50_000, cost=cost)
    for plan in sampler:
        for bucket in plan.buckets:
            counts = {len(rank) for rank in bucket.ranks}
            assert counts == {bucket.num_micro_batches}
            rows = [row for rank in bucket.ranks for mb in rank for row in mb.rows if row.pieces]
            costs = [sum(cost(row) for mb in rank for row in mb.rows) for rank in bucket.ranks]
            if rows:
                assert max(costs) - min(costs) <= max(cost(row) for row in rows) + 1e-9
                # minimal padding: ranks hold ceil(rows / dp) rows, rounded up to whole micro-batches
                per_rank = math.ceil(len(rows) / len(bucket.ranks))
                assert bucket.num_micro_batches == math.ceil(per_rank / bucket.strategy.micro_batch)

        # the rows are the bucketed best-fit packing of the mini-batch's pieces (up to
        # swapping pieces of equal length, which input order decides)
        def shape(rows):
            return sorted(sorted(p.length for p in row.pieces) for row in rows)

        pieces = [
            p for b in plan.buckets for r in b.ranks for mb in r for w in mb.rows for p in w.pieces
        ]
        packed = pack_buckets(pieces, sampler.edges)
        for bucket, rows in zip(plan.buckets, packed):
            real = [row for rank in bucket.ranks for mb in rank for row in mb.rows if row.pieces]
            assert shape(real) == shape(rows)
        assert len(_piece_multiset(plan)) == len(set(_piece_multiset(plan)))


def test_balance_rows_small_case():
    rows = [RowPlan(10, (Piece(i, 0, n, True),)) for i, n in enumerate([9, 1, 7, 3, 5, 8, 2])]
    ranks = balance_rows(rows, edge=10, dp=3, micro_batch=2, cost=lambda r: r.num_tokens)
    # rounds (9, 8, 7) -> ranks 0, 1, 2; (5, 3, 2) -> least loaded first: 2, 1, 0; (1) -> 0
    assert [[r.num_tokens for mb in rank for r in mb.rows] for rank in ranks] == [
        [9, 2, 1, 0],
        [8, 3, 0, 0],
        [7, 5, 0, 0],
    ]
    assert [[mb.is_padding for mb in rank] for rank in ranks] == [
        [False, False],
        [False, True],
        [False, True],
    ]
    assert balance_rows([], edge=10, dp=2, micro_batch=2, cost=len) == ((), ())


def test_resume_mid_epoch_yields_the_identical_remaining_sequence():
    lengths = synthetic_lengths(2000, seed=3)
    fresh = BucketSampler(lengths, BUCKETS, global_batch_tokens=40_000, seed=11)
    whole_epoch = list(fresh)
    second_epoch = list(itertools.islice(fresh, 4))

    first = BucketSampler(lengths, BUCKETS, global_batch_tokens=40_000, seed=11)
    head = list(itertools.islice(first, 5))
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    assert state["position"] == 5 and state["epoch"] == 0
    resumed = BucketSampler(lengths, BUCKETS, global_batch_tokens=40_000, seed=0)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert head + rest == whole_epoch
    assert list(itertools.islice(resumed, 4)) == second_epoch
    assert second_epoch[0].epoch == 1 and _piece_multiset(second_epoch[0]) != _piece_multiset(
        whole_epoch[0]
    )

    other_seed = BucketSampler(lengths, BUCKETS, global_batch_tokens=40_000, seed=12)
    assert list(other_seed) != whole_epoch
    with pytest.raises(ConfigError, match="num_documents"):
        BucketSampler(lengths[:-1], BUCKETS, 40_000).load_state_dict(state)
    with pytest.raises(ConfigError, match="global_batch_tokens"):
        BucketSampler(lengths, BUCKETS, 50_000).load_state_dict(state)


def test_sampler_bad_input():
    with pytest.raises(ConfigError, match="below the longest bucket edge 4096"):
        BucketSampler(synthetic_lengths(), BUCKETS, global_batch_tokens=4000)
    with pytest.raises(DataError, match="no tokens"):
        BucketSampler(np.zeros(5, dtype=np.int64), BUCKETS, 1 << 16)
    with pytest.raises(ConfigError, match="strictly increasing"):
        BucketSampler(synthetic_lengths(), BUCKETS[::-1], 1 << 16)


# ---- the loss count across ranks (gloo, 2 processes) ---------------------------------

DIST_BUCKETS = (
    Bucket(64, Strategy(Layout(dp=2), micro_batch=2)),
    Bucket(256, Strategy(Layout(tp=2), micro_batch=1)),  # both ranks hold the same rows
)


def _count_and_loss_worker(rank, world_size, lengths, vocab):
    import torch.distributed as dist

    from ds_stpar.parallel import GroupCache
    from ds_stpar.seqbucket.loss import all_reduce_num_targets, count_targets, token_loss

    rng = np.random.default_rng(0)  # the same documents and "model" on both ranks
    docs = [rng.integers(0, vocab, n) for n in lengths]
    table = torch.from_numpy(np.random.default_rng(1).standard_normal((vocab, vocab)))
    plan = BucketSampler(lengths, DIST_BUCKETS, global_batch_tokens=2000, seed=5).plan(0)
    groups = GroupCache()

    counted = 0
    for bucket in plan.buckets:  # each data shard counted once: reduce over the DP group
        g = groups.get(bucket.strategy.layout)
        local = sum(
            count_targets(collate(mb.rows, docs.__getitem__, 0).labels)
            for mb in bucket.micro_batches(g.dp_index)
        )
        counted += all_reduce_num_targets(local, g.dp_group)
    assert counted == plan.num_targets, (counted, plan.num_targets)

    # the bucket with dp=2: local losses / N summed over ranks == that bucket's token mean
    bucket = plan.buckets[0]
    assert bucket.num_micro_batches > 0
    g = groups.get(bucket.strategy.layout)
    n = all_reduce_num_targets(
        sum(
            count_targets(collate(mb.rows, docs.__getitem__, 0).labels)
            for mb in bucket.micro_batches(g.dp_index)
        ),
        g.dp_group,
    )
    mine = sum(
        token_loss(table[b.input_ids], b.labels, n)
        for b in (collate(mb.rows, docs.__getitem__, 0) for mb in bucket.micro_batches(g.dp_index))
    )
    dist.all_reduce(mine, group=g.dp_group)
    everything = [collate(mb.rows, docs.__getitem__, 0) for r in bucket.ranks for mb in r]
    logits = torch.cat([table[b.input_ids].reshape(-1, vocab) for b in everything])
    labels = torch.cat([b.labels.reshape(-1) for b in everything])
    mean = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
    # float64, sums of a few hundred terms regrouped across two ranks: ~1e-15 relative
    assert abs(float(mine - mean)) <= 1e-12 * float(mean), (float(mine), float(mean))


@pytest.mark.dist
def test_all_reduced_target_count_and_loss_over_ranks():
    rng = np.random.default_rng(2)  # pieces of both buckets
    lengths = rng.permutation(np.concatenate([rng.integers(1, 64, 40), rng.integers(200, 300, 10)]))
    run_workers(_count_and_loss_worker, 2, lengths, 17)
