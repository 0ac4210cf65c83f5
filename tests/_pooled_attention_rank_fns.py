"""Functions run on pool ranks by DeepSeek-V4's pooled-attention tests
(``tests/test_hf_deepseek_v4.py``; importable by module path)."""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.kit.pools import plan_pools
from fcp.ops.pooled_attention import gated_pools, pool_select, pooled_window_attention
from tests.support import cp_jobs

#: differentiated inputs; ``sinks`` is not per token (its gradient: this rank's partial sum)
GRADS = ("q", "kv", "pkv", "pgate", "sinks")


def cp_rank(env, inputs: dict, doc_ids: torch.Tensor, grad_out: torch.Tensor, ratio: int,
            window: int, overlap: bool, topk: int | None,
            query_chunk: int | None = None) -> dict:  # fmt: skip
    """Pools, selection (``topk``; ``None``: every visible pool) and attention on this rank's
    interval (``env=None``: one process), ``query_chunk`` queries at a time, backward of
    ``sum(out * grad_out)``: ``{"out", "pooled", "pool_ends", "ends" (the selected pools' global
    end positions, -1: none), and one gradient per name of GRADS}``."""
    ctx = PackedContext(doc_ids) if env is None else cp_jobs.cp_context(env, doc_ids)
    sl = cp_jobs.shard(ctx)
    t = cp_jobs.leaves(inputs, sl, GRADS, ("sinks",))
    pooled, _ = gated_pools(t["pkv"], t["pgate"], ctx, ratio, overlap=overlap)
    selected = ends = None
    if topk is not None:
        keys, _ = gated_pools(t["ikv"], t["igate"], ctx, ratio, overlap=overlap)
        selected = pool_select(t["iq"], keys, t["hw"], ctx, ratio, topk, 0.5)
        slots = plan_pools(ctx, ratio).slots
        found = slots.gather(1, selected.clamp(min=0).flatten(1)).view_as(selected)
        ends = torch.where(selected >= 0, found, -1)
    out = pooled_window_attention(t["q"], t["kv"], pooled, ctx, ratio, window, sinks=t["sinks"],
                                  selected=selected, query_chunk=query_chunk)  # fmt: skip
    (out * grad_out[:, sl]).sum().backward()
    return {"out": out.detach(), "pooled": pooled.detach(),
            "pool_ends": plan_pools(ctx, ratio).ends, "ends": ends,
            **{n: t[n].grad for n in GRADS}}
