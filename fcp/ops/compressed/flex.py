"""Compressed attention's ``"flex"`` backend (CUDA): FlexAttention over ``cat(blocks, window)``
with per-key query bounds (:mod:`fcp.ops.kit.flex`), the dense backend's masks exactly."""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.compressed.blocks import compressed_keys
from fcp.ops.kit import flex
from fcp.ops.kit.attention import with_anchors

__all__ = ["compressed_flex"]


def compressed_flex(q, k, v, ctx: PackedContext, ratio: int, window: int, scale: float,
                    query_chunk: int | None = None):
    """``[batch, local_seq, heads, Dv]`` (arguments checked by the dispatcher; FlexAttention
    tiles by itself, ``query_chunk`` is unused)."""
    dk, start = k.shape[-1], ctx.seq_start
    keys = compressed_keys(k, v, ctx, ratio, window)
    b = keys.block_index
    j = torch.arange(keys.ext.shape[1], device=q.device)
    both = torch.cat([keys.blocks, keys.ext], 1)
    lo = torch.cat([(b + 1) * ratio - start, j - (window - 1)])
    hi = torch.cat([torch.full_like(b, flex.UNBOUNDED), j])
    key_doc = torch.cat([keys.block_doc, keys.ext_doc], 1)
    out = flex.flex_attend(q, both[..., :dk], both[..., dk:], ctx.local_doc_ids, key_doc, lo,
                           hi, scale)  # fmt: skip
    return with_anchors(out, ctx, keys.gathered, keys.halo)
