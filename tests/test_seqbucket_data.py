"""Tokenizers, document loading from every supported input, lengths, corpus; bad input.

References are independent of the code under test: byte ids are ``text.encode("utf-8")``
plus EOS; HF ids come from the ``tokenizers`` library called directly; lengths and the
bucket histogram from plain Python loops.
"""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict

from ds_stpar.errors import ConfigError, DataError
from ds_stpar.seqbucket.corpus import (
    stdlib_corpus,
    stdlib_documents,
    stdlib_files,
    stdlib_root,
    write_jsonl,
)
from ds_stpar.seqbucket.data import Documents, load_documents
from ds_stpar.seqbucket.lengths import bucket_histogram, check_edges, document_lengths
from ds_stpar.seqbucket.tokenize import (
    BYTE_EOS_ID,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    tokenize_dataset,
)


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8")) + [BYTE_EOS_ID]


@pytest.fixture(scope="module")
def docs():
    """40 real documents (standard-library sources), with non-ASCII text added to one."""
    rows = stdlib_documents(max_files=40)
    rows[3] = {"path": rows[3]["path"], "text": "naïve – ünïcödé ✓\r\nline two\n"}
    return rows


def ids_of(dataset) -> list[list[int]]:
    return [list(map(int, ids)) for ids in dataset["input_ids"]]


# ---- tokenizers -----------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "def f():\n    return 'é'\n"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and list(ids) == byte_ids(text)
    assert tok.decode(list(ids) + [tok.pad_id]) == text
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (258, 256, 257)
    assert list(ByteTokenizer(add_eos=False).encode("ab")) == [97, 98]


def test_tokenize_dataset_keeps_order_with_worker_processes(docs):
    raw = Dataset.from_dict({"text": [d["text"] for d in docs]})
    expected = [byte_ids(d["text"]) for d in docs]
    assert ids_of(tokenize_dataset(raw, ByteTokenizer())) == expected
    assert ids_of(tokenize_dataset(raw, ByteTokenizer(), num_proc=2, batch_size=7)) == expected


def test_hf_tokenizer_json_file_and_folder(tmp_path, docs):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"])
    bpe.train_from_iterator([d["text"] for d in docs], trainer)
    folder = tmp_path / "tok"
    folder.mkdir()
    file = folder / "tokenizer.json"
    bpe.save(str(file))
    eos = bpe.token_to_id("<|endoftext|>")
    path = tmp_path / "docs.jsonl"
    write_jsonl(docs, path)
    expected = [bpe.encode(d["text"]).ids + [eos] for d in docs]
    for spec in (file, folder):
        tok = load_tokenizer(spec, eos_token="<|endoftext|>")
        assert isinstance(tok, HFTokenizer) and tok.eos_id == eos
        got = load_documents(path, tokenizer=tok, cache_dir=str(tmp_path / "cache"))
        assert ids_of(got) == expected
    with pytest.raises(DataError, match="not in the vocabulary"):
        load_tokenizer(file, eos_token="<nope>")


