"""The short conv's exact static-shape path (``backend="masked"``): document-masked taps.

``y[t] = act(bias + sum_i weight[:, i] * x[t - (W-1-i) * dilation])`` over the taps whose token
lies in ``t``'s own document. Under CP the ``(W - 1) * dilation`` tokens before a shard come from
:func:`fcp.comm.left_halo` (several ranks back when a shard is shorter than that), and the
replicated doc-id map masks them, so no state crosses a document boundary, padding included.

Parameter gradients (``weight``, ``bias``) are per-rank partial sums under CP, the usual contract:
the data-parallel gradient reduction over the CP ranks sums them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fcp.comm import with_left_halo
from fcp.context import PackedContext
from fcp.layout import doc_ids_window
from fcp.ops.kit.common import compute_dtype

__all__ = ["short_conv_masked"]


def short_conv_masked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      ctx: PackedContext, activation: str | None = None,
                      dilation: int = 1) -> torch.Tensor:
    """The ``"masked"`` backend of :func:`fcp.ops.conv.short_conv` (arguments checked there).

    Guarantees: exact (fp32 accumulation, fp64 for fp64 inputs); every tap of another document is *selected away*
    (``torch.where``), so documents are bitwise independent and non-finite values stay in their
    document, forward and backward; deterministic; sync-free, static shapes.
    """
    width = weight.shape[1]
    history = (width - 1) * dilation
    dt = compute_dtype(x, weight)  # fp32 accumulation; fp64 stays fp64
    xx = with_left_halo(x, ctx, history, dtype=dt)  # the backward sums halo grads in dt
    # halo + shard doc ids; positions before the global start match no token
    start, length = ctx.seq_start - history, history + ctx.local_seq_len
    doc = doc_ids_window(ctx.doc_ids, start, length)
    own = doc[:, history:]
    w = weight.to(dt)
    out = x.new_zeros(x.shape, dtype=dt)
    length = x.shape[1]
    for i in range(width):  # static taps (width ~4): vectorised over tokens and channels
        j = i * dilation  # tap i reads token t - (width - 1 - i) * dilation
        same = (doc[:, j : j + length] == own).unsqueeze(-1)
        out = out + torch.where(same, xx[:, j : j + length], 0.0) * w[:, i]
    if bias is not None:
        out = out + bias.to(dt)
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)
