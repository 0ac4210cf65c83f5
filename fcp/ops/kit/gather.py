"""Softmax attention over each query's selected global tokens, by gathering them: the kernel of
:func:`fcp.ops.index_attention.index_attention` and
:func:`fcp.ops.latent_attention.latent_attention` (each operator folder imports only this kit,
never another operator).

Two steps:

* :func:`selected_slots` (plain PyTorch, traced by the compiler): from the global ``indices``
  and the replicated doc-id map, the keys a query may read (``0 <= s <= t``, ``doc(s) ==
  doc(t) != 0``), sorted ascending and de-duplicated, so the result is a function of the *set*
  of indices: bitwise independent of their order and of repeats. Excluded slots point at the
  query's own position (its own document: nothing of another document is ever read, even
  masked).
* ``fcp::index_attention_fwd`` / ``fcp::index_attention_bwd`` (``torch.library`` custom ops
  with fake kernels and ``register_autograd``; the compiler sees one opaque node each): the
  softmax over the gathered keys, in query chunks so that the transient memory is bounded. The
  forward saves only the output and the log-sum-exp per query and head; the backward gathers
  the keys again, recomputes the probabilities and accumulates the K/V gradients with
  ``index_add_`` (the flash-attention recipe, on gathered keys).

Cost per query: ``O(W * heads * (D + Dv))`` for ``W`` index slots, whatever the sequence
length; no ``local x sequence`` score or mask exists anywhere. Memory: the K/V gradients
(``[batch, keys, kv_heads, D + Dv]``, fp32) plus one chunk of gathered keys and scores.

Numerics: scores, softmax and accumulation in fp32 (fp64 for fp64 inputs); output and
gradients cast to the inputs' dtypes. Deterministic on CPU (``index_add_`` runs in index order);
on CUDA ``index_add_`` accumulates K/V gradients with atomics (run-to-run rounding differences
unless ``torch.use_deterministic_algorithms(True)``).
"""

from __future__ import annotations

import torch

from fcp.layout import PAD_DOC_ID
from fcp.ops.kit.common import register_fp32_autocast, scalar_tensor

__all__ = [
    "CHUNK_ELEMENTS",
    "chunk_rows",
    "gather_attention",
    "selected_slots",
]

#: Default target size, in elements, of one query chunk's gathered keys, values and scores.
CHUNK_ELEMENTS = 1 << 22


