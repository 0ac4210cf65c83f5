"""xLSTM's mLSTM layer (transformers' ``xLSTMLayer``) on fcp's operators: the matrix memory as
gated linear attention, its max stabiliser as a max-plus scan.

``fcp_forward(hidden_states [B, L, D], ctx) -> (out [B, L, D], None)``::

    q, k, v, o, i, f = fcp_mlstm_inputs(x)     # [B, L, H, K] x2, [B, L, H, V], [B, L, H V],
                                               # gates [B, L, H] (soft-capped preactivations)
    log_f = logsigmoid(f)                      # fp32
    m, m_prev = mlstm_stabilizer(log_f, i)     # the running max, m = 0 at a document start
    r, r_prev = m.detach(), m_prev.detach()    # references: they cancel (below)
    y = gla(q, k * exp(i - r), [v | 1], log_f + r_prev - r, scale=K ** -0.5)   # exps <= 0
    h = y[.., :V] / (max(|y[.., V]|, exp(-r)) + eps * exp(m - r))
    out = out_proj(sigmoid(o) * multihead_norm(h))

Why it is transformers' mLSTM exactly: with the state scaled by ``e^{-r_t}``, ``C~_t = e^{f_t +
r_{t-1} - r_t} C~_{t-1} + e^{i_t - r_t} k_t v_t^T`` is gated linear attention with the log decay
``f_t + r_{t-1} - r_t <= 0`` and the key ``e^{i_t - r_t} k_t`` (exponent ``<= 0``), the
normaliser ``n~`` its ones column. For any reference ``r`` the quotient equals
``C q / (max(|n^T q|, 1) + eps e^{m})`` (unscaled ``C``, ``n``): the reference cancels, so its
gradient may be dropped, and only the ``eps e^{m - r}`` term keeps ``m``'s gradient, which is
where transformers' value depends on the stabiliser (``eps`` is ``config.eps``). With ``r = m``
(the value transformers uses) every exponent is ``<= 0`` and the scaled sums are transformers'
own. :func:`fcp.ops.mlstm.mlstm_stabilizer` computes ``m`` exactly per document (the max-plus
maps cross ranks by one all-gather of fp32 ``[B, H, 2]``), :func:`fcp.ops.gla.gla` the rest
(one fp32 state-chain all-gather ``[B, H, K, K + V + 1]`` under CP).

``fcp_mlstm_inputs`` reads both of transformers' weight modes (``"single"``: ``q``, ``k``, ``v``,
``ogate_preact``, ``igate_preact``, ``fgate_preact``; ``"fused"``: ``qkv_opreact``,
``ifgate_preact``), the gates soft-capped by ``config.gate_soft_cap`` as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.ops.gla import gla
from fcp.ops.mlstm import mlstm_stabilizer

__all__ = ["MlstmMixer"]


def _soft_cap(x: torch.Tensor, cap) -> torch.Tensor:
    return x if cap is None else cap * torch.tanh(x / cap)


class MlstmMixer(FcpMixer):
    """xLSTM's mLSTM layer (module doc)."""

    @classmethod
    def fcp_check(cls, module) -> None:
        mode = module.config.weight_mode
        if mode not in ("single", "fused"):
            raise NotImplementedError(f"{type(module).__name__}: weight_mode {mode!r} is neither "
                                      "'single' nor 'fused'")  # fmt: skip

    def fcp_mlstm_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [B, L, D]`` -> ``(q, k [B, L, H, K], v [B, L, H, V], o [B, L, H * V],
        i, f [B, L, H])``: projections, output-gate and soft-capped gate preactivations."""
        config = self.config
        b, n, _ = x.shape
        if config.weight_mode == "single":
            q, k, v = self.q(x), self.k(x), self.v(x)
            o = self.ogate_preact(x)
            i = _soft_cap(self.igate_preact(x), config.gate_soft_cap)
            f = _soft_cap(self.fgate_preact(x), config.gate_soft_cap)
        else:
            q, k, v, o = torch.tensor_split(self.qkv_opreact(x), (self.qk_dim, 2 * self.qk_dim,
                                                                   2 * self.qk_dim + self.v_dim),
                                            dim=-1)  # fmt: skip
            gates = _soft_cap(self.ifgate_preact(x), config.gate_soft_cap)
            i, f = torch.tensor_split(gates, (config.num_heads,), dim=-1)
        heads = config.num_heads
        q, k, v = (t.reshape(b, n, heads, -1) for t in (q, k, v))
        return q, k, v, o, i, f

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, *, state=None,
                    **_) -> tuple[torch.Tensor, None]:  # fmt: skip
        if state is not None:
            raise ValueError(f"{type(self).__name__}: fcp runs full packed sequences; a recurrent "
                             "`state` cannot be given with cp_context")  # fmt: skip
        b, n, _ = hidden_states.shape
        q, k, v, o, i, f = self.fcp_mlstm_inputs(hidden_states)
        log_f, log_i = F.logsigmoid(f.float()), i.float()
        m, m_prev = mlstm_stabilizer(log_f, log_i, ctx)
        r, r_prev = m.detach(), m_prev.detach()
        dk, dv = q.shape[-1], v.shape[-1]
        keys = k.float() * torch.exp(log_i - r)[..., None]
        values = torch.cat([v.float(), v.new_ones(*v.shape[:-1], 1, dtype=torch.float32)], -1)
        y = gla(q.float(), keys, values, log_f + r_prev - r, ctx, scale=dk**-0.5)
        den = torch.maximum(y[..., dv:].abs(), torch.exp(-r)[..., None])
        h = y[..., :dv] / (den + self.config.eps * torch.exp(m - r)[..., None])
        h = self.multihead_norm(h.to(v.dtype)).reshape(b, n, -1)
        return self.out_proj(self.ogate_act_fn(o) * h), None
