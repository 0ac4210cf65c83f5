"""Lightning attention (MiniMax's ``MiniMaxLightningAttention``) on fcp's operators: linear
attention with one constant decay per head, as gated linear attention.

``fcp_forward(hidden_states [B, L, D], ctx) -> (out [B, L, D], None)``::

    q, k, v = fcp_lightning_qkv(x)            # act(qkv_proj(x)), split per head: [B, L, H, Dh]
    a = -fcp_slopes()                         # [H] fp32, the same decay at every token
    o = gla(q, k, v, a, ctx, scale=1)         # [B, L, H, Dh], in v's dtype
    out = fcp_output(o, x)                    # RMSNorm over H * Dh, * sigmoid(output_gate(x)),
                                              # out_proj

Per head ``h``, with the slope ``s_h`` (the ``slope_rate`` buffer: ALiBi's geometric slopes
``2 ** (-8 (h + 1) / H)`` scaled by ``1 - layer_idx / (num_layers - 1)``), transformers' block
computation (``block_size`` tokens at a time: an intra-block product masked by
``exp(-s_h (i - j))`` and the inter-block state decayed by ``exp(-s_h n)``) is the recurrence

    S_t = exp(-s_h) S_{t-1} + k_t v_t^T,      o_t = S_t^T q_t

(the diagonal ``i = j`` included, no query scale, the state zero at the start), i.e.
:func:`fcp.ops.gla.gla` with ``a = -s_h`` at every token and ``scale = 1``, the state ``[Dh, Dh]``
restarted at every document start. The block size is an implementation detail (rounding only);
fcp's chunks are the operator's default. transformers keeps the state in the layer's dtype, fcp
in fp32 (identical in fp32).

The norm (``norm``, an RMSNorm over all ``H * Dh`` channels at once, not per head), the sigmoid
output gate (``output_gate``, from the layer input) and ``out_proj`` are per token; the module's
own modules run them. The steps' contracts: :class:`~.protocols.LightningSteps`.

Under CP a layer exchanges one fp32 state-chain all-gather of ``[B, H, Dh, 2 Dh]``; it has no
conv and no halo.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.ops.gla import gla

__all__ = ["LightningMixer"]


class LightningMixer(FcpMixer):
    """Linear attention with a constant per-head decay, RMSNorm and a sigmoid output gate
    (module doc)."""

    def fcp_lightning_qkv(self, x: torch.Tensor):
        """``x [B, L, D]`` -> ``(q, k, v)``, each ``[B, L, H, Dh]``: ``act(qkv_proj(x))``, each
        head's ``3 Dh`` channels split as ``[q | k | v]`` (transformers' layout)."""
        qkv = self.act_fn(self.qkv_proj(x))
        qkv = qkv.view(*x.shape[:2], self.num_attention_heads, 3 * self.head_dim)
        return torch.split(qkv, self.head_dim, dim=-1)

    def fcp_slopes(self) -> torch.Tensor:
        """``[H]`` fp32: each head's decay rate ``s_h`` (``exp(-s_h)`` per token), the layer's
        ``slope_rate`` buffer."""
        return self.slope_rate.reshape(self.num_attention_heads).float()

    def fcp_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``o [B, L, H, Dh]`` and the layer input ``x [B, L, D]`` -> ``[B, L, D]``: the RMSNorm
        over ``H * Dh``, times ``sigmoid(output_gate(x))``, ``out_proj``."""
        o = self.norm(o.flatten(2))
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * o)

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, **_):
        q, k, v = self.fcp_lightning_qkv(hidden_states)
        b, n = hidden_states.shape[:2]
        decay = -self.fcp_slopes().expand(b, n, -1)
        o = gla(q, k, v, decay, ctx, scale=1.0)
        return self.fcp_output(o, hidden_states), None
