"""Document-causal attention's ``"flex"`` backend: FlexAttention (:mod:`fcp.ops.kit.flex`) with the
dense backend's mask, over the all-gathered K/V prefix ``[0, seq_end)`` (CUDA; no CPU backward).

Guarantees: the dense backend's mask exactly, and its balanced query plan under CP; the kernel's own rounding (online softmax, fp32
statistics); static shapes, no host sync.
"""

from __future__ import annotations

import torch

from fcp.comm import all_gather_sequence
from fcp.context import PackedContext
from fcp.ops.kit import flex
from fcp.ops.kit.attention import with_anchors
from fcp.ops.kit.balance import attention_plan, run_balanced

__all__ = ["doc_causal_flex"]


def doc_causal_flex(q, k, v, ctx: PackedContext, scale: float, query_chunk: int | None = None,
                    *, sinks=None, softcap=None) -> torch.Tensor:
    """``[batch, local_seq, heads, Dv]`` (arguments checked by the dispatcher; FlexAttention
    tiles by itself, ``query_chunk`` is unused)."""
    dk, plan = k.shape[-1], attention_plan(ctx)
    kv = all_gather_sequence(torch.cat([k, v], -1), ctx, dtype=torch.float32)

    def run(start: int, n: int, q, sinks):
        end = start + n  # keys after the run's queries are never visible
        keys = kv[:, :end]
        lo = torch.arange(end, device=q.device) - start  # the run's query index seeing key s
        hi = torch.full_like(lo, flex.UNBOUNDED)
        return flex.flex_attend(q, keys[..., :dk], keys[..., dk:], ctx.doc_ids[:, start:end],
                                ctx.doc_ids[:, :end], lo, hi, scale, sinks=sinks,
                                softcap=softcap)  # fmt: skip

    return with_anchors(run_balanced(ctx, plan, run, q, sinks), ctx, kv)
