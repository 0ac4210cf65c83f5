"""Qwen3.8-Flash-Next's QSA token selection over packed documents, exact under contiguous CP.

* :mod:`.reference` - the definition (NeMo's ``qsa.py`` per document; float64 per-query loop;
  tests only); the per-token pieces (zero-centred RMSNorm, rotate-half RoPE, RoPE tables) are
  :mod:`fcp.ops.kit.norms`;
* :mod:`.pooled` - the exact static-shape path (``backend="pooled"``, every device).

:func:`qsa_indexer` is the only dispatcher. Its output feeds
:func:`fcp.ops.index_attention.index_attention` (QSA's attention: GQA, fp32 softmax over the
selected tokens, an empty selection gives 0; the layer then multiplies by ``sigmoid(gate)``).
"""

from __future__ import annotations

import torch

from fcp.checks import check_float, check_positive_int, check_tensor
from fcp.context import PackedContext, check_context
from fcp.ops.kit.common import autocast_off, choose_backend, finite_or_zero
from fcp.ops.kit.pools import check_selection
from fcp.ops.qsa_indexer.pooled import qsa_indexer_pooled

__all__ = ["BACKENDS", "check_qsa_inputs", "qsa_indexer", "qsa_width"]

#: ``"pooled"``: compressed keys at block ends, all-gathered, scored per query (every device).
BACKENDS = ("pooled",)
_RUN = {"pooled": qsa_indexer_pooled}


def qsa_width(budget: int, ratio: int) -> int:
    """Row width ``budget + ratio - 1``."""
    return budget + ratio - 1


def check_qsa_inputs(name, index_q, index_k, q_norm_weight, k_norm_weight, cos, sin,
                     batch, local, budget, ratio) -> None:  # fmt: skip
    """Types and shapes of :func:`qsa_indexer`'s arguments (the :mod:`fcp.checks` rule)."""
    check_selection(name, index_q, batch, local, budget, ratio, budget_name="budget",
                    pool_name="ratio")  # fmt: skip
    di = index_q.shape[3]
    for what, t in (("cos", cos), ("sin", sin)):
        check_tensor(t, what, fn=name, kind="float", shape=(batch, local, None),
                     layout="[batch, local_seq, rotary/2]")  # fmt: skip
    if cos.shape != sin.shape:
        raise ValueError(f"{name}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if not 1 <= 2 * cos.shape[2] <= di:
        raise ValueError(f"{name}: rotary dim 2 * {cos.shape[2]} must be in [2, Di={di}]")
    for what, t, shape in (("index_k", index_k, (batch, local, di)),
                           ("q_norm_weight", q_norm_weight, (di,)),
                           ("k_norm_weight", k_norm_weight, (di,))):  # fmt: skip
        check_tensor(t, what, fn=name, kind="float", shape=shape)


def qsa_indexer(index_q: torch.Tensor, index_k: torch.Tensor, q_norm_weight: torch.Tensor,
                k_norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: PackedContext, *, budget: int, ratio: int, eps: float = 1e-6,
                query_chunk: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Global token ids each query attends to, by Qwen3.8-Flash-Next's QSA indexer.

    Args (NeMo's ``Qwen3_8_FlashNextQSAIndexer`` names in brackets):
        index_q: ``[batch, local_seq, index_heads, Di]``, the raw index queries (the first
            ``index_heads * Di`` outputs of ``index_qk_proj``).
        index_k: ``[batch, local_seq, Di]``, the raw index keys (its last ``Di`` outputs; one
            index KV head).
        q_norm_weight, k_norm_weight: ``[Di]`` (``q_layernorm.weight``, ``k_layernorm.weight``),
            zero-centred: the norm multiplies by ``1 + weight``.
        cos, sin: ``[batch, local_seq, R/2]``, RoPE tables at each token's **document-local**
            position (NeMo's ``freqs_cis`` is ``cat(cos, sin)``); :func:`~fcp.ops.kit.norms.rope_tables` of
            ``ctx.local_position_ids`` builds them. ``R <= Di``; dims past ``R`` pass
            through.
        ctx: the rank's :class:`~fcp.context.PackedContext`.
        budget: tokens selected from complete blocks (``indexer_budget``), a multiple of
            ``ratio``; ``budget // ratio`` blocks per sparse query.
        ratio: tokens per block (``indexer_compress_ratio``). Blocks start at every document
            start and may straddle rank boundaries; any local length works.
        eps: RMSNorm epsilon (``rms_norm_eps``).
        query_chunk: queries scored at a time (transient memory ``O(query_chunk * (query_chunk
            + ctx.band) / ratio)`` scores); default: about 1M scores per chunk. Results do
            not depend on it, bitwise.
        backend: ``"auto"`` (= ``"pooled"``) or ``"pooled"``.

    Returns:
        int64 ``[batch, local_seq, budget + ratio - 1]``, valid ids first (NeMo's layout):
        the tokens of the query's blocks (ascending inside a block; blocks ascending while
        every visible block fits the budget, i.e. document position
        ``t < (budget/ratio + 1) * ratio - 1``, else the top ``budget // ratio`` by descending
        score, equal scores to the earlier block), right after them the tail
        ``V_t * ratio .. t`` (``V_t = (t + 1) // ratio``), then ``-1`` padding. Ids are global
        positions; pad queries get all ``-1``. No gradient (NeMo freezes the indexer).

    Guarantees: equals NeMo's ``select_qsa_token_ids`` on each document alone (offset by the
    document start) wherever its ``torch.topk`` has no tie at the cutoff; bitwise the same under
    CP and without, and bitwise independent of other documents. Under CP: one ``ratio - 1``
    token left halo of ``(index_k, cos, sin)`` and one all-gather of ``ceil(local_seq / ratio)``
    compressed keys per rank. Cost: each query is scored against the blocks of the
    ``ctx.band`` positions before it (not the whole row), and results do not depend on
    ``ctx.band`` either, bitwise. No host synchronisation, static shapes.
    """
    name = "qsa_indexer"
    check_context(ctx, fn=name)
    check_qsa_inputs(name, index_q, index_k, q_norm_weight, k_norm_weight, cos, sin,
                     ctx.batch_size, ctx.local_seq_len, budget, ratio)  # fmt: skip
    eps = check_float(eps, "eps", fn=name, positive=True)
    if query_chunk is not None:
        query_chunk = check_positive_int(query_chunk, "query_chunk", fn=name)
    backend = choose_backend(name, backend, BACKENDS, "pooled")
    index_q, index_k, q_norm_weight, k_norm_weight, cos, sin = (
        finite_or_zero(t.detach())
        for t in (index_q, index_k, q_norm_weight, k_norm_weight, cos, sin)
    )
    with autocast_off(index_q.device):  # the same selection inside autocast as outside
        return _RUN[backend](index_q, index_k, q_norm_weight, k_norm_weight, cos, sin, ctx,
                             budget, ratio, eps, query_chunk)  # fmt: skip
