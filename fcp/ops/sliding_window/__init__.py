"""Sliding-window softmax attention within documents, exact under contiguous CP by a left halo.

Query ``t`` sees key ``s`` iff ``doc(s) == doc(t) != 0`` and ``t - window < s <= t`` (global
positions; transformers' ``sliding_window`` convention: a query sees itself and the ``window -
1`` tokens before it). Optional attention sinks (gpt-oss, GPT-OSS-style per-head logits or
per-query ones) and logit soft-capping (Gemma).

Under CP no rank needs more than the ``min(window, band) - 1`` tokens before its interval, so
each rank receives exactly those tokens' K/V with :func:`fcp.comm.with_left_halo` (one
all-to-all with static splits; the halo may span several earlier ranks when the window is longer
than a shard) instead of all-gathering the row: ``O(window)`` bytes per layer whatever the row
length (``band``: :attr:`fcp.context.PackedContext.band`, the planned bound on document
lengths, so short documents shrink the halo too).

* :mod:`.reference` - the definition (a float64 per-query loop; tests only);
* :mod:`.dense` - ``backend="dense"``: the banded masked fp32 softmax (every device);
* :mod:`.flex` - ``backend="flex"``: FlexAttention with the same mask (CUDA).

:func:`sliding_window_attention` is the only dispatcher.
"""

from __future__ import annotations

import torch

from fcp.checks import check_positive_int
from fcp.context import PackedContext, check_context
from fcp.ops.kit.attention import (
    SOFTMAX_BACKENDS,
    attention_backend,
    check_qkv,
    check_sinks_softcap,
)
from fcp.ops.kit.common import autocast_off, default_scale, finite_or_zero, zero_nonfinite_grad
from fcp.ops.sliding_window.dense import sliding_window_dense
from fcp.ops.sliding_window.flex import sliding_window_flex

__all__ = ["BACKENDS", "halo_tokens", "sliding_window_attention"]

#: ``"dense"``: banded masked fp32 softmax, every device. ``"flex"``: FlexAttention (CUDA default).
BACKENDS = SOFTMAX_BACKENDS
_RUN = {"dense": sliding_window_dense, "flex": sliding_window_flex}


def halo_tokens(ctx: PackedContext, window: int) -> int:
    """The K/V tokens each rank receives from earlier ranks: ``min(window, band) - 1`` under CP
    (a key further back is outside the window or in an earlier document), 0 without."""
    return min(window, ctx.key_band) - 1 if ctx.cp_enabled else 0


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             ctx: PackedContext, window: int, scale: float | None = None, *,
                             sinks: torch.Tensor | None = None, softcap: float | None = None,
                             query_chunk: int | None = None,
                             backend: str = "auto") -> torch.Tensor:  # fmt: skip
    """Causal attention within documents over the last ``window`` tokens.

    Args:
        q: ``[batch, local_seq, heads, D]``, this rank's queries.
        k: ``[batch, local_seq, kv_heads, D]``; ``heads`` a multiple of ``kv_heads`` (GQA:
            query head ``h`` uses kv head ``h // (heads // kv_heads)``).
        v: ``[batch, local_seq, kv_heads, Dv]``.
        ctx: the rank's :class:`~fcp.context.PackedContext`.
        window: keys ``s`` with ``t - window < s <= t`` (``>= 1``; ``1``: each token itself).
        scale: softmax scale, default ``D ** -0.5``.
        sinks: attention sinks: ``[heads]`` or ``[batch, local_seq, heads]`` logits, one more
            ``exp(sink)`` in each softmax's denominator with a zero value; gradients flow to
            them. ``None``: none.
        softcap: scores (after ``scale``) become ``softcap * tanh(score / softcap)``.
        query_chunk: ``"dense"``: queries processed at a time (rounded down to blocks of 64;
            results do not depend on it, bitwise). ``"flex"`` ignores it.
        backend: ``"auto"`` (``"flex"`` on CUDA, ``"dense"`` elsewhere), ``"dense"`` or
            ``"flex"``.

    Returns:
        ``[batch, local_seq, heads, Dv]`` in ``q``'s dtype (softmax in fp32, fp64 for fp64
        inputs). Pad queries (doc id 0) get zeros and send no gradient. Cost: ``O(local x
        min(window, band))`` scores per head; under CP a halo of :func:`halo_tokens` tokens'
        K/V per layer (sent in the inputs' dtype).

    Example: ``window=2``, one document of 3 tokens with equal scores: token 2 averages
    tokens 1 and 2, not 0::

        >>> ctx = PackedContext(torch.tensor([[1, 1, 1]]))
        >>> q = k = torch.zeros(1, 3, 1, 1)
        >>> v = torch.tensor([1.0, 3.0, 5.0]).view(1, 3, 1, 1)
        >>> sliding_window_attention(q, k, v, ctx, window=2).flatten().tolist()
        [1.0, 2.0, 4.0]
    """
    name = "sliding_window_attention"
    check_context(ctx, fn=name)
    check_qkv(name, q, k, v, ctx)
    window = check_positive_int(window, "window", fn=name)
    sinks, softcap = check_sinks_softcap(name, sinks, softcap, q)
    backend = attention_backend(name, backend, q)
    scale = default_scale(q.shape[-1], scale)
    if query_chunk is not None:
        query_chunk = check_positive_int(query_chunk, "query_chunk", fn=name)
    q, k, v = finite_or_zero(q), finite_or_zero(k), finite_or_zero(v)
    with autocast_off(q.device):
        out = _RUN[backend](q, k, v, ctx, window, halo_tokens(ctx, window), scale, query_chunk,
                            sinks=sinks, softcap=softcap)  # fmt: skip
    return zero_nonfinite_grad(out)
