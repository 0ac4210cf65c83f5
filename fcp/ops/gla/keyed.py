"""Gated linear attention with a decay per key dimension (GLA proper, Mamba1's selective scan):
the exact static-shape PyTorch path, chunked, documents reset exactly, exact under CP.

:func:`gla_keyed_chunked` evaluates :mod:`fcp.ops.gla.reference`'s recurrence with ``a [B, L, H,
K]`` chunk-wise, ``S_t = diag(exp(a_t)) S_{t-1} + k_t v_t^T``, ``o_t = scale S_t^T q_t``. Per chunk
of ``C`` tokens, per head, with ``D_k(i, t] = sum_{i < s <= t} a_{s,k}`` (inside one run)::

    o_t   = sum_{i <= t, same run} (sum_k q_tk k_ik exp(D_k(i, t])) v_i         # in-chunk
          + (q_t * exp(D(start, t]))^T S               (t in the run carried into the chunk)
    S_end = diag(dec) S + sum_{i in the last run} (k_i * exp(D(i, end])) v_i^T
    dec   = exp(D(start, end]) per key if the whole chunk continues the carried run, else 0

**Why not ``q exp(A_t)`` times ``k exp(-A_i)``.** With a per-key decay the pair decay no longer
leaves the key sum, and the usual factorisation through the cumulative sum ``A`` overflows for
strong decays (``exp(-A_i)`` reaches ``exp(8 C)`` at ``a = -8`` per token). Here every exponent
is a *direct* sum of the ``a``'s it spans, ``<= 0`` for ``a <= 0``:

* in-chunk pairs by a binary block hierarchy (:func:`_pair_scores`): at level ``s`` each block
  of ``s`` tokens (left, ending at token ``r``) meets the next one (right); the pair ``(i, t)``
  factors through ``r``: ``exp(D(i, t]) = exp(D(r, t]) exp(D(i, r])``, two sums inside one
  block, so the off-diagonal ``[s, s]`` block is one matmul ``(q_R exp(D(r, t])) (k_L exp(D(i,
  r]))^T``. Cost ``O(C^2 K)`` per chunk and head, with no ``[C, C, K]`` tensor (the dense
  masked ``[C, C, K]`` exponential costs the same flops but ``C`` times the memory of ``q``);
* chunk boundaries by the kit (:func:`~fcp.ops.kit.recurrence.boundary_decays`, one decay per
  key), the chunk recurrence by :func:`fcp.scan.decay_scan` (a decay per state row), and under
  CP the shard's map ``S_out = diag(m_r) S_in + S_r`` through
  :func:`~fcp.ops.kit.recurrence.entering_state` (one :func:`fcp.comm.state_chain`).

Runs (documents and the pad tail) never mix: cross-run factors are removed by
:func:`~fcp.ops.kit.recurrence.masked_exp` before the exponential (exact zeros, exact zero
gradients), so a document's outputs are independent of every token outside it.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fcp.context import PackedContext
from fcp.ops.kit.common import compute_dtype, register_fp32_autocast, trim
from fcp.ops.kit.opaque import recompute_vjp
from fcp.ops.kit.recurrence import (
    boundary_decays,
    chunk_runs,
    entering_state,
    entry_products,
    masked_exp,
)
from fcp.scan import decay_scan

__all__ = ["gla_keyed_chunked"]


def _after(x: torch.Tensor) -> torch.Tensor:
    """``[..., S, K] -> [..., S, K]``: ``sum_{s > i} x_s`` within the last-but-one axis (a
    reversed cumulative sum, shifted: direct sums, no difference)."""
    rev = x[..., 1:, :].flip(-2).cumsum(-2).flip(-2)
    return torch.nn.functional.pad(rev, (0, 0, 0, 1))


def _pair_scores(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor,
                 seg: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``attn [.., C, C]``: ``sum_k q_tk k_ik exp(D_k(i, t])`` for same-run ``i <= t``, else an
    exact 0.

    ``q``, ``k`` ``[.., C, K]`` (broadcast against ``a``), ``a [.., C, K]`` log decays, ``seg
    [.., C]`` run ids (broadcast); ``C`` a power of two. Level by level (module doc): the
    diagonal blocks of ``2 s`` tokens are the previous level's blocks plus one off-diagonal
    ``[s, s]`` matmul; the exponents are block-local direct sums masked to the boundary token's
    run (``t`` and ``i`` in the run of ``r`` is exactly ``i``, ``t`` in one run: runs are
    contiguous).
    """
    c, dk = a.shape[-2], a.shape[-1]
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], a.shape[:-2])
    q, k = q.expand(*lead, c, dk), k.expand(*lead, c, dk)
    attn = (q * k).sum(-1)[..., None, None]  # [.., C, 1, 1]: the diagonal, D(t, t] = 0
    s = 1
    while s < c:
        nb = c // (2 * s)

        def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            left, right = x.reshape(*x.shape[:-2], nb, 2, s, x.shape[-1]).unbind(-3)
            return left, right

        seg_l, seg_r = seg.reshape(*seg.shape[:-1], nb, 2, s).unbind(-2)  # [.., nb, s]
        ref = seg_l[..., -1:]  # the run of the boundary token r
        left_in, right_in = (seg_l == ref)[..., None], (seg_r == ref)[..., None]
        a_l, a_r = halves(a)
        to_t = masked_exp(right_in, a_r.cumsum(-2))  # exp(D(r, t]) [.., nb, s, K]
        from_i = masked_exp(left_in, _after(a_l))  # exp(D(i, r])
        off = (halves(q)[1] * to_t) @ (halves(k)[0] * from_i).transpose(-1, -2)  # [.., nb, s, s]
        d0, d1 = attn.reshape(*off.shape[:-3], nb, 2, s, s).unbind(-3)
        upper = torch.zeros_like(off)
        attn = torch.cat([torch.cat([d0, upper], -1), torch.cat([off, d1], -1)], -2)
        s *= 2
    return attn[..., 0, :, :]


