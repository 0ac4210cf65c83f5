"""Latent attention, the definition (tests only).

Every token's latent ``c[s]`` expands per head ``h`` to ``[k | v][s, h] = (kv_weight @ c[s] +
kv_bias)[h * (Dk + Dv) : (h + 1) * (Dk + Dv)]``; query ``t`` attends to the *set*

    S(t) = { s in indices[t] :  0 <= s <= t  and  doc(s) == doc(t) != 0 }

with one softmax per head, ``o[t, h] = sum_{s in S(t)} softmax_s(scale * q[t, h] . k[s, h])
v[s, h]``; ``S(t)`` empty gives ``o[t] = 0``. Evaluated in float64 one query at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fcp.context import PackedContext
from fcp.layout import PAD_DOC_ID
from fcp.ops.kit.loops import attend_keys, per_query, reference_doc_ids

__all__ = ["latent_attention_reference"]


def latent_attention_reference(q: torch.Tensor, latent: torch.Tensor, kv_weight: torch.Tensor,
                               indices: torch.Tensor, ctx: PackedContext | torch.Tensor, *,
                               kv_bias: torch.Tensor | None = None,
                               k_rope: torch.Tensor | None = None,
                               scale: float | None = None) -> torch.Tensor:  # fmt: skip
    """float64 ``[batch, seq, heads, Dv]`` from global ``q [b, seq, H, Dk]``, ``latent [b, seq,
    rank]``, ``kv_weight [H * (Dk - R + Dv), rank]``, ``indices [b, seq, W]``, the optional
    shared rotary key ``k_rope [b, seq, R]`` (the last ``R`` channels of every head's key) and a
    single-process context (or the doc-id map) in one process.

    >>> ctx = torch.tensor([[1, 2]])  # two documents: token 1 cannot read token 0
    >>> latent_attention_reference(torch.ones(1, 2, 1, 1), torch.tensor([[[1.0], [2.0]]]),
    ...                            torch.ones(2, 1), torch.tensor([[[0], [0]]]), ctx).flatten()
    tensor([1., 0.], dtype=torch.float64)
    """
    doc_ids = reference_doc_ids(ctx, "latent_attention_reference")
    heads, dk = q.shape[2], q.shape[3]
    bias = None if kv_bias is None else kv_bias.double()
    kv = F.linear(latent.double(), kv_weight.double(), bias).unflatten(-1, (heads, -1))
    nope = dk if k_rope is None else dk - k_rope.shape[-1]
    k, v, q = kv[..., :nope], kv[..., nope:], q.double()
    if k_rope is not None:
        k = torch.cat([k, k_rope.double()[:, :, None].expand(-1, -1, heads, -1)], -1)
    scale = dk**-0.5 if scale is None else scale

    def row(b: int, t: int, doc: list[int]) -> torch.Tensor:
        keys = sorted({s for s in indices[b, t].tolist()
                       if 0 <= s <= t and doc[s] == doc[t] != PAD_DOC_ID})  # fmt: skip
        return attend_keys(q[b, t], k[b], v[b], keys, scale)

    return per_query(doc_ids, row)
