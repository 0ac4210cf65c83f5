"""Compressed attention's ``"dense"`` backend (every device): one softmax over the query's exact
window (a per-query key part, ``unfold``) and the visible block means (shared keys, banded:
:mod:`fcp.ops.kit.softmax`).

Guarantees: masked keys get probability exactly 0, so documents are bitwise independent; fp32
softmax (fp64 for fp64 inputs); deterministic, and bitwise independent of ``ctx.band`` and
of ``query_chunk``; static shapes, no host sync. With long documents under CP the queries are
balanced across ranks (:mod:`fcp.ops.kit.balance`), bitwise the same outputs. Cost: ``O(local x (band / ratio + window))``
scores per head.
"""

from __future__ import annotations

import torch

from fcp.comm import send_pieces
from fcp.context import PackedContext
from fcp.ops.compressed.blocks import compressed_keys
from fcp.ops.kit.attention import with_anchors
from fcp.ops.kit.balance import attention_plan
from fcp.ops.kit.masks import doc_ids_window, full_block_doc_ids, same_doc
from fcp.ops.kit.softmax import Window, banded_attention

__all__ = ["compressed_dense"]


def compressed_dense(q, k, v, ctx: PackedContext, ratio: int, window: int, scale: float,
                     query_chunk: int | None = None):
    """``[batch, local_seq, heads, Dv]`` (arguments checked by the dispatcher). Long
    documents: the queries of :func:`~fcp.ops.kit.balance.attention_plan`, each moved query
    with its exact window (the piece's tokens and the ``window - 1`` before it)."""
    dk = k.shape[-1]
    keys = compressed_keys(k, v, ctx, ratio, window)
    plan = attention_plan(ctx, ratio)
    if not plan.moves:
        out = _attend(q, keys.ext, keys.gathered, ctx, ctx.seq_start, ctx.local_seq_len, dk,
                      ratio, window, scale, query_chunk)  # fmt: skip
        return with_anchors(out, ctx, keys.gathered, keys.halo)
    n, piece, h = len(plan.owners) // ctx.cp_size, plan.piece, window - 1
    # each piece travels with the window - 1 tokens before it (from ext: halo, then shard)
    ext = torch.cat([keys.ext[:, j * piece : (j + 1) * piece + h] for j in range(n)], 1)
    q_in, ext_in = send_pieces(q, ctx, plan.owners), send_pieces(ext, ctx, plan.owners)
    outs, done = [], 0
    for start, length in plan.runs(ctx.cp_rank):
        first = done // piece  # the run's first received piece; later ones drop their halo
        parts = [ext_in[:, first * (piece + h) : (first + 1) * (piece + h)]]
        parts += [ext_in[:, i * (piece + h) + h : (i + 1) * (piece + h)]
                  for i in range(first + 1, first + length // piece)]  # fmt: skip
        outs.append(_attend(q_in[:, done : done + length], torch.cat(parts, 1), keys.gathered,
                            ctx, start, length, dk, ratio, window, scale, query_chunk))
        done += length
    out = send_pieces(torch.cat(outs, 1), ctx, plan.owners, back=True)
    return with_anchors(out, ctx, keys.gathered, keys.halo)


def _attend(q, ext, gathered, ctx: PackedContext, start: int, n: int, dk: int, ratio: int,
            window: int, scale: float, query_chunk):
    """Queries ``[start, start + n)`` (``q [b, n, H, D]``) over the visible block means and
    their exact windows (``ext [b, window - 1 + n, hkv, D + Dv]``: the tokens from ``start -
    window + 1``)."""
    nc = min(max(start + n - 1, 0) // ratio, gathered.shape[1])  # blocks ending before the end
    win = ext.unfold(1, window, 1).transpose(-1, -2)  # [b, n, hkv, window, dk + dv]
    doc_q = ctx.doc_ids[:, start : start + n]
    mask_w = same_doc(doc_q, doc_ids_window(ctx.doc_ids, start - (window - 1),
                                            n + window - 1).unfold(1, window, 1))  # fmt: skip
    return banded_attention(q, gathered[:, :nc], dk, full_block_doc_ids(ctx.doc_ids, ratio, nc),
                            (torch.arange(nc, device=q.device) + 1) * ratio, doc_q, start,
                            ctx.key_band, scale, stride=ratio, window=Window(win, mask_w),
                            chunk=query_chunk)  # fmt: skip
