"""Sliding-window attention's ``"dense"`` backend: the banded masked softmax of
:mod:`fcp.ops.kit.softmax` over the halo and the shard (every device).

Guarantees: masked keys get probability exactly 0 (``torch.where``), so documents are bitwise
independent; fp32 softmax (fp64 for fp64 inputs); deterministic and bitwise independent of
``query_chunk``; static shapes, no host sync. Cost: ``O(local x min(window, band))`` scores per
head (each block of queries visits only the key blocks its window reaches).
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.kit.attention import with_anchors
from fcp.ops.kit.softmax import banded_attention
from fcp.ops.sliding_window.keys import window_keys

__all__ = ["sliding_window_dense"]


def sliding_window_dense(q, k, v, ctx: PackedContext, window: int, halo: int, scale: float,
                         query_chunk: int | None = None, *, sinks=None,
                         softcap=None) -> torch.Tensor:  # fmt: skip
    """``[batch, local_seq, heads, Dv]`` (arguments checked by the dispatcher)."""
    keys = window_keys(k, v, ctx, halo)
    # positions relative to the first halo key: query i at halo + i, key j at j, visible to
    # queries j .. j + window - 1; the band bounds the key blocks visited
    out = banded_attention(q, keys.kv, k.shape[-1], keys.doc, keys.pos, ctx.local_doc_ids, halo,
                           min(window, ctx.key_band), scale, key_hi=keys.pos + (window - 1),
                           sinks=sinks, softcap=softcap, chunk=query_chunk)  # fmt: skip
    return with_anchors(out, ctx, keys.kv[:, :halo])
