"""The k-pool indexer's exact path (``backend="pooled"``, every device), exact under CP.

Each rank computes the pooled key of every pool that *ends* in its interval, from the ``kpool``
tokens of ``(index_k, gate_logits)`` behind the end (a ``kpool - 1`` token left halo brings the
part of a pool that starts on an earlier rank), compacts them into ``ceil(local / kpool)``
static slots and all-gathers the slots: ``[batch, cp_size * slots, Di]`` in ``index_k``'s dtype,
about ``Di / kpool`` values per token. Nothing else crosses ranks: the slot table comes from the
replicated doc-id map (:mod:`fcp.ops.doc_pools`). Each query then scores every slot (``O(local x
seq / kpool)`` fp32 scores, one matmul per index head), keeps the visible ones and takes the
top ``topk // kpool`` with fcp's tie rule.

Bitwise: a pooled key is computed by the same arithmetic on the same tokens whatever the rank
layout, and a query's scores involve only its document's pools, so the selection is the same
with and without CP and independent of other documents.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.doc_pools import (
    all_gather_slots,
    by_score,
    doc_lengths,
    local_slots,
    place_tail,
    pool_slots,
    pool_tokens,
    pool_windows,
    tail_tokens,
    top_pools,
    visible_pools,
)

__all__ = ["pooled_keys", "kpool_indexer_pooled"]


def pooled_keys(
    index_k: torch.Tensor,
    gate_logits: torch.Tensor,
    ape: torch.Tensor,
    ends: torch.Tensor,
    context: PackedContext,
    kpool: int,
) -> torch.Tensor:
    """``[batch, C, Di]`` in ``index_k``'s dtype: the gated pool mean of every local pool end
    (zeros in empty slots)."""
    di = index_k.shape[-1]
    common = torch.promote_types(index_k.dtype, gate_logits.dtype)
    window = pool_windows(
        torch.cat([index_k.to(common), gate_logits.to(common)], -1), ends, context, kpool
    )  # [b, C, kpool, 2 Di]; the casts back below are exact
    k_win = window[..., :di].to(index_k.dtype)
    z_win = window[..., di:].to(gate_logits.dtype)
    # the softmax over each channel's kpool tokens runs along the last axis (CPU's fast path)
    logits = (z_win.float() + ape.float()).transpose(-1, -2)  # [b, C, Di, kpool]
    prob = torch.softmax(logits, -1).to(index_k.dtype)
    pooled = (prob * k_win.transpose(-1, -2)).sum(-1)
    return torch.where((ends >= 0)[..., None], pooled, torch.zeros((), dtype=pooled.dtype))


def kpool_indexer_pooled(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    gate_logits: torch.Tensor,
    ape: torch.Tensor,
    head_weights: torch.Tensor,
    context: PackedContext,
    topk: int,
    kpool: int,
    select_tail: bool,
    scale: float,
) -> torch.Tensor:
    """int64 ``[batch, local_seq, W]`` global token ids (see :mod:`.reference`)."""
    slots = pool_slots(context.doc_ids, kpool, context.cp_size)  # [b, P], replicated
    ends = local_slots(slots, context, kpool)
    keys = all_gather_slots(pooled_keys(index_k, gate_logits, ape, ends, context, kpool), context)
    keys_t = keys.float().transpose(1, 2)  # [b, Di, P]
    q, w = index_q.float(), head_weights.float()
    score = None
    for h in range(q.shape[2]):  # one [local, P] matmul per head bounds the memory
        term = w[:, :, h, None] * torch.relu(torch.matmul(q[:, :, h], keys_t) * scale)
        score = term if score is None else score + term
    slot, chosen, chosen_score = top_pools(score, visible_pools(slots, context), topk // kpool)
    slot, chosen = by_score(slot, chosen, chosen_score)
    pool_end = slots.gather(1, slot.flatten(1)).view_as(slot)
    rows = pool_tokens(pool_end, chosen, kpool)
    if select_tail and kpool > 1:
        # transformers' layout: the tail right after min(K, complete pools of the document) pool
        # slots (the columns in between hold -1)
        n_doc = doc_lengths(context.doc_ids, context.seq_start, context.local_seq_len)
        first = torch.clamp(n_doc // kpool, max=topk // kpool)[..., None] * kpool
        rows = place_tail(rows, tail_tokens(context, kpool), first)
    return rows