def selected_slots(
                   indices: torch.Tensor, doc_ids: torch.Tensor, seq_start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots, valid)``, both ``[batch, local, W]``: the keys each local query reads.

    ``indices`` int ``[batch, local, W]`` global token ids (-1 = none; anything outside the
    query's document or after it is dropped); ``doc_ids`` the replicated map; ``seq_start`` the
    global position of local query 0. ``slots`` (int64) holds the surviving ids ascending, then
    the query's own position ``t`` wherever ``valid`` is False.
    """
    batch, local, _ = indices.shape
    dev = indices.device
    idx = indices.long()
    t = torch.arange(seq_start, seq_start + local, device=dev)[None, :, None]
    doc_q = doc_ids[:, seq_start : seq_start + local, None]
    in_range = (idx >= 0) & (idx <= t)
    doc_k = doc_ids.gather(1, torch.where(in_range, idx, t).flatten(1)).view_as(idx)
    valid = in_range & (doc_k == doc_q) & (doc_q != PAD_DOC_ID)
    big = torch.iinfo(torch.int64).max
    key = torch.sort(torch.where(valid, idx, big), -1).values  # valid ids first, ascending
    valid = key != big
    valid[..., 1:] &= key[..., 1:] != key[..., :-1]  # a repeated id counts once
    return torch.where(valid, key, t), valid


def chunk_rows(width: int, heads: int, kv_heads: int, dk: int, dv: int, local: int) -> int:
    """Default queries per chunk: about :data:`CHUNK_ELEMENTS` gathered and score elements."""
    per_query = width * (kv_heads * (dk + dv) + 3 * heads)
    return max(1, min(local, CHUNK_ELEMENTS // max(per_query, 1)))


def _dtype(q: torch.Tensor, kv: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.float32, torch.promote_types(q.dtype, kv.dtype))


def _chunk(q, kvh, slots, valid, scale, dk, r0, r1):
    """Rows ``r0:r1``: queries ``[b, hkv, c, g, D]``, gathered keys/values ``[b, hkv, c, W, D +
    Dv]`` (one ``index_select`` of head-major rows: batched-matmul layout, no permute copies),
    scaled scores ``[b, hkv, c, g, W]``, the broadcast mask and the flat row ids."""
    b, _, h, d = q.shape
    hkv, keys = kvh.shape[1], kvh.shape[2]
    dt = _dtype(q, kvh)
    sl, vm = slots[:, r0:r1], valid[:, r0:r1]
    c, w = sl.shape[1], sl.shape[2]
    base = torch.arange(b * hkv, device=q.device).view(b, hkv, 1, 1) * keys
    flat = (sl[:, None] + base).reshape(-1)  # [b * hkv * c * W]
    kvg = kvh.reshape(-1, kvh.shape[-1]).index_select(0, flat).view(b, hkv, c, w, -1).to(dt)
    qg = q[:, r0:r1].to(dt).view(b, c, hkv, h // hkv, d).transpose(1, 2)  # [b, hkv, c, g, d]
    s = torch.matmul(qg, kvg[..., :dk].transpose(-1, -2)) * scale
    return qg, kvg, s, vm[:, None, :, None, :], flat


@torch.library.custom_op("fcp::index_attention_fwd", mutates_args=())
def index_attention_fwd(q: torch.Tensor, kvh: torch.Tensor, slots: torch.Tensor,
                        valid: torch.Tensor, scale: torch.Tensor, dk: int,
                        chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, L, H, Dv], lse [b, L, H])`` in the compute dtype; empty rows: 0 and 0.

    ``kvh``: ``[b, kv_heads, keys, D + Dv]``, keys then values, head-major; ``scale`` a 0-d
    fp64 tensor (:func:`~fcp.ops.kit.common.scalar_tensor`). ``chunk`` queries at a time."""
    b, local, h, _ = q.shape
    hkv, dv = kvh.shape[1], kvh.shape[-1] - dk
    dt = _dtype(q, kvh)
    out = q.new_empty(b, local, h, dv, dtype=dt)
    lse = q.new_empty(b, local, h, dtype=dt)
    for r0 in range(0, local, chunk):
        r1 = min(local, r0 + chunk)
        _, kvg, s, m, _ = _chunk(q, kvh, slots, valid, scale, dk, r0, r1)
        s = torch.where(m, s, float("-inf"))
        top = s.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, 0.0)  # empty rows: all -inf
        e = torch.exp(s - top)
        den = e.sum(-1, keepdim=True)
        p = e / torch.where(den > 0, den, 1.0)
        o = torch.matmul(p, kvg[..., dk:])  # [b, hkv, c, g, dv]
        out[:, r0:r1] = o.transpose(1, 2).flatten(2, 3)
        lse_c = torch.where(den > 0, top + torch.log(den), 0.0)  # [b, hkv, c, g, 1]
        lse[:, r0:r1] = lse_c.squeeze(-1).transpose(1, 2).flatten(2)
    return out, lse


@index_attention_fwd.register_fake
def _(q, kvh, slots, valid, scale, dk, chunk):
    dt = _dtype(q, kvh)
    dv = kvh.shape[-1] - dk
    return q.new_empty(*q.shape[:3], dv, dtype=dt), q.new_empty(q.shape[:3], dtype=dt)


