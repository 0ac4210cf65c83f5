"""Gated DeltaNet layers (Qwen3-Next's ``Qwen3NextGatedDeltaNet``, Qwen3.5's, OLMo-Hybrid's; later
Qwen4-Exp) on fcp's operators.

``fcp_forward(hidden_states [B, L, D], ctx) -> [B, L, D]``::

    qkv, z, b, a = fcp_projections(x)            # the model's projection layout (adapter)
    q, k, v = split(conv(qkv))                   # short conv over [q | k | v], SiLU
    g, beta = fcp_decay_from_logit(a), fcp_beta_from_logit(b)
    o = kda(l2norm(q), l2norm(k), v, g, beta, ctx, scale=head_k_dim ** -0.5)
    out = fcp_gated_output(o, z)                 # SiLU-gated RMSNorm with z, output projection

:func:`fcp.ops.kda.kda` with one decay per value head is Gated DeltaNet; value head ``h`` reads
key head ``h // (num_v_heads // num_k_heads)`` (transformers' ``repeat_interleave``). The
attribute names are the ones Qwen3-Next, Qwen3.5 and OLMo-Hybrid share (``num_k_heads``,
``num_v_heads``, ``head_k_dim``, ``head_v_dim``, ``key_dim``, ``value_dim``, ``conv1d``,
``A_log``, ``dt_bias``); the projections differ per model, so ``fcp_projections`` is the
adapter's (OLMo-Hybrid also overrides ``fcp_beta_from_logit``: ``2 * sigmoid(b)``, and
``fcp_gated_output``: its ``o_norm`` / ``o_proj``). The steps' contracts:
:class:`~.protocols.GdnSteps`. Under CP: the conv halo and one fp32 state-chain all-gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.mixers.common import check_silu, conv, l2norm
from fcp.ops.kda import kda

__all__ = ["GatedDeltaNetMixer"]


class GatedDeltaNetMixer(FcpMixer):
    """A Gated DeltaNet layer (module doc); an adapter defines :meth:`fcp_projections`."""

    @classmethod
    def fcp_check(cls, module) -> None:
        check_silu(module)

    def fcp_projections(self, x: torch.Tensor):
        """``(qkv [B, L, 2 * key_dim + value_dim], z [B, L, HV, V], b [B, L, HV], a [B, L, HV])``:
        the conv input ``[q | k | v]``, the output gate, the beta and decay logits."""
        raise NotImplementedError(f"{type(self).__name__}: the adapter defines fcp_projections")

    def fcp_beta_from_logit(self, b: torch.Tensor) -> torch.Tensor:
        return b.sigmoid()

    def fcp_decay_from_logit(self, a: torch.Tensor) -> torch.Tensor:
        """One log decay per value head, fp32: ``-exp(A_log) * softplus(a + dt_bias)``."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def fcp_gated_output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``o [B, L, HV, V]`` (fp32) -> ``[B, L, D]``: the RMSNorm gated by ``z``, ``out_proj``."""
        return self.out_proj(self.norm(o.to(z.dtype), z).flatten(2))

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, **_) -> torch.Tensor:
        b, n, _ = hidden_states.shape
        qkv, z, beta_logit, a = self.fcp_projections(hidden_states)
        qkv = conv(self.conv1d, qkv, ctx, "silu")
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (t.reshape(b, n, self.num_k_heads, self.head_k_dim) for t in (q, k))
        v = v.reshape(b, n, self.num_v_heads, self.head_v_dim)
        o = kda(l2norm(q), l2norm(k), v, self.fcp_decay_from_logit(a),
                self.fcp_beta_from_logit(beta_logit), ctx,
                scale=self.head_k_dim**-0.5)  # fmt: skip
        return self.fcp_gated_output(o, z)
