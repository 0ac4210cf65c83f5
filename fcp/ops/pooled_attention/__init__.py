"""Attention over an exact sliding window plus learned-gated, document-aligned pools (DeepSeek-V4's
compressed attention: CSA and HCA), exact under contiguous CP.

Pools. Pool ``j`` of a document covers its document-local positions ``[j*ratio, (j+1)*ratio)``;
only complete pools exist (:mod:`fcp.ops.kit.pools`: a token ends a pool iff it is real and its
document position ``p`` has ``(p + 1) % ratio == 0``). :func:`gated_pools` turns each pool into
one vector, a per-channel softmax-gated sum of token rows::

    pooled_j = sum_i softmax_i(gate_i) * kv_i       (per channel, softmax over the rows i)

* ``overlap=False`` (HCA): the rows are the ``ratio`` tokens of pool ``j``; ``kv``, ``gate``
  ``[B, L, D]``.
* ``overlap=True`` (CSA): ``kv``, ``gate`` ``[B, L, 2D]`` hold two series per token, ``[Ca |
  Cb]``; the rows are the ``ratio`` tokens of pool ``j - 1`` read through ``Ca`` then the
  ``ratio`` tokens of pool ``j`` through ``Cb`` (width ``2 * ratio``, stride ``ratio``). Pool 0
  has no previous pool: its ``Ca`` rows are left out of the softmax, as transformers does
  (``-inf`` gates) for the first window of a sequence, so nothing crosses a document start.

A position bias per row (``position_bias[p % ratio]``) is the caller's: it is per token. The
pools' norm and rotary embedding (at the pool's first document position, returned) are the
caller's too: they are per pool.

:func:`pooled_window_attention`: query ``t`` attends, in **one** softmax, to

(a) the exact keys ``s`` of its own document with ``t - window < s <= t``, and
(b) the pools of its document that end at or before ``t`` (all of them, HCA; or only those in
    ``selected``, CSA), and
(c) optional attention sinks (one extra logit per head with a zero value).

Keys are values (DeepSeek-V4's shared K = V, one KV head for every query head).

:func:`pool_select`: the lightning indexer's selection, ``sum_h w_h * relu(scale * q_h . k_j)``
over the visible pools of the query's document, the ``topk`` best (equal scores: the earlier
pool), no gradient.

CP. :func:`gated_pools` receives the ``ratio - 1`` (``2 * ratio - 1`` with ``overlap``) tokens
before its interval with one left halo (differentiable); each rank pools the pools that *end* in
its interval (``ceil(L / ratio)`` slots, a static shape). :func:`pooled_window_attention`
receives the ``min(window, band) - 1`` keys before its interval (left halo) and all-gathers the
pooled vectors (``ceil(L / ratio)`` per rank; backward: a reduce-scatter).
:func:`pool_select` all-gathers the index keys (no gradient).

* :mod:`.reference` - the definitions (float64, per document and per query; tests only);
* :mod:`.dense` - ``backend="dense"`` (every device): masked fp32 softmax over the window and
  the pools.
"""

from __future__ import annotations

import torch

from fcp.checks import check_choice, check_positive_int
from fcp.context import PackedContext, check_context
from fcp.ops.kit.attention import check_sinks_softcap
from fcp.ops.kit.common import autocast_off, default_scale, finite_or_zero, zero_nonfinite_grad
from fcp.ops.pooled_attention.dense import (
    gated_pools_dense,
    pool_select_dense,
    pooled_window_attention_dense,
)

__all__ = ["BACKENDS", "gated_pools", "pool_select", "pooled_window_attention"]

#: ``"dense"``: masked fp32 softmax over the window and the pools (every device).
BACKENDS = ("dense",)


def _backend(name: str, backend: str) -> str:
    return "dense" if backend == "auto" else check_choice(backend, "backend", BACKENDS, fn=name)


