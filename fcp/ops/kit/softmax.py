"""Dense masked softmax attention in fp32, banded: the backend that runs everywhere (CPU included).

:func:`banded_attention` attends each query over

* shared keys ``k``, ``v`` ``[batch, keys, kv_heads, D | Dv]``: key ``i`` is visible to query
  ``t`` iff ``key_doc[i] == doc(t) != 0`` and ``key_lo[i] <= t``, and covers the positions
  ``[i * stride, (i + 1) * stride)`` (a token, or a compressed block of ``stride`` tokens), and
* optionally a per-query part ``window = (k, v, mask)``, ``[batch, q, kv_heads, W, D | Dv]`` and
  ``[batch, q, W]`` (each query has its own few keys, e.g. a sliding window),

in **one** softmax. Optionally a key also leaves sight after a last query ``key_hi[i]`` (a
sliding window), each query's denominator has one more zero-value logit (attention sinks,
``[b, q, H]``: the online softmax starts from the sink as if it were a key), and the scaled
scores are soft-capped (``c * tanh(s / c)``). Only keys within ``band`` positions of a query can be visible (its document
started fewer than ``band`` tokens before it, :attr:`fcp.context.PackedContext.band`), so each
block of :data:`BLOCK` queries scores only the key blocks that reach back ``band`` positions:
``O(local x band)`` scores, not ``O(local x keys)``.

Grid and rounding. Keys are processed in blocks of :data:`BLOCK` on a grid fixed by the key
index (block ``j`` = keys ``[j * BLOCK, (j + 1) * BLOCK)``), queries in blocks of ``BLOCK``
local rows, with an online (flash-style) softmax in ascending key-block order after the
per-query part. A key block that is entirely masked for a query changes nothing of its state,
bitwise (its maximum stays, the rescale is ``exp(0) = 1``, it adds exact zeros: inputs are
finite), so skipping it gives the same bits: the result does not depend on ``band`` or on how
many query blocks run at once (``chunk``). The backward (``fcp::banded_attention_bwd``)
recomputes the probabilities from the saved log-sum-exp and accumulates each key block's
gradient over query blocks in ascending order, so it is independent of both as well.

GQA: query head ``h`` uses kv head ``h // (heads // kv_heads)``. Scores, softmax and sums run in
fp32 (fp64 for fp64 inputs); the result is cast to ``q``'s dtype. Masked keys get probability
exactly 0 (``torch.where``), so other documents' values never reach an output, bitwise. A query
with no visible key (a pad query) gets exact zeros and sends no gradient.

Memory: ``fcp::banded_attention_fwd`` / ``_bwd`` are ``torch.library`` custom ops looping over
chunks of query blocks (the compiled graph does not grow with the sequence); the forward saves
the output and one log-sum-exp per query and head, never a probability matrix. Deterministic on
CPU; on CUDA the key gradients' ``index_add_`` uses atomics (run-to-run rounding differences
unless ``torch.use_deterministic_algorithms(True)``), and ``"flex"`` is the default there.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fcp.layout import OUTSIDE_DOC_ID, PAD_DOC_ID
from fcp.ops.kit.common import compute_dtype, register_fp32_autocast, scalar_tensor, trim

__all__ = ["BLOCK", "CHUNK_ELEMENTS", "Window", "banded_attention", "key_block_windows"]

#: Queries per query block and keys per key block (part of the rounding: fixed).
BLOCK = 64
#: Default target size, in elements, of one chunk's scores and gathered keys.
CHUNK_ELEMENTS = 1 << 22


class Window(NamedTuple):
    """The per-query key part: keys then values ``kv [b, q, hkv, W, D + Dv]`` and ``mask [b, q,
    W]``."""

    kv: torch.Tensor
    mask: torch.Tensor


def key_block_windows(q_start: int, n_qblocks: int, n_kblocks: int, band: int,
                      stride: int) -> list[tuple[int, int]]:
    """``(first, last)`` key block that query block ``i`` (global positions ``q_start + i *
    BLOCK ..``) can see, for every ``i`` (``first > last``: none); static."""
    out = []
    for i in range(n_qblocks):
        p0 = q_start + i * BLOCK
        lo = max(0, p0 - band + 1) // stride // BLOCK
        out.append((lo, _last_block(p0 + BLOCK - 1, n_kblocks, stride)))
    return out


def _last_block(last_query, n_kblocks: int, stride: int):
    """The last key block a query at ``last_query`` can see (a Python int or an int64
    tensor, the same arithmetic)."""
    hi = last_query // stride // BLOCK
    return min(n_kblocks - 1, hi) if isinstance(hi, int) else hi.clamp(max=n_kblocks - 1)


def _chunks(windows: list[tuple[int, int]], chunk: int):
    """``(i0, i1, n_w)``: query blocks ``i0:i1`` visit ``n_w`` key blocks each (:func:`_starts`),
    covering their own windows (blocks past a window are fully masked for it)."""
    for i0 in range(0, len(windows), chunk):
        win = windows[i0 : i0 + chunk]
        yield i0, i0 + len(win), max(0, max(hi - lo + 1 for lo, hi in win))


def _starts(q_start, i0, i1, n_w, n_kblocks, stride, device) -> torch.Tensor:
    """int64 ``[i1 - i0]``: the first key block each query block of a chunk visits (computed on
    the device: no host-to-device copy)."""
    last = q_start + torch.arange(i0, i1, device=device) * BLOCK + BLOCK - 1
    return (_last_block(last, n_kblocks, stride) - n_w + 1).clamp(min=0)


class _Chunk(NamedTuple):
    qc: torch.Tensor  # [b, hkv, nq, M, D], M = BLOCK * groups (rows: query, then group)
    doc: torch.Tensor  # [b, nq, BLOCK] query doc ids
    t: torch.Tensor  # [nq, BLOCK] global query positions
    rows: slice


def _chunk(q, doc_q, q_start, hkv, i0, i1, dt) -> _Chunk:
    rows = slice(i0 * BLOCK, i1 * BLOCK)
    t = torch.arange(q_start + rows.start, q_start + rows.stop, device=q.device)
    c = _Chunk(None, doc_q[:, rows].view(q.shape[0], i1 - i0, BLOCK), t.view(i1 - i0, BLOCK), rows)
    return c._replace(qc=_rows(q, c, hkv, dt))


def _rows(x: torch.Tensor, c: _Chunk, hkv: int, dt) -> torch.Tensor:
    """``[b, Lp, H, E]`` rows of chunk ``c`` -> ``[b, hkv, nq, M, E]`` in ``dt``."""
    b, _, h, e = x.shape
    nq = c.t.shape[0]
    x = x[:, c.rows].to(dt).view(b, nq, BLOCK, hkv, h // hkv, e).permute(0, 3, 1, 2, 4, 5)
    return x.reshape(b, hkv, nq, BLOCK * (h // hkv), e)


def _unrows(x: torch.Tensor, h: int) -> torch.Tensor:
    """``[b, hkv, nq, M, E] -> [b, nq * BLOCK, H, E]``."""
    b, hkv, nq, m, e = x.shape
    x = x.view(b, hkv, nq, BLOCK, h // hkv, e).permute(0, 2, 3, 1, 4, 5)
    return x.reshape(b, nq * BLOCK, h, e)


def _where(mask: torch.Tensor, s: torch.Tensor, other) -> torch.Tensor:
    """``where(mask, s, other)`` for scores ``s [b, hkv, nq, M, K]`` and a per-query ``mask [b,
    nq, BLOCK, K]``, broadcast over kv heads and groups without materialising it."""
    b, hkv, nq, m, k = s.shape
    out = torch.where(mask[:, None, :, :, None, :], s.view(b, hkv, nq, BLOCK, m // BLOCK, k),
                      other)  # fmt: skip
    return out.view(s.shape)


def _block(kvh, key_doc, key_lo, key_hi, c: _Chunk, idx):
    """Key blocks ``idx`` (one per query block): keys and values ``[b, hkv, nq, BLOCK, D +
    Dv]`` and the visibility ``[b, nq, BLOCK (queries), BLOCK (keys)]``."""
    kd, kl = key_doc.index_select(1, idx), key_lo.index_select(0, idx)  # [b, nq, B], [nq, B]
    vis = (kd[:, :, None, :] == c.doc[..., None]) & (c.doc > PAD_DOC_ID)[..., None]
    seen = kl[:, None, :] <= c.t[..., None]
    if key_hi is not None:  # a sliding window: the key leaves it after query key_hi
        seen = seen & (key_hi.index_select(0, idx)[:, None, :] >= c.t[..., None])
    return kvh.index_select(2, idx), vis & seen[None]


def _per_query(c: _Chunk, x: torch.Tensor) -> torch.Tensor:
    """``[b, hkv, nq, M, E] -> [b, hkv, nq * BLOCK, groups, E]``: one matmul batch per query."""
    b, hkv, nq, m, e = x.shape
    return x.view(b, hkv, nq * BLOCK, m // BLOCK, e)


def _window(win_kv, win_mask, c: _Chunk, dt):
    """The per-query part of a chunk: keys and values ``[b, hkv, rows, W, D + Dv]``, mask ``[b,
    nq, BLOCK, W]``."""
    wkv = win_kv[:, c.rows].transpose(1, 2).to(dt)
    return wkv, win_mask[:, c.rows].view(*c.doc.shape, -1)


def _capped(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """Scores ``s`` (already scaled) soft-capped to ``softcap * tanh(s / softcap)`` (0: as
    they are)."""
    return s if not softcap else torch.tanh(s / softcap) * softcap


def _initial(c: _Chunk, sinks, hkv: int, dv: int, dt):
    """The online softmax's state before any key: ``(max, sum, acc)`` per row ``[b, hkv, nq,
    M]``; with sinks, each row starts as if it had seen one key of logit ``sink`` and value 0."""
    rows = c.qc.shape[:4]
    acc = c.qc.new_zeros(*rows, dv)
    if sinks is None:
        return c.qc.new_full(rows, float("-inf")), c.qc.new_zeros(rows), acc
    return _rows(sinks[..., None], c, hkv, dt)[..., 0], c.qc.new_ones(rows), acc


def _online(state, s, mask, weigh):
    """One step of the online softmax over scores ``s`` (masked where not ``mask``);
    ``weigh(p)`` is the probabilities' weighted sum of the step's values."""
    m, l, acc = state
    s = _where(mask, s, float("-inf"))
    m_new = torch.maximum(m, s.amax(-1))
    safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: stay at zero
    alpha = torch.exp(m - safe)
    p = torch.exp(s - safe[..., None])
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + weigh(p)


@torch.library.custom_op("fcp::banded_attention_fwd", mutates_args=())
def banded_attention_fwd(q: torch.Tensor, kvh: torch.Tensor, key_doc: torch.Tensor,
                         key_lo: torch.Tensor, doc_q: torch.Tensor,
                         win_kv: Optional[torch.Tensor], win_mask: Optional[torch.Tensor],
                         key_hi: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                         q_start: int, band: int, stride: int, scale: torch.Tensor,
                         softcap: float, dk: int,
                         chunk: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(out [b, Lp, H, Dv], lse [b, Lp, H])`` in the compute dtype (empty rows: 0 and 0;
    with sinks: 0 and the sink).

    ``q [b, Lp, H, D]`` with ``Lp`` a multiple of :data:`BLOCK`, ``doc_q [b, Lp]``; ``kvh [b,
    hkv, nkb, BLOCK, D + Dv]`` head-major key blocks, ``key_doc [b, nkb, BLOCK]``, ``key_lo``
    and ``key_hi`` (or ``None``: unbounded) ``[nkb, BLOCK]``; the window ``win_kv [b, Lp, hkv,
    W, D + Dv]``, ``win_mask [b, Lp, W]`` or ``None``; ``sinks [b, Lp, H]`` in the compute
    dtype or ``None``; ``scale`` a 0-d fp64 tensor (:func:`~fcp.ops.kit.common.scalar_tensor`);
    ``softcap`` 0 for none; ``chunk`` query blocks at a time (0: :func:`chunk_blocks`'
    default)."""
    b, lp, h, _ = q.shape
    hkv, nkb, dv = kvh.shape[1], kvh.shape[2], kvh.shape[-1] - dk
    dt = compute_dtype(q, kvh)
    chunk = chunk or chunk_blocks(b, h, hkv, kvh.shape[-1], band, stride, lp // BLOCK)
    out = q.new_empty(b, lp, h, dv, dtype=dt)
    lse = q.new_empty(b, lp, h, dtype=dt)
    windows = key_block_windows(q_start, lp // BLOCK, nkb, band, stride)
    for i0, i1, n_w in _chunks(windows, chunk):
        c = _chunk(q, doc_q, q_start, hkv, i0, i1, dt)
        rows = c.qc.shape[:4]
        state = _initial(c, sinks, hkv, dv, dt)
        if win_kv is not None:  # the per-query part first, then the key blocks ascending
            wkv, wmask = _window(win_kv, win_mask, c, dt)
            s = torch.matmul(_per_query(c, c.qc), wkv[..., :dk].transpose(-1, -2)) * scale
            state = _online(state, _capped(s.view(*rows, -1), softcap), wmask,
                            lambda p: torch.matmul(_per_query(c, p), wkv[..., dk:]).view(
                                *rows, dv))  # fmt: skip
        base = _starts(q_start, i0, i1, n_w, nkb, stride, q.device)
        for w in range(n_w):
            kb, vis = _block(kvh, key_doc, key_lo, key_hi, c, base + w)
            kb = kb.to(dt)
            s = _capped(torch.matmul(c.qc, kb[..., :dk].transpose(-1, -2)) * scale, softcap)
            state = _online(state, s, vis, lambda p: torch.matmul(p, kb[..., dk:]))
        m, l, acc = state
        live = l > 0
        one = torch.where(live, l, 1.0)
        out[:, c.rows] = _unrows(torch.where(live[..., None], acc / one[..., None], 0.0), h)
        lse[:, c.rows] = _unrows(torch.where(live, m + torch.log(one), 0.0)[..., None], h)[..., 0]
    return out, lse


@banded_attention_fwd.register_fake
def _(q, kvh, key_doc, key_lo, doc_q, win_kv, win_mask, key_hi, sinks, q_start, band, stride,
      scale, softcap, dk, chunk):  # fmt: skip
    dt = compute_dtype(q, kvh)
    return (q.new_empty(*q.shape[:3], kvh.shape[-1] - dk, dtype=dt),
            q.new_empty(q.shape[:3], dtype=dt))  # fmt: skip


@torch.library.custom_op("fcp::banded_attention_bwd", mutates_args=())
def banded_attention_bwd(grad_out: torch.Tensor, q: torch.Tensor, kvh: torch.Tensor,
                         key_doc: torch.Tensor, key_lo: torch.Tensor, doc_q: torch.Tensor,
                         win_kv: Optional[torch.Tensor], win_mask: Optional[torch.Tensor],
                         key_hi: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                         out: torch.Tensor, lse: torch.Tensor, q_start: int, band: int,
                         stride: int, scale: torch.Tensor, softcap: float, dk: int,
                         chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor]:  # fmt: skip
    """``(dq, dkvh, d win_kv, d sinks)`` in the inputs' dtypes (``d win_kv`` / ``d sinks``
    empty without a window / sinks)."""
    b, lp, h, _ = q.shape
    hkv, nkb, e = kvh.shape[1], kvh.shape[2], kvh.shape[-1]
    dt = out.dtype
    chunk = chunk or chunk_blocks(b, h, hkv, e, band, stride, lp // BLOCK)
    dq = q.new_empty(q.shape, dtype=dt)
    # key-block major, so that index_add_ adds whole contiguous blocks in index order
    dkv = kvh.new_zeros(nkb, b, hkv, BLOCK, e, dtype=dt)
    dwin = q.new_zeros(0) if win_kv is None else win_kv.new_empty(win_kv.shape, dtype=dt)
    windows = key_block_windows(q_start, lp // BLOCK, nkb, band, stride)

    def dscores(s, dp, lse_c, delta, mask):
        """``(p, d s)`` of raw scores ``s`` (before scale and cap) from ``dp = go . v``."""
        s = s * scale
        capped = _capped(s, softcap)
        p = _where(mask, torch.exp(capped - lse_c), 0.0)
        ds = p * (dp - delta) * scale
        if softcap:  # d(c tanh(s / c)) / ds = 1 - tanh^2
            ds = ds * (1 - (capped / softcap) ** 2)
        return p, ds

    for i0, i1, n_w in _chunks(windows, chunk):
        c = _chunk(q, doc_q, q_start, hkv, i0, i1, dt)
        nq = i1 - i0
        go, o = _rows(grad_out, c, hkv, dt), _rows(out, c, hkv, dt)
        lse_c = _rows(lse[..., None], c, hkv, dt)  # [b, hkv, nq, M, 1]
        delta = (go * o).sum(-1, keepdim=True)
        dqc = torch.zeros_like(c.qc)
        if win_kv is not None:
            wkv, wmask = _window(win_kv, win_mask, c, dt)
            qr, gr = _per_query(c, c.qc), _per_query(c, go)
            s = torch.matmul(qr, wkv[..., :dk].transpose(-1, -2)).view(*go.shape[:4], -1)
            dp = torch.matmul(gr, wkv[..., dk:].transpose(-1, -2)).view(s.shape)
            p, ds = dscores(s, dp, lse_c, delta, wmask)
            ds, p = _per_query(c, ds), _per_query(c, p)
            dqc = dqc + torch.matmul(ds, wkv[..., :dk]).view(dqc.shape)
            grads = torch.cat([torch.matmul(ds.transpose(-1, -2), qr),
                               torch.matmul(p.transpose(-1, -2), gr)], -1)  # fmt: skip
            dwin[:, c.rows] = grads.transpose(1, 2)
        if n_w:
            grads = kvh.new_empty(nq, n_w, b, hkv, BLOCK, e, dtype=dt)
            base = _starts(q_start, i0, i1, n_w, nkb, stride, q.device)
            for w in range(n_w):
                kb, vis = _block(kvh, key_doc, key_lo, key_hi, c, base + w)
                kb = kb.to(dt)
                s = torch.matmul(c.qc, kb[..., :dk].transpose(-1, -2))
                dp = torch.matmul(go, kb[..., dk:].transpose(-1, -2))
                p, ds = dscores(s, dp, lse_c, delta, vis)  # [b, hkv, nq, M, BLOCK]
                dqc = dqc + torch.matmul(ds, kb[..., :dk])
                blk = torch.cat([torch.matmul(ds.transpose(-1, -2), c.qc),
                                 torch.matmul(p.transpose(-1, -2), go)], -1)  # fmt: skip
                grads[:, w] = blk.permute(2, 0, 1, 3, 4)
            # (query block, window step) order: each key block sums its query blocks ascending
            idx = (base[:, None] + torch.arange(n_w, device=q.device)).flatten()
            dkv.index_add_(0, idx, grads.flatten(0, 1))
        dq[:, c.rows] = _unrows(dqc, h)
    dkvh = dkv.permute(1, 2, 0, 3, 4).to(kvh.dtype).contiguous()
    dsinks = q.new_zeros(0)
    if sinks is not None:  # d lse / d sink = p_sink, and d out / d sink = -p_sink * out
        delta = (grad_out.to(dt) * out).sum(-1)
        dsinks = (-torch.exp(sinks.to(dt) - lse) * delta).to(sinks.dtype)
    return (dq.to(q.dtype), dkvh, dwin if win_kv is None else dwin.to(win_kv.dtype),
            dsinks)  # fmt: skip


@banded_attention_bwd.register_fake
def _(grad_out, q, kvh, key_doc, key_lo, doc_q, win_kv, win_mask, key_hi, sinks, out, lse,
      q_start, band, stride, scale, softcap, dk, chunk):  # fmt: skip
    dwin = q.new_empty(0) if win_kv is None else win_kv.new_empty(win_kv.shape)
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), kvh.new_empty(kvh.shape), dwin, dsinks


_TENSORS = 9  # q, kvh, key_doc, key_lo, doc_q, win_kv, win_mask, key_hi, sinks
_SCALE = 12  # the position of ``scale`` (a tensor: saved, not kept on ctx) among the inputs


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:_TENSORS], *output, inputs[_SCALE])
    ctx.before, ctx.after = inputs[_TENSORS:_SCALE], inputs[_SCALE + 1 :]


def _backward(ctx, grad_out, grad_lse):
    *tensors, scale = ctx.saved_tensors
    win_kv, sinks = tensors[5], tensors[8]
    dq, dkvh, dwin, dsinks = banded_attention_bwd(grad_out, *tensors, *ctx.before, scale,
                                                  *ctx.after)  # fmt: skip
    return (dq, dkvh, None, None, None, None if win_kv is None else dwin, None, None,
            None if sinks is None else dsinks,
            *[None] * (len(ctx.before) + 1 + len(ctx.after)))  # fmt: skip


banded_attention_fwd.register_autograd(_backward, setup_context=_setup)
register_fp32_autocast(banded_attention_fwd, banded_attention_bwd)


#: ``key_lo`` of padding keys: visible to no query. 2**62, not int64's maximum: the pad value
#: passes through a double, which holds 2**62 exactly.
_NEVER = 1 << 62


def _pad(x: torch.Tensor, n: int, dim: int, value=0) -> torch.Tensor:
    """``x`` padded with ``value`` to length ``n`` along ``dim``."""
    extra = n - x.shape[dim]
    if statically_known_true(extra == 0):
        return x
    # constant_pad_nd, not a `cat`: a cat guards on the padding being empty, which would
    # specialise a dynamic length on its remainder modulo BLOCK
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1 - dim % x.dim()) + (0, extra),
                                   value=value)


