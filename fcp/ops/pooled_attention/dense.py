"""The ``"dense"`` backend of :mod:`fcp.ops.pooled_attention` (every device): gated pools from a
left halo, pool selection with the kit's pool scorer, and one masked fp32 softmax over the exact
window, the visible (or selected) pools and the sinks."""

from __future__ import annotations

import torch

from fcp.comm import all_gather_group, with_left_halo
from fcp.context import PackedContext
from fcp.layout import PAD_DOC_ID
from fcp.ops.kit.common import scalar_tensor
from fcp.ops.kit.pools import gather_pool_keys, plan_pools, pool_top, slot_window, visible_slots

__all__ = ["gated_pools_dense", "pool_select_dense", "pooled_window_attention_dense"]


def gated_pools_dense(kv: torch.Tensor, gate: torch.Tensor, ctx: PackedContext, ratio: int,
                      overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(pooled [B, C, D] in kv's dtype, start [B, C] int64)``: one entry per local pool slot
    (:func:`fcp.ops.kit.pools.plan_pools`), zeros and start 0 for an empty slot."""
    batch, _, feat = kv.shape
    dim = feat // 2 if overlap else feat
    width = 2 * ratio if overlap else ratio
    ends = plan_pools(ctx, ratio).ends  # [B, C] global end positions, -1: empty slot
    # the width - 1 tokens before the interval (differentiable): one exchange when both share a
    # dtype; a wider gate (fp32 position bias added to a bf16 projection) keeps its own
    if gate.dtype == kv.dtype:
        both = with_left_halo(torch.cat([kv, gate], -1), ctx, width - 1)
        kboth, gboth = both[..., :feat], both[..., feat:]
    else:
        kboth, gboth = with_left_halo(kv, ctx, width - 1), with_left_halo(gate, ctx, width - 1)
    first = (ends - ctx.seq_start).clamp(min=0)  # the window's first row in halo coordinates
    idx = first[..., None] + torch.arange(width, device=kv.device)  # [B, C, width]
    rows = torch.arange(batch, device=kv.device)[:, None, None]
    kw, gw = kboth[rows, idx], gboth[rows, idx]  # [B, C, width, F]
    tok = ends[..., None] - (width - 1) + torch.arange(width, device=kv.device)
    doc = ctx.doc_ids
    doc_tok = doc.gather(1, tok.clamp(min=0).flatten(1)).view_as(tok)
    doc_end = doc.gather(1, ends.clamp(min=0))
    filled = ends >= 0  # [B, C]
    ok = (tok >= 0) & (doc_tok == doc_end[..., None])
    ok = ok | ~filled[..., None]  # an empty slot reads finite rows; its result is zeroed below
    if overlap:  # rows of the previous window read the first series, the current one the second
        kw = torch.cat([kw[:, :, :ratio, :dim], kw[:, :, ratio:, dim:]], 2)
        gw = torch.cat([gw[:, :, :ratio, :dim], gw[:, :, ratio:, dim:]], 2)
    weights = torch.where(ok[..., None], gw, float("-inf")).softmax(2, dtype=torch.float32)
    kw = torch.where(ok[..., None], kw, 0)
    pooled = (kw * weights.to(kw.dtype)).sum(2)
    pooled = torch.where(filled[..., None], pooled, 0)
    pos = ctx.position_ids.gather(1, ends.clamp(min=0)) - (ratio - 1)
    return pooled, torch.where(filled, pos, 0)


def pool_select_dense(index_q: torch.Tensor, index_keys: torch.Tensor,
                      head_weights: torch.Tensor, ctx: PackedContext, ratio: int, topk: int,
                      scale: float) -> torch.Tensor:  # fmt: skip
    """int64 ``[B, L, topk]`` global slot ids (-1: none), no gradient."""
    plan = plan_pools(ctx, ratio)
    keys = gather_pool_keys(index_keys, ctx)  # [B, P, Di] fp32, one all-gather, no gradient
    slot, chosen, _ = pool_top(index_q.detach().float(), keys, head_weights.detach().float(),
                               plan.slots, ctx.doc_ids, ctx.seq_start, ctx.local_seq_len, ratio,
                               ctx.key_band, topk,
                               scalar_tensor(scale, index_q.device), None, 0)  # fmt: skip
    return torch.where(chosen, slot, -1)


def _attend_chunk(qf, win, ok_w, keys, ok_p, sinks, scale):
    """One softmax over a chunk's window keys ``win [B, n, W, D]`` and pooled keys ``keys``
    (``[B, P, D]`` shared by the chunk, or ``[B, n, k, D]`` per query) plus the sinks:
    ``[B, n, H, D]`` in ``qf``'s dtype."""
    dtype = qf.dtype
    shared = keys.dim() == 3
    score_w = torch.einsum("blhd,blwd->blhw", qf, win.to(dtype)) * scale
    score_p = torch.einsum("blhd,bpd->blhp" if shared else "blhd,blkd->blhk", qf,
                           keys.to(dtype)) * scale  # fmt: skip
    parts = [torch.where(ok_w[:, :, None], score_w, float("-inf")),
             torch.where(ok_p[:, :, None], score_p, float("-inf"))]  # fmt: skip
    if sinks is not None:
        parts.append(sinks[..., None])
    probs = torch.cat(parts, -1).softmax(-1)
    width = win.shape[2]
    p_w, p_p = probs[..., :width], probs[..., width : width + ok_p.shape[-1]]
    out = torch.einsum("blhw,blwd->blhd", p_w, win.to(dtype))
    return out + torch.einsum("blhp,bpd->blhd" if shared else "blhk,blkd->blhd", p_p,
                              keys.to(dtype))  # fmt: skip


def pooled_window_attention_dense(q: torch.Tensor, kv: torch.Tensor, pooled: torch.Tensor,
                                  ctx: PackedContext, ratio: int, window: int, scale: float,
                                  sinks: torch.Tensor | None, selected: torch.Tensor | None,
                                  query_chunk: int) -> torch.Tensor:  # fmt: skip
    """``[B, L, H, D]`` in q's dtype (module doc of :mod:`fcp.ops.pooled_attention`),
    ``query_chunk`` queries at a time: each chunk scores its window, and either the pools of
    the slots its queries can see (``[first query - band + 1, last query]``: every visible
    pool) or its queries' selected pools."""
    batch, local = q.shape[:2]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    start, doc, band = ctx.seq_start, ctx.doc_ids, ctx.key_band
    # a key further back than the band is in an earlier document: the window never needs it
    width = min(window, band)
    kvh = with_left_halo(kv, ctx, width - 1)  # zeros before the sequence start (masked below)
    win = kvh.unfold(1, width, 1).transpose(-1, -2)  # [B, L, width, D]
    t = torch.arange(start, start + local, device=q.device)
    s = t[:, None] - (width - 1) + torch.arange(width, device=q.device)  # [L, width]
    doc_q = doc[:, start : start + local]  # [B, L]
    doc_s = doc.gather(1, s.clamp(min=0).flatten()[None].expand(batch, -1))
    # a pad query sees itself (and pad keys) only, so no row is empty; its output is zeroed
    ok_w = (s >= 0) & (doc_s.view(batch, local, width) == doc_q[..., None])  # [B, L, width]
    slots = plan_pools(ctx, ratio).slots  # [B, P] global pool ends, -1: empty
    keys = all_gather_group(pooled.contiguous(), ctx.group_info, 1, validate=False)  # [B, P, D]
    if sinks is not None:
        sinks = sinks.to(dtype)  # [B, L, H]: expanded by the dispatcher's check
    qf = q.to(dtype)
    rows = torch.arange(batch, device=q.device)[:, None, None]
    outs = []
    for r0 in range(0, local, query_chunk):
        r1 = min(local, r0 + query_chunk)
        if selected is None:
            s0, s1 = slot_window(start + r0, start + r1 - 1, band, local, ratio, slots.shape[1])
            chunk_keys = keys[:, s0:s1]
            ok_p = visible_slots(slots[:, s0:s1], doc, start + r0, r1 - r0)
        else:
            pick = selected[:, r0:r1].clamp(min=0)  # [B, n, k]
            end = slots.gather(1, pick.flatten(1)).view_as(pick)
            doc_end = doc.gather(1, end.clamp(min=0).flatten(1)).view_as(end)
            ok_p = ((selected[:, r0:r1] >= 0) & (end >= 0) & (end <= t[r0:r1, None])
                    & (doc_end == doc_q[:, r0:r1, None]))  # fmt: skip
            chunk_keys = keys[rows, pick]  # [B, n, k, D]
        sink = None if sinks is None else sinks[:, r0:r1]
        outs.append(_attend_chunk(qf[:, r0:r1], win[:, r0:r1], ok_w[:, r0:r1], chunk_keys, ok_p,
                                  sink, scale))  # fmt: skip
    out = torch.cat(outs, 1) if len(outs) > 1 else outs[0]
    out = torch.where((doc_q != PAD_DOC_ID)[:, :, None, None], out, 0)
    return out.to(q.dtype)
