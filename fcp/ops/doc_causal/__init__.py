"""Document-causal softmax attention, exact under contiguous CP.

Query ``t`` sees key ``s`` iff ``doc(s) == doc(t) != 0`` and ``s <= t`` (global positions).
Under CP every rank all-gathers K and V (one collective on ``cat([k, v], -1)``) and masks with the
replicated doc-id map; keys after the rank's interval can never be seen, so only the prefix
``[0, seq_end)`` of the gathered sequence is used, and each query block scores only the keys of
the ``ctx.band`` positions before it.

* :mod:`.reference` - the definition (a float64 per-query loop; tests only);
* :mod:`.dense` - ``backend="dense"``: the masked fp32 softmax (every device);
* :mod:`.flex` - ``backend="flex"``: FlexAttention with the same mask (CUDA).

:func:`doc_causal_attention` is the only dispatcher.
"""

from __future__ import annotations

import torch

from fcp.checks import check_positive_int
from fcp.context import PackedContext, check_context
from fcp.ops.doc_causal.dense import doc_causal_dense
from fcp.ops.doc_causal.flex import doc_causal_flex
from fcp.ops.kit.attention import (
    SOFTMAX_BACKENDS,
    attention_backend,
    check_qkv,
    check_sinks_softcap,
)
from fcp.ops.kit.common import autocast_off, default_scale, finite_or_zero, zero_nonfinite_grad

__all__ = ["BACKENDS", "doc_causal_attention"]

#: ``"dense"``: masked fp32 softmax, every device. ``"flex"``: FlexAttention (CUDA default).
BACKENDS = SOFTMAX_BACKENDS
_RUN = {"dense": doc_causal_dense, "flex": doc_causal_flex}


def doc_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PackedContext,
                         scale: float | None = None, *, sinks: torch.Tensor | None = None,
                         softcap: float | None = None, query_chunk: int | None = None,
                         backend: str = "auto") -> torch.Tensor:
    """Causal attention within documents.

    Args:
        q: ``[batch, local_seq, heads, D]``, this rank's queries.
        k: ``[batch, local_seq, kv_heads, D]``; ``heads`` is a multiple of ``kv_heads`` (GQA:
            query head ``h`` uses kv head ``h // (heads // kv_heads)``).
        v: ``[batch, local_seq, kv_heads, Dv]``.
        ctx: the rank's :class:`~fcp.context.PackedContext`.
        scale: softmax scale, default ``D ** -0.5``.
        sinks: attention sinks (gpt-oss): ``[heads]`` or ``[batch, local_seq, heads]`` logits,
            one more term ``exp(sink)`` in each softmax's denominator with a zero value, so a
            query may attend "nowhere"; gradients flow to them. ``None``: none.
        softcap: soft-capping (Gemma 2/3): scores (after ``scale``) become ``softcap *
            tanh(score / softcap)``. ``None``: none.
        query_chunk: ``"dense"``: queries processed at a time (rounded down to blocks of 64;
            default: about 4M elements of scores and keys per chunk). Results do not depend on
            it, bitwise. ``"flex"`` tiles by itself and ignores it.
        backend: ``"auto"`` (``"flex"`` on CUDA, ``"dense"`` elsewhere), ``"dense"`` or
            ``"flex"``.

    Returns:
        ``[batch, local_seq, heads, Dv]`` in ``q``'s dtype (softmax in fp32, fp64 for fp64
        inputs). Pad queries (doc id 0) get zeros and no gradient flows from them. Non-finite
        values stay in their document (:mod:`fcp.ops.kit.common`). Cost: each query block
        scores the keys of the ``ctx.band`` positions before it, not the whole row
        (``"dense"``: bitwise independent of ``ctx.band``; FlexAttention skips masked
        tiles).

    Example: ``doc_ids = [[1, 1, 2]]``: token 1 averages tokens 0-1 by softmax weight; token 2
    (document 2) sees only itself, so its output is ``v[2]``::

        >>> ctx = PackedContext(torch.tensor([[1, 1, 2]]))
        >>> q = k = torch.zeros(1, 3, 1, 1)
        >>> v = torch.tensor([1.0, 3.0, 5.0]).view(1, 3, 1, 1)
        >>> doc_causal_attention(q, k, v, ctx).flatten().tolist()
        [1.0, 2.0, 5.0]
    """
    name = "doc_causal_attention"
    check_context(ctx, fn=name)
    check_qkv(name, q, k, v, ctx)
    sinks, softcap = check_sinks_softcap(name, sinks, softcap, q)
    backend = attention_backend(name, backend, q)
    scale = default_scale(q.shape[-1], scale)
    if query_chunk is not None:
        query_chunk = check_positive_int(query_chunk, "query_chunk", fn=name)
    q, k, v = finite_or_zero(q), finite_or_zero(k), finite_or_zero(v)
    with autocast_off(q.device):
        out = _RUN[backend](q, k, v, ctx, scale, query_chunk, sinks=sinks, softcap=softcap)
    return zero_nonfinite_grad(out)
