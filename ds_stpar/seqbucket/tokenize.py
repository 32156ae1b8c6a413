"""Tokenizers that need no download: bytes, or a local ``tokenizer.json``.

Both turn a batch of texts into lists of token ids through one method, ``encode_batch``, so
:func:`tokenize_dataset` can run either inside ``datasets.Dataset.map(batched=True)``
(optionally with ``num_proc`` worker processes: both tokenizers pickle).

Byte-level ids (:class:`ByteTokenizer`, vocabulary 258)::

    0..255   the UTF-8 bytes of the text, in order
    256      EOS, appended to every document (the model learns where documents end)
    257      PAD, fills a packed row up to its bucket edge; never a target (label -100)

A document of ``n`` UTF-8 bytes becomes ``n + 1`` ids.
"""

from __future__ import annotations

import os
from typing import Protocol

import numpy as np

from ds_stpar.errors import DataError

BYTE_VOCAB = 256
BYTE_EOS_ID = 256
BYTE_PAD_ID = 257


class Tokenizer(Protocol):
    """What :func:`tokenize_dataset` and the packer need from a tokenizer."""

    vocab_size: int
    eos_id: int | None
    pad_id: int

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus EOS (256) and PAD (257); see the module docstring."""

    vocab_size = BYTE_VOCAB + 2
    eos_id = BYTE_EOS_ID
    pad_id = BYTE_PAD_ID

    def __init__(self, add_eos: bool = True) -> None:
        self.add_eos = add_eos

    def encode(self, text: str) -> np.ndarray:
        """One text -> int32 ids of length ``len(text.encode()) + add_eos``."""
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
        return np.append(ids, np.int32(BYTE_EOS_ID)) if self.add_eos else ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids) -> str:
        """Ids -> text; EOS and PAD are dropped, invalid UTF-8 is replaced (U+FFFD)."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < BYTE_VOCAB)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A local ``tokenizer.json`` (or a folder holding one) as a fast HF tokenizer.

    ``add_special_tokens`` is passed to the tokenizer (BOS and the like, as its
    post-processor defines them); EOS is appended when ``add_eos`` and the tokenizer has one
    (``eos_token`` names it for a bare tokenizer.json that does not say).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        eos_token: str | None = None,
        add_eos: bool = True,
        add_special_tokens: bool = False,
    ) -> None:
        from transformers import PreTrainedTokenizerFast

        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise DataError(f"{file}: no such tokenizer file; pass a tokenizer.json or 'bytes'")
        try:
            if os.path.isdir(path):
                self.hf = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
            else:
                self.hf = PreTrainedTokenizerFast(tokenizer_file=file)
        except Exception as err:  # the tokenizers library raises its own exception types
            raise DataError(f"{file}: not a readable tokenizer.json ({err})") from None
        if eos_token is not None:
            eos = self.hf.convert_tokens_to_ids(eos_token)
            if eos is None or eos == self.hf.unk_token_id:
                raise DataError(f"{file}: EOS token {eos_token!r} is not in the vocabulary")
            self.eos_id: int | None = int(eos)
        else:
            self.eos_id = self.hf.eos_token_id
        self.vocab_size = len(self.hf)
        pad = self.hf.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.eos_id or 0))
        self.add_eos = add_eos and self.eos_id is not None
        self.add_special_tokens = add_special_tokens

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        batch = self.hf(texts, add_special_tokens=self.add_special_tokens)["input_ids"]
        tail = [self.eos_id] if self.add_eos else []
        return [np.asarray(ids + tail, dtype=np.int32) for ids in batch]


def load_tokenizer(spec: str | os.PathLike = "bytes", **kwargs) -> ByteTokenizer | HFTokenizer:
    """``"bytes"`` -> :class:`ByteTokenizer`; a path -> :class:`HFTokenizer` (must exist)."""
    if os.fspath(spec) == "bytes":
        return ByteTokenizer(**kwargs)
    if not os.path.exists(spec):
        raise DataError(f"{os.fspath(spec)}: no such tokenizer; pass a tokenizer.json or 'bytes'")
    return HFTokenizer(spec, **kwargs)


def int32_list_feature():
    """The ``list<int32>`` feature of an ``input_ids`` column (``List`` from datasets 4 on)."""
    import datasets

    list_type = getattr(datasets, "List", None) or datasets.Sequence
    return list_type(datasets.Value("int32"))


def _encode_column(batch: dict, tokenizer: Tokenizer, text_column: str) -> dict:
    return {"input_ids": tokenizer.encode_batch(batch[text_column])}


def tokenize_dataset(
    dataset,
    tokenizer: Tokenizer,
    text_column: str = "text",
    num_proc: int | None = None,
    batch_size: int = 1000,
):
    """``dataset[text_column]`` -> a Dataset with only an ``input_ids`` column (list<int32>).

    Row order is kept (``map`` is order-preserving, also with ``num_proc``).
    """
    from datasets import Features

    return dataset.map(
        _encode_column,
        fn_kwargs={"tokenizer": tokenizer, "text_column": text_column},
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=dataset.column_names,
        features=Features({"input_ids": int32_list_feature()}),
        desc="tokenize",
    )
