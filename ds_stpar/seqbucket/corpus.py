"""The demo corpus: the Python standard library's own ``*.py`` sources, one file a document.

Present on every machine with Python, nothing to download, and its lengths are skewed the
way real code corpora are (Python 3.11.7: 1,786 files, 30 MiB; bytes per file p10 / p50 /
p90 / max = 279 / 6,530 / 46,294 / 757,011), so bucketing has something to do.

The file list is deterministic: the ``*.py`` files under ``sysconfig.get_paths()["stdlib"]``
(``site-packages``, ``dist-packages`` and ``__pycache__`` excluded) sorted by relative
path; files that are not valid UTF-8 (a handful of encoding tests) are skipped. Its content
differs between Python versions: ship the jsonl written by :func:`write_jsonl` where two
machines must see the same data.
"""

from __future__ import annotations

import json
import os
import sysconfig

from ds_stpar.errors import DataError

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[str]:
    """Relative paths of the standard library's ``*.py`` files, sorted."""
    root = root or stdlib_root()
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        rel = os.path.relpath(folder, root)
        found.extend(os.path.normpath(os.path.join(rel, f)) for f in files if f.endswith(".py"))
    return sorted(found, key=lambda path: path.split(os.sep))


def stdlib_documents(
    max_files: int | None = None, max_bytes: int | None = None, root: str | None = None
) -> list[dict]:
    """``[{"path", "text"}]`` for the sorted files, at most ``max_files`` of them and at
    most ``max_bytes`` in total (the prefix of the file list that fits; no file is cut)."""
    root = root or stdlib_root()
    docs: list[dict] = []
    total = 0
    for rel in stdlib_files(root):
        if max_files is not None and len(docs) >= max_files:
            break
        with open(os.path.join(root, rel), "rb") as handle:
            data = handle.read()
        if max_bytes is not None and total + len(data) > max_bytes:
            break
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        docs.append({"path": rel, "text": text})
        total += len(data)
    if not docs:
        raise DataError(
            f"{root}: no standard-library *.py file fits max_files={max_files}, "
            f"max_bytes={max_bytes}; raise the limits"
        )
    return docs


def stdlib_corpus(
    max_files: int | None = None, max_bytes: int | None = None, root: str | None = None
):
    """The corpus as a ``datasets.Dataset`` with columns ``path`` and ``text``."""
    from datasets import Dataset

    docs = stdlib_documents(max_files, max_bytes, root)
    return Dataset.from_dict({"path": [d["path"] for d in docs], "text": [d["text"] for d in docs]})


def write_jsonl(docs, path: str | os.PathLike) -> int:
    """Write rows (dicts, or a Dataset) as JSON lines, UTF-8; returns the number written."""
    count = 0
    with open(path, "w", encoding="utf-8") as handle:
        for row in docs:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count
