"""The token indexer's exact path (``backend="gathered"``, every device), exact under CP.

The k-pool pipeline of :mod:`fcp.ops.kit.pools` with pools of one token: every real token ends
its own pool, so the slot table is the doc-id map itself (slot ``r * L + c`` = rank ``r``'s
local token ``c``, ``-1`` for padding), the "pooled" keys are the index keys as they are (no
halo, no softmax over a pool), and one all-gather of ``[batch, local_seq, Di]`` in
``index_k``'s dtype brings every rank's keys. Each chunk of queries then scores the keys its
documents can reach (``ctx.band`` positions back: ``O(local x band)`` fp32 scores, one matmul
per index head and chunk), keeps the visible ones and takes the top ``topk`` with fcp's tie
rule (:func:`~fcp.ops.kit.pools.top_pools`: equal scores to the earlier token).

Bitwise: a query's scores involve only its document's keys, each computed by the same
arithmetic whatever the rank layout, so the selection is the same with and without CP and
independent of other documents. It is also bitwise :func:`fcp.ops.kpool_indexer.kpool_indexer`
with ``kpool=1`` and ``select_tail=False`` (a one-token pool's key is its token's key, exactly).
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.kit.pools import gather_pool_keys, plan_pools, select_pools

__all__ = ["token_indexer_gathered"]


def token_indexer_gathered(index_q: torch.Tensor, index_k: torch.Tensor,
                           head_weights: torch.Tensor, ctx: PackedContext, topk: int,
                           scale: float, query_chunk: int | None = None) -> torch.Tensor:
    """int64 ``[batch, local_seq, topk]`` global token ids (see :mod:`.reference`; arguments
    checked, detached and made finite by the dispatcher)."""
    plan = plan_pools(ctx, 1)  # one-token pools: slot c of a rank is its local token c
    keys = gather_pool_keys(index_k, ctx)  # [batch, cp_size * local_seq, Di] fp32, slot order
    return select_pools(index_q.float(), keys, plan, ctx, 1, topk, tail="none",
                        head_weights=head_weights.float(), scale=scale,
                        chunk=query_chunk)  # fmt: skip
