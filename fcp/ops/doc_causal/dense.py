"""Document-causal attention's ``"dense"`` backend: the masked softmax of :mod:`fcp.ops.kit.softmax`
over the all-gathered K/V prefix ``[0, seq_end)`` (every device).

Guarantees: masked keys get probability exactly 0 (``torch.where``), so documents are bitwise
independent; fp32 softmax (fp64 for fp64 inputs); deterministic; static shapes, no host sync.
Cost: ``O(local x seq_end)`` scores per head.
"""

from __future__ import annotations

import torch

from fcp.comm import all_gather_sequence
from fcp.context import PackedContext
from fcp.ops.kit.attention import query_positions, with_anchors
from fcp.ops.kit.masks import doc_causal_mask
from fcp.ops.kit.softmax import KeyPart, attend

__all__ = ["doc_causal_dense"]


def doc_causal_dense(q, k, v, context: PackedContext, scale: float) -> torch.Tensor:
    """``[batch, local_seq, heads, Dv]`` (arguments checked by the dispatcher)."""
    dk, end = k.shape[-1], context.seq_end
    kv = all_gather_sequence(torch.cat([k, v], -1), context, dtype=torch.float32)
    keys = kv[:, :end]
    k_pos = torch.arange(end, device=q.device)
    mask = doc_causal_mask(context.local_doc_ids, query_positions(context, q.device),
                           context.doc_ids[:, :end], k_pos)  # fmt: skip
    out = attend(q, [KeyPart(keys[..., :dk], keys[..., dk:], mask)], scale)
    return with_anchors(out, context, kv)
