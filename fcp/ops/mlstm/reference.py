"""xLSTM's mLSTM, the definition: the per-token loop with transformers' max stabiliser (tests
only).

Per head, inside one document, with ``f_t = log sigmoid(forget preactivation)`` and ``i_t`` the
input-gate preactivation (an exponential gate), the recurrence of transformers'
``mlstm_recurrent_step_native`` from a zero state and ``m_0 = 0`` at every document start::

    m_t = max(f_t + m_{t-1}, i_t)                               # the stabiliser (running max)
    C_t = e^{f_t + m_{t-1} - m_t} C_{t-1} + e^{i_t - m_t} k_t v_t^T   # [K, V], scaled by e^-m_t
    n_t = e^{f_t + m_{t-1} - m_t} n_{t-1} + e^{i_t - m_t} k_t
    h_t = (s q_t)^T C_t / (max(|(s q_t)^T n_t|, e^{-m_t}) + eps)     # s = K ** -0.5

:func:`mlstm_stabilizer_reference` is the stabiliser alone (what :func:`fcp.ops.mlstm.
mlstm_stabilizer` computes), :func:`mlstm_reference` the whole layer core (what xLSTM's mixer
composes from the stabiliser and :func:`fcp.ops.gla.gla`). O(sequence) Python steps.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.layout import document_starts
from fcp.ops.kit.loops import reference_doc_ids

__all__ = ["mlstm_reference", "mlstm_stabilizer_reference"]


def mlstm_stabilizer_reference(log_f: torch.Tensor, log_i: torch.Tensor,
                               ctx: PackedContext | torch.Tensor):  # fmt: skip
    """``(m, m_prev)`` ``[batch, seq, heads]`` of ``log_f, log_i [batch, seq, heads]`` (float64):
    the running max after each token and before it (0 at a document start)."""
    doc_ids = reference_doc_ids(ctx, "mlstm_stabilizer_reference")
    starts = document_starts(doc_ids)
    f, i = log_f.double(), log_i.double()
    ms, prevs = [], []
    for b in range(f.shape[0]):
        row, row_prev, m = [], [], None
        for t in range(f.shape[1]):
            if bool(starts[b, t]):
                m = torch.zeros_like(f[b, t])
            row_prev.append(m)
            m = torch.maximum(f[b, t] + m, i[b, t])
            row.append(m)
        ms.append(torch.stack(row))
        prevs.append(torch.stack(row_prev))
    return torch.stack(ms), torch.stack(prevs)


def mlstm_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor,
                    log_i: torch.Tensor, ctx: PackedContext | torch.Tensor,
                    eps: float = 1e-6) -> torch.Tensor:  # fmt: skip
    """The mLSTM of the module doc (float64): ``q, k [batch, seq, heads, K]``,
    ``v [batch, seq, heads, V]``, ``log_f, log_i [batch, seq, heads]``; ``ctx`` a non-CP context
    or the doc-id map. Returns ``h [batch, seq, heads, V]`` in ``v``'s dtype."""
    doc_ids = reference_doc_ids(ctx, "mlstm_reference")
    starts = document_starts(doc_ids)
    qd, kd, vd, f, i = (x.double() for x in (q, k, v, log_f, log_i))
    scale = q.shape[-1] ** -0.5
    out = torch.empty_like(vd)
    for b in range(q.shape[0]):
        c = n = m = None
        for t in range(q.shape[1]):
            if bool(starts[b, t]):
                c = torch.zeros(q.shape[2], q.shape[3], v.shape[3], dtype=torch.float64)
                n = torch.zeros(q.shape[2], q.shape[3], dtype=torch.float64)
                m = torch.zeros(q.shape[2], dtype=torch.float64)
            m_new = torch.maximum(f[b, t] + m, i[b, t])
            decay, gate = torch.exp(f[b, t] + m - m_new), torch.exp(i[b, t] - m_new)
            kv = kd[b, t, :, :, None] * vd[b, t, :, None]  # [H, K, V]
            c = decay[:, None, None] * c + gate[:, None, None] * kv
            n = decay[:, None] * n + gate[:, None] * kd[b, t]
            m = m_new
            qs = qd[b, t] * scale
            num = torch.einsum("hk,hkv->hv", qs, c)
            den = torch.maximum((qs * n).sum(-1).abs(), torch.exp(-m)) + eps
            out[b, t] = num / den[:, None]
    return out.to(v.dtype)
