"""Relative-bias attention, the definition: query ``t`` attends to the keys ``s <= t`` of its own
(real) document (and ``t - s < window``) with scores ``scale * q_t . k_s + bias[t, h, t - s]``
(no bias at distances ``>= E``); pad queries give zeros."""

from __future__ import annotations

import torch

from fcp.ops.kit.loops import prepare

__all__ = ["relative_attention_reference"]


def relative_attention_reference(q, k, v, bias, doc_ids, scale=None, *, window=None,
                                 sinks=None) -> torch.Tensor:  # fmt: skip
    """float64 ``[batch, seq, heads, Dv]`` from global ``q [b, seq, H, D]``, ``k``/``v``
    ``[b, seq, Hkv, D|Dv]``, ``bias [b, seq, H, E]``, ``doc_ids [b, seq]`` and ``sinks``
    (broadcastable to ``[b, seq, H]``), one query at a time (tests only)."""
    q, k, v, scale = prepare(q, k, v, scale)
    bias = bias.double()
    extent = bias.shape[-1]
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    sinks = None if sinks is None else sinks.double().expand(*q.shape[:3])
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            doc = doc_ids[b]
            if doc[t] == 0:
                continue
            first = 0 if window is None else max(0, t - window + 1)
            keys = [s for s in range(first, t + 1) if doc[s] == doc[t]]
            scores = torch.stack([torch.einsum("hd,hd->h", q[b, t], k[b, s]) * scale
                                  + (bias[b, t, :, t - s] if t - s < extent else 0.0)
                                  for s in keys], -1)  # [H, n] fmt: skip
            if sinks is not None:
                scores = torch.cat([scores, sinks[b, t][:, None]], -1)
            p = torch.softmax(scores, -1)[:, : len(keys)]
            out[b, t] = torch.einsum("hn,nhd->hd", p, torch.stack([v[b, s] for s in keys]))
    return out
