"""Helpers of the references (specifications and test oracles; tests only).

The attention references compute one query at a time from their operator's definition, with
Python loops over keys (float64): slow and obviously correct. :func:`reference_doc_ids` is how
the recurrent references (``kda``, ``gla``) take their context.

>>> [(b, t, start) for b, t, doc, start in real_queries(torch.tensor([[1, 1, 2, 0]]))]
[(0, 0, 0), (0, 1, 0), (0, 2, 2)]
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.layout import PAD_DOC_ID
from fcp.ops.kit.common import compute_dtype

__all__ = ["linear_recurrence", "prepare", "softmax_row", "attend_keys", "empty_row", "per_query",
           "real_queries", "reference_doc_ids", "windowed_rows"]  # fmt: skip


def reference_doc_ids(ctx: PackedContext | torch.Tensor, fn: str) -> torch.Tensor:
    """The int64 doc-id map ``[batch, seq]`` of a single-process reference call: ``ctx`` is a
    :class:`~fcp.context.PackedContext` without CP, or the map itself."""
    if not isinstance(ctx, PackedContext):
        return ctx
    if ctx.cp_enabled:
        raise ValueError(f"{fn} is single-process: pass a context with cp_size=1")
    return ctx.doc_ids


def real_queries(doc_ids: torch.Tensor):
    """``(row, t, doc, start)`` for every real (non-pad) token of ``doc_ids [batch, seq]``:
    ``doc`` the row's ids as a list, ``start`` the position where ``t``'s document starts."""
    for b in range(doc_ids.shape[0]):
        doc = doc_ids[b].tolist()
        for t, d in enumerate(doc):
            if d != PAD_DOC_ID:
                yield b, t, doc, doc.index(d)


def per_query(doc_ids: torch.Tensor, row_fn) -> torch.Tensor:
    """``[batch, seq, ...]``: ``row_fn(b, t, doc)`` stacked for every token (pad ones included)."""
    batch, seq = doc_ids.shape
    rows = []
    for b in range(batch):
        doc = doc_ids[b].tolist()
        rows += [row_fn(b, t, doc) for t in range(seq)]
    return torch.stack(rows).view(batch, seq, *rows[0].shape)


def prepare(q, k, v, scale):
    """float64 ``q``, kv heads repeated to query heads (GQA), and the resolved scale."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q, k.repeat_interleave(groups, dim=-2), v.repeat_interleave(groups, dim=-2), scale


def softmax_row(qt, keys, vals, scale, empty, sink=None, softcap=None):
    """Attention of one query ``[H, D]`` over lists of keys ``[H, D]`` / values ``[H, Dv]``;
    ``empty`` (zeros ``[H, Dv]``) when there are no keys. ``sink [H]``: one more logit per head
    whose value is zero; ``softcap``: scores ``c * tanh(s / c)``."""
    if not keys:
        return empty
    kk, vv = torch.stack(keys), torch.stack(vals)  # [n, H, D]
    s = torch.einsum("hd,nhd->hn", qt, kk) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if sink is not None:
        p = torch.softmax(torch.cat([s, sink.to(s.dtype)[:, None]], -1), -1)[:, :-1]
    else:
        p = torch.softmax(s, -1)
    return torch.einsum("hn,nhd->hd", p, vv)


def attend_keys(qt, k, v, positions, scale, sink=None, softcap=None):
    """Attention of one query over the tokens at ``positions`` of one row's ``k``/``v``."""
    keys, vals = [k[s] for s in positions], [v[s] for s in positions]
    return softmax_row(qt, keys, vals, scale, empty_row(qt, v), sink, softcap)


def windowed_rows(q, k, v, doc_ids, scale, window, sinks, softcap) -> torch.Tensor:
    """float64 ``[b, seq, H, Dv]``: every query ``t`` attends to the keys ``s <= t`` of its own
    real document with ``s > t - window`` (``window=None``: all of them); ``sinks``
    (broadcastable to ``[b, seq, H]``): one zero-value logit per query and head in the
    denominator; ``softcap``: scores ``c * tanh(s / c)``. Pad queries give zeros."""
    q, k, v, scale = prepare(q, k, v, scale)
    if sinks is not None:
        sinks = sinks.double().expand(*q.shape[:3])

    def row(b, t, doc):
        first = 0 if window is None else max(0, t - window + 1)
        keys = [s for s in range(first, t + 1) if doc[t] != 0 and doc[s] == doc[t]]
        sink = None if sinks is None else sinks[b, t]
        return attend_keys(q[b, t], k[b], v[b], keys, scale, sink, softcap)

    return per_query(doc_ids, row)


def empty_row(qt, v):
    """Zeros ``[H, Dv]`` still attached to ``qt`` and ``v`` (autograd always has a graph)."""
    return v[0] * 0.0 + qt.sum() * 0.0


def linear_recurrence(q, k, v, extras, scale: float, step, starts=None, initial_state=None):
    """The per-token loop of a linear recurrence with a ``[K, V]`` state per value head, shared
    by the recurrent references (:mod:`fcp.ops.kda.reference`, :mod:`fcp.ops.gla.reference`).

    ``q, k [B, T, H, K]`` (repeated to the ``HV`` value heads of ``v [B, T, HV, V]``, as
    ``repeat_interleave``), ``extras``: per-token tensors ``[B, T, HV, ...]``; all are taken in
    the compute dtype (fp32, fp64 for fp64). Per token: the state is zeroed where ``starts``
    (bool ``[B, T]``; ``torch.where``, so a reset is exact whatever the state holds), then
    ``state = step(state, k_t, v_t, *extras_t)``, then ``o_t = scale * q_t . state``.
    Returns ``(o [B, T, HV, V], final state [B, HV, K, V])``, differentiable by autograd.
    """
    hv = v.shape[2]
    rep = hv // q.shape[2]
    dt = compute_dtype(q, k, v, *extras)
    q = q.to(dt).repeat_interleave(rep, dim=2) * scale
    k = k.to(dt).repeat_interleave(rep, dim=2)
    v, extras = v.to(dt), [x.to(dt) for x in extras]
    if initial_state is None:
        state = q.new_zeros(q.shape[0], hv, q.shape[3], v.shape[3])
    else:
        state = initial_state.to(dt)
    out = []
    for t in range(q.shape[1]):
        if starts is not None:
            state = torch.where(starts[:, t, None, None, None], 0.0, state)
        state = step(state, k[:, t], v[:, t], *(x[:, t] for x in extras))
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    o = torch.stack(out, 1) if out else v.new_zeros(v.shape)
    return o, state
