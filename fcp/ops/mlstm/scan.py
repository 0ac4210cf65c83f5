"""The mLSTM stabiliser's exact static-shape PyTorch path: a log-depth max-plus scan, documents
reset exactly, exact under CP.

The running max ``m_t = max(f_t + m_{t-1}, i_t)`` (``m = 0`` before a document's first token) is
a recurrence in the max-plus semiring: token ``t`` is the map ``m -> max(m + f_t, i_t)``, a pair
``(G, M) = (f_t, i_t)``, and maps compose associatively, ``(G_R, M_R) o (G_L, M_L) = (G_L + G_R,
max(M_L + G_R, M_R))``. :func:`stabilizer_scan` composes the tokens by a Hillis-Steele scan
(``log2(T)`` elementwise steps) within runs (a token that starts a run is the constant map
``max(f_t, i_t)``, and a left segment joins only where it ends in the token's own run). The
result is the same maximum of the same sums as the per-token loop (only the association of the
sums of ``f`` differs: fp32 rounding), and its gradient flows through the ``max`` as the loop's
does (to the argument that attains it).

**CP.** A shard's map on the max entering it is ``m -> max(m + G_r, M_r)`` (a constant ``M_r``
where a run starts inside the shard): one differentiable all-gather of every rank's
``(G_r, M_r)`` (fp32 ``[batch, heads, 2]``) and a local fold over the earlier ranks give the
exact entering max; its gradient returns by the gather's reduce-scatter.
"""

from __future__ import annotations

import torch

from fcp.comm import all_gather_backward_anchor, all_gather_group
from fcp.context import PackedContext
from fcp.layout import document_starts
from fcp.ops.kit.common import compute_dtype
from fcp.ops.kit.recurrence import chunk_runs

__all__ = ["stabilizer_scan"]


def _entering(g_last: torch.Tensor, m_last: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
    """``[B, H]``: the running max entering this shard (a placeholder on rank 0, where no
    token reads it), from every rank's shard map ``(G_r, M_r)``."""
    n, rank = ctx.local_seq_len, ctx.cp_rank
    seg = torch.cumsum(document_starts(ctx.doc_ids), 1)
    ends = seg[:, n - 1 :: n]  # [B, world]: each shard's last run
    passes = torch.cat([torch.zeros_like(ends[:, :1], dtype=torch.bool),
                        ends[:, 1:] == ends[:, :-1]], 1)  # fmt: skip
    maps = all_gather_group(torch.stack([g_last, m_last], -1)[None], ctx.group, dim=0,
                            validate=False)  # [world, B, H, 2], differentiable  # fmt: skip
    m_out = maps[0, ..., 1]
    m_in = m_out
    for j in range(1, rank + 1):  # static: the rank is a Python int
        m_in = m_out
        m_out = torch.where(passes[:, j, None], torch.maximum(m_in + maps[j, ..., 0],
                                                              maps[j, ..., 1]), maps[j, ..., 1])
    # every rank joins the gather's backward reduce-scatter, also one whose tokens read nothing
    return m_in + all_gather_backward_anchor(maps)


def stabilizer_scan(log_f: torch.Tensor, log_i: torch.Tensor, ctx: PackedContext):
    """The ``"scan"`` backend of :func:`fcp.ops.mlstm.mlstm_stabilizer` (same arguments, checked
    there). Returns ``(m, m_prev)`` in the compute dtype (fp32, fp64 for fp64 inputs).

    Guarantees: exact (the loop's maxima of the same sums, fp32 rounding of the sums); a
    document's values are bitwise independent of every token outside it; no host
    synchronisation, static shapes. Under CP one all-gather of fp32 ``[batch, heads, 2]``.
    """
    dt = compute_dtype(log_f, log_i)
    f, i = log_f.to(dt), log_i.to(dt)
    n = f.shape[1]
    seg, prev = chunk_runs(ctx, n, 1)
    seg, prev = seg[..., 0], prev[:, :1]  # [B, T], [B, 1]
    carried = (seg == prev)[..., None]  # [B, T, 1]: tokens of the run entering the shard
    start = (seg != torch.cat([prev, seg[:, :-1]], 1))[..., None]  # a run starts here (m = 0)
    g = f
    big = torch.where(start, torch.maximum(f, i), i)  # a run start: the constant max(0 + f, i)
    s = 1
    while s < n:
        same = (seg[:, s:] == seg[:, :-s])[..., None]
        joined = torch.maximum(big[:, :-s] + g[:, s:], big[:, s:])
        big = torch.cat([big[:, :s], torch.where(same, joined, big[:, s:])], 1)
        g = torch.cat([g[:, :s], torch.where(same, g[:, :-s] + g[:, s:], g[:, s:])], 1)
        s *= 2
    if ctx.cp_enabled:
        m_in = _entering(g[:, -1], big[:, -1], ctx).to(dt)
        m = torch.where(carried, torch.maximum(m_in[:, None] + g, big), big)
    else:
        m_in = torch.zeros_like(f[:, 0])
        m = big
    has = torch.cat([carried[:, :1], (seg[:, 1:] == seg[:, :-1])[..., None]], 1)
    before = torch.cat([m_in[:, None], m[:, :-1]], 1)
    return m, torch.where(has, before, 0.0)
