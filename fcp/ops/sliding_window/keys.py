"""What both backends of sliding-window attention share: the halo exchange and the key metadata."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fcp.comm import with_left_halo
from fcp.context import PackedContext
from fcp.ops.kit.masks import doc_ids_window

__all__ = ["WindowKeys", "window_keys"]


class WindowKeys(NamedTuple):
    kv: torch.Tensor  # [b, halo + local, hkv, D + Dv] fp32: the halo, then the shard
    doc: torch.Tensor  # [b, halo + local] their doc ids (OUTSIDE before the row)
    pos: torch.Tensor  # int64 [halo + local]: positions relative to kv[:, 0]
    halo: int  # tokens before the shard (local query i is at relative position halo + i)


def window_keys(k, v, ctx: PackedContext, halo: int) -> WindowKeys:
    """The keys of this rank's queries: ``halo`` tokens received from earlier ranks (zeros with
    doc id ``OUTSIDE`` before the row start), then the shard; fp32 so that the halo's gradient is
    summed in fp32 on its owner."""
    kv = with_left_halo(torch.cat([k, v], -1), ctx, halo, dtype=torch.float32)
    n = kv.shape[1]
    doc = doc_ids_window(ctx.doc_ids, ctx.seq_start - halo, n)
    return WindowKeys(kv, doc, torch.arange(n, device=k.device), halo)
