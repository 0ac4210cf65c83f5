"""Hypothesis strategies the operators' property tests share."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

__all__ = ["one_document", "packing"]


@st.composite
def packing(draw, batch: int, total: int) -> torch.Tensor:
    """A ``[batch, total]`` int64 doc-id map: per row random document lengths (often 1-3
    tokens, sometimes the whole row), then a pad tail (often none)."""
    rows = []
    for _ in range(batch):
        pad = draw(st.one_of(st.just(0), st.integers(0, total)))
        ids, left = [], total - pad
        while left:
            n = min(left, draw(st.one_of(st.integers(1, 3), st.integers(1, total), st.just(total))))
            ids += [ids[-1] + 1 if ids else 1] * n
            left -= n
        rows.append(ids + [0] * pad)
    return torch.tensor(rows, dtype=torch.long).view(batch, total)


def one_document(data, doc_ids: torch.Tensor) -> torch.Tensor:
    """bool ``[batch, seq]``: every token of one drawn run (a document or the pad tail) of one
    drawn row."""
    row = data.draw(st.integers(0, doc_ids.shape[0] - 1))
    victim = data.draw(st.sampled_from(sorted(set(doc_ids[row].tolist()))))
    inside = torch.zeros_like(doc_ids, dtype=torch.bool)
    inside[row] = doc_ids[row] == victim
    return inside
