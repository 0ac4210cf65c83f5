"""Mamba1 layers (transformers' ``MambaMixer``, ``FalconMambaMixer``) on fcp's operators: the
selective scan as gated linear attention with a decay per key dimension.

``fcp_forward(hidden_states [B, L, D], ctx) -> [B, L, D]``::

    x, z = chunk(fcp_project(h), 2)               # in_proj: [B, L, I] each
    x = short_conv(x, SiLU)                        # depthwise causal conv, a W - 1 halo under CP
    dt, B, C = fcp_ssm_inputs(x)                   # fcp_ssm_norms(split(x_proj(x), [R, N, N])),
                                                   # dt @ dt_proj.weight^T: [B, L, I], [B, L, 1, N]
    A, D, dt_bias = fcp_ssm_params()               # -exp(A_log) [I, N], D [I], dt_proj.bias [I]
    dt = softplus(dt + dt_bias)                    # [B, L, I], the layer's dtype
    y = gla(C, B, dt * x, dt * A, ctx, scale=1) + D * x             # fp32 [B, L, I]
    out = out_proj((y * silu(z)).to(dtype))

**The mapping.** Per channel ``c`` of the ``I = intermediate_size`` channels, Mamba1's selective
scan keeps a state ``h [N]``::

    h_t = exp(dt_t,c A_c) * h_{t-1} + dt_t,c B_t x_t,c        (A_c = -exp(A_log_c) [N])
    y_t,c = C_t . h_t + D_c x_t,c

which is :func:`fcp.ops.gla.gla` with **heads = channels** (``H = I``), one query/key group
shared by every head (``groups = 1``: B and C do not depend on the channel; Zamba's ``G =
n_mamba_heads`` groups of ``I / G`` channels each have their own), **keys = the state** (``K =
N``), **one value** (``V = 1``)::

    q = C [B, L, G, N],  k = B [B, L, G, N],  v = dt * x [B, L, I, 1],
    a = dt[..., None] * A [B, L, I, N]   (a decay per key: the state's own decay per entry),
    scale = 1

the ``[N, 1]`` state of each head restarted at every document start and carried across CP ranks
by one fp32 state-chain all-gather of ``[B, I, N, N + 1]``. The order of operations and dtypes
are transformers' PyTorch path (``mamba_selective_scan``): ``dt`` projected without its bias,
the bias added in the layer's dtype, ``softplus``; the scan, ``y`` and the D skip in fp32;
``out_proj`` on ``y * silu(z)`` cast back. The result is checked per document against
transformers' sequential scan (the parity battery).

The attribute names are the ones ``MambaMixer`` and ``FalconMambaMixer`` share (``in_proj``,
``conv1d``, ``x_proj``, ``dt_proj``, ``A_log``, ``D``, ``out_proj``, ``intermediate_size``,
``ssm_state_size``, ``time_step_rank``, ``activation``); Zamba's adapter overrides
``fcp_project`` (its interleaved ``[x | z]``), ``fcp_ssm_inputs`` and ``fcp_ssm_params`` (its
per-head ``x_proj`` / ``dt_proj`` weights). The steps' contracts:
:class:`~.protocols.Mamba1Steps`.

The chunk size changes rounding only: with one value per head the in-chunk pairs cost ``C``
times the per-token scan, so the chunks are short (8 tokens; measured fwd + bwd, one thread,
4096 tokens, 256 channels, N = 16, on a loaded 2-core machine: 6.0 s at 8, 6.8 s at 16, 8.8 s
at 32). A dedicated ``V = 1`` form (a per-token diagonal scan) is not written yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.mixers.common import check_silu, conv
from fcp.ops.gla import gla

__all__ = ["Mamba1Mixer"]


class Mamba1Mixer(FcpMixer):
    """A Mamba1 layer: conv over x, selective scan as per-key-decay gated linear attention, D
    skip, SiLU gate (module doc)."""

    @classmethod
    def fcp_check(cls, module) -> None:
        check_silu(module)

    def fcp_project(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L, 2 * intermediate_size]``: ``[x | z]``."""
        return self.in_proj(x)

    def fcp_ssm_norms(self, dt: torch.Tensor, b: torch.Tensor,
                      c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x_proj``'s ``dt [B, L, R]``, ``B``, ``C [B, L, N]`` as the scan reads them: as they
        are (Mamba); Falcon-Mamba and Jamba normalise each."""
        return dt, b, c

    def fcp_ssm_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [B, L, I]`` (after the conv) -> ``(dt [B, L, I]`` before its bias and softplus,
        ``B``, ``C [B, L, G, N])``: ``x_proj``, :meth:`fcp_ssm_norms`, ``dt_proj``'s weight
        (one group: ``G = 1``)."""
        state = self.ssm_state_size
        dt, b, c = torch.split(self.x_proj(x), [self.time_step_rank, state, state], dim=-1)
        dt, b, c = self.fcp_ssm_norms(dt, b, c)
        return F.linear(dt, self.dt_proj.weight), b[:, :, None], c[:, :, None]

    def fcp_ssm_params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(A [I, N]`` fp32, ``A = -exp(A_log)``; ``D [I]``; the dt bias ``[I]`` or ``None)``."""
        return -torch.exp(self.A_log.float()), self.D, self.dt_proj.bias

    def fcp_chunk_size(self) -> int:
        """8: short chunks for one value per head (module doc)."""
        return 8

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, **_) -> torch.Tensor:
        x, z = self.fcp_project(hidden_states).chunk(2, dim=-1)
        x = conv(self.conv1d, x, ctx, "silu")  # [B, L, I]
        dt, bk, cq = self.fcp_ssm_inputs(x)
        a_mat, d_skip, dt_bias = self.fcp_ssm_params()
        if dt_bias is not None:  # transformers adds the bias in the scan, in dt's dtype
            dt = dt + dt_bias.float().to(dt.dtype)
        dt = F.softplus(dt).float()  # [B, L, I]
        xf = x.float()
        y = gla(cq.float(), bk.float(), (dt * xf)[..., None], dt[..., None] * a_mat, ctx,
                scale=1.0, chunk_size=self.fcp_chunk_size())[..., 0]  # fmt: skip
        y = (y + xf * d_skip.float()) * F.silu(z)
        return self.out_proj(y.to(hidden_states.dtype))
