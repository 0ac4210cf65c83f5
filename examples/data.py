"""Packed byte-level documents from the Python standard library's own source files.

Real text that ships with every Python installation, so nothing is ever downloaded: the ``.py``
files under ``sysconfig.get_paths()["stdlib"]`` (installed third-party packages excluded), one
document per file, tokens = bytes (vocabulary 256).

Packing, deterministic for a given ``seed`` and Python installation:

* files are visited in sorted path order shuffled by ``random.Random(seed)`` (a new shuffle per
  epoch, the stream never ends);
* each document is the file's opening bytes, cut at a length drawn log-uniformly in
  ``[min_doc_len, max_doc_len]`` (``max_doc_len`` defaults to the row length; most files are
  longer than a row), so rows mix short and long documents; documents longer than a row are
  always cut to the row length; ``vary_lengths=False`` keeps whole files (cut at the row);
* rows of ``seq_len`` tokens are filled first-fit from a small look-ahead buffer of documents;
  when no buffered document fits in the rest of a row, the row ends with a pad tail.

A batch is what :func:`fcp.shard_batch` takes::

    {"input_ids":    int64 [batch, seq_len],     # pad tokens are 0
     "shift_labels": int64 [batch, seq_len],     # next byte of the same document, else -100
     "seq_lens":     int64 [batch, max_docs],    # per-row document lengths, -1000 = unused slot
     "cu_seqlens":   int64 [docs + 1]}           # only when batch == 1 (one packed row)

``shift_labels`` are next-token targets already aligned with the tokens (transformers' name;
unshifted ``labels`` would be the tokens themselves, shifted by :func:`fcp.shard_batch`).

Example::

    data = PackedDocuments(seq_len=512, batch_size=1, seed=0)
    batch = next(iter(data))
    local, ctx = fcp.shard_batch(cp_group, batch, pad_multiple=4)
"""

from __future__ import annotations

import math
import os
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = [
    "IGNORE_INDEX",
    "SEQ_LENS_SENTINEL",
    "PackedDocuments",
    "stdlib_source_files",
    "iter_documents",
    "pack_rows",
    "make_batch",
    "decode",
]

IGNORE_INDEX = -100
SEQ_LENS_SENTINEL = -1000
PAD_TOKEN_ID = 0
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_source_files(root: str | os.PathLike | None = None) -> list[Path]:
    """Sorted non-empty ``.py`` files of the standard library (no installed packages)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                try:
                    if path.stat().st_size > 0:
                        files.append(path)
                except OSError:
                    continue
    files.sort()
    if not files:
        raise FileNotFoundError(f"no .py files under {root}")
    return files


def iter_documents(
    max_doc_len: int,
    *,
    min_doc_len: int = 32,
    seed: int = 0,
    vary_lengths: bool = True,
    files: list[Path] | None = None,
) -> Iterator[bytes]:
    """Endless stream of documents (file openings) in a seeded order; see the module docstring."""
    if max_doc_len < 1:
        raise ValueError(f"max_doc_len must be >= 1, got {max_doc_len}")
    min_doc_len = max(1, min(min_doc_len, max_doc_len))
    files = list(files) if files is not None else stdlib_source_files()
    rng = random.Random(seed)
    lo, hi = math.log(min_doc_len), math.log(max_doc_len + 1)
    while True:
        order = files[:]
        rng.shuffle(order)
        for path in order:
            budget = int(math.exp(rng.uniform(lo, hi))) if vary_lengths else max_doc_len
            budget = max(min_doc_len, min(budget, max_doc_len))
            try:
                with open(path, "rb") as f:
                    text = f.read(budget)
            except OSError:
                continue
            if text:
                yield text


def pack_rows(
    docs: Iterator[bytes], seq_len: int, lookahead: int = 8
) -> Iterator[list[bytes]]:
    """Group documents into rows of at most ``seq_len`` bytes, first-fit from a look-ahead buffer
    (deterministic); a document longer than a row is cut to ``seq_len``."""
    pending: list[bytes] = []
    while True:
        while len(pending) < lookahead:
            pending.append(next(docs)[:seq_len])
        row, room = [], seq_len
        while True:
            pick = next((i for i, d in enumerate(pending) if len(d) <= room), None)
            if pick is None:
                break
            doc = pending.pop(pick)
            row.append(doc)
            room -= len(doc)
            if len(pending) < lookahead:
                pending.append(next(docs)[:seq_len])
        yield row


def make_batch(rows: list[list[bytes]], seq_len: int) -> dict[str, torch.Tensor]:
    """Token/label tensors and packing metadata for rows of documents (module docstring)."""
    n = len(rows)
    input_ids = torch.full((n, seq_len), PAD_TOKEN_ID, dtype=torch.long)
    targets = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)
    max_docs = max(1, max(len(r) for r in rows))
    seq_lens = torch.full((n, max_docs), SEQ_LENS_SENTINEL, dtype=torch.long)
    for i, row in enumerate(rows):
        pos = 0
        for j, doc in enumerate(row):
            ids = torch.frombuffer(bytearray(doc), dtype=torch.uint8).long()
            if pos + len(ids) > seq_len:
                raise ValueError(f"row {i} holds more than seq_len={seq_len} tokens")
            input_ids[i, pos : pos + len(ids)] = ids
            targets[i, pos : pos + len(ids) - 1] = ids[1:]  # the last token predicts nothing
            seq_lens[i, j] = len(ids)
            pos += len(ids)
    batch = {"input_ids": input_ids, "shift_labels": targets, "seq_lens": seq_lens}
    if n == 1:
        lens = seq_lens[0][seq_lens[0] >= 0]
        batch["cu_seqlens"] = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    return batch


class PackedDocuments:
    """Endless, deterministic iterable of packed batches of stdlib source text.

    Args:
        seq_len: tokens per row.
        batch_size: rows per batch.
        seed: file order and document lengths.
        max_doc_len: longest document (default ``seq_len``; never more than a row).
        min_doc_len: shortest length budget (shorter files stay whole).
        vary_lengths: cut documents at random lengths (``True``) or keep whole files.
        lookahead: first-fit buffer size of the packer.

    Iterating twice restarts the same stream.
    """

    def __init__(
        self,
        seq_len: int = 512,
        batch_size: int = 1,
        *,
        seed: int = 0,
        max_doc_len: int | None = None,
        min_doc_len: int = 32,
        vary_lengths: bool = True,
        lookahead: int = 8,
    ):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.max_doc_len = min(max_doc_len or seq_len, seq_len)
        self.min_doc_len, self.vary_lengths, self.lookahead = min_doc_len, vary_lengths, lookahead
        self._files = stdlib_source_files()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        docs = iter_documents(
            self.max_doc_len,
            min_doc_len=self.min_doc_len,
            seed=self.seed,
            vary_lengths=self.vary_lengths,
            files=self._files,
        )
        rows = pack_rows(docs, self.seq_len, self.lookahead)
        while True:
            yield make_batch([next(rows) for _ in range(self.batch_size)], self.seq_len)

    def batches(self, n: int) -> list[dict[str, torch.Tensor]]:
        """The first ``n`` batches of the stream."""
        it = iter(self)
        return [next(it) for _ in range(n)]


def decode(ids: torch.Tensor) -> str:
    """Bytes back to text (invalid UTF-8 replaced), e.g. to print a document."""
    return bytes(int(i) & 0xFF for i in ids.flatten().tolist()).decode("utf-8", "replace")
