"""KDA's exact static-shape PyTorch path: chunked, documents reset exactly, exact under CP.

:func:`kda_chunked` evaluates :mod:`fcp.ops.kda.reference`'s recurrence chunk-wise (WY
representation, cost linear in the sequence length) with static shapes: documents are never split into variable-length pieces. Instead every cross-document
term is masked to an exact zero, so a document's outputs are bitwise independent of every other
token of the row. Under CP each rank summarises its shard as the affine map
``S_out = M_r S_in + S_r`` and :func:`fcp.comm.state_chain` hands it the state entering its shard.

How :func:`kda_chunked` stays exact and static:

* Runs (documents and the pad tail) are numbered by a cumulative sum of run starts over the
  replicated global map; every cross-run term is removed with ``torch.where`` (exact zeros), so no
  value of another document ever enters a document's arithmetic.
* In-chunk decays ``exp(sum of g over (i, t])`` come from a binary hierarchy of blocks: a pair of
  blocks factors through their boundary token, both exponents are direct sums of the g's they
  span (<= 0: no overflow at any decay; no difference of long cumulative sums: no cancellation).
* ``(I + A)^-1`` of the WY form is built in the same hierarchy (log-depth block inversion).
* A scalar gate per head (Gated DeltaNet, ``g [B, L, HV]``) is never broadcast over K: its pair
  decays form one ``[C, C]`` matrix per chunk (same exponents, same masks) that multiplies the
  plain ``q k^T`` and ``k k^T`` (:func:`_intra_chunk_scalar`); the rest broadcasts ``[.., 1]``.
* Only the tokens of the run going on at a chunk's (shard's) start see the incoming state; the
  chunk recurrence ``S_{i+1} = A_i S_i + B_i`` is composed by a log-depth associative scan
  (:func:`fcp.scan.chunk_scan`), so a compiled graph does not grow with the sequence length.
* Under CP the scan runs on ``[S | P]`` with ``P0 = I``, giving the shard's transition ``M_r`` and
  each token's response to ``S_in`` in the same pass; ``S_in`` from ``state_chain`` is then added
  to the outputs of the shard's first run.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fcp.comm import state_chain
from fcp.context import PackedContext
from fcp.layout import document_starts
from fcp.ops.kit.common import compute_dtype, default_scale, repeat_last, trim
from fcp.scan import chunk_scan

__all__ = ["kda_chunked"]

_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# argument handling
# ---------------------------------------------------------------------------------------------
class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward returns a contiguous gradient.

    The chunked backward produces input gradients through permutes whose eager strides can
    differ from the strides the compiler's fake tensors predict; a caller's ``view`` of such a
    gradient (e.g. the backward of ``(x @ w).view(b, t, h, d)``) then fails in a compiled
    graph. Handing back contiguous gradients makes both agree.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


# ---------------------------------------------------------------------------------------------
# chunked operator
# ---------------------------------------------------------------------------------------------
def _masked_exp(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` where ``mask``, exact 0 elsewhere; masked BEFORE exp so no inf is ever formed
    (and the backward of a masked entry is an exact zero, never ``0 * inf``)."""
    return torch.exp(torch.where(mask, x, _NEG_INF))


