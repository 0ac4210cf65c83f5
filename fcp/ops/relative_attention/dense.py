"""Relative-bias attention's ``"dense"`` backend: the masked softmax, one chunk of queries at a
time, over the keys the chunk can see (every device).

Keys: with a ``window``, this rank's shard after the ``min(window, band) - 1`` tokens before it
(:func:`fcp.comm.with_left_halo`); without, the all-gathered prefix ``[0, seq_end)`` of the row.
A chunk of queries at global positions ``[t0, t1)`` scores only the keys ``[t0 - reach + 1,
t1)``, ``reach = min(window, band)``: no key further back can share a query's document (or
window). For every scored pair the bias entry of its distance is gathered from the query's
table (``torch.gather``) and added to ``scale * q . k``; invisible pairs become ``-inf``
(``torch.where``, so other documents' values never reach an output, bitwise), the sink joins
the denominator, and the softmax runs in fp32 (fp64 for fp64 inputs) with the row maximum
subtracted. Plain PyTorch ops, each chunk under activation checkpointing (the backward
recomputes its scores: memory ``O(local)`` kept per layer plus one chunk's scores at a time),
static shapes, no host sync.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from fcp.comm import all_gather_sequence, with_left_halo
from fcp.context import PackedContext
from fcp.layout import PAD_DOC_ID
from fcp.ops.kit.attention import with_anchors
from fcp.ops.kit.common import compute_dtype
from fcp.ops.kit.masks import doc_ids_window

__all__ = ["relative_attention_dense"]

#: Default scores per query chunk (elements).
CHUNK_ELEMENTS = 1 << 22


def _keys(k, v, ctx: PackedContext, reach: int, window: int | None):
    """``(kv [b, S, hkv, D + Dv] fp32+, first global position of kv, received part)``."""
    kv = torch.cat([k, v], -1)
    if window is None:  # keys after this rank's queries are never visible: the prefix only
        gathered = all_gather_sequence(kv, ctx, dtype=torch.float32)
        return gathered[:, : ctx.seq_end], 0, gathered
    halo = reach - 1 if ctx.cp_enabled else 0
    keys = with_left_halo(kv, ctx, halo, dtype=torch.float32)
    return keys, ctx.seq_start - halo, keys[:, :halo]


def _chunk(q, keys, bias, sinks, doc_q, doc_k, t0: int, lo: int, scale: float,
           window: int | None, dt: torch.dtype) -> torch.Tensor:
    """``[b, C, H, Dv]`` of the queries at global positions ``t0 ..`` (``q [b, C, H, D]``, ``bias
    [b, C, H, E]``, ``sinks [b, C, H]`` or ``None``, doc ids ``doc_q [b, C]``) over the keys at
    ``lo ..`` (``keys [b, S, hkv, D + Dv]``, doc ids ``doc_k [b, S]``)."""
    b, c, h, d = q.shape
    hkv, extent = keys.shape[2], bias.shape[-1]
    g = h // hkv
    keys = keys.to(dt)
    dist = (torch.arange(t0, t0 + c, device=q.device)[:, None]
            - torch.arange(lo, lo + keys.shape[1], device=q.device)[None, :])  # [C, S] fmt: skip
    seen = dist >= 0 if window is None else (dist >= 0) & (dist < window)
    vis = (doc_q[:, :, None] == doc_k[:, None, :]) & (doc_q != PAD_DOC_ID)[..., None] & seen
    s = torch.einsum("bchgd,bshd->bhgcs", q.to(dt).view(b, c, hkv, g, d),
                     keys[..., :d]) * scale  # [b, hkv, g, C, S] fmt: skip
    table = bias.to(dt).view(b, c, hkv, g, extent).permute(0, 2, 3, 1, 4)
    near = torch.gather(table, -1, dist.clamp(0, extent - 1).expand(*table.shape[:-1], -1))
    s = s + torch.where(dist < extent, near, 0.0)
    s = torch.where(vis[:, None, None], s, float("-inf"))
    m = s.amax(-1)  # [b, hkv, g, C]
    if sinks is not None:
        sink = sinks.to(dt).view(b, c, hkv, g).permute(0, 2, 3, 1)
        m = torch.maximum(m, sink)
    # the softmax does not depend on the shift: a detached, finite one (0 for empty rows)
    m = torch.where(m > float("-inf"), m, 0.0).detach()
    p = torch.exp(s - m[..., None])
    den = p.sum(-1)
    if sinks is not None:
        den = den + torch.exp(sink - m)
    p = p / torch.where(den > 0, den, 1.0)[..., None]
    o = torch.einsum("bhgcs,bshe->bchge", p, keys[..., d:])  # [b, C, hkv, g, Dv]
    return o.reshape(b, c, h, -1)


def relative_attention_dense(q, k, v, bias, ctx: PackedContext, scale: float,
                             window: int | None, sinks,
                             query_chunk: int | None) -> torch.Tensor:  # fmt: skip
    """``[batch, local_seq, heads, Dv]`` (arguments checked by the dispatcher; ``sinks`` ``None``
    or ``[batch, local_seq, heads]``)."""
    b, n, h, _ = q.shape
    dt = compute_dtype(q, k, v, bias)
    reach = ctx.key_band if window is None else min(window, ctx.key_band)
    kv, k0, received = _keys(k, v, ctx, reach, window)
    chunk = query_chunk or max(1, CHUNK_ELEMENTS // max(1, b * h * min(reach, kv.shape[1])))
    outs = []
    for a in range(0, n, chunk):
        e = min(n, a + chunk)
        t0, t1 = ctx.seq_start + a, ctx.seq_start + e  # global query positions [t0, t1)
        lo = max(k0, t0 - reach + 1)  # the first key any query of the chunk can see
        doc_q = ctx.local_doc_ids[:, a:e]
        doc_k = doc_ids_window(ctx.doc_ids, lo, t1 - lo)
        sink = None if sinks is None else sinks[:, a:e]
        # recomputed in the backward: only the chunk's inputs are kept, never its probabilities
        outs.append(checkpoint(_chunk, q[:, a:e], kv[:, lo - k0 : t1 - k0], bias[:, a:e], sink,
                               doc_q, doc_k, t0, lo, scale, window, dt,
                               use_reentrant=False))  # fmt: skip
    out = torch.cat(outs, 1).to(q.dtype) if len(outs) > 1 else outs[0].to(q.dtype)
    return with_anchors(out, ctx, received)
