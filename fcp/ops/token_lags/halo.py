"""Token lags by a left halo: the ``"halo"`` backend of :func:`fcp.ops.token_lags.token_lags`,
every device.

A token's lags reach at most ``size - 1`` tokens back, so this rank needs exactly the ``size -
1`` global tokens before its interval: one :func:`~fcp.comm.with_left_halo` (multi-hop when a
shard is shorter than that; their gradients go back to their owners through its backward).
Which of them belong to the token's document comes from the replicated doc-id map: entry ``j``
is ``torch.where(same document, x[t - j], fill)``, so no document boundary is communicated and
another document's values never reach an entry (forward or backward). Static shapes, no host
synchronisation.
"""

from __future__ import annotations

import torch

from fcp.comm import with_left_halo
from fcp.context import PackedContext
from fcp.layout import PAD_DOC_ID, doc_ids_window

__all__ = ["token_lags_halo"]


def token_lags_halo(x: torch.Tensor, ctx: PackedContext, size: int,
                    fill: float | torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``[batch, local_seq, size, channels]`` (arguments checked by the dispatcher)."""
    back, n = size - 1, x.shape[1]
    # global tokens seq_start - back .. seq_end - 1; zeros (doc id OUTSIDE) before the row
    both = with_left_halo(x, ctx, back)
    docs = doc_ids_window(ctx.doc_ids, ctx.seq_start - back, back + n)
    mine = ctx.local_doc_ids
    real = (mine != PAD_DOC_ID)[..., None]
    lags = [x]
    for j in range(1, size):  # token t - j sits at column back - j + (t - seq_start)
        same = real & (docs[:, back - j : back - j + n] == mine)[..., None]
        lags.append(torch.where(same, both[:, back - j : back - j + n], fill))
    return torch.stack(lags, 2)
