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

Cost: ``O(local_seq * (seq_end / ratio + window))`` scores per head; the window is gathered with
``unfold`` (a static ``[batch, local_seq, window]`` view), not a dense ``local x global`` mask.
"""

from __future__ import annotations

import torch

from fcp.comm import all_gather_sequence, left_halo
from fcp.context import PackedContext
from fcp.ops.attention import flex
from fcp.ops.attention.checks import (
    attention_backend,
    check_qkv,
    positive_int,
    query_positions,
    with_anchors,
)
from fcp.ops.attention.dense import KeyPart, attend
from fcp.ops.attention.compressed.reference import compressed_attention_reference
from fcp.ops.attention.masks import doc_ids_window, full_block_doc_ids, same_doc
from fcp.ops.common import default_scale, finite_or_zero, zero_nonfinite_grad

__all__ = ["compressed_attention", "compressed_attention_reference", "compress_blocks"]


def compress_blocks(x: torch.Tensor, ratio: int) -> torch.Tensor:
    """``[batch, n, ...] -> [batch, n // ratio, ...]``: mean of each full block (fp32 sum, result
    in ``x``'s dtype); a trailing partial block is dropped."""
    nb = x.shape[1] // ratio
    blocks = x[:, : nb * ratio].unflatten(1, (nb, ratio))
    return blocks.float().mean(2).to(x.dtype)


def compressed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context: PackedContext,
    ratio: int = 4,
    window: int | None = None,
    scale: float | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over same-document compressed blocks plus an exact local window.

    Args:
        q, k, v: ``[batch, local_seq, heads | kv_heads, D]`` as in
            :func:`~fcp.ops.attention.doc_causal_attention` (GQA allowed).
        context: the rank's :class:`~fcp.context.PackedContext`.
        ratio: tokens per compressed block.
        window: exact-key window (``t - window < s <= t``), default ``ratio``; ``>= 1``.
        scale: softmax scale, default ``D ** -0.5``.
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
    check_qkv(name, q, k, v, context)
    ratio = positive_int(name, "ratio", ratio)
    window = ratio if window is None else positive_int(name, "window", window)
    backend = attention_backend(name, backend, q)
    scale = default_scale(q.shape[-1], scale)
    q, k, v = finite_or_zero(q), finite_or_zero(k), finite_or_zero(v)
    local = context.local_seq_len
    if context.cp_enabled and local % ratio:
        raise ValueError(
            f"{name}: under CP the local sequence length {local} must be a multiple of "
            f"ratio={ratio} (pad the global length to a multiple of cp_size * ratio)"
        )
    dk = k.shape[-1]
    kv = torch.cat([k, v], -1)
    start, end = context.seq_start, context.seq_end
    doc_q = context.local_doc_ids
    t = query_positions(context, q.device)

    # (a) compressed blocks: only blocks ending at or before seq_end - 1 can be visible.
    kvc = all_gather_sequence(compress_blocks(kv, ratio), context)
    nc = min(max(end - 1, 0) // ratio, kvc.shape[1])
    kvc = kvc[:, :nc]
    b = torch.arange(nc, device=q.device)
    block_doc = full_block_doc_ids(context.doc_ids, ratio, nc)

    # (b) exact window: the window - 1 tokens before the shard (halo), then the shard.
    halo = left_halo(kv, context, window - 1)
    ext = torch.cat([halo, kv], 1) if window > 1 else kv
    doc_ext = doc_ids_window(context.doc_ids, start - (window - 1), local + window - 1)

    if backend == "flex":
        j = torch.arange(ext.shape[1], device=q.device)
        keys = torch.cat([kvc, ext], 1)
        lo = torch.cat([(b + 1) * ratio - start, j - (window - 1)])
        hi = torch.cat([torch.full_like(b, flex.UNBOUNDED), j])
        key_doc = torch.cat([block_doc, doc_ext], 1)
        out = flex.flex_attend(q, keys[..., :dk], keys[..., dk:], doc_q, key_doc, lo, hi, scale)
    else:
        mask_c = same_doc(doc_q, block_doc) & ((b[None, :] + 1) * ratio <= t[:, None])[None]
        win = ext.unfold(1, window, 1).transpose(-1, -2)  # [b, local, hkv, window, dk + dv]
        mask_w = same_doc(doc_q, doc_ext.unfold(1, window, 1))  # [b, local, window]
        parts = [
            KeyPart(kvc[..., :dk], kvc[..., dk:], mask_c),
            KeyPart(win[..., :dk], win[..., dk:], mask_w, per_query=True),
        ]
        out = attend(q, parts, scale)
    return zero_nonfinite_grad(with_anchors(out, context, kvc, halo))
