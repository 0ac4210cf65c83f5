"""Token history by an integer left halo: the ``"halo"`` backend of
:func:`fcp.ops.token_history.token_history`, every device.

A token's history reaches at most ``size - 1`` tokens back, so this rank needs exactly the
``size - 1`` global ids before its interval: one :func:`~fcp.comm.left_halo` (multi-hop when a
shard is shorter than that). Which of them belong to the token's document comes from the
replicated doc-id map, so no document boundary is ever communicated. The output is built column
by column with a running mask (the history stops at the first document change or reset token and
never resumes), one ``where`` per column: static shapes, no host synchronisation.
"""

from __future__ import annotations

import torch

from fcp.comm import left_halo
from fcp.context import PackedContext
from fcp.layout import PAD_DOC_ID

__all__ = ["token_history_halo"]


def token_history_halo(tokens: torch.Tensor, ctx: PackedContext, size: int, fill: int,
                       reset: int | None) -> torch.Tensor:  # fmt: skip
    """int64 ``[batch, local_seq, size]`` (arguments checked by the dispatcher)."""
    ids = tokens.long()
    back = size - 1
    if back == 0:
        return ids[..., None]
    n = ids.shape[1]
    # global tokens seq_start - back .. seq_end - 1: column j + i of `both` is token
    # seq_start + i - (back - j); ids before the sequence start come back as zeros
    both = torch.cat([left_halo(ids, ctx, back), ids], 1)
    pos = torch.arange(ctx.seq_start - back, ctx.seq_end, device=ids.device)
    docs = torch.where(pos >= 0, ctx.doc_ids[:, pos.clamp(min=0)], PAD_DOC_ID)
    mine = ctx.local_doc_ids
    ok = mine != PAD_DOC_ID  # pad tokens have no history
    cols = [ids]
    for s in range(1, size):
        j = back - s  # token t - s sits at column j + (t - seq_start) of `both`
        ok = ok & (docs[:, j : j + n] == mine)
        if reset is not None and s > 1:  # token t - s + 1 is a reset: nothing before it counts
            ok = ok & (both[:, j + 1 : j + 1 + n] != reset)
        cols.append(torch.where(ok, both[:, j : j + n], fill))
    return torch.stack(cols, -1)
