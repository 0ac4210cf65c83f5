"""Gated linear attention's exact static-shape PyTorch path: chunked, documents reset exactly,
exact under CP.

:func:`gla_chunked` evaluates :mod:`fcp.ops.gla.reference`'s recurrence chunk-wise (Mamba2's SSD
form, cost linear in the sequence length) with static shapes: documents are never split into
variable-length pieces; every cross-document term is an exact zero instead, so a document's
outputs are bitwise independent of every other token of the row. It is GLA's *intra-chunk form*
(:class:`_DecayedScores`, the group-major state matmuls) over the recurrence kit
(:mod:`fcp.ops.kit.recurrence`: run numbering, masked exponentials, chunk boundary decays, the
CP wiring). Per chunk of ``C`` tokens, per head, with ``D(i, t] = sum_{i < s <= t} a_s``
(inside one document)::

    o_t   = sum_{i <= t, same run} exp(D(i, t]) (q_t . k_i) v_i          # in-chunk, [C, C]
          + exp(D(start, t]) q_t^T S            (t in the run carried into the chunk)
    S_end = dec * S + sum_{i in the last run} exp(D(i, end]) k_i v_i^T
    dec   = exp(D(start, end]) if the whole chunk continues the carried run, else exactly 0

How it stays exact and static:

* Runs (documents and the pad tail) are numbered over the replicated global map
  (:func:`~fcp.ops.kit.recurrence.chunk_runs`). Cross-run pairs inside a chunk are removed with
  ``torch.where`` (exact zeros, also for a product that overflowed), before any exponential (no
  ``inf`` is formed, and a masked entry's gradient is an exact zero); the state entering a
  chunk reaches only the tokens of the run carried into it, through decays that are exact zeros
  for the others.
* Every exponent is a *direct* sum of the ``a``'s it spans (:func:`segment_sums`: a masked
  cumulative sum per pair, Mamba2's "stable segsum"; reversed cumulative sums to the chunk
  end), never a difference of long cumulative sums: ``<= 0`` for ``a <= 0`` (no overflow at
  any decay) and no cancellation, also in the gradient of ``a`` (:class:`_DecayedScores`'s
  hand-written backward keeps direct sums).
* ``q . k`` is formed once per group (GQA), not per head, and the state matmuls run one
  ``[C, K] @ [K, R V]`` product per group and chunk for the group's ``R`` heads.
* The chunk recurrence is diagonal (a scalar per chunk and head), composed by
  :func:`fcp.scan.decay_scan`: log depth, no Python loop over chunks, so a compiled graph does
  not grow with the sequence length.
* Under CP the shard's map is ``S_out = m_r S_in + S_r`` with ``m_r`` the product of the chunk
  decays; :func:`~fcp.ops.kit.recurrence.entering_state` (:func:`fcp.comm.state_chain` with
  ``M_r = m_r I``) hands each rank ``S_in``, which enters chunk ``n`` scaled by the product of
  the decays before it (:func:`~fcp.ops.kit.recurrence.entry_products`).
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fcp.context import PackedContext
from fcp.ops.kit.common import compute_dtype, trim
from fcp.ops.kit.recurrence import (
    boundary_decays,
    chunk_runs,
    entering_state,
    entry_products,
    masked_exp,
)
from fcp.scan import decay_scan

__all__ = ["gla_chunked", "segment_sums"]


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """``[..., C] -> [..., C, C]`` with ``[t, i] = sum_{i < s <= t} a_s`` for ``i <= t`` (0 on the
    diagonal; the upper triangle holds no meaning). Direct sums: a masked cumulative sum per
    column, exact zeros before ``i + 1``."""
    c = a.shape[-1]
    later = torch.ones(c, c, dtype=torch.bool, device=a.device).tril(-1)  # [s, i]: s > i
    return torch.where(later, a[..., :, None], 0.0).cumsum(-2)


class _DecayedScores(torch.autograd.Function):
    """``(scores [.., 1, N, C, C], a [.., R, N, C], same [.., N, C, C]) -> attn [.., R, N, C, C]``,
    ``attn[t, i] = scores[t, i] * exp(D(i, t])`` for same-run pairs ``i <= t``, exact 0 else.

    Hand-written backward (half the passes over ``[C, C]`` tensors of autograd's): with ``dS =
    dattn * attn`` (the gradient of each pair's exponent; exact zeros off the pairs),
    ``da_s = sum_{t >= s} sum_{i < s} dS[t, i]``, a row-wise cumulative sum over ``i`` then a
    masked column sum over ``t``: direct sums, no difference of cumulative sums.
    """

    @staticmethod
    def forward(ctx, scores, a, same):
        decay = masked_exp(same, segment_sums(a))
        # `where` as well as the zero decay: a product overflowing elsewhere stays out exactly
        attn = torch.where(same, scores * decay, 0.0)
        ctx.save_for_backward(decay, attn)
        return attn

    @staticmethod
    def backward(ctx, d_attn):
        decay, attn = ctx.saved_tensors
        d_scores = (d_attn * decay).sum(-4, keepdim=True)  # over the heads of a group
        before = (d_attn * attn).cumsum(-1)[..., :, :-1]  # [t, s - 1] = sum_{i < s} dS[t, i]
        c = attn.shape[-1]
        later = torch.ones(c, c - 1, dtype=torch.bool, device=attn.device).tril(-1)  # t >= s
        d_a = torch.where(later, before, 0.0).sum(-2)
        return d_scores, torch.nn.functional.pad(d_a, (1, 0)), None


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for equal leading dims as one 3-D ``bmm`` (views where the layout allows:
    ``torch.matmul``'s N-D path copies transposed operands, ~3x slower on CPU here)."""
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return out.view(*a.shape[:-2], a.shape[-2], b.shape[-1])


def gla_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                ctx: PackedContext, scale: float, chunk_size: int = 64) -> torch.Tensor:
    """The ``"chunked"`` backend of :func:`fcp.ops.gla.gla` (same arguments, checked there;
    ``scale`` resolved). The shard is padded internally to a multiple of ``chunk_size``.

    Guarantees: exact to fp32 rounding (fp64 for fp64 inputs); a document's outputs are bitwise
    independent of every token outside it; deterministic; no host synchronisation and no
    data-dependent shapes (CUDA-graph safe; a new packing never recompiles). Under CP, one
    :func:`~fcp.comm.state_chain` all-gather of fp32 ``[batch, heads, K, K + V]`` per call.
    """
    bsz, length, groups, dk = q.shape
    heads, dv = v.shape[2], v.shape[3]
    rep = heads // groups
    dt = compute_dtype(q, k, v, a)
    c = chunk_size
    n = -(-length // c)

    def tokens(x: torch.Tensor) -> torch.Tensor:
        # [B, T, X, D] -> [B, N, C, X, D] in the compute dtype, zero-padded at the end
        if not statically_known_true(n * c == length):
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, n * c - length))
        return x.to(dt).reshape(bsz, n, c, *x.shape[2:])

    # Head h = g * R + r reads group g. The in-chunk part is head-major ([B, G, R, N, C, .]);
    # the state matmuls are group-major ([B, G, N, C, R * V]): one matmul per group and chunk
    # serves the group's R heads, with no broadcast copy of q or k.
    qc = (tokens(q) * scale).permute(0, 3, 1, 2, 4)  # [B, G, N, C, K]
    kc = tokens(k).permute(0, 3, 1, 2, 4)
    vt = tokens(v).unflatten(3, (groups, rep)).permute(0, 3, 1, 2, 4, 5)  # [B, G, N, C, R, V]
    vc = vt.permute(0, 1, 4, 2, 3, 5)  # [B, G, R, N, C, V]
    ac = tokens(a[..., None])[..., 0].unflatten(3, (groups, rep)).permute(0, 3, 4, 1, 2)
    seg, prev = chunk_runs(ctx, n, c)
    seg, prev = seg[:, None, None], prev[:, None, None]  # [B, 1, 1, N, C], [B, 1, 1, N]

    # in-chunk: decayed scores of same-run pairs i <= t
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    same = (seg[..., :, None] == seg[..., None, :]) & causal  # [B, 1, 1, N, C, C]
    scores = _bmm(qc, kc.transpose(-1, -2))[:, :, None]  # once per group: [B, G, 1, N, C, C]
    attn = _DecayedScores.apply(scores, ac, same)  # [B, G, R, N, C, C]
    intra = _bmm(attn, vc).permute(0, 1, 3, 4, 2, 5)  # [B, G, N, C, R, V]

    # chunk boundaries: what each chunk adds to the state, and what it passes on
    decay_in, dec = boundary_decays(ac, seg, prev)  # [B, G, R, N, C], [B, G, R, N]
    # D(i, end] = sum_{s > i} a_s (a reversed cumulative sum, shifted: direct sums)
    after = torch.nn.functional.pad(ac.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))
    to_end = masked_exp(seg == seg[..., -1:], after)  # exp(D(i, end]) for the last run
    v_end = (vt * to_end.permute(0, 1, 3, 4, 2)[..., None]).flatten(-2)  # [B, G, N, C, R V]
    kv = _bmm(kc.transpose(-1, -2), v_end)  # [B, G, N, K, R V]
    dec_cols = dec.permute(0, 1, 3, 2)[..., None, :, None].expand(-1, -1, -1, 1, -1, dv)
    states, final = decay_scan(dec_cols.flatten(-2), kv)  # the state entering each chunk
    if ctx.cp_enabled:
        prefix, total = entry_products(dec)  # [B, G, R, N], [B, G, R]
        s_final = final.unflatten(-1, (rep, dv)).transpose(2, 3)  # [B, G, R, K, V]
        s_in = entering_state(total, s_final, ctx).to(dt)  # the shard's map is total * I
        reach = prefix.permute(0, 1, 3, 2)[:, :, :, None, :, None]  # [B, G, N, 1, R, 1]
        states = states + (reach * s_in.transpose(2, 3)[:, :, None]).flatten(-2)  # [B, G, N, K, R V]
    inter = _bmm(qc, states).unflatten(-1, (rep, dv))  # [B, G, N, C, R, V]
    # decay_in is an exact 0 for tokens not carried into their chunk: the entering state (finite)
    # adds exact zeros to them
    decay_in = decay_in.permute(0, 1, 3, 4, 2)[..., None]  # [B, G, N, C, R, 1]
    out = (decay_in * inter).add_(intra)  # [B, G, N, C, R, V]
    out = out.permute(0, 2, 3, 1, 4, 5).reshape(bsz, n * c, heads, dv)
    return trim(out, length, v.dtype)
