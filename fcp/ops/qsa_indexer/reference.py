"""Qwen3.8-Flash-Next's QSA selection, the definition, per document, and the argument rules.

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

:func:`qsa_indexer_reference` evaluates this one query at a time in float64 (tests only);
:func:`zero_centered_rms_norm`, :func:`rotate_half_rope` and :func:`rope_tables` are the
per-token pieces in the model's dtype (the operator uses them too).
"""

from __future__ import annotations

import math

import torch

from fcp.layout import PAD_DOC_ID
from fcp.ops.doc_pools import rank_pools_reference

__all__ = [
    "check_qsa_inputs",
    "qsa_indexer_reference",
    "qsa_width",
    "rope_tables",
    "rotate_half_rope",
    "zero_centered_rms_norm",
]


def qsa_width(budget: int, ratio: int) -> int:
    """Row width ``budget + ratio - 1``."""
    return budget + ratio - 1


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` over the last axis, in fp32, cast back to
    ``x``'s dtype (Qwen3-Next's ``RMSNorm``; fp64 stays fp64)."""
    xf = x.float() if x.dtype != torch.float64 else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.to(y.dtype))).to(x.dtype)


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotary embedding of the first ``R = 2 * cos.shape[-1]`` dims of ``x [..., D]``;
    ``cos``/``sin`` ``[..., R/2]`` broadcast against ``x[..., :R/2]`` and are cast to ``x``'s
    dtype; the arithmetic runs in ``x``'s dtype; dims ``R..D`` pass through."""
    half = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)


def rope_tables(
    positions: torch.Tensor, rotary_dim: int, theta: float = 10000.0, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[*positions.shape, rotary_dim // 2]``: angles ``pos * theta **
    (-2i / rotary_dim)`` in fp32, cast to ``dtype`` (NeMo's ``freqs_cis`` is ``cat(cos, sin)``).
    Pass document-local positions (``PackedContext.local_position_ids``)."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / (theta ** (exps / rotary_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def check_qsa_inputs(name, index_q, index_k, q_norm_weight, k_norm_weight, cos, sin,
                     batch, local, budget, ratio) -> None:  # fmt: skip
    """Shapes of :func:`fcp.ops.qsa_indexer.qsa_indexer`'s arguments (``ValueError``)."""
    for what, value in (("ratio", ratio), ("budget", budget)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {what} must be a positive int, got {value!r}")
    if budget % ratio:
        raise ValueError(f"{name}: budget={budget} must be a multiple of ratio={ratio}")
    tensors = (("index_q", index_q), ("index_k", index_k), ("q_norm_weight", q_norm_weight),
               ("k_norm_weight", k_norm_weight), ("cos", cos), ("sin", sin))  # fmt: skip
    for what, t in tensors:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            kind = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {what} must be a floating-point tensor, got {kind}")
    if index_q.dim() != 4 or tuple(index_q.shape[:2]) != (batch, local):
        raise ValueError(
            f"{name}: index_q must be [batch, local_seq, index_heads, Di] = "
            f"[{batch}, {local}, ., .], got {tuple(index_q.shape)}"
        )
    di = index_q.shape[3]
    if cos.dim() != 3 or tuple(cos.shape[:2]) != (batch, local) or cos.shape != sin.shape:
        raise ValueError(
            f"{name}: cos and sin must both be [batch={batch}, local_seq={local}, rotary/2], "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if not 1 <= 2 * cos.shape[2] <= di:
        raise ValueError(f"{name}: rotary dim 2 * {cos.shape[2]} must be in [2, Di={di}]")
    for what, t, shape in (("index_k", index_k, (batch, local, di)),
                           ("q_norm_weight", q_norm_weight, (di,)),
                           ("k_norm_weight", k_norm_weight, (di,))):  # fmt: skip
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: {what} must have shape {list(shape)}, got {tuple(t.shape)}")


def qsa_indexer_reference(
    index_q, index_k, q_norm_weight, k_norm_weight, cos, sin, doc_ids, *, budget, ratio,
    eps=1e-6, tol=1e-4,
):  # fmt: skip
    """``(indices, near_tie, exact_tie)`` from global tensors, one query at a time, float64.

    ``cos``/``sin`` ``[batch, seq, R/2]`` at each token's document-local position. Ties as in
    :func:`~fcp.ops.doc_pools.rank_pools_reference` (dense-phase rows have none).
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
    for b in range(batch):
        doc = doc_ids[b].tolist()
        for t in range(seq):
            if doc[t] == PAD_DOC_ID:
                continue
            start = doc.index(doc[t])
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
