"""Latent attention by gathering the selected keys: the ``"gather"`` backend of
:func:`fcp.ops.latent_attention.latent_attention`, every device.

Three steps:

* the latent crosses ranks, not K/V: one :func:`~fcp.comm.all_gather_sequence` of ``[batch,
  local_seq, rank (+ R)]`` (the rotary key beside it) in the latent's dtype (bf16 on the wire for a bf16 model), whose backward
  reduce-scatter sums the ranks' partial gradients in fp32 before rounding once;
* the expansion ``kv_weight`` of the gathered prefix ``[0, seq_end)`` only: a query never reads a
  token after it, so later ranks' tokens are never expanded here (rank ``r`` of ``w`` expands
  ``(r + 1) / w`` of the sequence);
* the selected keys and values per query: :func:`selected_slots` and :func:`gather_attention`,
  the kernel of :func:`~fcp.ops.index_attention.index_attention` (``O(W)`` per query, no
  ``local x sequence`` score).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fcp.comm import all_gather_sequence
from fcp.context import PackedContext
from fcp.ops.kit.attention import with_anchors
from fcp.ops.kit.common import finite_or_zero
from fcp.ops.kit.gather import gather_attention, selected_slots

__all__ = ["latent_attention_gather"]


def latent_attention_gather(q: torch.Tensor, latent: torch.Tensor, kv_weight: torch.Tensor,
                            kv_bias: torch.Tensor | None, indices: torch.Tensor,
                            ctx: PackedContext, scale: float, query_chunk: int | None,
                            k_rope: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``[batch, local_seq, heads, Dv]`` in ``q``'s dtype (arguments checked by the
    dispatcher, non-finite ``q`` / ``latent`` / ``k_rope`` entries already zeroed)."""
    heads, dk, rank = q.shape[2], q.shape[3], latent.shape[2]
    # the rotary key travels with the latent: one all-gather
    both = latent if k_rope is None else torch.cat([latent, k_rope.to(latent.dtype)], -1)
    full = all_gather_sequence(both, ctx, dtype=torch.float32).to(latent.dtype)
    dt = torch.promote_types(latent.dtype, kv_weight.dtype)
    bias = None if kv_bias is None else kv_bias.to(dt)
    prefix = full[:, : ctx.seq_end].to(dt)
    kv = F.linear(prefix[..., :rank], kv_weight.to(dt), bias).unflatten(-1, (heads, -1))
    if k_rope is not None:  # each head's key: its own Dk - R channels, then the shared R
        nope = dk - k_rope.shape[-1]
        shared = prefix[:, :, None, rank:].expand(-1, -1, heads, -1)
        kv = torch.cat([kv[..., :nope], shared, kv[..., nope:]], -1)
    # [batch, seq_end, heads, Dk + Dv]: per head keys then values, the layout gather_attention
    # reads; a non-finite weight must not carry one document's NaN into another's scores
    kv = finite_or_zero(kv)
    slots, valid = selected_slots(indices, ctx.doc_ids, ctx.seq_start)
    out = gather_attention(q, kv, dk, slots, valid, scale, query_chunk)
    # the gather's backward reduce-scatter runs on every rank, whatever the loss reads
    return with_anchors(out, ctx, full)