def gated_pools(kv: torch.Tensor, gate: torch.Tensor, ctx: PackedContext, ratio: int, *,
                overlap: bool = False,
                backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The softmax-gated pools ending in this rank's interval (module doc).

    Args:
        kv: ``[B, L, D]`` (``[B, L, 2D]`` with ``overlap``: ``[Ca | Cb]``), this rank's rows.
        gate: the gate logits, ``kv``'s shape (position bias included; may be wider than
            ``kv``: the softmax runs in fp32 and its weights are cast to ``kv``'s dtype).
        ctx: the rank's context. ratio: tokens per pool. overlap: CSA's two-series windows.

    Returns:
        ``(pooled [B, C, D]`` in ``kv``'s dtype, ``start [B, C]`` int64): ``C =
        ceil(L / ratio)`` slots (:func:`fcp.ops.kit.pools.plan_pools`; slot ``c`` holds the pool
        ending among local positions ``[c*ratio, (c+1)*ratio)``), each pool's first document
        position (where it is rotated); an empty slot gives zeros and start 0. Differentiable
        in ``kv`` and ``gate``.
    """
    name = "gated_pools"
    check_context(ctx, fn=name)
    ratio = check_positive_int(ratio, "ratio", fn=name)
    backend = _backend(name, backend)
    if kv.shape != gate.shape or kv.dim() != 3 or kv.shape[1] != ctx.local_seq_len:
        raise ValueError(f"{name}: kv and gate must both be [batch, local_seq="
                         f"{ctx.local_seq_len}, F], got {tuple(kv.shape)} and "
                         f"{tuple(gate.shape)}")  # fmt: skip
    if overlap and kv.shape[-1] % 2:
        raise ValueError(f"{name}: with overlap, F={kv.shape[-1]} must be even ([Ca | Cb])")
    # a non-finite row of one document must not reach another's pool through a zero weight
    kv = finite_or_zero(kv)
    with autocast_off(kv.device):
        pooled, start = gated_pools_dense(kv, gate, ctx, ratio, bool(overlap))
    return zero_nonfinite_grad(pooled), start


def pool_select(index_q: torch.Tensor, index_keys: torch.Tensor, head_weights: torch.Tensor,
                ctx: PackedContext, ratio: int, topk: int, scale: float, *,
                backend: str = "auto") -> torch.Tensor:  # fmt: skip
    """The lightning indexer's choice of pools per query (module doc), no gradient.

    Args:
        index_q: ``[B, L, Hi, Di]`` index queries (rotated as the model does).
        index_keys: ``[B, C, Di]`` this rank's pooled index keys (:func:`gated_pools` slots,
            normed and rotated).
        head_weights: ``[B, L, Hi]``; ``scale``: multiplies each dot product before the relu.
        topk: pools per query (fewer when fewer are visible).

    Returns:
        int64 ``[B, L, topk]``: global slot ids (into the all-gathered slots of
        :func:`pooled_window_attention`), ``-1`` for none.
    """
    name = "pool_select"
    check_context(ctx, fn=name)
    ratio = check_positive_int(ratio, "ratio", fn=name)
    topk = check_positive_int(topk, "topk", fn=name)
    _backend(name, backend)
    with torch.no_grad(), autocast_off(index_q.device):
        return pool_select_dense(index_q, index_keys, head_weights, ctx, ratio, topk,
                                 float(scale))  # fmt: skip


def pooled_window_attention(q: torch.Tensor, kv: torch.Tensor, pooled: torch.Tensor,
                            ctx: PackedContext, ratio: int, window: int,
                            scale: float | None = None, *, sinks: torch.Tensor | None = None,
                            selected: torch.Tensor | None = None,
                            query_chunk: int | None = None,
                            backend: str = "auto") -> torch.Tensor:  # fmt: skip
    """One softmax over the exact window, the document's visible pools and the sinks.

    Args:
        q: ``[B, L, H, D]`` queries.
        kv: ``[B, L, D]`` the shared key/value of each token (one head for all query heads).
        pooled: ``[B, C, D]`` this rank's pooled keys/values (:func:`gated_pools` slots, after
            the caller's norm and rotation); all-gathered here (differentiable).
        ratio: the pools' size (to find the slots). window: ``t - window < s <= t``.
        scale: default ``D ** -0.5``. sinks: ``[H]`` or ``[B, L, H]`` logits, or ``None``.
        selected: ``None`` (every visible pool) or int64 ``[B, L, k]`` global slot ids from
            :func:`pool_select` (``-1``: none; ids of invisible pools are ignored).
        query_chunk: queries scored at a time (default 256; results do not depend on it):
            without ``selected`` a chunk scores only the slots of positions ``[first query -
            band + 1, last query]``, so the pooled scores cost ``O(L * band / ratio)`` per head,
            not ``O(L * P)``; with it, ``O(L * k)``.

    Returns:
        ``[B, L, H, D]`` in ``q``'s dtype (scores and softmax in fp32, fp64 for fp64 inputs);
        pad queries give zeros.
    """
    name = "pooled_window_attention"
    check_context(ctx, fn=name)
    ratio = check_positive_int(ratio, "ratio", fn=name)
    window = check_positive_int(window, "window", fn=name)
    backend = _backend(name, backend)
    batch, local = q.shape[:2]
    if kv.shape != (batch, local, q.shape[-1]) or local != ctx.local_seq_len:
        raise ValueError(f"{name}: kv must be [batch, local_seq, D] = {(batch, local, q.shape[-1])}"
                         f" for q {tuple(q.shape)}, got {tuple(kv.shape)}")  # fmt: skip
    if selected is not None and selected.shape[:2] != (batch, local):
        raise ValueError(f"{name}: selected must be [batch, local_seq, k], got "
                         f"{tuple(selected.shape)}")  # fmt: skip
    sinks, _ = check_sinks_softcap(name, sinks, None, q)  # -> [B, L, H] or None
    scale = default_scale(q.shape[-1], scale)
    chunk = 256 if query_chunk is None else check_positive_int(query_chunk, "query_chunk", fn=name)
    # non-finite values stay in their document (fcp.ops.kit.common): zero probabilities meet
    # finite keys only
    q, kv, pooled = finite_or_zero(q), finite_or_zero(kv), finite_or_zero(pooled)
    with autocast_off(q.device):
        out = pooled_window_attention_dense(q, kv, pooled, ctx, ratio, window, scale, sinks,
                                            selected, chunk)  # fmt: skip
    return zero_nonfinite_grad(out)
