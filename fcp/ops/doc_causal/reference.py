"""Document-causal attention, the definition: query ``t`` attends to the keys ``s <= t`` of its own
(real) document; pad queries give zeros."""

from __future__ import annotations

import torch

from fcp.ops.kit.loops import attend_keys, per_query, prepare

__all__ = ["doc_causal_attention_reference"]


def doc_causal_attention_reference(q, k, v, doc_ids, scale=None) -> torch.Tensor:
    """float64 ``[batch, seq, heads, Dv]`` from global ``q [b, seq, H, D]``, ``k``/``v``
    ``[b, seq, Hkv, D|Dv]`` and ``doc_ids [b, seq]``, one query at a time (tests only)."""
    q, k, v, scale = prepare(q, k, v, scale)

    def row(b, t, doc):
        keys = [s for s in range(t + 1) if doc[t] != 0 and doc[s] == doc[t]]
        return attend_keys(q[b, t], k[b], v[b], keys, scale)

    return per_query(doc_ids, row)
