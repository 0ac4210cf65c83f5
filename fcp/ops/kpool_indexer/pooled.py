"""The k-pool indexer's exact path (``backend="pooled"``, every device), exact under CP.

Each rank computes the pooled key of every pool that *ends* in its interval, from the ``kpool``
tokens of ``(index_k, gate_logits)`` behind the end (a ``kpool - 1`` token left halo brings the
part of a pool that starts on an earlier rank), compacts them into ``ceil(local / kpool)``
static slots and all-gathers the slots: ``[batch, cp_size * slots, Di]`` in ``index_k``'s dtype,
about ``Di / kpool`` values per token. Nothing else crosses ranks: the slot table comes from the
replicated doc-id map (:mod:`fcp.ops.kit.pools`). Each chunk of queries then scores the slots
its documents can reach (``ctx.band`` positions back: ``O(local x band / kpool)`` fp32
scores, one matmul per index head and chunk; a chunk's scores bound the transient memory),
keeps the visible ones and takes the top ``topk // kpool`` with fcp's tie rule.

Bitwise: a pooled key is computed by the same arithmetic on the same tokens whatever the rank
layout, and a query's scores involve only its document's pools, so the selection is the same
with and without CP and independent of other documents.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.kit.pools import (
    gather_pool_keys,
    plan_pools,
    pool_windows,
    select_pools,
)

__all__ = ["pooled_keys", "kpool_indexer_pooled"]


def pooled_keys(index_k: torch.Tensor, gate_logits: torch.Tensor, ape: torch.Tensor,
                ends: torch.Tensor, ctx: PackedContext, kpool: int) -> torch.Tensor:
    """``[batch, C, Di]`` in ``index_k``'s dtype: the gated pool mean of every local pool end
    (zeros in empty slots)."""
    di = index_k.shape[-1]
    common = torch.promote_types(index_k.dtype, gate_logits.dtype)
    window = pool_windows(
        torch.cat([index_k.to(common), gate_logits.to(common)], -1), ends, ctx, kpool
    )  # [b, C, kpool, 2 Di]; the casts back below are exact
    k_win = window[..., :di].to(index_k.dtype)
    z_win = window[..., di:].to(gate_logits.dtype)
    # the softmax over each channel's kpool tokens runs along the last axis (CPU's fast path)
    logits = (z_win.float() + ape.float()).transpose(-1, -2)  # [b, C, Di, kpool]
    prob = torch.softmax(logits, -1).to(index_k.dtype)
    pooled = (prob * k_win.transpose(-1, -2)).sum(-1)
    return torch.where((ends >= 0)[..., None], pooled, torch.zeros((), dtype=pooled.dtype))


def kpool_indexer_pooled(index_q: torch.Tensor, index_k: torch.Tensor, gate_logits: torch.Tensor,
                         ape: torch.Tensor, head_weights: torch.Tensor, ctx: PackedContext,
                         topk: int, kpool: int, select_tail: bool, scale: float,
                         query_chunk: int | None = None) -> torch.Tensor:
    """int64 ``[batch, local_seq, W]`` global token ids (see :mod:`.reference`)."""
    plan = plan_pools(ctx, kpool)
    keys = gather_pool_keys(pooled_keys(index_k, gate_logits, ape, plan.ends, ctx, kpool),
                            ctx)  # fmt: skip
    tail = "after_document_pools" if select_tail else "none"
    return select_pools(index_q.float(), keys, plan, ctx, kpool, topk // kpool, tail=tail,
                        head_weights=head_weights.float(), scale=scale,
                        chunk=query_chunk)  # fmt: skip