def chunk_blocks(batch: int, heads: int, kv_heads: int, e: int, band: int, stride: int,
                 n_qblocks: int) -> int:
    """Default query blocks per chunk: about :data:`CHUNK_ELEMENTS` scores, gathered keys and
    (backward) key-block gradients."""
    n_w = (band // stride + 2 * BLOCK) // BLOCK + 1
    per_block = batch * BLOCK * (4 * heads * BLOCK + kv_heads * e * (1 + n_w))
    return max(1, min(n_qblocks, CHUNK_ELEMENTS // per_block))


def banded_attention(q: torch.Tensor, kv: torch.Tensor, dk: int, key_doc: torch.Tensor,
                     key_lo: torch.Tensor, doc_q: torch.Tensor, q_start: int, band: int,
                     scale: float, *, stride: int = 1, window: Window | None = None,
                     key_hi: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                     softcap: float | None = None, chunk: int | None = None) -> torch.Tensor:
    """Softmax attention of ``q [b, L, H, D]`` (global positions ``q_start ..``, doc ids ``doc_q
    [b, L]``) over the shared keys and values ``kv [b, K, hkv, D + Dv]`` (keys ``[..., :dk]``;
    key ``i`` is visible iff ``key_doc [b, K] == doc(t) != 0`` and ``key_lo [K] <= t``) and the
    optional per-query ``window``, in one softmax (module docstring).

    ``band``: no key more than ``band - 1`` positions before a query is visible (key ``i``
    covers positions ``[i * stride, (i + 1) * stride)``). ``chunk``: queries per step, rounded
    down to whole blocks (default: about :data:`CHUNK_ELEMENTS` elements). Neither changes the
    result, bitwise. Positions are relative: any origin shared by ``q_start``, ``key_lo`` and
    ``key_hi`` gives the same result (keys starting mid-row, e.g. after a left halo, index
    their first key 0).

    ``key_hi [K]`` (optional): key ``i`` is also invisible to queries after ``key_hi[i]`` (a
    sliding window: ``key_lo + window - 1``; ``band`` should then be at most ``window``).
    ``sinks`` (optional, broadcastable to ``[b, L, H]``): one more logit per query and head in
    the softmax's denominator with a zero value (attention sinks). ``softcap``: scores (after
    ``scale``) become ``softcap * tanh(scores / softcap)``. Returns ``[b, L, H, Dv]`` in ``q``'s
    dtype.
    """
    b, n, h, _ = q.shape
    hkv, e = kv.shape[2], kv.shape[3]
    nkb = -(-kv.shape[1] // BLOCK)
    lp = max(1, -(-n // BLOCK)) * BLOCK
    kvh = _pad(kv, nkb * BLOCK, 1).view(b, nkb, BLOCK, hkv, e).permute(0, 3, 1, 2, 4)
    kd = _pad(key_doc, nkb * BLOCK, 1, OUTSIDE_DOC_ID).view(b, nkb, BLOCK)
    kl = _pad(key_lo, nkb * BLOCK, 0, _NEVER).view(nkb, BLOCK)
    wkv = wm = kh = sk = None
    if window is not None:
        wkv, wm = _pad(window.kv, lp, 1), _pad(window.mask, lp, 1, False)
    if key_hi is not None:
        kh = _pad(key_hi, nkb * BLOCK, 0, -1).view(nkb, BLOCK)
    if sinks is not None:
        sk = _pad(sinks.to(compute_dtype(q, kv)).expand(b, n, h), lp, 1)
    # 0: the ops pick the default themselves, on concrete sizes (a dynamic length then does not
    # specialise the graph on the chunking, which changes no result)
    blocks = 0 if chunk is None else max(1, chunk // BLOCK)
    out, _ = banded_attention_fwd(_pad(q, lp, 1), kvh.contiguous(), kd, kl,
                                  _pad(doc_q, lp, 1, OUTSIDE_DOC_ID), wkv, wm, kh, sk, q_start,
                                  band, stride, scalar_tensor(scale, q.device),
                                  float(softcap or 0.0), dk, blocks)  # fmt: skip
    return trim(out, n, q.dtype)
