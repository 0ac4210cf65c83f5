"""Block-sparse attention selected by a lightning indexer over pooled keys (pooled-key DSA).

Indexer. Blocks are ``block`` consecutive global positions. For query ``t`` and block ``b``::

    score(t, b) = sum_h index_weights[t, h] * relu(index_q[t, h] . pooled_b)

where ``pooled_b`` is the mean of ``index_k`` over the tokens of block ``b`` in ``doc(t)``. One
shared index key head (``index_k`` is ``[batch, seq, Di]``), as in DeepSeek's DSA indexer.
Candidates are the blocks strictly before ``t``'s own block that contain a token of ``doc(t)``.
Only a block's *last* document can continue past it, so for every candidate the ``doc(t)`` tokens
are exactly the block's last-document segment: one pooled key per block (the mean over that
segment) serves every query, and ``b`` is a candidate iff ``b < t // block`` and the doc of
``b``'s last token is ``doc(t)``.

Selection, static and isolated. Non-candidate scores are set to ``-inf`` and the row is sorted
with a **stable** descending sort; the first ``k = min(topk, #blocks that can precede the rank's
last query)`` indices are taken (a static count). Picks whose score is ``-inf`` (fewer than ``k``
candidates) are dropped from the selection map; equal scores go to the earlier block (stable
sort). A query's candidate scores depend only on its own document (pooled segments lie inside
``doc(t)``), so changing another document never changes its selection.

Attention. Query ``t`` attends to the tokens of its selected blocks plus its own block, masked to
``doc(t)`` and ``s <= t``. Both backends score the keys ``[0, seq_end)`` under that mask (the
selection enters as a bool ``[batch, local, blocks]`` map): the dense CPU backend costs
``O(local * seq_end)`` like document-causal attention (a per-query gather of the selected blocks
was slower on CPU: thousands of tiny matmuls and an index-accumulate backward), while
FlexAttention skips the blocks that the mask leaves empty.

Gradients. The selection carries no gradient: ``index_q``, ``index_k`` and ``index_weights`` are
detached here and get no gradient from the attention output (train the indexer with its own
loss, e.g. DSA's KL to the attention distribution). ``q``, ``k``, ``v`` get exact gradients.

CP: the local length must be a multiple of ``block``. Each rank pools its own blocks and
all-gathers the pooled index keys (fp32, ``differentiable=False``, ``1/block`` of the tokens) and
the full K/V; a rank holding only padding still joins the K/V backward reduce-scatter (anchor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fcp.comm import all_gather_sequence
from fcp.context import PackedContext
from fcp.ops.attention import flex
from fcp.ops.attention.checks import (
    attention_backend,
    check_qkv,
    positive_int,
    query_positions,
    with_anchors,
)
from fcp.ops.attention.dense import KeyPart, attend
from fcp.ops.attention.sparse.reference import sparse_attention_reference
from fcp.ops.attention.masks import OUTSIDE, doc_causal_mask, last_doc_of_blocks, same_doc
from fcp.ops.common import default_scale, finite_or_zero, zero_nonfinite_grad

__all__ = ["sparse_attention", "sparse_attention_reference", "pooled_index_keys", "select_blocks", "sparse_mask"]


def pooled_index_keys(index_k: torch.Tensor, doc_ids: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 ``[batch, n // block, Di]``: per block, the mean of ``index_k`` over the block's
    last-document segment. ``index_k`` ``[batch, n, Di]`` and ``doc_ids`` ``[batch, n]`` cover
    whole blocks (``n`` a multiple of ``block``)."""
    ik = index_k.detach().float().unflatten(1, (-1, block))  # [b, nb, block, di]
    docs = doc_ids.unflatten(1, (-1, block))
    seg = docs == docs[..., -1:]  # the last-document segment (never empty)
    total = torch.where(seg[..., None], ik, 0.0).sum(2)
    return total / seg.sum(2, keepdim=True).to(total.dtype)


