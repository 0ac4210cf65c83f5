"""Index attention, the definition (tests only).

Query ``t`` (global position, head ``h``) attends to the *set* of selected tokens

    S(t) = { s in indices[t] :  0 <= s <= t  and  doc(s) == doc(t) != 0 }

(ids outside ``[start of doc(t), t]`` or equal to -1 are dropped; repeats count once) with one
fp32 softmax::

    o[t, h] = sum_{s in S(t)} softmax_s(scale * q[t, h] . k[s, h // G]) v[s, h // G]

``G = heads // kv_heads`` (GQA; MLA with expanded per-head keys is ``kv_heads == heads``).
``S(t)`` empty gives ``o[t] = 0`` and no gradient (as NeMo's QSA oracle and SDPA's safe softmax
do; transformers' eager path would average every value instead). No implicit diagonal or causal
term: a query reads exactly its selected tokens.

:func:`index_attention_reference` evaluates this one query at a time in float64 (tests only).
"""

from __future__ import annotations

import torch

from fcp.layout import PAD_DOC_ID

__all__ = ["index_attention_reference", "selected_set"]


def selected_set(indices_row: list[int], doc: list[int], t: int) -> list[int]:
    """``S(t)`` of one query, ascending: ``indices_row`` filtered by the definition."""
    if doc[t] == PAD_DOC_ID:
        return []
    return sorted({s for s in indices_row if 0 <= s <= t and doc[s] == doc[t]})


def index_attention_reference(q, k, v, indices, doc_ids, scale=None) -> torch.Tensor:
    """float64 ``[batch, seq, heads, Dv]`` from global ``q [b, seq, H, D]``, ``k``/``v``
    ``[b, seq, Hkv, D|Dv]``, ``indices [b, seq, W]`` and ``doc_ids [b, seq]`` (one process)."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    batch, seq = doc_ids.shape
    rows = []
    for b in range(batch):
        doc = doc_ids[b].tolist()
        for t in range(seq):
            keys = selected_set(indices[b, t].tolist(), doc, t)
            if not keys:  # zeros still attached to q and v, so autograd always has a graph
                rows.append(v[b, 0] * 0.0 + q[b, t].sum() * 0.0)
                continue
            s = torch.einsum("hd,nhd->hn", q[b, t], k[b, keys]) * scale
            rows.append(torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v[b, keys]))
    return torch.stack(rows).view(batch, seq, *rows[0].shape)
