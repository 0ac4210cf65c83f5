"""What both backends of compressed attention share: the CP data movement and key metadata.

:func:`compressed_keys` returns, for this rank's queries,

* the all-gathered block means ``blocks [batch, nc, kv_heads, D + Dv]`` (only the ``nc`` blocks
  that end before ``seq_end``, the only ones any local query can see), their doc ids
  (``OUTSIDE`` for a block mixing documents) and indices;
* the exact window: the ``window - 1`` tokens before the shard (:func:`fcp.comm.with_left_halo`)
  followed by the shard, ``ext [batch, window - 1 + local, kv_heads, D + Dv]``, and their doc ids.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fcp.comm import all_gather_sequence, with_left_halo
from fcp.context import PackedContext
from fcp.ops.kit.common import compute_dtype
from fcp.ops.kit.masks import doc_ids_window, full_block_doc_ids

__all__ = ["CompressedKeys", "compress_blocks", "compressed_keys"]


def compress_blocks(x: torch.Tensor, ratio: int) -> torch.Tensor:
    """``[batch, n, ...] -> [batch, n // ratio, ...]``: mean of each full block (summed in fp32,
    fp64 for fp64 input; result in ``x``'s dtype); a trailing partial block is dropped."""
    nb = x.shape[1] // ratio
    blocks = x[:, : nb * ratio].unflatten(1, (nb, ratio))
    return blocks.to(compute_dtype(x)).mean(2).to(x.dtype)


class CompressedKeys(NamedTuple):
    blocks: torch.Tensor  # [b, nc, hkv, D + Dv] block means, gathered
    block_doc: torch.Tensor  # [b, nc] doc id of each full-document block, else OUTSIDE
    block_index: torch.Tensor  # [nc] global block numbers
    ext: torch.Tensor  # [b, window - 1 + local, hkv, D + Dv] halo + shard
    ext_doc: torch.Tensor  # [b, window - 1 + local] their doc ids (OUTSIDE before the row)
    halo: torch.Tensor  # the received halo (for the backward anchor)
    gathered: torch.Tensor  # the full all-gather result (for the backward anchor)


def compressed_keys(k, v, ctx: PackedContext, ratio: int, window: int) -> CompressedKeys:
    """The keys of compressed attention for this rank's queries (see the module docstring)."""
    kv = torch.cat([k, v], -1)
    start, end, local = ctx.seq_start, ctx.seq_end, ctx.local_seq_len
    gathered = all_gather_sequence(compress_blocks(kv, ratio), ctx, dtype=torch.float32)
    nc = min(max(end - 1, 0) // ratio, gathered.shape[1])
    ext = with_left_halo(kv, ctx, window - 1, dtype=torch.float32)  # fp32 backward sums
    return CompressedKeys(
        blocks=gathered[:, :nc],
        block_doc=full_block_doc_ids(ctx.doc_ids, ratio, nc),
        block_index=torch.arange(nc, device=k.device),
        ext=ext,
        ext_doc=doc_ids_window(ctx.doc_ids, start - (window - 1), local + window - 1),
        halo=ext[:, : window - 1],
        gathered=gathered,
    )
