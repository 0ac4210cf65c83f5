"""Compressed attention's ``"dense"`` backend (every device): one softmax over the visible block
means (a shared key part) and the query's exact window (a per-query key part, ``unfold``).

Guarantees: masked keys get probability exactly 0, so documents are bitwise independent; fp32
softmax (fp64 for fp64 inputs); deterministic; static shapes, no host sync.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.compressed.blocks import compressed_keys
from fcp.ops.kit.attention import query_positions, with_anchors
from fcp.ops.kit.masks import same_doc
from fcp.ops.kit.softmax import KeyPart, attend

__all__ = ["compressed_dense"]


def compressed_dense(q, k, v, context: PackedContext, ratio: int, window: int, scale: float):
    """``[batch, local_seq, heads, Dv]`` (arguments checked by the dispatcher)."""
    dk = k.shape[-1]
    keys = compressed_keys(k, v, context, ratio, window)
    doc_q, t, b = context.local_doc_ids, query_positions(context, q.device), keys.block_index
    mask_c = same_doc(doc_q, keys.block_doc) & ((b[None, :] + 1) * ratio <= t[:, None])[None]
    win = keys.ext.unfold(1, window, 1).transpose(-1, -2)  # [b, local, hkv, window, dk + dv]
    mask_w = same_doc(doc_q, keys.ext_doc.unfold(1, window, 1))  # [b, local, window]
    parts = [
        KeyPart(keys.blocks[..., :dk], keys.blocks[..., dk:], mask_c),
        KeyPart(win[..., :dk], win[..., dk:], mask_w, per_query=True),
    ]
    return with_anchors(attend(q, parts, scale), context, keys.gathered, keys.halo)
