"""Kimi Delta Attention layers (GLM-5.3-Flash's ``Glm5NextTextLinearAttention``, Kimi-Linear's
``KimiLinearDeltaAttention``, Bailing-Hybrid's ``BailingHybridDeltaAttention``) on fcp's
operators.

``fcp_forward(hidden_states [B, L, D], ctx) -> [B, L, D]``::

    qkv  = conv(fcp_conv_input(x))               # short conv over [q | k | v], SiLU
    g    = fcp_decay(x)                          # [B, L, H, K] fp32 log-decay per channel
    beta = fcp_beta(x)                           # [B, L, H]
    o    = kda(l2norm(q), l2norm(k), v, g, beta, ctx, scale=head_dim ** -0.5)   # state chained
    out  = fcp_output(o, x)                      # gated RMSNorm, output projection

The defaults read the attribute names both models share (``q_proj``/``k_proj``/``v_proj``,
``conv1d``, ``forget_gate``, ``b_proj``, ``g_a_proj``/``g_b_proj``, ``o_norm``, ``o_proj``,
``head_dim``, ``qkv_dim``); the forget gate is the model's own module. An adapter overrides what
differs (Bailing-Hybrid: ``fcp_output`` with its single ``g_proj``); the steps' contracts:
:class:`~.protocols.KdaSteps`. Under CP a layer exchanges the conv halo and one fp32 state-chain
all-gather of ``[B, H, K, K + V]``.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.mixers.common import check_silu, conv, l2norm
from fcp.ops.kda import kda

__all__ = ["KdaMixer"]


class KdaMixer(FcpMixer):
    """A KDA layer: short conv, per-channel forget gate, delta rule, gated norm (module doc)."""

    @classmethod
    def fcp_check(cls, module) -> None:
        check_silu(module)

    def fcp_conv_input(self, x: torch.Tensor) -> torch.Tensor:
        """The conv input ``[B, L, 3 * qkv_dim]``: ``[q | k | v]``."""
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)

    def fcp_decay(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token, per-channel log decay ``[B, L, H, K]`` (fp32)."""
        return self.forget_gate(x)

    def fcp_beta(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.b_proj(x))

    def fcp_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``o [B, L, H, V]`` (fp32) -> ``[B, L, D]``: RMSNorm gated by a low-rank projection."""
        b, n = x.shape[:2]
        gate = self.g_b_proj(self.g_a_proj(x)).view(b, n, -1, self.head_dim)
        return self.o_proj(self.o_norm(o.to(x.dtype), gate).reshape(b, n, -1))

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, **_) -> torch.Tensor:
        x = hidden_states
        shape = (*x.shape[:2], -1, self.head_dim)
        qkv = conv(self.conv1d, self.fcp_conv_input(x), ctx, "silu")
        q, k, v = (t.reshape(shape) for t in torch.split(qkv, [self.qkv_dim] * 3, dim=-1))
        o = kda(l2norm(q), l2norm(k), v, self.fcp_decay(x), self.fcp_beta(x), ctx,
                scale=self.head_dim**-0.5)  # fmt: skip
        return self.fcp_output(o, x)
