"""Index attention by gathering the selected keys: the ``"gather"`` backend, every device.

The K/V all-gather (``kv="local"``) or the caller's global K/V, then the kernel of
:mod:`fcp.ops.kit.gather` (:func:`~fcp.ops.kit.gather.selected_slots`,
:func:`~fcp.ops.kit.gather.gather_attention`: ``O(W)`` per query, no ``local x sequence`` score).
"""

from __future__ import annotations

import torch

from fcp.comm import all_gather_sequence
from fcp.context import PackedContext
from fcp.ops.kit.attention import with_anchors
from fcp.ops.kit.gather import gather_attention, selected_slots

__all__ = ["index_attention_gather"]


def index_attention_gather(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           indices: torch.Tensor, ctx: PackedContext, scale: float, kv: str,
                           query_chunk: int | None) -> torch.Tensor:
    """The ``"gather"`` backend of :func:`fcp.ops.index_attention.index_attention` (arguments
    checked there): the K/V all-gather (``kv="local"``) or the global K/V prefix, the selected
    slots, :func:`gather_attention`, and the backward anchors on what came from other ranks."""
    end, dk = ctx.seq_end, k.shape[-1]
    common = torch.promote_types(k.dtype, v.dtype)
    if kv == "local":
        gathered = all_gather_sequence(torch.cat([k.to(common), v.to(common)], -1), ctx,
                                       dtype=torch.float32)  # fp32 K/V grads summed
        received = [gathered]
        kv_all = gathered[:, :end]  # keys after this rank's queries are never selected
    else:
        received = [k, v]
        kv_all = torch.cat([k[:, :end].to(common), v[:, :end].to(common)], -1)
    slots, valid = selected_slots(indices, ctx.doc_ids, ctx.seq_start)
    out = gather_attention(q, kv_all, dk, slots, valid, scale, query_chunk)
    # the backward reduce-scatter of the K/V gather runs on every rank, whatever the loss
    return with_anchors(out, ctx, *received)
