"""RWKV-4's WKV, the definition: the per-token loop with the running-max stabiliser (tests only).

Per channel ``c``, with a per-step log decay ``a_c <= 0`` (RWKV-4: ``a = -exp(time_decay)``) and a
bonus ``u_c`` (``time_first``), inside one document::

    wkv_t = (sum_{i<t} e^{(t-1-i) a + k_i} v_i + e^{u + k_t} v_t)
          / (sum_{i<t} e^{(t-1-i) a + k_i}     + e^{u + k_t})

Both sums restart at every document start (and at the pad tail). The loop keeps them scaled by a
running maximum of the exponents, as transformers' ``rwkv_linear_attention_cpu`` does, so no
exponential overflows. O(sequence) Python steps: the specification and test oracle, never a
model's path.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.layout import document_starts
from fcp.ops.kit.loops import reference_doc_ids

__all__ = ["wkv_reference"]


def wkv_reference(k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, u: torch.Tensor,
                  ctx: PackedContext | torch.Tensor) -> torch.Tensor:
    """Single-process :func:`fcp.ops.wkv.wkv` by the per-token loop (float64).

    ``k, v [batch, seq, channels]``, ``a, u [channels]``; ``ctx`` a non-CP context or the doc-id
    map ``[batch, seq]``. Returns ``[batch, seq, channels]`` in ``v``'s dtype.
    """
    doc_ids = reference_doc_ids(ctx, "wkv_reference")
    starts = document_starts(doc_ids)
    kd, vd, ad, ud = k.double(), v.double(), a.double(), u.double()
    out = torch.empty_like(vd)
    for b in range(k.shape[0]):
        num = den = mx = None  # the state: sums scaled by exp(-mx)
        for t in range(k.shape[1]):
            if bool(starts[b, t]):
                num = torch.zeros_like(vd[b, t])
                den = torch.zeros_like(vd[b, t])
                mx = torch.full_like(vd[b, t], -torch.inf)
            kt, vt = kd[b, t], vd[b, t]
            m_out = torch.maximum(mx, ud + kt)
            e1, e2 = torch.exp(mx - m_out), torch.exp(ud + kt - m_out)
            out[b, t] = (e1 * num + e2 * vt) / (e1 * den + e2)
            m_new = torch.maximum(mx + ad, kt)
            e1, e2 = torch.exp(mx + ad - m_new), torch.exp(kt - m_new)
            num, den, mx = e1 * num + e2 * vt, e1 * den + e2, m_new
    return out.to(v.dtype)
