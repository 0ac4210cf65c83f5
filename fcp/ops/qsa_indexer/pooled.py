"""The QSA selection's exact path (``backend="pooled"``, every device), exact under CP.

Each rank builds the compressed key of every block that *ends* in its interval (fp32 mean of
the ``ratio`` raw keys, cast back, zero-centred RMSNorm, RoPE with the tables of the block's
first token), from a ``ratio - 1`` token left halo of ``(index_k, cos, sin)`` for blocks that
start on an earlier rank, compacts them into ``ceil(local / ratio)`` static slots and
all-gathers the slots: ``[batch, cp_size * slots, Di]`` in ``index_k``'s dtype, ``Di / ratio``
values per token (NeMo's packed CP path all-gathers the raw index keys and the RoPE tables of
every token instead). Each chunk of queries scores the slots its documents can reach
(``ctx.band`` positions back; one matmul per index head and chunk), keeps the visible
blocks of their document and takes the top ``budget // ratio`` with fcp's tie rule; queries in
the dense phase keep every visible block in ascending order, as NeMo does.
"""

from __future__ import annotations

import math

import torch

from fcp.context import PackedContext
from fcp.ops.kit.norms import rotate_half_rope, zero_centered_rms_norm
from fcp.ops.kit.pools import (
    gather_pool_keys,
    plan_pools,
    pool_windows,
    select_pools,
)

__all__ = ["compressed_keys", "qsa_indexer_pooled"]


def compressed_keys(index_k: torch.Tensor, k_norm_weight: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, ends: torch.Tensor, ctx: PackedContext, ratio: int,
                    eps: float) -> torch.Tensor:
    """``[batch, C, Di]`` in ``index_k``'s dtype: the compressed key of every local block end
    (zeros in empty slots)."""
    di, half = index_k.shape[-1], cos.shape[-1]
    common = torch.promote_types(index_k.dtype, torch.promote_types(cos.dtype, sin.dtype))
    parts = [index_k.to(common), cos.to(common), sin.to(common)]
    window = pool_windows(torch.cat(parts, -1), ends, ctx, ratio)  # [b, C, ratio, Di + R]
    k_win = window[..., :di].to(index_k.dtype)  # exact casts back
    cos0 = window[:, :, 0, di : di + half].to(cos.dtype)  # the block's first token
    sin0 = window[:, :, 0, di + half :].to(sin.dtype)
    kbar = k_win.float().mean(2).to(index_k.dtype)
    keys = rotate_half_rope(zero_centered_rms_norm(kbar, k_norm_weight, eps), cos0, sin0)
    return torch.where((ends >= 0)[..., None], keys, torch.zeros((), dtype=keys.dtype))


def qsa_indexer_pooled(index_q: torch.Tensor, index_k: torch.Tensor, q_norm_weight: torch.Tensor,
                       k_norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       ctx: PackedContext, budget: int, ratio: int,
                       eps: float, query_chunk: int | None = None) -> torch.Tensor:
    """int64 ``[batch, local_seq, budget + ratio - 1]`` global token ids (see :mod:`.reference`)."""
    k_blocks = budget // ratio
    q = rotate_half_rope(
        zero_centered_rms_norm(index_q, q_norm_weight, eps), cos[:, :, None], sin[:, :, None]
    )
    plan = plan_pools(ctx, ratio)
    keys = compressed_keys(index_k, k_norm_weight, cos, sin, plan.ends, ctx, ratio, eps)
    # dense phase (every visible block fits the budget): ascending blocks, as NeMo emits them
    dense = ((ctx.local_position_ids + 1) // ratio <= k_blocks)[..., None]
    return select_pools(q.float(), gather_pool_keys(keys, ctx), plan, ctx, ratio,
                        k_blocks, tail="after_chosen", ascending=dense,
                        divisor=math.sqrt(q.shape[-1]), chunk=query_chunk)  # fmt: skip
