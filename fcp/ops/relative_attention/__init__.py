"""Softmax attention within documents with a per-query relative position bias, exact under
contiguous CP (Inkling-2's attention layers).

Query ``t`` sees key ``s`` iff ``doc(s) == doc(t) != 0`` and ``0 <= t - s`` (and ``t - s <
window`` with a window); the score of the pair is::

    scale * q_t . k_s  +  bias[t, h, t - s]     (0 where t - s >= E, E = bias.shape[-1])

``bias [B, L, H, E]`` is a table per query and head over the backward distance ``0 .. E - 1``
(Inkling-2: the token's relative states times a trained bank of bias-vs-distance profiles). Such
a bias is neither a function of ``(t - s)`` alone nor a product of a query and a key vector, so
the softmax operators of :mod:`fcp.ops.kit.softmax` cannot add it; this operator adds it to each
score it computes. Optional per-query attention sinks (one more logit in every denominator with
a zero value).

Under CP: with a ``window``, the ``min(window, band) - 1`` tokens' K/V before the shard
(:func:`fcp.comm.with_left_halo`); without, an all-gather of K/V
(:func:`fcp.comm.all_gather_sequence`). The bias and the sinks are per query: they never leave
their rank.

* :mod:`.reference` - the definition (a float64 per-query loop; tests only);
* :mod:`.dense` - ``backend="dense"``: masked fp32 softmax, queries in chunks (every device).

:func:`relative_attention` is the only dispatcher.
"""

from __future__ import annotations

import torch

from fcp.checks import check_positive_int, check_tensor
from fcp.context import PackedContext, check_context
from fcp.ops.kit.attention import check_qkv, check_sinks_softcap
from fcp.ops.kit.common import autocast_off, choose_backend, default_scale, finite_or_zero
from fcp.ops.kit.common import zero_nonfinite_grad
from fcp.ops.relative_attention.dense import relative_attention_dense

__all__ = ["BACKENDS", "relative_attention"]

#: ``"dense"``: masked fp32 softmax over query chunks, every device.
BACKENDS = ("dense",)


def relative_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                       ctx: PackedContext, scale: float | None = None, *,
                       window: int | None = None, sinks: torch.Tensor | None = None,
                       query_chunk: int | None = None,
                       backend: str = "auto") -> torch.Tensor:  # fmt: skip
    """Causal attention within documents plus a per-query bias over the backward distance.

    Args:
        q: ``[batch, local_seq, heads, D]``, this rank's queries.
        k: ``[batch, local_seq, kv_heads, D]``; ``heads`` a multiple of ``kv_heads`` (GQA:
            query head ``h`` uses kv head ``h // (heads // kv_heads)``).
        v: ``[batch, local_seq, kv_heads, Dv]``.
        bias: ``[batch, local_seq, heads, E]``: ``bias[b, t, h, d]`` is added to the score of
            query ``t``, head ``h`` and the key ``d`` tokens before it (``d < E``; keys further
            back get no bias). Gradients flow to it.
        ctx: the rank's :class:`~fcp.context.PackedContext`.
        scale: softmax scale of ``q . k``, default ``D ** -0.5``.
        window: ``None`` (every earlier key of the document) or keys ``t - window < s <= t``.
        sinks: ``[heads]`` or ``[batch, local_seq, heads]`` logits, one more ``exp(sink)`` in
            each softmax's denominator with a zero value; gradients flow to them.
        query_chunk: queries processed at a time (default: about 4M scores per chunk). The
            result does not depend on it.
        backend: ``"auto"`` (= ``"dense"``) or ``"dense"``.

    Returns:
        ``[batch, local_seq, heads, Dv]`` in ``q``'s dtype (scores and softmax in fp32, fp64
        for fp64 inputs). Pad queries (doc id 0) get zeros and send no gradient. Cost: each
        chunk of queries scores the keys of the ``min(window, ctx.band)`` positions before it
        (``O(local x min(window, band))`` per head); the backward recomputes each chunk's
        scores, so only one chunk's are held at a time.

    Example: two tokens of one document, equal keys: the bias of distance 1 (``log 3``) makes
    token 1 weigh token 0 three times as much as itself::

        >>> ctx = PackedContext(torch.tensor([[1, 1]]))
        >>> q = k = torch.zeros(1, 2, 1, 1)
        >>> v = torch.tensor([4.0, 0.0]).view(1, 2, 1, 1)
        >>> bias = torch.tensor([0.0, 3.0]).log().expand(1, 2, 1, 2)
        >>> [round(x, 4) for x in relative_attention(q, k, v, bias, ctx).flatten().tolist()]
        [4.0, 3.0]
    """
    name = "relative_attention"
    check_context(ctx, fn=name)
    check_qkv(name, q, k, v, ctx)
    b, n, h, _ = q.shape
    check_tensor(bias, "bias", fn=name, kind="float", dim=4,
                 layout="[batch, local_seq, heads, extent]")  # fmt: skip
    if tuple(bias.shape[:3]) != (b, n, h) or bias.shape[3] < 1:
        raise ValueError(f"{name}: bias {tuple(bias.shape)} must be [batch, local_seq, heads, "
                         f"extent >= 1] = [{b}, {n}, {h}, E]")  # fmt: skip
    sinks, _ = check_sinks_softcap(name, sinks, None, q)
    if window is not None:
        window = check_positive_int(window, "window", fn=name)
    if query_chunk is not None:
        query_chunk = check_positive_int(query_chunk, "query_chunk", fn=name)
    choose_backend(name, backend, BACKENDS, "dense")
    scale = default_scale(q.shape[-1], scale)
    q, k, v, bias = (finite_or_zero(t) for t in (q, k, v, bias))
    with autocast_off(q.device):
        out = relative_attention_dense(q, k, v, bias, ctx, scale, window, sinks, query_chunk)
    return zero_nonfinite_grad(out)
