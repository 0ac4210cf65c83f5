"""Compressed attention, the definition: query ``t`` attends, in one softmax, to the means of the
full ``ratio``-blocks (global positions ``[b*ratio, (b+1)*ratio)``) that lie in its document and
end at or before ``t``, and to the exact keys of its document in ``(t - window, t]``."""

from __future__ import annotations

import torch

from fcp.ops.kit.loops import empty_row, per_query, prepare, softmax_row

__all__ = ["compressed_attention_reference"]


def compressed_attention_reference(q, k, v, doc_ids, ratio=4, window=None, scale=None):
    """float64 ``[batch, seq, heads, Dv]`` from global tensors, one query at a time (tests)."""
    window = ratio if window is None else window
    q, k, v, scale = prepare(q, k, v, scale)
    seq = doc_ids.shape[1]

    def row(b, t, doc):
        keys, vals = [], []
        if doc[t] != 0:
            for blk in range(seq // ratio):
                toks = range(blk * ratio, (blk + 1) * ratio)
                if all(doc[s] == doc[t] for s in toks) and (blk + 1) * ratio <= t:
                    keys.append(torch.stack([k[b, s] for s in toks]).mean(0))
                    vals.append(torch.stack([v[b, s] for s in toks]).mean(0))
            for s in range(max(0, t - window + 1), t + 1):
                if doc[s] == doc[t]:
                    keys.append(k[b, s])
                    vals.append(v[b, s])
        return softmax_row(q[b, t], keys, vals, scale, empty_row(q[b, t], v[b]))

    return per_query(doc_ids, row)
