"""Pooled-key sparse attention, the definition (see :mod:`fcp.ops.attention.sparse`)."""

from __future__ import annotations

import torch

from fcp.ops.attention.loops import attend_keys, prepare

__all__ = ["sparse_selection_reference", "sparse_attention_reference"]


def sparse_selection_reference(index_q, index_k, index_weights, doc_ids, block, topk):
    """``{(row, query): (selected blocks, ambiguous)}`` straight from the definition: keys pooled
    over the block's tokens of ``doc(t)``; candidates are earlier blocks holding ``doc(t)``; ties
    go to the earlier block. ``ambiguous``: the top-k boundary is within float32 noise."""
    iq, ik, w = index_q.double(), index_k.double(), index_weights.double()
    batch, seq = doc_ids.shape
    out = {}
    for b in range(batch):
        doc = doc_ids[b].tolist()
        for t in range(seq):
            cands = []
            for blk in range(t // block if doc[t] else 0):
                toks = [s for s in range(blk * block, (blk + 1) * block) if doc[s] == doc[t]]
                if toks:
                    pooled = torch.stack([ik[b, s] for s in toks]).mean(0)
                    args = iq[b, t] @ pooled  # [index_heads]
                    cands.append((float((w[b, t] * torch.relu(args)).sum()), blk, args))
            cands.sort(key=lambda c: (-c[0], c[1]))
            ambiguous = False
            if len(cands) > topk:
                (s0, _, a0), (s1, _, a1) = cands[topk - 1], cands[topk]
                exact_zero_tie = s0 == s1 == 0 and bool((a0 < -1e-4).all() & (a1 < -1e-4).all())
                ambiguous = abs(s0 - s1) < 1e-4 and not exact_zero_tie
            out[b, t] = ([c[1] for c in cands[:topk]], ambiguous)
    return out


def sparse_attention_reference(
    q, k, v, index_q, index_k, index_weights, doc_ids, block=4, topk=16, scale=None
):
    """``(float64 output [batch, seq, heads, Dv], ambiguous)`` from global tensors (tests)."""
    sel = sparse_selection_reference(index_q, index_k, index_weights, doc_ids, block, topk)
    q, k, v, scale = prepare(q, k, v, scale)
    batch, seq = doc_ids.shape
    rows, ambiguous = [], False
    for b in range(batch):
        doc = doc_ids[b].tolist()
        for t in range(seq):
            blocks, amb = sel[b, t]
            ambiguous |= amb
            keys = [
                s
                for blk in sorted(blocks + [t // block])
                for s in range(blk * block, min(seq, (blk + 1) * block))
                if doc[t] != 0 and doc[s] == doc[t] and s <= t
            ]
            rows.append(attend_keys(q[b, t], k[b], v[b], keys, scale))
    return torch.stack(rows).view(batch, seq, *rows[0].shape), ambiguous
