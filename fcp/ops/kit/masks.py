"""Attention masks built from the replicated doc-id map (static shapes, no host sync).

Every mask here is a bool tensor computed from ``PackedContext.doc_ids`` with static slicing and
comparisons only, so a compiled graph sees the same shapes for every packing and never reads a
doc id on the host. Conventions:

* documents are numbered 1, 2, ... per row; pad tokens are ``PAD_DOC_ID`` (0);
* a pad **query** sees nothing (its row of the mask is all False; the dense backend then returns
  exact zeros for it, with zero gradient);
* positions outside ``[0, global_seq)`` get doc id ``-1`` (:data:`OUTSIDE`), which matches nothing.

Worked example (one row, ``doc_ids = [[1, 1, 2, 2, 2, 0]]``): document-causal visibility,
``same_doc(doc_q, doc_k) & (s <= t)``, as the banded softmax of :mod:`fcp.ops.kit.softmax`
applies it block by block::

        t=0: 1 0 0 0 0 0        t=3: 0 0 1 1 0 0
        t=1: 1 1 0 0 0 0        t=4: 0 0 1 1 1 0
        t=2: 0 0 1 0 0 0        t=5: 0 0 0 0 0 0   (pad query: empty row)
"""

from __future__ import annotations

import torch

from fcp.layout import OUTSIDE_DOC_ID, PAD_DOC_ID, doc_ids_window

__all__ = [
    "OUTSIDE",
    "doc_ids_window",
    "full_block_doc_ids",
    "last_doc_of_blocks",
    "same_doc",
]

OUTSIDE = OUTSIDE_DOC_ID  # doc id of positions outside the global map


def same_doc(doc_q: torch.Tensor, doc_k: torch.Tensor) -> torch.Tensor:
    """bool: ``doc_k == doc_q`` and the query is real; ``doc_q`` ``[b, q]`` is broadcast over the
    trailing key axis of ``doc_k`` (``[b, k]`` shared keys or ``[b, q, k]`` per-query keys)."""
    dq = doc_q[..., None]
    if doc_k.dim() == 2:
        doc_k = doc_k[:, None, :]
    return (doc_k == dq) & (dq != PAD_DOC_ID)


def full_block_doc_ids(doc_ids: torch.Tensor, block: int, num_blocks: int) -> torch.Tensor:
    """int64 ``[batch, num_blocks]``: the doc id of block ``b`` (global positions
    ``[b*block, (b+1)*block)``) if all its tokens are in one document, else ``OUTSIDE``.

    Documents are contiguous runs, so "first token's doc == last token's doc" is enough.

    >>> full_block_doc_ids(torch.tensor([[1, 1, 1, 2, 2, 2, 0, 0]]), 2, 4).tolist()
    [[1, -1, 2, 0]]
    """
    end = num_blocks * block
    first = doc_ids[:, 0:end:block]
    last = doc_ids[:, block - 1 : end : block]
    return torch.where(first == last, first, OUTSIDE)


def last_doc_of_blocks(doc_ids: torch.Tensor, block: int, num_blocks: int) -> torch.Tensor:
    """int64 ``[batch, num_blocks]``: the doc id of each block's last token.

    Only a block's last document can continue past it, so for a query ``t`` after block ``b`` the
    tokens of ``doc(t)`` inside ``b`` are exactly the block's last-document segment (when
    ``doc(t)`` equals this id) or nothing.
    """
    return doc_ids[:, block - 1 : num_blocks * block : block]