@torch.library.custom_op("fcp::index_attention_bwd", mutates_args=())
def index_attention_bwd(grad_out: torch.Tensor, q: torch.Tensor, kvh: torch.Tensor,
                        slots: torch.Tensor, valid: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, scale: torch.Tensor, dk: int,
                        chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dkvh)`` in the dtypes of ``q`` and ``kvh``."""
    b, local, h, _ = q.shape
    hkv, g = kvh.shape[1], h // kvh.shape[1]
    dv = kvh.shape[-1] - dk
    dt = out.dtype
    dq = q.new_empty(q.shape, dtype=dt)
    dkv = kvh.new_zeros(kvh.numel() // kvh.shape[-1], kvh.shape[-1], dtype=dt)
    for r0 in range(0, local, chunk):
        r1 = min(local, r0 + chunk)
        qg, kvg, s, m, flat = _chunk(q, kvh, slots, valid, scale, dk, r0, r1)
        c = r1 - r0
        lse_c = lse[:, r0:r1].view(b, c, hkv, g).transpose(1, 2)[..., None]
        p = torch.where(m, torch.exp(s - lse_c), 0.0)  # [b, hkv, c, g, W]
        go = grad_out[:, r0:r1].to(dt).view(b, c, hkv, g, dv).transpose(1, 2)
        o = out[:, r0:r1].view(b, c, hkv, g, dv).transpose(1, 2)
        delta = (go * o).sum(-1, keepdim=True)
        dp = torch.matmul(go, kvg[..., dk:].transpose(-1, -2))
        ds = p * (dp - delta) * scale
        dq[:, r0:r1] = torch.matmul(ds, kvg[..., :dk]).transpose(1, 2).flatten(2, 3)
        grads = torch.cat([torch.matmul(ds.transpose(-1, -2), qg),  # [b, hkv, c, W, D]
                           torch.matmul(p.transpose(-1, -2), go)], -1)  # fmt: skip
        dkv.index_add_(0, flat, grads.reshape(-1, kvh.shape[-1]))
    return dq.to(q.dtype), dkv.view(kvh.shape).to(kvh.dtype)


@index_attention_bwd.register_fake
def _(grad_out, q, kvh, slots, valid, out, lse, scale, dk, chunk):
    return q.new_empty(q.shape), kvh.new_empty(kvh.shape)


def _setup(ctx, inputs, output):
    q, kvh, slots, valid, scale, dk, chunk = inputs
    out, lse = output
    ctx.save_for_backward(q, kvh, slots, valid, out, lse, scale)
    ctx.args = (dk, chunk)


def _backward(ctx, grad_out, grad_lse):
    q, kvh, slots, valid, out, lse, scale = ctx.saved_tensors
    dq, dkvh = index_attention_bwd(grad_out, q, kvh, slots, valid, out, lse, scale, *ctx.args)
    return dq, dkvh, None, None, None, None, None


index_attention_fwd.register_autograd(_backward, setup_context=_setup)
register_fp32_autocast(index_attention_fwd, index_attention_bwd)


def gather_attention(q: torch.Tensor, kv: torch.Tensor, dk: int, slots: torch.Tensor,
                     valid: torch.Tensor, scale: float, chunk: int | None = None) -> torch.Tensor:
    """Softmax attention of ``q [b, L, H, D]`` over the keys ``slots`` of ``kv [b, S, Hkv, D +
    Dv]`` (keys ``[..., :dk]``, values ``[..., dk:]``) where ``valid``: ``[b, L, H, Dv]`` in
    ``q``'s dtype, exact zeros (and no gradient) for a query without a valid slot. ``chunk``
    queries are processed at a time (default :func:`chunk_rows`); the result does not depend on
    it, bitwise.

    ``kv`` is laid out once per call head-major, ``[b, Hkv, S, D + Dv]`` (an ``O(S)`` copy), so
    each chunk gathers keys and values with one ``index_select``, ready for batched matmuls."""
    if chunk is None:
        chunk = chunk_rows(slots.shape[-1], q.shape[2], kv.shape[2], dk, kv.shape[3] - dk,
                           q.shape[1])  # fmt: skip
    kvh = kv.transpose(1, 2).contiguous()
    out, _ = index_attention_fwd(q, kvh, slots, valid, scalar_tensor(scale, q.device), dk,
                                 max(1, int(chunk)))  # fmt: skip
    return out.to(q.dtype)
