"""Index attention: each query attends to a given set of global tokens, exact under CP.

One operator serves both selections fcp ships: GLM-5.3-Flash's DSA k-pool indexer
(:func:`fcp.ops.kpool_indexer.kpool_indexer`, MLA head layout) and Qwen3.8-Flash-Next's QSA
(:func:`fcp.ops.qsa_indexer.qsa_indexer`, GQA). Any other producer of global token ids works.

* :mod:`.reference` - the definition (a float64 per-query loop; tests only);
* :mod:`.gather` - the ``"gather"`` backend: gathers the selected keys (``O(W)`` per query,
  no ``local x sequence`` mask), the same code on CPU and CUDA.

:func:`index_attention` is the only dispatcher.
"""

from __future__ import annotations

import torch

from fcp.checks import check_choice
from fcp.context import PackedContext, check_context
from fcp.ops.index_attention.gather import index_attention_gather
from fcp.ops.kit.attention import check_qkv, check_selection
from fcp.ops.kit.common import (
    autocast_off,
    choose_backend,
    default_scale,
    finite_or_zero,
    zero_nonfinite_grad,
)

__all__ = ["BACKENDS", "KV_MODES", "index_attention"]

#: ``"gather"``: gathers each query's selected keys and values (exact, every device).
BACKENDS = ("gather",)
_RUN = {"gather": index_attention_gather}
#: ``"local"``: k/v are this rank's shards, all-gathered here. ``"global"``: k/v are full length.
KV_MODES = ("local", "global")


def index_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                    ctx: PackedContext, scale: float | None = None, *, kv: str = "local",
                    query_chunk: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Softmax attention of each query over its selected global tokens.

    Args:
        q: ``[batch, local_seq, heads, D]``, this rank's queries.
        k: ``[batch, local_seq | global_seq, kv_heads, D]``; ``heads`` is a multiple of
            ``kv_heads`` (GQA: head ``h`` reads kv head ``h // (heads // kv_heads)``; MLA with
            per-head keys: ``kv_heads == heads``).
        v: ``[batch, local_seq | global_seq, kv_heads, Dv]``.
        indices: int ``[batch, local_seq, W]``: **global** token ids (positions in the
            replicated doc-id map), ``-1`` for none; a set (order and repeats do not matter).
            Ids outside ``[start of doc(t), t]`` are ignored, so a selection never reaches
            another document or the future. From :func:`~fcp.ops.kpool_indexer.kpool_indexer`,
            :func:`~fcp.ops.qsa_indexer.qsa_indexer` or any other indexer; no gradient.
        ctx: the rank's :class:`~fcp.context.PackedContext`.
        scale: softmax scale, default ``D ** -0.5``.
        kv: ``"local"``: ``k``/``v`` are this rank's shards (``local_seq`` long) and are
            all-gathered here (one differentiable :func:`~fcp.comm.all_gather_sequence` of
            ``cat([k, v], -1)``; backward: a reduce-scatter). ``"global"``: ``k``/``v`` already
            cover the whole padded sequence (``global_seq`` long), e.g. the caller all-gathered
            an MLA latent ``c`` (``kv_lora_rank`` per token, the smallest thing that determines
            K and V) and expanded it with ``kv_b_proj``; no collective for them here, and their
            gradient flows back to whatever produced them.
        query_chunk: queries whose keys are gathered at a time (memory ``O(query_chunk * W *
            kv_heads * (D + Dv))``); default: about 4M elements per chunk. Results do not
            depend on it, bitwise.
        backend: ``"auto"`` (= ``"gather"`` on every device) or ``"gather"``.

    Returns:
        ``[batch, local_seq, heads, Dv]`` in ``q``'s dtype (scores, softmax and accumulation in
        fp32; fp64 for fp64 inputs). A query with no valid selected token (a pad query, or an
        all ``-1`` row) gets exact zeros and sends no gradient.

    Guarantees: every query reads only tokens of its own document at or before it, so outputs
    are bitwise independent of other documents; a NaN/inf in one document's inputs or output
    gradient leaves every other document's outputs and gradients unchanged
    (:mod:`fcp.ops.kit.common`). Under CP the result equals the single-process one to fp32
    rounding (the K/V gradients are summed over ranks). No host synchronisation, static
    shapes: a compiled model never recompiles for a new packing or selection.

    Example: ``doc_ids = [[1, 1, 1, 2]]``, ``indices = [[[0, -1], [0, 1], [0, 2], [0, 3]]]``:
    token 0 reads itself, token 1 tokens 0 and 1, token 2 tokens 0 and 2, token 3 only itself
    (token 0 is another document).
    """
    name = "index_attention"
    check_context(ctx, fn=name)
    kv = check_choice(kv, "kv", KV_MODES, fn=name)
    local = ctx.local_seq_len
    check_qkv(name, q, k, v, ctx, key_len=local if kv == "local" else ctx.global_seq_len)
    query_chunk = check_selection(indices, query_chunk, q.shape[0], local, fn=name)
    backend = choose_backend(name, backend, BACKENDS, "gather")
    scale = default_scale(q.shape[-1], scale)
    q, k, v = finite_or_zero(q), finite_or_zero(k), finite_or_zero(v)
    with autocast_off(q.device):
        out = _RUN[backend](q, k, v, indices.detach(), ctx, scale, kv, query_chunk)
    return zero_nonfinite_grad(out)
