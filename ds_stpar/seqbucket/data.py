"""Documents from a path, through HF datasets, as an ``input_ids`` column; random access.

Accepted inputs (all local, nothing is downloaded):

- a ``.jsonl`` / ``.json`` file or a ``.parquet`` file (``datasets.load_dataset``),
- a ``Dataset.save_to_disk`` folder (a DatasetDict folder: its "train" split, or its only one),
- any other folder: a folder of UTF-8 text files, each file one document, read byte for
  byte (no newline translation) in the order of their sorted relative paths; hidden files
  and folders are skipped.

The documents are a text column (``text_column``, default "text"), tokenized, or a column
of token ids (``ids_column``; a column named "input_ids" is taken when there is no text
column). Row order is the file order. Every mistake is a one-line :class:`DataError`.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ds_stpar.errors import DataError
from ds_stpar.seqbucket.lengths import document_lengths, list_column
from ds_stpar.seqbucket.tokenize import (
    ByteTokenizer,
    Tokenizer,
    int32_list_feature,
    tokenize_dataset,
)

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _first_line(err: BaseException) -> str:
    cause = err.__cause__ or err
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"


def _text_files(folder: str) -> list[str]:
    """Relative paths of the visible files under ``folder``, sorted (deterministic order)."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if not name.startswith("."):
                found.append(os.path.relpath(os.path.join(root, name), folder))
    return sorted(found, key=lambda rel: rel.split(os.sep))


def _read_text_folder(folder: str):
    from datasets import Dataset

    texts = []
    for rel in _text_files(folder):
        with open(os.path.join(folder, rel), encoding="utf-8", newline="") as handle:
            try:
                texts.append(handle.read())
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{os.path.join(folder, rel)}: not UTF-8 text ({err.reason} at byte "
                    f"{err.start}); convert or remove it"
                ) from None
    return Dataset.from_dict({"text": texts})


def _read(path: str, cache_dir: str | None):
    """The raw rows at ``path`` as a ``datasets.Dataset`` (any columns)."""
    import datasets

    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            splits = datasets.load_from_disk(path)
            if "train" in splits:
                return splits["train"]
            if len(splits) == 1:
                return next(iter(splits.values()))
            raise DataError(
                f"{path}: a DatasetDict with splits {list(splits)} and no 'train'; "
                "save the split to use with Dataset.save_to_disk"
            )
        if os.path.isfile(os.path.join(path, "state.json")):
            return datasets.load_from_disk(path)
        return _read_text_folder(path)
    fmt = FILE_FORMATS.get(os.path.splitext(path)[1].lower())
    if fmt is None:
        raise DataError(
            f"{path}: unsupported file type; use .jsonl, .json, .parquet, a "
            "Dataset.save_to_disk folder or a folder of text files"
        )
    if os.path.getsize(path) == 0:
        raise DataError(f"{path}: empty file, no documents")
    try:
        return datasets.load_dataset(fmt, data_files=path, split="train", cache_dir=cache_dir)
    except Exception as err:  # datasets wraps parser errors in DatasetGenerationError
        raise DataError(f"{path}: cannot read as {fmt} ({_first_line(err)})") from None


def _is_list_of_ints(feature) -> bool:
    inner = getattr(feature, "feature", None)
    dtype = getattr(inner, "dtype", "")
    return inner is not None and (dtype.startswith("int") or dtype.startswith("uint"))


def load_documents(
    path: str | os.PathLike,
    text_column: str = "text",
    ids_column: str | None = None,
    tokenizer: Tokenizer | None = None,
    num_proc: int | None = None,
    cache_dir: str | None = None,
):
    """Documents at ``path`` -> a ``datasets.Dataset`` with one column, ``input_ids``.

    ``tokenizer`` defaults to :class:`ByteTokenizer`; ``num_proc`` tokenizes in worker
    processes; ``cache_dir`` is where HF datasets keeps its Arrow copy of json/parquet input.
    """
    path = os.fspath(path)
    if not path:
        raise DataError("empty dataset path; pass a .jsonl/.parquet file or a folder")
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file or folder")
    raw = _read(path, cache_dir)
    columns = raw.column_names
    if len(raw) == 0:
        raise DataError(f"{path}: no documents (columns found: {columns})")
    if ids_column is None and text_column not in columns and "input_ids" in columns:
        ids_column = "input_ids"
    if ids_column is not None:
        if ids_column not in columns:
            raise DataError(f"{path}: no ids column {ids_column!r}; columns found: {columns}")
        if not _is_list_of_ints(raw.features[ids_column]):
            raise DataError(
                f"{path}: column {ids_column!r} is {raw.features[ids_column]}, not lists of "
                f"integer token ids; columns found: {columns}"
            )
        return _ids_dataset(raw, ids_column, path)
    if text_column not in columns:
        raise DataError(
            f"{path}: no text column {text_column!r} and no 'input_ids'; columns found: "
            f"{columns}; choose one with text_column= or ids_column="
        )
    feature = raw.features[text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"{path}: text column {text_column!r} is {feature}, not strings")
    nulls = raw.data.column(text_column).null_count
    if nulls:
        raise DataError(f"{path}: text column {text_column!r} has {nulls} empty (null) rows")
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    return tokenize_dataset(raw, tokenizer, text_column, num_proc=num_proc)


def _ids_dataset(raw, ids_column: str, path: str):
    from datasets import Features

    data = raw.select_columns([ids_column])
    if ids_column != "input_ids":
        data = data.rename_column(ids_column, "input_ids")
    array = list_column(data, "input_ids")
    if array.null_count:
        raise DataError(f"{path}: ids column {ids_column!r} has {array.null_count} null rows")
    values = pa.chunked_array([chunk.flatten() for chunk in array.chunks], array.type.value_type)
    if len(values):
        low, high = (int(v.as_py()) for v in pc.min_max(values).values())
        if low < 0 or high >= 2**31:
            raise DataError(
                f"{path}: ids column {ids_column!r} has ids outside [0, 2**31): {low}..{high}"
            )
    return data.cast(Features({"input_ids": int32_list_feature()}))


class Documents:
    """Token ids of document ``i`` as a zero-copy int32 view: ``docs[i]``; ``docs.lengths``.

    Built once from the ``input_ids`` column (a Dataset, Arrow table or list array): each
    Arrow chunk's offsets and values are viewed as numpy arrays, so a lookup is a binary
    search over chunks and a slice.
    """

    def __init__(self, data, column: str = "input_ids") -> None:
        array = list_column(data, column)
        self.lengths = document_lengths(array)
        self._chunks = [
            (chunk.offsets.to_numpy(), chunk.values.to_numpy(zero_copy_only=False))
            for chunk in array.chunks
        ]
        self._first_row = np.cumsum([0] + [len(chunk) for chunk in array.chunks])

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def __getitem__(self, doc: int) -> np.ndarray:
        if not 0 <= doc < len(self):
            raise IndexError(f"document {doc} outside 0..{len(self) - 1}")
        k = int(np.searchsorted(self._first_row, doc, side="right")) - 1
        offsets, values = self._chunks[k]
        row = doc - self._first_row[k]
        return values[offsets[row] : offsets[row + 1]]
