"""Document-causal attention's ``"flex"`` backend: FlexAttention (:mod:`fcp.ops.kit.flex`) with the
dense backend's mask, over the all-gathered K/V prefix ``[0, seq_end)`` (CUDA; no CPU backward).

Guarantees: the dense backend's mask exactly; the kernel's own rounding (online softmax, fp32
statistics); static shapes, no host sync.
"""

from __future__ import annotations

import torch

from fcp.comm import all_gather_sequence
from fcp.context import PackedContext
from fcp.ops.kit import flex
from fcp.ops.kit.attention import with_anchors

__all__ = ["doc_causal_flex"]


def doc_causal_flex(q, k, v, ctx: PackedContext, scale: float, query_chunk: int | None = None,
                    *, sinks=None, softcap=None) -> torch.Tensor:
    """``[batch, local_seq, heads, Dv]`` (arguments checked by the dispatcher; FlexAttention
    tiles by itself, ``query_chunk`` is unused)."""
    dk, start, end = k.shape[-1], ctx.seq_start, ctx.seq_end
    kv = all_gather_sequence(torch.cat([k, v], -1), ctx, dtype=torch.float32)
    keys = kv[:, :end]
    k_pos = torch.arange(end, device=q.device)
    lo = k_pos - start  # the local query index from which key s is visible
    hi = torch.full_like(k_pos, flex.UNBOUNDED)
    out = flex.flex_attend(q, keys[..., :dk], keys[..., dk:], ctx.local_doc_ids,
                           ctx.doc_ids[:, :end], lo, hi, scale, sinks=sinks,
                           softcap=softcap)  # fmt: skip
    return with_anchors(out, ctx, kv)
