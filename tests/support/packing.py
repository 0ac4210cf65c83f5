"""Document layouts for the tests: doc-id maps, random packings, Hypothesis strategies.

A doc-id map is int64 ``[batch, seq]``: documents numbered 1, 2, ... per row, pad tokens 0,
zero-length documents numbering nothing (as in :mod:`fcp.layout`). Everything here is plain
Python loops and ``torch.tensor``, independent of the code under test::

    packing(8, [3, 2], [8])                  # [[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]
    doc_ids_from_lengths([([3, 2], 3)])      # [[1, 1, 1, 2, 2, 0, 0, 0]]  (lengths, pad tail)
    ref_positions_row([1, 1, 2, 2, 2, 0])    # [0, 1, 0, 1, 2, 0]
    ref_segments([1, 1, 2, 0])               # [0, 2, 3, 4]
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st


# ---------------------------------------------------------------------------------------------
# plain-loop references (also the oracles of the fcp.layout tests)
# ---------------------------------------------------------------------------------------------
def ref_doc_ids_row(lengths: list[int], seq_len: int) -> list[int]:
    """One row: documents of ``lengths`` (zeros skipped), then pad up to ``seq_len``."""
    row, doc = [], 0
    for n in lengths:
        if n > 0:
            doc += 1
            row += [doc] * n
    return row + [0] * (seq_len - len(row))


def ref_segments(row: list[int]) -> list[int]:
    """Boundaries of the runs of equal ids (documents and the pad tail), 0 and len included."""
    bounds = [0]
    for j in range(1, len(row)):
        if row[j] != row[j - 1]:
            bounds.append(j)
    if row:
        bounds.append(len(row))
    return bounds


def ref_positions_row(ids: list[int]) -> list[int]:
    """Document-local positions: 0 at every run start, then counting up."""
    out = []
    for j, v in enumerate(ids):
        out.append(0 if j == 0 or ids[j - 1] != v else out[-1] + 1)
    return out


# ---------------------------------------------------------------------------------------------
# doc-id maps
# ---------------------------------------------------------------------------------------------
def packing(seq: int, *rows: list[int]) -> torch.Tensor:
    """``[len(rows), seq]`` from each row's document lengths; the rest of a row is padding."""
    return torch.tensor([ref_doc_ids_row(r, seq) for r in rows], dtype=torch.long)


#: small edge layouts ``(seq, *rows of document lengths)``: :func:`packing` takes them as they are
EDGE_PACKINGS = {
    "one_doc": (16, [16]),
    "pad_tail": (16, [5, 3, 6]),
    "tiny_docs": (16, [1, 2, 1, 3, 1, 5, 1]),
    "two_rows": (12, [7, 4], [2, 2, 2, 2, 2, 2]),
    "all_pad_row": (8, [8], [0]),
}


def doc_ids_from_lengths(rows: list[tuple[list[int], int]]) -> torch.Tensor:
    """int64 ``[batch, seq]`` from per-row ``(document lengths, pad length)``."""
    return torch.tensor([ref_doc_ids_row(lens, sum(lens) + pad) for lens, pad in rows],
                        dtype=torch.long)  # fmt: skip


def random_packings(n: int, batch: int, seq: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` maps of up to 6 documents per row and a pad tail of 0-3 tokens (or more)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        rows = []
        for _ in range(batch):
            left, lens = seq - int(torch.randint(0, 4, (), generator=g)), []
            while left > 0 and len(lens) < 6:
                lens.append(int(torch.randint(1, left + 1, (), generator=g)))
                left -= lens[-1]
            rows.append(lens)
        out.append(packing(seq, *rows))
    return out


def random_doc_ids(gen: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    """One map drawn from ``gen``: a pad tail of 0-11 tokens, documents of 1-15 tokens."""
    rows = []
    for _ in range(batch):
        pad = int(torch.randint(0, 12, (), generator=gen))
        lens, left = [], seq - pad
        while left:
            lens.append(min(left, int(torch.randint(1, 16, (), generator=gen))))
            left -= lens[-1]
        rows.append((lens, pad))
    return doc_ids_from_lengths(rows)


# ---------------------------------------------------------------------------------------------
# Hypothesis strategies
# ---------------------------------------------------------------------------------------------
@st.composite
def length_rows(draw, batch: int, total: int) -> torch.Tensor:
    """A ``[batch, total]`` map: random document lengths (often 1-3, sometimes the whole row),
    then a pad tail (often none, sometimes the whole row)."""
    rows = []
    for _ in range(batch):
        pad = draw(st.one_of(st.just(0), st.integers(0, total)))
        lens, left = [], total - pad
        while left:
            n = draw(st.one_of(st.integers(1, 3), st.integers(1, total), st.just(total)))
            lens.append(min(n, left))
            left -= lens[-1]
        rows.append((lens, pad))
    return doc_ids_from_lengths(rows)


@st.composite
def cut_rows(draw, batch: int, seq: int, max_cuts: int) -> torch.Tensor:
    """A ``[batch, seq]`` map: a pad tail of 0-5 tokens, the rest cut at up to ``max_cuts``
    random places (tiny documents and documents spanning the row both common)."""
    rows = []
    for _ in range(batch):
        pad = draw(st.integers(0, min(5, seq)))
        real = seq - pad
        cuts = set()
        if real > 1:
            cuts = draw(st.sets(st.integers(1, real - 1), max_size=max_cuts))
        bounds = [0, *sorted(c for c in cuts if c < real), real]
        rows.append([b - a for a, b in zip(bounds, bounds[1:]) if b > a])
    return packing(seq, *rows)


def one_document(data, doc_ids: torch.Tensor) -> torch.Tensor:
    """bool ``[batch, seq]``: every token of one drawn run (a document or the pad tail) of one
    drawn row (``data``: Hypothesis' ``st.data()``)."""
    row = data.draw(st.integers(0, doc_ids.shape[0] - 1))
    victim = data.draw(st.sampled_from(sorted(set(doc_ids[row].tolist()))))
    inside = torch.zeros_like(doc_ids, dtype=torch.bool)
    inside[row] = doc_ids[row] == victim
    return inside
