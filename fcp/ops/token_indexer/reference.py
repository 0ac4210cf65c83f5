"""The token-level DSA "lightning" indexer, the definition, per document (tests only).

DeepSeek-V3.2's and GLM-5's (transformers' ``GlmMoeDsaIndexer``) indexer selects single tokens.
For one document with tokens ``s = 0 .. n-1`` (document-local), index heads
``h = 0 .. Hi-1``::

    score(t, s)   = sum_h w_{t,h} * relu(scale * q_{t,h} . k_s)       (fp32)
    visible(t, s) = s <= t                                            (same document)
    selected(t)   = the topk visible tokens of highest score
                    (fewer visible tokens: all of them)
    row(t)        = selected tokens by descending score | -1 up to W = topk

with ``q [Hi, Di]`` and ``k [Di]`` the indexer's projections *after* the model's positional
rotation (GLM-5: ``q = rope(wq_b(q_resid))``, ``k = rope(LayerNorm(wk x))`` on the first
``qk_rope_head_dim`` channels, at document-local positions), ``w = weights_proj(x) * Hi ** -0.5``
and ``scale = Di ** -0.5``: the operator takes these *projected, rotated* tensors.

This is exactly :mod:`fcp.ops.kpool_indexer` with pools of one token (``kpool = 1``: a pool's
softmax over one token is 1, so its pooled key is the token's key, whatever the gate and the
positional term; no tail), which is how :mod:`.gathered` computes it.

Tie rule (fcp's; ``torch.topk`` leaves it unspecified): a higher score first, equal scores to
the earlier token. Scores tie exactly whenever every head's term is clamped to 0 by the
``relu``, which is common. transformers masks invisible tokens with ``-inf`` (or the dtype's
minimum) and takes ``topk(min(topk, n))``, so a query with fewer than ``topk`` visible tokens
also "selects" invisible ones, which its causal mask then drops: the attended set is the same.
Token ids in the row are **global** (document start + local id); pad queries get an all ``-1``
row. The selection carries no gradient.

:func:`token_indexer_reference` evaluates this one query at a time in float64 (tests only).
"""

from __future__ import annotations

import torch

from fcp.ops.kit.loops import real_queries
from fcp.ops.kit.pools import rank_pools_reference

__all__ = ["token_indexer_reference"]


def token_indexer_reference(index_q, index_k, head_weights, doc_ids, *, topk, scale=None,
                            tol=1e-4):  # fmt: skip
    """``(indices, near_tie, exact_tie)`` from global tensors, one query at a time, float64.

    ``index_q [batch, seq, Hi, Di]``, ``index_k [batch, seq, Di]``, ``head_weights [batch, seq,
    Hi]``, ``doc_ids [batch, seq]``. ``indices``: int64 ``[batch, seq, topk]`` global ids as the
    module docstring defines them. ``near_tie`` / ``exact_tie``: bool ``[batch, seq]`` from
    :func:`~fcp.ops.kit.pools.rank_pools_reference` (a fp32 implementation may order a
    ``near_tie`` row differently; an ``exact_tie`` row is decided by the tie rule alone).
    """
    iq, ik, w = (t.detach().double() for t in (index_q, index_k, head_weights))
    scale = iq.shape[-1] ** -0.5 if scale is None else scale
    batch, seq = doc_ids.shape
    out = torch.full((batch, seq, topk), -1, dtype=torch.int64)
    near = torch.zeros(batch, seq, dtype=torch.bool)
    exact = torch.zeros(batch, seq, dtype=torch.bool)
    for b, t, _, start in real_queries(doc_ids):
        args = scale * (ik[b, start : t + 1] @ iq[b, t].T)  # [t - start + 1, Hi]
        scores = (torch.relu(args) * w[b, t]).sum(-1).tolist()
        robust = ((args < -tol) | (args == 0)).all(-1).tolist()
        chosen, near[b, t], exact[b, t] = rank_pools_reference(scores, robust, topk, tol)
        row = [start + s for s in chosen]
        out[b, t, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out, near, exact
