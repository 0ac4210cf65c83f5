"""Mamba2 layers (Nemotron-H's ``NemotronHMamba2Mixer``, Granite 4.0-H's
``GraniteMoeHybridMambaLayer``, Falcon-H1's ``FalconH1Mixer``, Bamba's ``BambaMixer``) on fcp's
operators: the state-space duality (SSD) as gated linear attention.

``fcp_forward(hidden_states [B, L, D], ctx) -> [B, L, D]``::

    z, xBC, dt = split(fcp_project(x))       # [B, L, H P], [B, L, H P + 2 G N], [B, L, H]
    x, B, C = split(short_conv(xBC, SiLU))   # one depthwise conv over [x | B | C]
    dt = softplus(dt + dt_bias).clamp(*time_step_limit)          # the layer's dtype, then fp32
    y = gla(C, B, dt * x, dt * -exp(A_log), ctx, scale=1) + D * x  # fp32 [B, L, H, P]
    out = fcp_ssd_output(y, z)               # gated RMSNorm with z, out_proj

Per head ``h`` (``P = head_dim``, ``N = ssm_state_size``) the SSD recurrence
``S_t = exp(dt_t A_h) S_{t-1} + (dt_t x_t) B_t^T``, ``y_t = S_t C_t + D_h x_t`` is
:func:`fcp.ops.gla.gla` with ``q = C``, ``k = B`` (group ``h // (H // G)``, transformers'
``repeat_interleave``; Mamba2's ``n_groups``), ``v = dt x`` and ``a = dt A``, the state ``[N, P]``
restarted at every document start. The order of operations and dtypes are transformers'
(``mamba2_chunk_scan``, its pure-PyTorch path): x, B, C and the SSD in fp32, ``dt`` computed in
the layer's dtype, the gated norm given the fp32 ``y``, ``out_proj`` on ``y`` cast back.

The attribute names are the ones all four families share (``in_proj``, ``conv1d``, ``dt_bias``,
``A_log``, ``D``, ``norm``, ``out_proj``, ``num_heads``, ``head_dim``, ``n_groups``,
``ssm_state_size``, ``intermediate_size``, ``conv_dim``, ``chunk_size``, ``time_step_limit``,
``activation``); the gated RMSNorm (``norm(y, z)``: group size, gate before or after the norm) is
the layer's own module. Falcon-H1's adapter overrides ``fcp_project`` (its muP multipliers) and
``fcp_ssd_output`` (an optional norm). The steps' contracts: :class:`~.protocols.SsdSteps`.

The chunk size changes rounding only; it is fcp's, not the model's (a tile size of mamba_ssm's
kernels: 128 in Nemotron-H, 256 in Granite 4.0-H, Falcon-H1 and Bamba): 64, the operator's
default, or the largest power of two not above a smaller ``chunk_size`` of the layer (larger
chunks cost more time and activations on a CPU: ``docs/performance.md``).

Under CP a layer exchanges the conv's ``W - 1``-token left halo of ``[x | B | C]`` and one fp32
state-chain all-gather of ``[B, H, N, N + P]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.mixers.common import check_silu, conv
from fcp.ops.gla import gla

__all__ = ["SsdMixer"]


class SsdMixer(FcpMixer):
    """A Mamba2 layer: conv over ``[x | B | C]``, SSD as gated linear attention, D skip, gated
    RMSNorm (module doc)."""

    @classmethod
    def fcp_check(cls, module) -> None:
        check_silu(module)

    def fcp_project(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L, intermediate_size + conv_dim + num_heads]``: ``[z | x B C | dt]``."""
        return self.in_proj(x)

    def fcp_ssd_output(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``y [B, L, H * P]`` (fp32) -> ``[B, L, D]``: the RMSNorm gated by ``z``, ``out_proj``."""
        return self.out_proj(self.norm(y, z).to(dtype))

    def fcp_chunk_size(self) -> int:
        """64, or the largest power of two not above a smaller ``chunk_size`` (module doc)."""
        return 1 << (max(1, min(int(self.chunk_size), 64)).bit_length() - 1)

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, **_) -> torch.Tensor:
        b, n, _ = hidden_states.shape
        heads, groups, state = self.num_heads, self.n_groups, self.ssm_state_size
        sizes = [self.intermediate_size, self.conv_dim, heads]
        z, xbc, dt = torch.split(self.fcp_project(hidden_states), sizes, dim=-1)
        xbc = conv(self.conv1d, xbc, ctx, "silu")
        x, bk, cq = torch.split(xbc, [self.intermediate_size, groups * state, groups * state], -1)
        x = x.reshape(b, n, heads, self.head_dim).float()
        bk, cq = (t.reshape(b, n, groups, state).float() for t in (bk, cq))
        low, high = self.time_step_limit
        dt = torch.clamp(F.softplus(dt + self.dt_bias.to(dt.dtype)), min=low, max=high).float()
        decay = -torch.exp(self.A_log.float()) * dt
        y = gla(cq, bk, x * dt[..., None], decay, ctx, scale=1.0,
                chunk_size=self.fcp_chunk_size())  # fmt: skip
        y = y + self.D[..., None] * x
        return self.fcp_ssd_output(y.reshape(b, n, -1), z, hidden_states.dtype)