def test_tokenizer_path_must_exist(tmp_path):
    with pytest.raises(DataError, match="no such tokenizer"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(DataError, match="no such tokenizer file"):
        load_tokenizer(tmp_path)  # a folder without tokenizer.json
    bad = tmp_path / "bad.json"
    bad.write_text("{not a tokenizer")
    with pytest.raises(DataError, match="not a readable tokenizer.json"):
        load_tokenizer(bad)


# ---- loading from every input kind ---------------------------------------------------


def test_jsonl_json_parquet_and_save_to_disk_agree(tmp_path, docs):
    expected = [byte_ids(d["text"]) for d in docs]
    cache = str(tmp_path / "cache")
    jsonl = tmp_path / "docs.jsonl"
    write_jsonl(docs, jsonl)
    array = tmp_path / "docs.json"
    array.write_text(json.dumps(docs), encoding="utf-8")
    parquet = tmp_path / "docs.parquet"
    pq.write_table(
        pa.table({"path": [d["path"] for d in docs], "text": [d["text"] for d in docs]}), parquet
    )
    saved = tmp_path / "saved"
    Dataset.from_list(docs).save_to_disk(str(saved))
    splits = tmp_path / "splits"
    DatasetDict(
        {"train": Dataset.from_list(docs), "test": Dataset.from_list(docs[:2])}
    ).save_to_disk(str(splits))
    for path in (jsonl, array, parquet, saved, splits):
        got = load_documents(path, cache_dir=cache)
        assert got.column_names == ["input_ids"], path
        assert ids_of(got) == expected, path


def test_text_folder_one_document_per_file_sorted_bytes_kept(tmp_path, docs):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / ".git").mkdir()
    names = ["b.txt", "a.txt", "sub/c.py", "a10.txt"]
    for name, doc in zip(names, docs):
        (folder / name).write_bytes(doc["text"].encode("utf-8"))
    (folder / ".hidden").write_text("skip me")
    (folder / ".git" / "HEAD").write_text("skip me too")
    (folder / "empty.txt").write_bytes(b"")
    order = ["a.txt", "a10.txt", "b.txt", "empty.txt", "sub/c.py"]
    texts = {name: doc["text"] for name, doc in zip(names, docs)} | {"empty.txt": ""}
    got = load_documents(folder)
    assert ids_of(got) == [byte_ids(texts[name]) for name in order]
    # the CRLF of docs[3] survives byte for byte (no universal-newline translation)
    assert 13 in ids_of(got)[order.index("a10.txt")]


def test_ids_columns(tmp_path, docs):
    ids = [byte_ids(d["text"])[:50] for d in docs[:5]]
    named = tmp_path / "tokens.jsonl"
    write_jsonl([{"tokens": x, "meta": 1} for x in ids], named)
    got = load_documents(named, ids_column="tokens", cache_dir=str(tmp_path / "c"))
    assert got.column_names == ["input_ids"] and ids_of(got) == ids
    assert str(got.features["input_ids"].feature.dtype) == "int32"
    auto = tmp_path / "auto.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int64()))}), auto)
    assert ids_of(load_documents(auto, cache_dir=str(tmp_path / "c"))) == ids


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: p / "missing.jsonl", "no such file or folder"),
        (lambda p: _write(p / "empty.jsonl", ""), "empty file"),
        (lambda p: _write(p / "x.csv", "a,b\n"), "unsupported file type"),
        (lambda p: _write(p / "bad.jsonl", '{"text": "a"}\n{"text": \n'), "cannot read as json"),
        (
            lambda p: _write(p / "cols.jsonl", '{"body": "a", "n": 1}\n'),
            r"no text column 'text' and no 'input_ids'; columns found: \['body', 'n'\]",
        ),
        (lambda p: _write(p / "num.jsonl", '{"text": 5}\n'), "not strings"),
        (lambda p: _write(p / "null.jsonl", '{"text": "a"}\n{"text": null}\n'), "1 empty"),
        (lambda p: _write(p / "strids.jsonl", '{"input_ids": ["a"]}\n'), "not lists of integer"),
        (lambda p: _write(p / "neg.jsonl", '{"input_ids": [1, -2]}\n'), "outside"),
        (lambda p: (p / "emptydir").mkdir() or p / "emptydir", r"no documents \(columns found"),
    ],
)
def test_bad_inputs_name_the_path(tmp_path, make, match):
    path = make(tmp_path)
    with pytest.raises(DataError, match=match) as err:
        load_documents(path, cache_dir=str(tmp_path / "cache"))
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_more_bad_inputs(tmp_path):
    with pytest.raises(DataError, match="empty dataset path"):
        load_documents("")
    with pytest.raises(DataError, match=r"no ids column 'ids'; columns found: \['text'\]"):
        load_documents(
            _write(tmp_path / "t.jsonl", '{"text": "a"}\n'),
            ids_column="ids",
            cache_dir=str(tmp_path),
        )
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "a.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="a.txt: not UTF-8 text"):
        load_documents(latin)
    two = tmp_path / "two"
    DatasetDict(
        {"a": Dataset.from_dict({"text": ["x"]}), "b": Dataset.from_dict({"text": ["y"]})}
    ).save_to_disk(str(two))
    with pytest.raises(DataError, match=r"splits \['a', 'b'\] and no 'train'"):
        load_documents(two)