def _segment_ids(context: PackedContext, n_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ids of the local (internally padded) shard and of the token before it.

    Returns ``(seg [batch, local_seq + n_pad], prev [batch, 1])``, int64. Runs (documents and the
    pad tail) are numbered by a cumulative sum of run starts over the *global* map, so equal ids
    mean the same contiguous run, across ranks too. ``prev`` is 0 (no run) on the first rank.
    The internal padding continues the last run: its tokens have k = beta = g = 0, so they carry
    the state through unchanged and the shard's final state is the one after its last real token.
    """
    seg = torch.cumsum(document_starts(context.doc_ids), 1)  # >= 1
    s0, s1 = context.seq_start, context.seq_end
    local = seg[:, s0:s1]
    if not statically_known_true(n_pad == 0):
        # the last token's run repeated by an index (a `cat` would guard on n_pad == 0 and
        # specialise a dynamic length)
        local = local[:, repeat_last(local.shape[1], n_pad, seg.device)]
    prev = seg[:, s0 - 1 : s0] if s0 > 0 else torch.zeros_like(seg[:, :1])
    return local, prev


def _halves(x: torch.Tensor, nb: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., nb * 2 * s, D]`` -> the left and right halves ``[..., nb, s, D]`` of each block."""
    left, right = x.reshape(*x.shape[:-2], nb, 2, s, x.shape[-1]).unbind(-3)
    return left, right


def _merge(m: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Diagonal blocks ``[..., 2nb, s, s]`` plus lower off-diagonal blocks ``[..., nb, s, s]`` ->
    lower-triangular ``[..., nb, 2s, 2s]`` blocks (the upper block is an exact zero)."""
    m0, m1 = m.reshape(*off.shape[:-3], -1, 2, *m.shape[-2:]).unbind(-3)
    return torch.cat([torch.cat([m0, torch.zeros_like(off)], -1), torch.cat([off, m1], -1)], -2)


def _merge_inverse(d: torch.Tensor, l21: torch.Tensor) -> torch.Tensor:
    """Inverses of unit-lower diagonal blocks ``[..., 2nb, s, s]`` and the lower blocks
    ``L21`` -> inverses of the ``2s`` blocks: ``inv([[L11, 0], [L21, L22]]) =
    [[D11, 0], [-D22 L21 D11, D22]]``. A log-depth alternative to forward substitution, as
    stable (no Neumann-series cancellation); zeros between documents stay exact zeros."""
    d11, d22 = d.reshape(*l21.shape[:-3], -1, 2, *d.shape[-2:]).unbind(-3)
    return _merge(d, -(d22 @ (l21 @ d11)))


class _Level(NamedTuple):
    """One level ``s`` of a chunk's binary block hierarchy (see :func:`_intra_chunk`): ``nb``
    pairs of blocks of ``s`` tokens; whether each token is in the document of the pair's
    boundary token ``r`` (``left_in``, ``right_in``: ``[B, 1, N, nb, s, 1]``); the right
    blocks' ``fwd`` and the left blocks' ``rev`` sums; and the sums for blocks of ``2s``."""

    nb: int
    left_in: torch.Tensor
    right_in: torch.Tensor
    f_r: torch.Tensor
    r_l: torch.Tensor
    fwd: torch.Tensor
    rev: torch.Tensor


def _level(seg, g, fwd, rev, s: int) -> _Level:
    """Level ``s`` from the block-local sums ``fwd``/``rev`` of blocks of ``s`` tokens."""
    nb = g.shape[-2] // (2 * s)
    seg_l, seg_r = seg.reshape(*seg.shape[:-1], nb, 2, s).unbind(-2)  # [B, 1, N, nb, s]
    ref = seg_l[..., -1:]  # document of the boundary token r
    left_in, right_in = (seg_l == ref)[..., None], (seg_r == ref)[..., None]
    f_l, f_r = _halves(fwd, nb, s)
    r_l, r_r = _halves(rev, nb, s)
    g_r = _halves(g, nb, s)[1]
    # block-local sums for blocks of 2s: extend across the boundary within the document
    # (sums of same-sign terms; `where`, not a multiply, keeps other documents out exactly)
    f_next = f_r + torch.where(right_in, f_l[..., -1:, :], 0.0)
    head_in = (seg_l == seg_r[..., :1])[..., None]
    r_next = r_l + torch.where(head_in, g_r[..., :1, :] + r_r[..., :1, :], 0.0)
    return _Level(nb, left_in, right_in, f_r, r_l, torch.cat([f_l, f_next], -2).reshape(g.shape),
                  torch.cat([r_next, r_r], -2).reshape(g.shape))  # fmt: skip


def _intra_chunk(q, k, g, beta, seg):
    """In-chunk pairwise matrices and within-document decay sums, by a binary block hierarchy.

    Inputs: q, k, g ``[B, H, N, C, K]``, beta ``[B, H, N, C, 1]``, seg ``[B, 1, N, C]`` run ids;
    ``C`` a power of two. With ``D(i, t] = sum_{i < s <= t} g_s`` (zero-free only inside one
    document) it returns

    * ``aqk [.., C, C]``: ``q_t . (exp(D(i, t]) * k_i)`` for ``i <= t`` in t's document, else 0;
    * ``t_inv [.., C, C]``: ``(I + A)^-1`` with ``A[t, i] = beta_t k_t . (exp(D(i, t]) * k_i)``
      for ``i < t`` in t's document;
    * ``fwd [.., C, K]``: ``sum of g`` from the chunk (or document) start through ``t``;
    * ``rev [.., C, K]``: ``sum of g`` after ``t`` to the chunk (or document) end.

    Level ``s`` pairs each block of ``s`` tokens (left, ending at token ``r``) with the next
    (right). A left/right pair's decay factors through ``r``: ``exp(D(i, t]) = exp(D(r, t]) *
    exp(D(i, r])``, two exponents that are sums of the block-local ``fwd``/``rev`` sums, so every
    exponent is <= 0 for g <= 0 (no overflow, however strong the decay) and is a direct sum of
    the g's it spans, never a difference of long cumulative sums (no cancellation, also in the
    gradient of g). Each factor is masked to the document of ``r``, so only same-document pairs
    survive, as exact zeros otherwise, and other documents' g never enter another document's
    sums. Cost ``O(C^2 K)`` per chunk, like the dense form, without a ``[C, C, K]`` tensor.
    """
    c = q.shape[-2]
    fwd, rev = g, torch.zeros_like(g)
    aqk = (q * k).sum(-1)[..., None, None]  # [.., C, 1, 1]: the diagonal, D(t, t] = 0
    t_inv = torch.ones_like(aqk)
    s = 1
    while s < c:
        lv = _level(seg, g, fwd, rev, s)
        q_r = _halves(q, lv.nb, s)[1]
        k_l, k_r = _halves(k, lv.nb, s)
        beta_r = _halves(beta, lv.nb, s)[1]
        k_from = (k_l * _masked_exp(lv.left_in, lv.r_l)).transpose(-1, -2)  # [.., nb, K, s]
        to_t = _masked_exp(lv.right_in, lv.f_r)  # [.., nb, s, K]
        aqk = _merge(aqk, (q_r * to_t) @ k_from)
        t_inv = _merge_inverse(t_inv, ((k_r * to_t) @ k_from) * beta_r)
        fwd, rev = lv.fwd, lv.rev
        s *= 2
    return aqk[..., 0, :, :], t_inv[..., 0, :, :], fwd, rev


def _diagonal_lower_blocks(x: torch.Tensor, nb: int, s: int) -> torch.Tensor:
    """The lower-left ``[s, s]`` block of each of the ``nb`` diagonal ``[2s, 2s]`` blocks of
    ``x [.., C, C]`` (``C = 2 s nb``), as ``[.., nb, s, s]`` (views, no copy)."""
    blocks = x.reshape(*x.shape[:-2], nb, 2 * s, nb, 2 * s).diagonal(dim1=-4, dim2=-2)
    return blocks.movedim(-1, -3)[..., s:, :s]


def _intra_chunk_scalar(q, k, g, beta, seg):
    """:func:`_intra_chunk` for one gate per head (Gated DeltaNet): ``g [B, H, N, C, 1]``.

    Same outputs (``fwd``/``rev`` ``[.., C, 1]``). A scalar gate leaves the K-sum, so the pair
    decays form one ``[C, C]`` matrix per chunk, ``E[t, i] = exp(D(i, t])`` for ``i <= t`` in t's
    document (exact 0 elsewhere), and ``aqk = (q k^T) * E``, ``A = beta (k k^T) * E`` are two
    plain chunk-sized matmuls: no ``[.., K]`` gate, decayed copy of q or k, ``[.., K]``
    exponential or per-level small matmul is formed (``benchmarks/bench_gdn.py`` measures the
    saving over broadcasting the gate). The exponents come from the same binary hierarchy as the
    per-key path: the pair ``(i, t)`` split at boundary ``r`` gets ``D(r, t] + D(i, r]``, two
    direct sums of the g's they span (<= 0, no cancellation), masked to ``r``'s document before
    the exponential. ``(I + A)^-1`` is built by the same log-depth block inversion, from the
    diagonal blocks of the dense ``A``.
    """
    c = q.shape[-2]
    fwd, rev = g, torch.zeros_like(g)
    expo = torch.zeros_like(g)[..., None]  # [.., C, 1, 1]: exponents of the diagonal, D(t, t]
    same = torch.ones_like(seg, dtype=torch.bool)[..., None, None]  # [B, 1, N, C, 1, 1]
    s = 1
    while s < c:
        lv = _level(seg, g, fwd, rev, s)
        expo = _merge(expo, lv.f_r + lv.r_l.transpose(-1, -2))  # D(r, t] + D(i, r]
        same = _merge(same, lv.right_in & lv.left_in.transpose(-1, -2))
        fwd, rev = lv.fwd, lv.rev
        s *= 2
    same = same[..., 0, :, :]  # [B, 1, N, C, C]: i <= t in t's document
    decay = _masked_exp(same, expo[..., 0, :, :])  # [B, H, N, C, C]
    k_t = k.transpose(-1, -2)
    # `where` as well as the zero decay: a product overflowing elsewhere stays out exactly
    aqk = torch.where(same, (q @ k_t) * decay, 0.0)
    a = torch.where(same, (k @ k_t) * decay, 0.0) * beta  # only its strict lower part is read
    t_inv = aqk.new_ones(*aqk.shape[:-1], 1, 1)  # [.., C, 1, 1]: inverses of the unit diagonal
    s = 1
    while s < c:
        t_inv = _merge_inverse(t_inv, _diagonal_lower_blocks(a, c // (2 * s), s))
        s *= 2
    return aqk, t_inv[..., 0, :, :], fwd, rev


def _chunk_forms(q, k, v, g, beta, seg, prev, scalar: bool):
    """Everything a chunk needs that does not depend on the incoming state (all chunks at once).

    Inputs: q, k ``[B, H, N, C, K]`` (q already scaled), g ``[B, H, N, C, K]`` or, ``scalar``,
    ``[B, H, N, C, 1]`` (every decay factor below then broadcasts over K), v
    ``[B, H, N, C, V]``, beta ``[B, H, N, C]``, seg ``[B, 1, N, C]`` run ids, prev ``[B, 1, N]``
    run id of the token before each chunk. With ``G`` the within-document cumulative decay from the chunk start and
    ``carry`` the tokens of the run that was going on before the chunk (those that see the
    incoming state ``S``), the chunk's outputs and final state are (WY representation)::

        U     = u0 - w @ S                       # pseudo-values, [C, V]
        o     = qg @ S + Aqk @ U
        S_end = dec * S + kd^T @ U

    with ``T = (I + A)^-1``, ``w = T (beta k exp(G) [carry])``, ``u0 = T (beta v)``,
    ``qg = q exp(G) [carry]``, ``kd = k exp(G_end - G) [last run]``, ``dec = exp(G_end) [carry]``.
    Returns ``(Aqk [.., C, C], w [.., C, K], u0 [.., C, V], qg [.., C, K], kd [.., C, K],
    dec [.., K or 1])``.
    """
    bk = beta[..., None]
    aqk, t_inv, fwd, rev = (_intra_chunk_scalar if scalar else _intra_chunk)(q, k, g, bk, seg)
    carry = (seg == prev[..., None])[..., None]  # [B, 1, N, C, 1]
    decay_in = _masked_exp(carry, fwd)  # exp(G_t) for carried tokens, else exactly 0
    qg = q * decay_in
    w = t_inv @ (bk * k * decay_in)
    u0 = t_inv @ (bk * v)
    last_run = (seg == seg[..., -1:])[..., None]  # the run holding the chunk's last token
    kd = k * _masked_exp(last_run, rev)
    dec = _masked_exp(carry[..., -1, :], fwd[..., -1, :])  # [B, H, N, K]
    return aqk, w, u0, qg, kd, dec


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, context: PackedContext, scale: float | None = None,
                chunk_size: int = 64) -> torch.Tensor:
    """The ``"chunked"`` backend of :func:`fcp.ops.kda.kda` (same arguments; inputs checked
    there). ``chunk_size`` is a power of two; the shard is padded internally to a multiple of it.

    Guarantees: exact to fp32 rounding (fp64 for fp64 inputs); a document's outputs are bitwise
    independent of every token outside it; deterministic; no host synchronisation and no
    data-dependent shapes (CUDA-graph safe; a new packing never recompiles). Under CP, one
    :func:`~fcp.comm.state_chain` all-gather of ``[batch, value_heads, K, K + V]`` per call.
    """
    q, k, v, g, beta = (_ContiguousGrad.apply(t) for t in (q, k, v, g, beta))
    scalar = g.dim() == 3  # one gate per head (GDN): [B, L, HV]
    bsz, length, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    dt = compute_dtype(q, k, v, g, beta)
    scale = default_scale(dk, scale)
    c = chunk_size
    n = -(-length // c)
    n_pad = n * c - length

    def chunked(x: torch.Tensor, heads_repeat: int = 1) -> torch.Tensor:
        # [B, T, heads, D] -> [B, HV, N, C, D] in the compute dtype, zero-padded at the end
        x = x.to(dt)
        if heads_repeat > 1:
            x = x.repeat_interleave(heads_repeat, dim=2)
        if not statically_known_true(n_pad == 0):
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, n_pad))
        return x.reshape(bsz, n, c, hv, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qc = chunked(q, hv // h) * scale
    kc = chunked(k, hv // h)
    vc, gc = chunked(v), chunked(g[..., None] if scalar else g)
    bc = chunked(beta[..., None])[..., 0]
    seg, prev = _segment_ids(context, n_pad)
    seg = seg.reshape(bsz, 1, n, c)
    # run id before each chunk: the shard's predecessor for chunk 0, else the previous chunk's
    # last token
    prev = torch.cat([prev, seg[:, 0, :-1, -1]], 1)[:, None]  # [B, 1, N]

    aqk, w, u0, qg, kd, dec = _chunk_forms(qc, kc, vc, gc, bc, seg, prev, scalar)
    dec = dec.expand(*dec.shape[:-1], dk)  # a scalar gate's chunk decay, on the state's diagonal

    cp = context.cp_enabled
    if cp:
        # Augmented state [S | P] with P0 = I: the same linear recurrence then also yields the
        # shard's transition M (final P) and each token's response R to the incoming state.
        u0 = torch.cat([u0, u0.new_zeros(*u0.shape[:-1], dk)], -1)
        eye = torch.eye(dk, dtype=dt, device=q.device).expand(bsz, hv, dk, dk)
        state = torch.cat([u0.new_zeros(bsz, hv, dk, dv), eye], -1)
    else:
        state = None  # zero

    # The chunk recurrence, composed as affine maps by a log-depth scan (no Python loop over
    # chunks, so the compiled graph does not grow with the sequence length).
    states, pseudo, state = chunk_scan(w, u0, kd, dec, state)
    out = qg @ states + aqk @ pseudo  # [B, HV, N, C, V(+K)]

    if cp:
        s_in = state_chain(state[..., dv:], state[..., :dv], context).to(dt)
        # Only tokens of the run going on at the shard start have a nonzero response row.
        out = out[..., :dv] + out[..., dv:] @ s_in[:, :, None]
    return trim(out.permute(0, 2, 3, 1, 4).reshape(bsz, n * c, hv, dv), length, v.dtype)
