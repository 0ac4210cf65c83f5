"""Gated short-convolution layers (LFM2's ``Lfm2ShortConv``, LFM2-MoE's ``Lfm2MoeShortConv``) on
fcp's operators.

``fcp_forward(hidden_states [B, L, D], ctx) -> [B, L, D]``::

    b, c, x = chunk(in_proj(hidden_states), 3)     # [B, L, D] each
    y = c * short_conv(b * x)                      # depthwise causal conv, no activation
    out = out_proj(y)

The conv (``conv``, ``nn.Conv1d(groups=D)``, width ``conv_L_cache``, optional bias) never mixes
two documents; under CP the layer exchanges its ``W - 1``-token left halo, nothing else.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.mixers.common import conv

__all__ = ["GatedShortConvMixer"]


class GatedShortConvMixer(FcpMixer):
    """The input-gated, output-gated depthwise causal conv (module doc)."""

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, **_) -> torch.Tensor:
        b, c, x = self.in_proj(hidden_states).chunk(3, dim=-1)
        return self.out_proj(c * conv(self.conv, b * x, ctx, None))
