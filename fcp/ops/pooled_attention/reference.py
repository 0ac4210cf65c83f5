"""The definitions of :mod:`fcp.ops.pooled_attention` (float64, per document and per query; tests
only), from global tensors and the doc-id map, with no slots and no ranks."""

from __future__ import annotations

import torch

from fcp.layout import PAD_DOC_ID, position_ids_from_doc_ids

__all__ = ["gated_pools_reference", "pool_select_reference", "pooled_window_attention_reference"]


def gated_pools_reference(kv, gate, doc_ids, ratio, overlap=False) -> dict:
    """``{(row, global end position): (pooled [D] float64, first document position)}`` for every
    complete pool of every document."""
    kv, gate = kv.double(), gate.double()
    pos = position_ids_from_doc_ids(doc_ids)
    dim = kv.shape[-1] // 2 if overlap else kv.shape[-1]
    out = {}
    for b in range(doc_ids.shape[0]):
        for e in range(doc_ids.shape[1]):
            if doc_ids[b, e] == PAD_DOC_ID or (int(pos[b, e]) + 1) % ratio:
                continue
            cur = range(e - ratio + 1, e + 1)
            rows = [(kv[b, s, dim:] if overlap else kv[b, s], gate[b, s, dim:] if overlap
                     else gate[b, s]) for s in cur]  # fmt: skip
            if overlap and int(pos[b, e]) + 1 > ratio:  # pool j > 0: the previous pool's Ca rows
                rows = [(kv[b, s, :dim], gate[b, s, :dim]) for s in range(e - 2 * ratio + 1,
                                                                          e - ratio + 1)] + rows
            k = torch.stack([r[0] for r in rows])
            w = torch.stack([r[1] for r in rows]).softmax(0)
            out[(b, e)] = ((k * w).sum(0), int(pos[b, e]) - ratio + 1)
    return out


def _visible(doc_ids, b, t, ends):
    return [e for e in ends if doc_ids[b, e] == doc_ids[b, t] != PAD_DOC_ID and e <= t]


def pool_select_reference(index_q, keys: dict, head_weights, doc_ids, topk, scale) -> list:
    """``[[set of end positions] per query] per row``: the ``topk`` best visible pools by
    ``sum_h w_h relu(scale q_h . k)`` (equal scores: the earlier pool). ``keys``: ``{(row,
    end): key [Di]}``."""
    out = []
    for b in range(doc_ids.shape[0]):
        ends = sorted(e for (r, e) in keys if r == b)
        row = []
        for t in range(doc_ids.shape[1]):
            vis = _visible(doc_ids, b, t, ends)
            q, w = index_q[b, t].double(), head_weights[b, t].double()
            score = {e: float((w * torch.relu(scale * (q @ keys[(b, e)].double()))).sum())
                     for e in vis}  # fmt: skip
            row.append(set(sorted(vis, key=lambda e: (-score[e], e))[:topk]))
        out.append(row)
    return out


def pooled_window_attention_reference(q, kv, pooled: dict, doc_ids, window, scale=None,
                                      sinks=None, selected=None):  # fmt: skip
    """float64 ``[B, S, H, D]``: one softmax per query over the window keys of its document, its
    visible pools (``pooled``: ``{(row, end): vector}``; only those in ``selected[b][t]``, a set
    of end positions, when given) and the sinks ``[H]``; pad queries give zeros."""
    q, kv = q.double(), kv.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros_like(q)
    for b in range(doc_ids.shape[0]):
        ends = sorted(e for (r, e) in pooled if r == b)
        for t in range(doc_ids.shape[1]):
            if doc_ids[b, t] == PAD_DOC_ID:
                continue
            keys = [kv[b, s] for s in range(max(0, t - window + 1), t + 1)
                    if doc_ids[b, s] == doc_ids[b, t]]  # fmt: skip
            vis = _visible(doc_ids, b, t, ends)
            if selected is not None:
                vis = [e for e in vis if e in selected[b][t]]
            keys += [pooled[(b, e)].double() for e in vis]
            k = torch.stack(keys)  # [n, D]
            for h in range(q.shape[2]):
                logits = k @ q[b, t, h] * scale
                if sinks is not None:
                    logits = torch.cat([logits, sinks[h].double().reshape(1)])
                p = logits.softmax(0)[: len(keys)]
                out[b, t, h] = p @ k
    return out
