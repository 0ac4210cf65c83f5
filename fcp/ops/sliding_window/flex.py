"""Sliding-window attention's ``"flex"`` backend: FlexAttention (:mod:`fcp.ops.kit.flex`) with the
dense backend's mask over the halo and the shard (CUDA; no CPU backward).

Guarantees: the dense backend's mask exactly; the kernel's own rounding (online softmax, fp32
statistics); sinks applied from the kernel's log-sum-exp; static shapes, no host sync.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.kit import flex
from fcp.ops.kit.attention import with_anchors
from fcp.ops.sliding_window.keys import window_keys

__all__ = ["sliding_window_flex"]


def sliding_window_flex(q, k, v, ctx: PackedContext, window: int, halo: int, scale: float,
                        query_chunk: int | None = None, *, sinks=None,
                        softcap=None) -> torch.Tensor:  # fmt: skip
    """``[batch, local_seq, heads, Dv]`` (arguments checked by the dispatcher; FlexAttention
    tiles by itself, ``query_chunk`` is unused)."""
    dk = k.shape[-1]
    keys = window_keys(k, v, ctx, halo)
    lo = keys.pos - halo  # key j is visible to local queries j - halo .. j - halo + window - 1
    out = flex.flex_attend(q, keys.kv[..., :dk], keys.kv[..., dk:], ctx.local_doc_ids, keys.doc,
                           lo, lo + (window - 1), scale, sinks=sinks,
                           softcap=softcap)  # fmt: skip
    return with_anchors(out, ctx, keys.kv[:, :halo])
