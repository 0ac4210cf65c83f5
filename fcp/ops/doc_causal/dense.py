"""Document-causal attention's ``"dense"`` backend: the banded masked softmax of
:mod:`fcp.ops.kit.softmax` over the all-gathered K/V (every device).

Guarantees: masked keys get probability exactly 0 (``torch.where``), so documents are bitwise
independent; fp32 softmax (fp64 for fp64 inputs); deterministic, and bitwise independent of
``ctx.band`` and of ``query_chunk``; static shapes, no host sync. Cost: ``O(local x band)``
scores per head (each block of queries against the keys of the ``ctx.band`` positions
before it, causal), memory ``O(local)`` saved for the backward plus one chunk of scores.
With long documents under CP the queries are balanced across ranks (:mod:`fcp.ops.kit.balance`):
bitwise the same results, the same work on every rank.
"""

from __future__ import annotations

import torch

from fcp.comm import all_gather_sequence
from fcp.context import PackedContext
from fcp.ops.kit.attention import with_anchors
from fcp.ops.kit.balance import attention_plan, last_query, run_balanced
from fcp.ops.kit.softmax import banded_attention

__all__ = ["doc_causal_dense"]


def doc_causal_dense(q, k, v, ctx: PackedContext, scale: float, query_chunk: int | None = None,
                     *, sinks=None, softcap=None) -> torch.Tensor:
    """``[batch, local_seq, heads, Dv]`` (arguments checked by the dispatcher; ``sinks``
    ``[batch, local_seq, heads]``). Long documents: the queries of :func:`attention_plan`."""
    dk, plan = k.shape[-1], attention_plan(ctx)
    kv = all_gather_sequence(torch.cat([k, v], -1), ctx, dtype=torch.float32)
    positions = torch.arange(last_query(ctx, plan), device=q.device)

    def run(start: int, n: int, q, sinks):
        end = start + n  # keys after the run's queries are never visible
        return banded_attention(q, kv[:, :end], dk, ctx.doc_ids[:, :end], positions[:end],
                                ctx.doc_ids[:, start:end], start, ctx.key_band, scale,
                                sinks=sinks, softcap=softcap, chunk=query_chunk)  # fmt: skip

    return with_anchors(run_balanced(ctx, plan, run, q, sinks), ctx, kv)
