"""GLM-5.3-Flash's DSA k-pool indexer over packed documents, exact under contiguous CP.

* :mod:`.reference` - the definition (per document, per query, float64; tests only);
* :mod:`.pooled` - the exact static-shape path (``backend="pooled"``, every device).

:func:`kpool_indexer` is the only dispatcher. Its output feeds
:func:`fcp.ops.index_attention.index_attention`.
"""

from __future__ import annotations

import torch

from fcp.checks import check_bool, check_positive_int, check_tensor
from fcp.context import PackedContext, check_context
from fcp.ops.kit.common import autocast_off, choose_backend, default_scale, finite_or_zero
from fcp.ops.kit.pools import check_selection
from fcp.ops.kpool_indexer.pooled import kpool_indexer_pooled

__all__ = ["BACKENDS", "check_kpool_inputs", "kpool_indexer", "kpool_width"]

#: ``"pooled"``: pooled keys at pool ends, all-gathered, scored per query (exact, every device).
BACKENDS = ("pooled",)
_RUN = {"pooled": kpool_indexer_pooled}


def kpool_width(topk: int, kpool: int, select_tail: bool) -> int:
    """Row width ``W``: ``topk + kpool - 1`` with the tail, else ``topk``."""
    return topk + (kpool - 1 if select_tail else 0)


def check_kpool_inputs(name, index_q, index_k, gate_logits, ape, head_weights, batch, local,
                       topk, kpool) -> None:  # fmt: skip
    """Types and shapes of :func:`kpool_indexer`'s arguments (the :mod:`fcp.checks` rule)."""
    check_selection(name, index_q, batch, local, topk, kpool, budget_name="topk",
                    pool_name="kpool")  # fmt: skip
    hi, di = index_q.shape[2:]
    for what, t, shape in (("index_k", index_k, (batch, local, di)),
                           ("gate_logits", gate_logits, (batch, local, di)),
                           ("ape", ape, (kpool, di)),
                           ("head_weights", head_weights, (batch, local, hi))):  # fmt: skip
        check_tensor(t, what, fn=name, kind="float", shape=shape)


def kpool_indexer(index_q: torch.Tensor, index_k: torch.Tensor, gate_logits: torch.Tensor,
                  ape: torch.Tensor, head_weights: torch.Tensor, ctx: PackedContext, *,
                  topk: int, kpool: int, select_tail: bool = True, scale: float | None = None,
                  query_chunk: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Global token ids each query attends to, by GLM-5.3-Flash's k-pool DSA indexer.

    Args (the indexer's projections of this rank's tokens, as transformers'
    ``Glm5NextTextIndexer`` computes them):
        index_q: ``[batch, local_seq, index_heads, Di]``: ``wq_b(q_resid)``.
        index_k: ``[batch, local_seq, Di]``: ``k_norm(wk(x))`` (LayerNorm, one shared key head).
        gate_logits: ``[batch, local_seq, Di]``: ``x @ index_kpool_compress_gate.T``.
        ape: ``[kpool, Di]``: ``index_kpool_compress_ape``.
        head_weights: ``[batch, local_seq, index_heads]``: ``weights_proj(x) * index_heads**-0.5``.
        ctx: the rank's :class:`~fcp.context.PackedContext`.
        topk: tokens selected from complete pools (``index_topk``), a multiple of ``kpool``;
            ``topk // kpool`` pools per query.
        kpool: tokens per pool (``index_kpool``). Pools start at every document start and
            may straddle rank boundaries; any local length works.
        select_tail: append the tokens of the query's incomplete pool
            (``index_kpool_always_select_tail``, default ``True``).
        scale: score scale inside the ``relu``, default ``Di ** -0.5``.
        query_chunk: queries scored at a time (transient memory ``O(query_chunk * (query_chunk
            + ctx.band) / kpool)`` scores); default: about 1M scores per chunk. Results do
            not depend on it, bitwise.
        backend: ``"auto"`` (= ``"pooled"``) or ``"pooled"``.

    Returns:
        int64 ``[batch, local_seq, W]``, ``W = topk + kpool - 1`` with the tail (else ``topk``),
        transformers' layout: per query the tokens of the selected pools (descending score;
        equal scores to the earlier pool; tokens ascending inside a pool), ``-1`` for unfilled
        pool slots up to ``min(topk, kpool * complete pools of the document)`` columns, the
        tail, then ``-1`` padding. Ids are global positions; pad queries get all ``-1``. No
        gradient (the inputs are detached; GLM-5.3-Flash trains no indexer loss).

    Guarantees: equals :func:`kpool_indexer_reference` per document up to the order of pools
    whose fp32 scores tie within rounding; bitwise the same under CP and without, and bitwise
    independent of other documents (NaN/inf in another document's inputs included). Under CP:
    one ``kpool - 1`` token left halo of ``(index_k, gate_logits)`` and one all-gather of
    ``ceil(local_seq / kpool)`` pooled keys per rank (``Di`` values each). Cost: each query is
    scored against the pools of the ``ctx.band`` positions before it (not the whole row),
    and results do not depend on ``ctx.band`` either, bitwise. No host synchronisation,
    static shapes.

    Example (one document of 9 tokens, ``kpool = 4``, ``topk = 4``: one pool per query)::

        t = 2 : [-1, -1, -1, -1,  0,  1,  2]   # no complete pool yet; tail 0..2
        t = 3 : [ 0,  1,  2,  3, -1, -1, -1]   # t ends pool 0, which is selected
        t = 8 : [ 4,  5,  6,  7,  8, -1, -1]   # pool 1 scored higher than pool 0; tail 8
                                               # (which pool wins depends on the scores)
    """
    name = "kpool_indexer"
    check_context(ctx, fn=name)
    check_kpool_inputs(name, index_q, index_k, gate_logits, ape, head_weights,
                       ctx.batch_size, ctx.local_seq_len, topk, kpool)  # fmt: skip
    select_tail = check_bool(select_tail, "select_tail", fn=name)
    if query_chunk is not None:
        query_chunk = check_positive_int(query_chunk, "query_chunk", fn=name)
    backend = choose_backend(name, backend, BACKENDS, "pooled")
    scale = default_scale(index_q.shape[-1], scale)
    index_q, index_k, gate_logits, ape, head_weights = (
        finite_or_zero(t.detach()) for t in (index_q, index_k, gate_logits, ape, head_weights)
    )
    with autocast_off(index_q.device):  # the same selection inside autocast as outside
        return _RUN[backend](index_q, index_k, gate_logits, ape, head_weights, ctx, topk,
                             kpool, select_tail, scale, query_chunk)  # fmt: skip
