"""GLM-5.3-Flash's DSA k-pool indexer, the definition, per document (tests only).

For one document with tokens ``i = 0 .. n-1`` (document-local), ``kp = kpool``, heads
``h = 0 .. Hi-1`` (transformers' ``Glm5NextTextIndexer``, run on the document alone)::

    pool j          = tokens [j*kp, (j+1)*kp), j < n // kp      (complete pools only)
    pooled key p_j  = sum_r softmax_r(z_{j*kp+r} + ape_r) * k_{j*kp+r}     (per channel)
    score(t, j)     = sum_h w_{t,h} * relu(scale * q_{t,h} . p_j)          (fp32)
    visible(t, j)   = (j+1)*kp - 1 <= t                                    (the pool has ended)
    selected(t)     = the topk // kp visible pools of highest score
                      (fewer visible pools: all of them)
    row(t)          = tokens of each selected pool (ascending), pools by descending score
                      | -1 up to min(topk // kp, n // kp) pools    (transformers' layout)
                      | tail: t's incomplete pool [t - (t+1) % kp + 1 .. t], then -1   (kp-1 slots)
                      | -1 up to W = topk + kp - 1

with ``q = wq_b(q_resid)`` ``[Hi, Di]``, ``k = LayerNorm(wk x)``, ``z = gate x`` (one logit per
channel), ``w = weights_proj(x) * Hi ** -0.5`` and ``scale = Di ** -0.5``: the operator takes
these *projected* tensors. The softmax over the pool runs in fp32 and its probabilities are
cast to ``k``'s dtype before the weighted sum (as transformers does).

Tie rule (fcp's; ``torch.topk`` leaves it unspecified): a higher score first, equal scores to
the earlier pool. Scores tie exactly whenever every head's term is clamped to 0 by the ``relu``,
which is common, so the rule matters. Token ids in the row are **global** (document start +
local id); pad queries get an all ``-1`` row. ``select_tail=False`` drops the tail slots (and
queries before the first complete pool then select nothing). The selection carries no gradient.

:func:`kpool_indexer_reference` evaluates this one query at a time in float64 (tests only).
"""

from __future__ import annotations

import torch

from fcp.ops.kit.loops import real_queries
from fcp.ops.kit.pools import rank_pools_reference

__all__ = ["kpool_indexer_reference"]


def kpool_indexer_reference(
    index_q, index_k, gate_logits, ape, head_weights, doc_ids, *, topk, kpool,
    select_tail=True, scale=None, tol=1e-4,
):  # fmt: skip
    """``(indices, near_tie, exact_tie)`` from global tensors, one query at a time, float64.

    ``indices``: int64 ``[batch, seq, W]`` global ids as the module docstring defines them.
    ``near_tie`` / ``exact_tie``: bool ``[batch, seq]`` from
    :func:`~fcp.ops.kit.pools.rank_pools_reference` (a fp32 implementation may order a
    ``near_tie`` row differently; an ``exact_tie`` row is decided by the tie rule alone).
    """
    iq, ik, z, ap, w = (
        t.detach().double() for t in (index_q, index_k, gate_logits, ape, head_weights)
    )
    scale = iq.shape[-1] ** -0.5 if scale is None else scale
    batch, seq = doc_ids.shape
    k_pools = topk // kpool
    width = topk + (kpool - 1 if select_tail else 0)
    out = torch.full((batch, seq, width), -1, dtype=torch.int64)
    near = torch.zeros(batch, seq, dtype=torch.bool)
    exact = torch.zeros(batch, seq, dtype=torch.bool)
    for b, t, doc, start in real_queries(doc_ids):
        pos = t - start
        scores, robust = [], []
        for j in range((pos + 1) // kpool):  # pools that ended at or before t
            toks = list(range(start + j * kpool, start + (j + 1) * kpool))
            logits = z[b, toks] + ap  # [kp, Di]: a softmax over the pool, per channel
            e = torch.exp(logits - logits.max(0).values)
            prob = e / e.sum(0)
            pooled = (prob * ik[b, toks]).sum(0)
            args = scale * (iq[b, t] @ pooled)  # [Hi]
            scores.append(float((w[b, t] * torch.relu(args)).sum()))
            robust.append(bool(((args < -tol) | (args == 0)).all()))
        chosen, near[b, t], exact[b, t] = rank_pools_reference(scores, robust, k_pools, tol)
        row = [start + j * kpool + r for j in chosen for r in range(kpool)]
        n_doc = doc.count(doc[t])  # the document's length (ids are contiguous runs)
        slots = min(k_pools, n_doc // kpool) if select_tail else k_pools
        row += [-1] * ((slots - len(chosen)) * kpool)
        if select_tail:
            n_tail = (pos + 1) % kpool
            row += list(range(t - n_tail + 1, t + 1)) + [-1] * (kpool - 1 - n_tail)
        out[b, t, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out, near, exact
