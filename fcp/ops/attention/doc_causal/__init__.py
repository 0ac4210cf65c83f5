"""Document-causal softmax attention, exact under contiguous CP.

Query ``t`` sees key ``s`` iff ``doc(s) == doc(t) != 0`` and ``s <= t`` (global positions).
Under CP every rank all-gathers K and V (one collective on ``cat([k, v], -1)``) and masks with the
replicated doc-id map; keys after the rank's interval can never be seen, so only the prefix
``[0, seq_end)`` of the gathered sequence is scored.

:mod:`.reference` is the definition (a float64 per-query loop); :func:`doc_causal_attention` is
the only dispatcher (``backend="dense"`` or ``"flex"``, :data:`~fcp.ops.attention.checks.BACKENDS`).
"""

from __future__ import annotations

import torch

from fcp.comm import all_gather_sequence
from fcp.context import PackedContext
from fcp.ops.attention import flex
from fcp.ops.attention.checks import attention_backend, check_qkv, query_positions, with_anchors
from fcp.ops.attention.dense import KeyPart, attend
from fcp.ops.attention.doc_causal.reference import doc_causal_attention_reference
from fcp.ops.attention.masks import doc_causal_mask
from fcp.ops.common import default_scale, finite_or_zero, zero_nonfinite_grad

__all__ = ["doc_causal_attention", "doc_causal_attention_reference"]


def doc_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context: PackedContext,
    scale: float | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention within documents.

    Args:
        q: ``[batch, local_seq, heads, D]``, this rank's queries.
        k: ``[batch, local_seq, kv_heads, D]``; ``heads`` is a multiple of ``kv_heads`` (GQA:
            query head ``h`` uses kv head ``h // (heads // kv_heads)``).
        v: ``[batch, local_seq, kv_heads, Dv]``.
        context: the rank's :class:`~fcp.context.PackedContext`.
        scale: softmax scale, default ``D ** -0.5``.
        backend: ``"auto"`` (``"flex"`` on CUDA, ``"dense"`` elsewhere), ``"dense"`` or
            ``"flex"``.

    Returns:
        ``[batch, local_seq, heads, Dv]`` in ``q``'s dtype (softmax in fp32). Pad queries (doc id
        0) get zeros and no gradient flows from them. Non-finite values stay in their document
        (:mod:`fcp.ops.common`).

    Example: ``doc_ids = [[1, 1, 2]]``: token 1 averages tokens 0-1 by softmax weight; token 2
    (document 2) sees only itself, so its output is ``v[2]``.
    """
    check_qkv("doc_causal_attention", q, k, v, context)
    backend = attention_backend("doc_causal_attention", backend, q)
    scale = default_scale(q.shape[-1], scale)
    q, k, v = finite_or_zero(q), finite_or_zero(k), finite_or_zero(v)
    dk, start, end = k.shape[-1], context.seq_start, context.seq_end
    kv = all_gather_sequence(torch.cat([k, v], -1), context)[:, :end]
    doc_q, doc_k = context.local_doc_ids, context.doc_ids[:, :end]
    k_pos = torch.arange(end, device=q.device)
    if backend == "flex":
        hi = torch.full_like(k_pos, flex.UNBOUNDED)
        lo = k_pos - start  # local query index from which key s is visible
        out = flex.flex_attend(q, kv[..., :dk], kv[..., dk:], doc_q, doc_k, lo, hi, scale)
    else:
        mask = doc_causal_mask(doc_q, query_positions(context, q.device), doc_k, k_pos)
        out = attend(q, [KeyPart(kv[..., :dk], kv[..., dk:], mask)], scale)
    return zero_nonfinite_grad(with_anchors(out, context, kv))
