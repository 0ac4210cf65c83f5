"""Compressed (block-mean) attention with an exact sliding window, exact under contiguous CP.

Keys and values are compressed by averaging each block of ``ratio`` consecutive global positions
``[b*ratio, (b+1)*ratio)``. Query ``t`` attends, in **one** softmax, to

(a) every compressed block whose tokens all belong to ``doc(t)`` and that ends before ``t``
    (``(b+1)*ratio <= t``), and
(b) the exact keys ``s`` of its own document with ``t - window < s <= t``.

A block mixing two documents (or a document and padding) is never visible, so no compressed key
carries information across documents. Every block ends strictly before its queries, so nothing
from the future leaks either.

CP: the local length must be a multiple of ``ratio`` (shards then hold whole blocks). Each rank
compresses its own blocks, all-gathers only the compressed K/V (``1/ratio`` of the tokens) and
fetches the ``window - 1`` exact tokens before its interval with :func:`fcp.comm.left_halo`.
Without CP any length works: a trailing partial block is never visible (it cannot end before a
query), so it is dropped.

Cost: ``O(local_seq * (band / ratio + window))`` scores per head (``band``: the context's bound
on document lengths); the window is gathered with ``unfold`` (a static ``[batch, local_seq,
window]`` view), not a dense ``local x global`` mask.

* :mod:`.reference` - the definition (a float64 per-query loop; tests only);
* :mod:`.blocks` - what both backends share: block means, their all-gather, the window halo;
* :mod:`.dense` - ``backend="dense"`` (every device); :mod:`.flex` - ``backend="flex"`` (CUDA).

:func:`compressed_attention` is the only dispatcher.
"""

from __future__ import annotations

import torch

from fcp.checks import check_positive_int
from fcp.context import PackedContext, check_context
from fcp.ops.compressed.dense import compressed_dense
from fcp.ops.compressed.flex import compressed_flex
from fcp.ops.kit.attention import SOFTMAX_BACKENDS, attention_backend, check_qkv
from fcp.ops.kit.common import autocast_off, default_scale, finite_or_zero, zero_nonfinite_grad

__all__ = ["BACKENDS", "compressed_attention"]

#: ``"dense"``: masked fp32 softmax, every device. ``"flex"``: FlexAttention (CUDA default).
BACKENDS = SOFTMAX_BACKENDS
_RUN = {"dense": compressed_dense, "flex": compressed_flex}


def compressed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PackedContext,
                         ratio: int = 4, window: int | None = None, scale: float | None = None, *,
                         query_chunk: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Attention over same-document compressed blocks plus an exact local window.

    Args:
        q, k, v: ``[batch, local_seq, heads | kv_heads, D]`` as in
            :func:`~fcp.ops.doc_causal.doc_causal_attention` (GQA allowed).
        ctx: the rank's :class:`~fcp.context.PackedContext`.
        ratio: tokens per compressed block.
        window: exact-key window (``t - window < s <= t``), default ``ratio``; ``>= 1``.
        scale: softmax scale, default ``D ** -0.5``.
        query_chunk: ``"dense"``: queries processed at a time (as in
            :func:`~fcp.ops.doc_causal.doc_causal_attention`; results do not depend on it,
            bitwise); ``"flex"`` ignores it.
        backend: ``"auto"`` (``"flex"`` on CUDA, ``"dense"`` elsewhere), ``"dense"`` or
            ``"flex"``.

    Returns:
        ``[batch, local_seq, heads, Dv]`` in ``q``'s dtype; pad queries give zeros.

    Raises:
        ValueError: under CP when ``local_seq`` is not a multiple of ``ratio``.

    Example (``ratio=2, window=1``, one document of 5 tokens): token 4 sees the block means of
    positions ``[0, 2)`` and ``[2, 4)`` and its own exact key; token 3 sees block ``[0, 2)`` and
    itself (block ``[2, 4)`` ends after it).
    """
    name = "compressed_attention"
    check_context(ctx, fn=name)
    check_qkv(name, q, k, v, ctx)
    ratio = check_positive_int(ratio, "ratio", fn=name)
    window = ratio if window is None else check_positive_int(window, "window", fn=name)
    backend = attention_backend(name, backend, q)
    scale = default_scale(q.shape[-1], scale)
    local = ctx.local_seq_len
    if ctx.cp_enabled and local % ratio:
        raise ValueError(
            f"{name}: under CP the local sequence length {local} must be a multiple of "
            f"ratio={ratio} (pad the global length to a multiple of cp_size * ratio)"
        )
    if query_chunk is not None:
        query_chunk = check_positive_int(query_chunk, "query_chunk", fn=name)
    q, k, v = finite_or_zero(q), finite_or_zero(k), finite_or_zero(v)
    with autocast_off(q.device):
        out = _RUN[backend](q, k, v, ctx, ratio, window, scale, query_chunk)
    return zero_nonfinite_grad(out)