# ---- lengths -------------------------------------------------------------------------


def test_document_lengths_and_documents_on_sliced_chunks():
    rows = [[1, 2, 3], [], [4], [5, 6, 7, 8, 9], [10, 11]]
    whole = pa.array(rows, pa.list_(pa.int32()))
    chunked = pa.chunked_array(
        [whole.slice(1, 2), pa.array([], pa.list_(pa.int32())), whole.slice(3, 2)]
    )
    assert document_lengths(chunked).tolist() == [0, 1, 5, 2]
    docs = Documents(chunked)
    assert [docs[i].tolist() for i in range(len(docs))] == rows[1:]
    assert docs.num_tokens == 8
    shuffled = Dataset.from_dict({"input_ids": rows}).select([4, 0, 2])
    assert document_lengths(shuffled).tolist() == [2, 3, 1]
    assert [Documents(shuffled)[i].tolist() for i in range(3)] == [rows[4], rows[0], rows[2]]
    with pytest.raises(DataError, match="no column 'ids'"):
        document_lengths(pa.table({"input_ids": whole}), "ids")


def test_bucket_histogram_matches_a_loop():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([[0, 1, 64, 65, 256, 257, 1000], rng.integers(0, 900, 500)])
    edges = (64, 128, 256)
    pieces, tokens = [0, 0, 0], [0, 0, 0]
    for n in lengths.tolist():  # reference: cut at 256, file each piece by the smallest edge >= it
        while n > 0:
            piece = min(n, 256)
            k = next(i for i, e in enumerate(edges) if piece <= e)
            pieces[k] += 1
            tokens[k] += piece
            n -= piece
    hist = bucket_histogram(lengths, edges)
    assert hist.pieces.tolist() == pieces and hist.tokens.tolist() == tokens
    assert hist.num_tokens == int(lengths.sum()) == sum(tokens)
    assert hist.num_split_documents == int((lengths > 256).sum())
    assert json.loads(json.dumps(hist.to_dict()))["pieces"] == pieces
    for bad in ([], [0, 8], [8, 8], [16, 8]):
        with pytest.raises(ConfigError, match="strictly increasing"):
            check_edges(bad)


# ---- corpus --------------------------------------------------------------------------


def test_stdlib_corpus_deterministic_limits_and_skips(tmp_path):
    files = stdlib_files()
    assert files == sorted(files, key=lambda p: p.split(os.sep)) and len(files) > 1000
    assert not any(
        part in p.split(os.sep) for p in files for part in ("site-packages", "__pycache__")
    )
    first = stdlib_corpus(max_files=25)
    assert first["path"] == files[:25] == stdlib_corpus(max_files=25)["path"]
    capped = stdlib_documents(max_bytes=100_000)
    total = sum(len(d["text"].encode()) for d in capped)
    following = os.path.getsize(os.path.join(stdlib_root(), files[len(capped)]))
    assert total <= 100_000 < total + following  # the longest prefix that fits
    root = tmp_path / "lib"
    (root / "site-packages").mkdir(parents=True)
    (root / "site-packages" / "x.py").write_text("skip")
    (root / "b.py").write_bytes("caf\xe9".encode("latin-1"))
    (root / "a.py").write_text("ok")
    (root / "c.txt").write_text("not python")
    assert stdlib_documents(root=str(root)) == [{"path": "a.py", "text": "ok"}]
    with pytest.raises(DataError, match="raise the limits"):
        stdlib_documents(max_bytes=1, root=str(root))
    out = tmp_path / "corpus.jsonl"
    assert write_jsonl(first, out) == 25
    back = load_documents(out, cache_dir=str(tmp_path / "cache"))
    assert ids_of(back) == [byte_ids(t) for t in first["text"]]
