"""Packing, document masks and the token loss, against independent references.

The model check uses a randomly initialised transformers LlamaForCausalLM in float64: the
loss of each document inside a packed row must equal the loss of that document run alone.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ds_stpar.seqbucket.corpus import stdlib_documents
from ds_stpar.seqbucket.loss import count_targets, masked_token_loss, token_loss
from ds_stpar.seqbucket.packing import (
    IGNORE_INDEX,
    Piece,
    RowPlan,
    additive_mask,
    block_causal_mask,
    collate,
    micro_batch_length,
    pack_buckets,
    pack_row,
    token_multiple,
)
from ds_stpar.seqbucket.tokenize import BYTE_PAD_ID, ByteTokenizer


@pytest.fixture(scope="module")
def docs():
    """Byte-level ids of 60 standard-library files (lengths 98 .. ~60 K)."""
    return [ByteTokenizer().encode(d["text"]) for d in stdlib_documents(max_files=60)]


def reference_bucketed_best_fit(lengths, edges):
    """Best-fit-decreasing per bucket with a linear scan: a piece goes to the open row of its
    own bucket (the smallest edge that holds it) with the least room that still holds it,
    else opens a row of that edge; it never joins another bucket's row. (edge, piece indices)
    per row, in opening order."""
    rows, room, edge = [], [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        own = min(e for e in edges if e >= lengths[i])
        fits = [r for r in range(len(rows)) if edge[r] == own and room[r] >= lengths[i]]
        if fits:
            r = min(fits, key=lambda r: (room[r], r))
        else:
            rows.append([])
            edge.append(own)
            room.append(own)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    return list(zip(edge, rows))


def reference_best_fit(lengths, budget):
    """Textbook best-fit-decreasing with a linear scan, returning rows of piece indices."""
    return [rows for _, rows in reference_bucketed_best_fit(lengths, (budget,))]


def pack_best_fit(pieces, budget):
    """One bucket of :func:`pack_buckets`: rows of ``budget`` tokens."""
    return pack_buckets(pieces, (budget,))[0]


def test_best_fit_decreasing_matches_reference_and_respects_budget():
    rng = np.random.default_rng(1)
    lengths = np.minimum(rng.lognormal(4.0, 1.2, 400).astype(int) + 1, 512).tolist()
    pieces = [Piece(doc=i, start=0, length=n, final=True) for i, n in enumerate(lengths)]
    rows = pack_best_fit(pieces, 512)
    assert [[p.doc for p in row.pieces] for row in rows] == reference_best_fit(lengths, 512)
    assert all(row.length == 512 and row.num_tokens <= 512 for row in rows)
    assert sorted(p.doc for row in rows for p in row.pieces) == list(range(400))
    assert len(rows) <= 11 / 9 * np.ceil(sum(lengths) / 512) + 1  # BFD's worst-case bound
    with pytest.raises(ValueError, match="does not fit"):
        pack_best_fit([Piece(0, 0, 513, True)], 512)
    with pytest.raises(ValueError, match="overflow"):
        RowPlan(8, (Piece(0, 0, 5, True), Piece(1, 0, 4, True)))


def test_bucketed_best_fit_packs_each_bucket_alone():
    # by hand: the long bucket's 900 and 700 open 1024-token rows (room 124 and 324), 300
    # joins the 700 (room 24). The short bucket's 120 opens a 128-token row (room 8) although
    # it would fit the 900's gap: rows run without their padding (collate), so filling that
    # gap saves nothing. 100 opens another (room 28), 60 a third (room 68), which takes 50.
    pieces = [Piece(i, 0, n, True) for i, n in enumerate([900, 700, 300, 120, 100, 60, 50])]
    short, long = pack_buckets(pieces, (128, 1024))
    assert [[p.length for p in r.pieces] for r in long] == [[900], [700, 300]]
    assert [[p.length for p in r.pieces] for r in short] == [[120], [100], [60, 50]]
    assert {r.length for r in long} == {1024} and {r.length for r in short} == {128}
    # each bucket exactly as packed alone
    assert short == pack_best_fit(pieces[3:], 128) and long == pack_best_fit(pieces[:3], 1024)
    # against the linear-scan reference on skewed lengths and three buckets
    rng = np.random.default_rng(2)
    lengths = np.minimum(rng.lognormal(5.0, 1.4, 600).astype(int) + 1, 2048).tolist()
    edges = (128, 512, 2048)
    packed = pack_buckets([Piece(i, 0, n, True) for i, n in enumerate(lengths)], edges)
    got = sorted((row.length, [p.doc for p in row.pieces]) for rows in packed for row in rows)
    assert got == sorted(reference_bucketed_best_fit(lengths, edges))
    for k, rows in enumerate(packed):  # every piece in a row of its own bucket, and each
        low = edges[k - 1] if k else 0  # bucket packed as its pieces alone would be
        assert all(low < p.length <= edges[k] for row in rows for p in row.pieces)
        own = [Piece(i, 0, n, True) for i, n in enumerate(lengths) if low < n <= edges[k]]
        assert rows == pack_best_fit(own, edges[k])
        assert all(row.length == edges[k] for row in rows)
    assert sorted(p.doc for rows in packed for row in rows for p in row.pieces) == list(range(600))
    with pytest.raises(ValueError, match="strictly increasing"):
        pack_buckets(pieces, (1024, 128))
    with pytest.raises(ValueError, match="does not fit"):
        pack_buckets(pieces, (128, 512))


def test_packed_row_layout_labels_positions_and_boundaries():
    docs = {7: np.arange(100, 110), 3: np.arange(200, 204), 9: np.arange(300, 320)}
    row = RowPlan(
        24, (Piece(7, 0, 10, True), Piece(9, 5, 6, False), Piece(3, 0, 4, True))
    )  # 20 tokens + 4 pad
    packed = pack_row(row, docs.__getitem__, pad_id=BYTE_PAD_ID)
    I = IGNORE_INDEX
    assert packed.input_ids.tolist() == (
        list(range(100, 110)) + list(range(305, 311)) + [200, 201, 202, 203] + [BYTE_PAD_ID] * 4
    )
    assert packed.labels.tolist() == (
        list(range(101, 110))
        + [I]  # document end: no target
        + list(range(306, 312))  # a chunk that does not end its document: true next token
        + [201, 202, 203, I]
        + [I] * 4  # padding
    )
    assert packed.position_ids.tolist() == list(range(10)) + list(range(6)) + list(range(4)) * 2
    assert packed.cu_seqlens.tolist() == [0, 10, 16, 20, 24]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.num_targets == row.num_targets == 9 + 6 + 3
    empty = pack_row(RowPlan(5), docs.__getitem__, pad_id=0)
    assert empty.labels.tolist() == [I] * 5 and empty.cu_seqlens.tolist() == [0, 5]


def test_block_causal_mask_and_batch_cu_seqlens():
    cu = torch.tensor([0, 3, 4, 7], dtype=torch.int32)
    mask = block_causal_mask(cu, 7)
    segment = [0, 0, 0, 1, 2, 2, 2]
    expected = [[segment[i] == segment[j] and j <= i for j in range(7)] for i in range(7)]
    assert mask.dtype == torch.bool and mask.tolist() == expected
    add = additive_mask(mask, torch.float32)
    assert add[mask].eq(0).all() and add[~mask].eq(torch.finfo(torch.float32).min).all()

    # a micro-batch: the pieces of its rows end to end, the rows' own padding dropped, then
    # one pad segment up to a multiple of the token multiple (by hand)
    docs = {0: np.arange(5), 1: np.arange(10, 13)}
    pieces = (Piece(0, 0, 5, True), Piece(1, 0, 3, True), Piece(0, 0, 2, False))
    rows = [RowPlan(7, pieces[:1]), RowPlan(7, pieces[1:])]  # 10 real tokens, 4 pad
    I = IGNORE_INDEX
    batch = collate(rows, docs.__getitem__, pad_id=9)  # multiple 1: no pad at all
    assert batch.input_ids.tolist() == [[0, 1, 2, 3, 4, 10, 11, 12, 0, 1]]
    assert batch.labels.tolist() == [[1, 2, 3, 4, I, 11, 12, I, 1, 2]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]]
    assert batch.cu_seqlens.tolist() == [0, 5, 8, 10] and batch.cu_seqlens.dtype == torch.int32
    assert batch.pieces == pieces and batch.max_seqlen == 5
    assert batch.num_targets == 4 + 2 + 2
    batch = collate(rows, docs.__getitem__, pad_id=9, multiple=8)  # 10 -> 16 tokens
    assert batch.input_ids.tolist() == [[0, 1, 2, 3, 4, 10, 11, 12, 0, 1] + [9] * 6]
    assert batch.labels.tolist() == [[1, 2, 3, 4, I, 11, 12, I, 1, 2] + [I] * 6]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5]]
    assert batch.cu_seqlens.tolist() == [0, 5, 8, 10, 16]
    assert batch.max_seqlen == 6  # the pad segment is the longest here
    assert batch.pieces == pieces and batch.num_targets == 8
    assert micro_batch_length(rows, 8) == 16 and micro_batch_length(rows, 1) == 10
    masks = batch.attention_mask()
    assert masks.shape == (1, 1, 16, 16) and masks.dtype == torch.bool
    segment = [0] * 5 + [1] * 3 + [2] * 2 + [3] * 6
    expected = [[segment[i] == segment[j] and j <= i for j in range(16)] for i in range(16)]
    assert masks[0, 0].tolist() == expected
    additive = batch.attention_mask(torch.float64)
    assert additive.dtype == torch.float64 and torch.equal(
        additive, additive_mask(masks, torch.float64)
    )
    # rows of different lengths may share a micro-batch; padding rows alone are one multiple
    mixed = collate([RowPlan(7, pieces[:1]), RowPlan(8, pieces[1:2])], docs.__getitem__, 0, 8)
    assert mixed.input_ids.shape == (1, 8) and mixed.cu_seqlens.tolist() == [0, 5, 8]
    empty = collate([RowPlan(7), RowPlan(7)], docs.__getitem__, 9, multiple=24)
    assert empty.input_ids.tolist() == [[9] * 24] and empty.cu_seqlens.tolist() == [0, 24]
    assert empty.num_targets == 0 and empty.pieces == ()
    # lcm(8, tp): tensor-core tiles, and sequence parallelism splits the tokens over tp
    assert [token_multiple(tp) for tp in (1, 2, 3, 4, 6, 8, 16)] == [8, 8, 24, 8, 24, 8, 16]


def _llama(attn_implementation: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float64).eval()


def _alone_loss(model, doc: np.ndarray, piece: Piece) -> torch.Tensor:
    """The piece as its own sequence: summed cross-entropy of its targets."""
    x = torch.as_tensor(doc[piece.start : piece.start + piece.length], dtype=torch.long)
    y = torch.full_like(x, IGNORE_INDEX)
    y[: piece.num_targets] = torch.as_tensor(
        doc[piece.start + 1 : piece.start + 1 + piece.num_targets], dtype=torch.long
    )
    logits = model(input_ids=x[None], use_cache=False).logits
    return F.cross_entropy(logits[0], y, ignore_index=IGNORE_INDEX, reduction="sum")


# float64 throughout. Inside a segment the packed run performs the same per-token arithmetic
# as the document alone; masked scores get exactly zero weight (bool mask, or -1.8e308 added
# then exp underflows to 0). Only matmul blocking over different shapes may reorder sums:
# ~1e-15 relative. 1e-10 leaves room for that, while one token attending across a boundary
# moves a document's loss by ~1e-4 relative (checked below: the plain causal mask fails).
REL_TOL = 1e-10


@pytest.mark.parametrize(
    "impl, how", [("sdpa", "bool"), ("eager", "additive"), ("sdpa", "position_ids")]
)
def test_packed_loss_equals_documents_alone_llama(docs, impl, how):
    model = _llama(impl)
    lengths = np.array([len(d) for d in docs])
    short = [int(i) for i in np.argsort(lengths, kind="stable")[:3]]
    long = int(np.argmax(lengths))
    rows = [  # three whole documents, two chunks of a long one (one mid-document), padding
        RowPlan(
            400,
            (
                Piece(short[0], 0, int(lengths[short[0]]), True),
                Piece(long, 0, 60, False),
                Piece(short[1], 0, int(lengths[short[1]]), True),
            ),
        ),
        RowPlan(
            352, (Piece(long, 500, 200, False), Piece(short[2], 0, int(lengths[short[2]]), True))
        ),
    ]
    # one row of the pieces end to end, the rows' padding dropped, a pad segment up to 24
    batch = collate(rows, docs.__getitem__, BYTE_PAD_ID, multiple=24)
    real = sum(row.num_tokens for row in rows)
    assert batch.input_ids.shape == (1, math.ceil(real / 24) * 24)
    assert batch.pieces == rows[0].pieces + rows[1].pieces
    assert len(batch.cu_seqlens) == 5 + 2  # five pieces and a trailing pad segment
    kwargs = {"position_ids": batch.position_ids, "use_cache": False}
    if how != "position_ids":  # position_ids alone: transformers derives the packed mask
        kwargs["attention_mask"] = batch.attention_mask(
            torch.float64 if how == "additive" else None
        )
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, **kwargs).logits
        leaky = model(input_ids=batch.input_ids, use_cache=False).logits  # plain causal
        checked = 0
        for k, piece in enumerate(batch.pieces):
            lo, hi = int(batch.cu_seqlens[k]), int(batch.cu_seqlens[k + 1])
            packed = token_loss(logits[:, lo:hi], batch.labels[:, lo:hi], 1)
            alone = _alone_loss(model, docs[piece.doc], piece)
            assert abs(packed - alone) <= REL_TOL * abs(alone), (k, float(packed), float(alone))
            if lo > 0:  # a later segment sees earlier ones under a plain causal mask
                wrong = token_loss(leaky[:, lo:hi], batch.labels[:, lo:hi], 1)
                assert abs(wrong - alone) > 1e-6 * abs(alone)
            checked += 1
        batch_loss = token_loss(logits, batch.labels, 1)
        pieces_alone = sum(_alone_loss(model, docs[p.doc], p) for p in batch.pieces)
        assert abs(batch_loss - pieces_alone) <= REL_TOL * abs(pieces_alone)
    assert checked == 5


def test_token_loss_layouts_and_reference():
    torch.manual_seed(3)
    b, s, V = 3, 5, 11
    logits = torch.randn(b, s, V, dtype=torch.float64)
    labels = torch.randint(0, V, (b, s))
    labels[0, 4] = labels[2, :2] = IGNORE_INDEX
    n = int(count_targets(labels))
    assert n == 12
    ref = 0.0
    for i in range(b):
        for j in range(s):
            if labels[i, j] != IGNORE_INDEX:
                row = logits[i, j]
                ref += float(torch.logsumexp(row, 0) - row[labels[i, j]])
    loss = token_loss(logits, labels, n)
    assert abs(float(loss) - ref / n) <= 1e-14 * ref / n  # float64, 12 terms
    assert torch.equal(
        token_loss(logits.transpose(0, 1).contiguous(), labels, n, seq_first=True), loss
    )
    half = logits.to(torch.bfloat16)
    assert torch.equal(token_loss(half, labels, n), token_loss(half.float(), labels, n))
    assert token_loss(half, labels, n).dtype == torch.float32
    per_token = F.cross_entropy(
        logits.reshape(-1, V), labels.clamp(min=0).reshape(-1), reduction="none"
    )
    assert torch.allclose(
        masked_token_loss(per_token.view(b, s), labels, n), loss, rtol=1e-15, atol=0
    )
    with pytest.raises(ValueError, match="do not match"):
        token_loss(logits, labels, n, seq_first=True)


def test_micro_batch_losses_sum_to_the_mini_batch_mean():
    """Whatever the split into micro-batches, the sum equals the mean over all targets."""
    torch.manual_seed(4)
    V = 7
    logits = torch.randn(10, 6, V, dtype=torch.float64)
    labels = torch.randint(0, V, (10, 6))
    labels[torch.rand(10, 6) < 0.3] = IGNORE_INDEX
    labels[7] = IGNORE_INDEX  # a zero-weight (padding) row
    mean = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    n = int(count_targets(labels))
    for splits in ([10], [1, 9], [3, 3, 4], [2] * 5):
        bounds = np.cumsum([0] + splits)
        total = sum(
            token_loss(logits[a:b], labels[a:b], n) for a, b in zip(bounds[:-1], bounds[1:])
        )
        # float64 sums of ~40 terms, regrouped: a few ulps
        assert abs(float(total - mean)) <= 1e-13 * float(mean)
        per_mb_mean = sum(
            F.cross_entropy(logits[a:b].reshape(-1, V), labels[a:b].reshape(-1)) / len(splits)
            for a, b in zip(bounds[:-1], bounds[1:])
            if (labels[a:b] != IGNORE_INDEX).any()
        )
        if len(splits) > 1:  # the HotSPa-style per-micro-batch mean is not the token mean
            assert abs(float(per_mb_mean - mean)) > 1e-6