# The pair scores as an opaque custom op (:mod:`fcp.ops.kit.opaque`): traced, the block
# hierarchy is most of what a dynamic-length compile of this operator costs.
@torch.library.custom_op("fcp::gla_pair_scores", mutates_args=())
def gla_pair_scores(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor,
                    seg: torch.Tensor) -> torch.Tensor:
    """:func:`_pair_scores` (same arguments; one floating dtype), contiguous."""
    return _pair_scores(q, k, a, seg).contiguous()


@gla_pair_scores.register_fake
def _(q, k, a, seg):
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], a.shape[:-2])
    return a.new_empty(*lead, a.shape[-2], a.shape[-2])


@torch.library.custom_op("fcp::gla_pair_scores_bwd", mutates_args=())
def gla_pair_scores_bwd(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, seg: torch.Tensor,
                        grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, da)`` of :func:`gla_pair_scores` (each shaped like its input: broadcast
    dimensions summed), by recomputation (:func:`~fcp.ops.kit.opaque.recompute_vjp`)."""
    return recompute_vjp(lambda *x: (_pair_scores(*x),), (q, k, a), (seg,), (grad,))


@gla_pair_scores_bwd.register_fake
def _(q, k, a, seg, grad):
    return q.new_empty(q.shape), k.new_empty(k.shape), a.new_empty(a.shape)


def _pair_scores_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _pair_scores_backward(ctx, grad):
    q, k, a, seg = ctx.saved_tensors
    return (*gla_pair_scores_bwd(q, k, a, seg, grad), None)


gla_pair_scores.register_autograd(_pair_scores_backward, setup_context=_pair_scores_setup)
register_fp32_autocast(gla_pair_scores, gla_pair_scores_bwd)


def gla_keyed_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                      ctx: PackedContext, scale: float, chunk_size: int = 64) -> torch.Tensor:
    """The ``"chunked"`` backend of :func:`fcp.ops.gla.gla` for ``a [B, L, H, K]`` (arguments
    checked there; ``scale`` resolved). The shard is padded internally to a multiple of
    ``chunk_size``.

    Guarantees: exact to fp32 rounding (fp64 for fp64 inputs) at any decay ``a <= 0``; a
    document's outputs are independent of every token outside it; deterministic; no host
    synchronisation and no data-dependent shapes (a new packing never recompiles). Under CP,
    one :func:`~fcp.comm.state_chain` all-gather of fp32 ``[B, H, K, K + V]`` per call.
    """
    bsz, length, groups, dk = q.shape
    heads, dv = v.shape[2], v.shape[3]
    rep = heads // groups
    dt = compute_dtype(q, k, v, a)
    c = chunk_size
    n = -(-length // c)

    def tokens(x: torch.Tensor) -> torch.Tensor:
        # [B, T, X, D] -> [B, X, N, C, D] in the compute dtype, zero-padded at the end
        if not statically_known_true(n * c == length):
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, n * c - length))
        return x.to(dt).reshape(bsz, n, c, *x.shape[2:]).permute(0, 3, 1, 2, 4)

    # head h = g * R + r reads group g: heads as [B, G, R, ...], q and k broadcast over R
    qc = (tokens(q) * scale)[:, :, None]  # [B, G, 1, N, C, K]
    kc = tokens(k)[:, :, None]
    vc = tokens(v).unflatten(1, (groups, rep))  # [B, G, R, N, C, V]
    ac = tokens(a).unflatten(1, (groups, rep))  # [B, G, R, N, C, K]
    seg, prev = chunk_runs(ctx, n, c)  # [B, N, C], [B, N]

    # in-chunk: per-key decayed scores of same-run pairs i <= t
    attn = gla_pair_scores(qc, kc, ac, seg[:, None, None])  # [B, G, R, N, C, C]
    intra = attn @ vc  # [B, G, R, N, C, V]

    # chunk boundaries, one decay per key: the kit's scalar form with K before N
    a_kn = ac.movedim(-1, -3)  # [B, G, R, K, N, C]
    decay_in, dec = boundary_decays(a_kn, seg[:, None, None, None], prev[:, None, None, None])
    decay_in = decay_in.movedim(-3, -1)  # [B, G, R, N, C, K]
    last_run = (seg == seg[..., -1:])[:, None, None, :, :, None]  # [B, 1, 1, N, C, 1]
    kd = kc * masked_exp(last_run, _after(ac))  # k_i * exp(D(i, end]) for the last run
    kv = kd.transpose(-1, -2) @ vc  # [B, G, R, N, K, V]
    states, final = decay_scan(dec.movedim(-1, -2)[..., None], kv)  # entering each chunk
    if ctx.cp_enabled:
        prefix, total = entry_products(dec)  # [B, G, R, K, N], [B, G, R, K]
        s_in = entering_state(torch.diag_embed(total), final, ctx).to(dt)  # [B, G, R, K, V]
        states = states + prefix.movedim(-1, -2)[..., None] * s_in[..., None, :, :]
    # decay_in is an exact 0 for tokens not carried into their chunk
    out = (qc * decay_in) @ states.to(dt) + intra  # [B, G, R, N, C, V]
    out = out.flatten(1, 2).permute(0, 2, 3, 1, 4).reshape(bsz, n * c, heads, dv)
    return trim(out, length, v.dtype)
