"""Which transformers mixer runs on which fcp mixer: the models' adapters, in one place.

A transformers token mixer is supported by an entry of :data:`ADAPTERS`: its class name ->
an fcp mixer class, either a mixer kind as it is (the model uses the kind's default layout) or
an **adapter**, a subclass of a kind that overrides the ``fcp_*`` steps where the model differs
(projection names, fused projection layouts, gate forms). An adapter holds no state and never
copies anything: its methods run on the transformers module itself (see
:mod:`fcp.integrations.hf.core`), so ``self.q_proj`` is the model's own projection.

Adding a model is an adapter of a few lines and a row here, e.g. OLMo-Hybrid's Gated DeltaNet
(separate projections, ``beta`` scaled by 2, its own norm and output names)::

    class OlmoHybridGdn(GatedDeltaNetMixer):
        def fcp_projections(self, x):
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
            z = self.g_proj(x).unflatten(-1, (self.num_v_heads, self.head_v_dim))
            return qkv, z, self.b_proj(x), self.a_proj(x)

        def fcp_beta(self, b):
            return 2.0 * b.sigmoid() if self.allow_neg_eigval else b.sigmoid()

        def fcp_output(self, o, z):
            return self.o_proj(self.o_norm(o.to(z.dtype), z).flatten(2))

    ADAPTERS["OlmoHybridGatedDeltaNet"] = OlmoHybridGdn

plus a per-document parity test against transformers (``tests/support/hf_reference.py``).
"""

from __future__ import annotations

import torch

from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.mixers import (
    GatedDeltaNetMixer,
    GqaMixer,
    IndexedMlaMixer,
    KdaMixer,
    MlaMixer,
)

__all__ = ["ADAPTERS", "Qwen3NextAttentionAdapter", "Qwen3NextGdnAdapter"]


class Qwen3NextGdnAdapter(GatedDeltaNetMixer):
    """Qwen3-Next's interleaved projections: ``in_proj_qkvz`` holds, per key head ``j``,
    ``[q_j | k_j | v and z of value heads j r .. j r + r - 1]`` (``r = num_v_heads //
    num_k_heads``), ``in_proj_ba`` likewise ``[b | a]``."""

    def fcp_projections(self, x: torch.Tensor):
        b, n, _ = x.shape
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        r = hv // hk
        q, k, v, z = torch.split(self.in_proj_qkvz(x).view(b, n, hk, 2 * dk + 2 * r * dv),
                                 [dk, dk, r * dv, r * dv], dim=-1)  # fmt: skip
        beta, a = torch.split(self.in_proj_ba(x).view(b, n, hk, 2 * r), [r, r], dim=-1)
        qkv = torch.cat([t.reshape(b, n, -1) for t in (q, k, v)], -1)
        return qkv, z.reshape(b, n, hv, dv), beta.reshape(b, n, hv), a.reshape(b, n, hv)


class Qwen3NextAttentionAdapter(GqaMixer):
    """Qwen3-Next's gated attention: ``q_proj`` holds per head ``[query | output gate]``; q/k
    RMSNorm per head (``q_norm``, ``k_norm``)."""

    def fcp_qkv(self, x: torch.Tensor):
        b, n, _ = x.shape
        d = self.head_dim
        q, gate = torch.chunk(self.q_proj(x).view(b, n, -1, 2 * d), 2, dim=-1)
        k = self.k_norm(self.k_proj(x).view(b, n, -1, d))
        return self.q_norm(q), k, self.v_proj(x).view(b, n, -1, d), gate.reshape(b, n, -1)


#: transformers class name -> the fcp mixer replacing it (:data:`fcp.integrations.hf.SUPPORTED`).
ADAPTERS: dict[str, type[FcpMixer]] = {
    # GLM-5.3-Flash (glm5_next)
    "Glm5NextTextLinearAttention": KdaMixer,
    "Glm5NextTextAttention": IndexedMlaMixer,
    # Kimi-Linear (kimi_linear)
    "KimiLinearDeltaAttention": KdaMixer,
    "KimiLinearAttention": MlaMixer,
    # Qwen3-Next (qwen3_next)
    "Qwen3NextGatedDeltaNet": Qwen3NextGdnAdapter,
    "Qwen3NextAttention": Qwen3NextAttentionAdapter,
}
