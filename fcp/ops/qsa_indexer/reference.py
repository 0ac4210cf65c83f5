"""Qwen3.8-Flash-Next's QSA selection, the definition, per document (tests only).

NeMo AutoModel's ``qsa.py`` (``Qwen3_8_FlashNextQSAIndexer`` + ``select_qsa_token_ids``) is the
definition; for one document with tokens ``t = 0 .. n-1`` (document-local positions, the RoPE
tables taken at those positions), block ratio ``c``, budget ``B`` tokens, ``K = B // c``::

    q_t      = RoPE_t( RMSNorm_q(q_raw_t) )                                   [Hi, Di]
    kbar_p   = mean_fp32(k_raw_{pc} .. k_raw_{pc+c-1}), cast to k_raw's dtype  (complete blocks)
    k_p      = RoPE_{pc}( RMSNorm_k(kbar_p) )        # RoPE at the block's FIRST token
    V_t      = (t + 1) // c                          # visible blocks: block p ends at or before t
    V_t <= K : blocks = 0 .. V_t-1, ascending, not scored   (t < (K+1)c - 1: causal attention)
    V_t >  K : blocks = the K highest of s_p = sum_h relu(q_t,h . k_p) / sqrt(Di)  (fp32),
               by descending score
    row(t)   = tokens of each block (ascending) | tail V_t*c .. t | -1 up to B + c - 1

``RMSNorm`` is Qwen3-Next's zero-centred one: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32,
cast back to ``x``'s dtype; ``RoPE`` rotates the first ``2 * cos.shape[-1]`` dims by halves
(NeoX ``rotate_half``, arithmetic in ``x``'s dtype) and passes the rest through.

Tie rule (fcp's; NeMo's ``torch.topk`` leaves it unspecified): a higher score first, equal
scores to the earlier block. A block scores exactly 0 whenever every head's dot product is
``<= 0`` (~1/16 of blocks for random data), so ties at the cutoff are real. Ids are **global**
(document start + local id); pad queries get an all ``-1`` row; no gradient.

:func:`qsa_indexer_reference` evaluates this one query at a time in float64 (tests only), with
the per-token pieces of :mod:`fcp.ops.kit.norms`.
"""

from __future__ import annotations

import math

import torch

from fcp.ops.kit.norms import rotate_half_rope, zero_centered_rms_norm
from fcp.ops.kit.loops import real_queries
from fcp.ops.kit.pools import rank_pools_reference

__all__ = ["qsa_indexer_reference"]


def qsa_indexer_reference(
    index_q, index_k, q_norm_weight, k_norm_weight, cos, sin, doc_ids, *, budget, ratio,
    eps=1e-6, tol=1e-4,
):  # fmt: skip
    """``(indices, near_tie, exact_tie)`` from global tensors, one query at a time, float64.

    ``cos``/``sin`` ``[batch, seq, R/2]`` at each token's document-local position. Ties as in
    :func:`~fcp.ops.kit.pools.rank_pools_reference` (dense-phase rows have none).
    """
    index_q, index_k, q_norm_weight, k_norm_weight, cos, sin = (
        t.detach().double() for t in (index_q, index_k, q_norm_weight, k_norm_weight, cos, sin)
    )
    q = rotate_half_rope(
        zero_centered_rms_norm(index_q, q_norm_weight, eps), cos[:, :, None], sin[:, :, None]
    )
    k_raw = index_k
    batch, seq = doc_ids.shape
    k_blocks, di = budget // ratio, q.shape[-1]
    out = torch.full((batch, seq, budget + ratio - 1), -1, dtype=torch.int64)
    near = torch.zeros(batch, seq, dtype=torch.bool)
    exact = torch.zeros(batch, seq, dtype=torch.bool)
    for b, t, doc, start in real_queries(doc_ids):
        visible = (t - start + 1) // ratio
        if visible <= k_blocks:
            chosen = list(range(visible))
        else:
            scores, robust = [], []
            for p in range(visible):
                first = start + p * ratio
                kbar = k_raw[b, first : first + ratio].mean(0)
                kbar = zero_centered_rms_norm(kbar, k_norm_weight, eps)
                kp = rotate_half_rope(kbar, cos[b, first], sin[b, first])
                dots = q[b, t] @ kp  # [Hi]
                scores.append(float(torch.relu(dots).sum()) / math.sqrt(di))
                robust.append(bool(((dots < -tol) | (dots == 0)).all()))
            ranked = rank_pools_reference(scores, robust, k_blocks, tol)
            chosen, near[b, t], exact[b, t] = ranked
        row = [start + p * ratio + r for p in chosen for r in range(ratio)]
        row += list(range(start + visible * ratio, t + 1))
        out[b, t, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out, near, exact