def select_blocks(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    pooled: torch.Tensor,
    candidate: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` candidate blocks per query: ``(block indices [b, q, k], valid [b, q, k])``.

    ``index_q`` ``[b, q, Hi, Di]``, ``index_weights`` ``[b, q, Hi]``, ``pooled`` ``[b, nb, Di]``,
    ``candidate`` bool ``[b, q, nb]``. No gradient; ties go to the earlier block.
    """
    iq = index_q.detach().float()
    w = index_weights.detach().float()
    s = torch.relu(torch.einsum("bqhd,bnd->bqhn", iq, pooled))
    score = (w[..., None] * s).sum(2)
    score = torch.where(candidate, score, float("-inf"))
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]
    return order, candidate.gather(-1, order)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    index_weights: torch.Tensor,
    context: PackedContext,
    block: int = 4,
    topk: int = 16,
    scale: float | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over the ``topk`` indexer-selected earlier blocks plus the query's own block.

    Args:
        q, k, v: ``[batch, local_seq, heads | kv_heads, D]`` as in
            :func:`~fcp.ops.attention.doc_causal_attention` (GQA allowed).
        index_q: ``[batch, local_seq, index_heads, Di]`` indexer queries.
        index_k: ``[batch, local_seq, Di]`` indexer keys (one shared head).
        index_weights: ``[batch, local_seq, index_heads]`` per-query head weights.
        context: the rank's :class:`~fcp.context.PackedContext`.
        block: tokens per block.
        topk: blocks selected per query besides its own (static; fewer candidates are masked).
        scale: softmax scale, default ``D ** -0.5``.
        backend: ``"auto"`` (``"flex"`` on CUDA, ``"dense"`` elsewhere), ``"dense"`` or
            ``"flex"``.

    Returns:
        ``[batch, local_seq, heads, Dv]`` in ``q``'s dtype; pad queries give zeros. The index
        tensors receive no gradient.

    Raises:
        ValueError: bad shapes, or under CP a local length that is not a multiple of ``block``.
    """
    name = "sparse_attention"
    check_qkv(name, q, k, v, context)
    block = positive_int(name, "block", block)
    topk = positive_int(name, "topk", topk)
    _check_index(name, q, index_q, index_k, index_weights)
    backend = attention_backend(name, backend, q)
    scale = default_scale(q.shape[-1], scale)
    q, k, v, index_q, index_k, index_weights = (
        finite_or_zero(t) for t in (q, k, v, index_q, index_k, index_weights)
    )
    local = context.local_seq_len
    if context.cp_enabled and local % block:
        raise ValueError(
            f"{name}: under CP the local sequence length {local} must be a multiple of "
            f"block={block} (pad the global length to a multiple of cp_size * block)"
        )

    # Without CP a trailing partial block is padded (doc id OUTSIDE: never a candidate).
    pad = -local % block
    doc_ids, ik = context.doc_ids, index_k
    if pad:
        doc_ids = F.pad(doc_ids, (0, pad), value=OUTSIDE)
        ik = F.pad(ik, (0, 0, 0, pad))
    start, end = context.seq_start, context.seq_end
    doc_q = context.local_doc_ids
    t = query_positions(context, q.device)
    own = t // block  # [local]

    # Indexer: pooled keys of every block that can precede this rank's last query.
    local_docs = doc_ids[:, start : start + local + pad]
    pooled = all_gather_sequence(
        pooled_index_keys(ik, local_docs, block), context, differentiable=False
    )
    nc = (end - 1) // block
    kk = min(topk, nc)
    sel = valid = None
    if kk:
        candidate = same_doc(doc_q, last_doc_of_blocks(doc_ids, block, nc))
        candidate = candidate & (torch.arange(nc, device=q.device)[None, :] < own[:, None])[None]
        sel, valid = select_blocks(index_q, index_weights, pooled[:, :nc], candidate, kk)

    # Selected blocks as a bool map [b, local, blocks]; picks of -inf candidates stay False.
    nb = doc_ids.shape[1] // block
    selected = torch.zeros(q.shape[0], local, nb, dtype=torch.bool, device=q.device)
    if kk:
        selected = selected.scatter(-1, sel, valid)
    kv_all = all_gather_sequence(torch.cat([k, v], -1), context)  # [b, global, hkv, dk + dv]
    keys, dk = kv_all[:, :end], k.shape[-1]
    s = torch.arange(end, device=q.device)
    if backend == "flex":
        hi = torch.full_like(s, flex.UNBOUNDED)
        out = flex.flex_attend(
            q, keys[..., :dk], keys[..., dk:], doc_q, doc_ids[:, :end], s - start, hi, scale,
            selected=selected, block=block, seq_start=start,
        )
    else:
        mask = sparse_mask(doc_ids[:, :end], doc_q, selected, block, t)
        out = attend(q, [KeyPart(keys[..., :dk], keys[..., dk:], mask)], scale)
    return zero_nonfinite_grad(with_anchors(out, context, kv_all))


def sparse_mask(doc_k, doc_q, selected, block, t):
    """bool ``[b, local, keys]``: key ``s`` lies in a selected block or in ``t``'s own block, in
    ``doc(t)``, and ``s <= t``. ``doc_k`` ``[b, keys]`` covers global positions ``0..keys-1``."""
    s = torch.arange(doc_k.shape[1], device=doc_k.device)
    in_block = selected[:, :, s // block] | (s[None, :] // block == t[:, None] // block)[None]
    return in_block & doc_causal_mask(doc_q, t, doc_k, s)


def _check_index(name, q, index_q, index_k, index_weights) -> None:
    b, n = q.shape[:2]
    if index_q.dim() != 4 or tuple(index_q.shape[:2]) != (b, n):
        raise ValueError(
            f"{name}: index_q must be [batch, local_seq, index_heads, Di] = [{b}, {n}, ., .], "
            f"got {tuple(index_q.shape)}"
        )
    hi, di = index_q.shape[2:]
    if tuple(index_k.shape) != (b, n, di):
        raise ValueError(
            f"{name}: index_k must be [batch, local_seq, Di] = {[b, n, di]} (one shared index "
            f"key head), got {tuple(index_k.shape)}"
        )
    if tuple(index_weights.shape) != (b, n, hi):
        raise ValueError(
            f"{name}: index_weights must be [batch, local_seq, index_heads] = {[b, n, hi]}, "
            f"got {tuple(index_weights.shape)}"
        )
