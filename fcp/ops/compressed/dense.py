"""Compressed attention's ``"dense"`` backend (every device): one softmax over the query's exact
window (a per-query key part, ``unfold``) and the visible block means (shared keys, banded:
:mod:`fcp.ops.kit.softmax`).

Guarantees: masked keys get probability exactly 0, so documents are bitwise independent; fp32
softmax (fp64 for fp64 inputs); deterministic, and bitwise independent of ``ctx.band`` and
of ``query_chunk``; static shapes, no host sync. Cost: ``O(local x (band / ratio + window))``
scores per head.
"""

from __future__ import annotations

from fcp.context import PackedContext
from fcp.ops.compressed.blocks import compressed_keys
from fcp.ops.kit.attention import with_anchors
from fcp.ops.kit.masks import same_doc
from fcp.ops.kit.softmax import Window, banded_attention

__all__ = ["compressed_dense"]


def compressed_dense(q, k, v, ctx: PackedContext, ratio: int, window: int, scale: float,
                     query_chunk: int | None = None):
    """``[batch, local_seq, heads, Dv]`` (arguments checked by the dispatcher)."""
    dk = k.shape[-1]
    keys = compressed_keys(k, v, ctx, ratio, window)
    win = keys.ext.unfold(1, window, 1).transpose(-1, -2)  # [b, local, hkv, window, dk + dv]
    mask_w = same_doc(ctx.local_doc_ids, keys.ext_doc.unfold(1, window, 1))  # [b, local, W]
    out = banded_attention(q, keys.blocks, dk, keys.block_doc, (keys.block_index + 1) * ratio,
                           ctx.local_doc_ids, ctx.seq_start, ctx.key_band, scale,
                           stride=ratio, window=Window(win, mask_w),
                           chunk=query_chunk)  # fmt: skip
    return with_anchors(out, ctx, keys.gathered, keys.halo)
