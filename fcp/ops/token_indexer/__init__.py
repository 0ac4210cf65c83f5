"""The token-level DSA "lightning" indexer (DeepSeek-V3.2, GLM-5) over packed documents, exact
under contiguous CP.

* :mod:`.reference` - the definition (per document, per query, float64; tests only);
* :mod:`.gathered` - the exact static-shape path (``backend="gathered"``, every device): the
  index keys all-gathered, each query scored against its band.

:func:`token_indexer` is the only dispatcher. Its output feeds
:func:`fcp.ops.latent_attention.latent_attention` or
:func:`fcp.ops.index_attention.index_attention`.
"""

from __future__ import annotations

import torch

from fcp.checks import check_positive_int, check_tensor
from fcp.context import PackedContext, check_context
from fcp.ops.kit.common import autocast_off, choose_backend, default_scale, finite_or_zero
from fcp.ops.token_indexer.gathered import token_indexer_gathered

__all__ = ["BACKENDS", "token_indexer"]

#: ``"gathered"``: index keys all-gathered, scored per query chunk (exact, every device).
BACKENDS = ("gathered",)
_RUN = {"gathered": token_indexer_gathered}


def token_indexer(index_q: torch.Tensor, index_k: torch.Tensor, head_weights: torch.Tensor,
                  ctx: PackedContext, *, topk: int, scale: float | None = None,
                  query_chunk: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Global token ids each query attends to, by the token-level DSA indexer.

    Args (the indexer's projections of this rank's tokens, positions already applied, as
    transformers' ``GlmMoeDsaIndexer`` computes them):
        index_q: ``[batch, local_seq, index_heads, Di]``: ``wq_b(q_resid)``, rotated (GLM-5:
            interleaved RoPE on the first ``qk_rope_head_dim`` channels) at document-local
            positions.
        index_k: ``[batch, local_seq, Di]``: ``k_norm(wk(x))`` (one shared key head), rotated
            the same way.
        head_weights: ``[batch, local_seq, index_heads]``: ``weights_proj(x) * index_heads**-0.5``.
        ctx: the rank's :class:`~fcp.context.PackedContext`.
        topk: tokens selected per query (``index_topk``).
        scale: score scale inside the ``relu``, default ``Di ** -0.5``.
        query_chunk: queries scored at a time (transient memory ``O(query_chunk * (query_chunk
            + ctx.band))`` scores); default: about 1M scores per chunk. Results do not depend
            on it, bitwise.
        backend: ``"auto"`` (= ``"gathered"``) or ``"gathered"``.

    Returns:
        int64 ``[batch, local_seq, topk]``: per query the selected tokens of its document at or
        before it (descending score; equal scores to the earlier token), then ``-1`` (a query
        with fewer than ``topk`` visible tokens gets all of them). Ids are global positions;
        pad queries get all ``-1``. No gradient (the inputs are detached; the indexer's
        training loss, if any, is not this operator's).

    Guarantees: equals :func:`~fcp.ops.token_indexer.reference.token_indexer_reference` per
    document up to the order of tokens whose fp32 scores tie within rounding; bitwise the same
    under CP and without, and bitwise independent of other documents (NaN/inf in another
    document's inputs included); bitwise :func:`fcp.ops.kpool_indexer.kpool_indexer` with
    ``kpool=1``, ``select_tail=False``. Under CP: one all-gather of ``index_k`` (``Di`` values
    per token, in its dtype); nothing else crosses ranks. Cost: each query is scored against
    the ``ctx.band`` positions before it (not the whole row), and results do not depend on
    ``ctx.band`` either, bitwise. No host synchronisation, static shapes.

    Example: one document of 4 tokens, one index head of one channel, ``q = w = 1``: token
    ``s`` scores ``relu(k_s)`` for every later query; token 1 scores 0, below token 0::

        >>> ctx = PackedContext(torch.tensor([[1, 1, 1, 1]]))
        >>> k = torch.tensor([[[0.5], [-1.0], [2.0], [1.0]]])
        >>> token_indexer(torch.ones(1, 4, 1, 1), k, torch.ones(1, 4, 1), ctx, topk=2, scale=1.0)
        tensor([[[ 0, -1],
                 [ 0,  1],
                 [ 2,  0],
                 [ 2,  3]]])
    """
    name = "token_indexer"
    check_context(ctx, fn=name)
    batch, local = ctx.batch_size, ctx.local_seq_len
    topk = check_positive_int(topk, "topk", fn=name)
    check_tensor(index_q, "index_q", fn=name, kind="float", shape=(batch, local, None, None),
                 layout="[batch, local_seq, index_heads, Di]")  # fmt: skip
    hi, di = index_q.shape[2:]
    check_tensor(index_k, "index_k", fn=name, kind="float", shape=(batch, local, di))
    check_tensor(head_weights, "head_weights", fn=name, kind="float", shape=(batch, local, hi))
    if query_chunk is not None:
        query_chunk = check_positive_int(query_chunk, "query_chunk", fn=name)
    backend = choose_backend(name, backend, BACKENDS, "gathered")
    scale = default_scale(di, scale)
    index_q, index_k, head_weights = (finite_or_zero(t.detach())
                                      for t in (index_q, index_k, head_weights))  # fmt: skip
    with autocast_off(index_q.device):  # the same selection inside autocast as outside
        return _RUN[backend](index_q, index_k, head_weights, ctx, topk, scale, query_chunk)
