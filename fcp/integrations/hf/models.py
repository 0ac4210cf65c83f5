"""Which transformers mixer runs on which fcp mixer: the models' adapters, in one place.

A transformers token mixer is supported by an entry of :data:`ADAPTERS`: its class name ->
an fcp mixer class, either a mixer kind as it is (the model uses the kind's default layout) or
an **adapter**, a subclass of a kind that overrides the ``fcp_*`` steps where the model differs
(projection names, fused projection layouts, gate forms). An adapter holds no state and never
copies anything: its methods run on the transformers module itself (see
:mod:`fcp.integrations.hf.core`), so ``self.q_proj`` is the model's own projection.

Adding a model is an adapter of a few lines and a row here (OLMo-Hybrid's Gated DeltaNet below:
its projections, ``beta = 2 sigmoid(b)``, its norm and output names), plus a per-document parity
test against transformers (``tests/support/hf_reference.py``). What the adapters here read from
transformers 5.24 (each checked per document against transformers, ``tests/test_hf_*.py``):

* the Gated DeltaNet layers of Qwen3-Next, Qwen3.5 (and Qwen3.5-MoE: the same layer) and
  OLMo-Hybrid all run ONE depthwise conv over ``[q | k | v]`` (``conv1d``, no bias, SiLU); they
  differ in how the conv input, the output gate ``z`` and the ``b`` / ``a`` logits are projected;
* Qwen3.5's attention is Qwen3-Next's code (gated, per-head q/k norm, partial RoPE); its text
  positions are mRoPE with three equal axes, i.e. 1-D RoPE (:mod:`.rope`);
* OLMo-Hybrid's attention normalises q and k over all heads at once, has no output gate, and
  RoPE only when ``rope_parameters["rope_theta"]`` is set (NoPE otherwise), in fp32 tables;
* Bailing-Hybrid (Ling) runs KDA with its own forget gate module and a single full-width output
  gate ``g_proj`` (sigmoid-gated norm), and DeepSeek MLA with interleaved RoPE on the
  ``qk_rope_head_dim`` channels and a per-head sigmoid output gate ``g_proj``;
* the Mamba2 layers of Nemotron-H, Granite 4.0-H (``granitemoehybrid``), Falcon-H1 and Bamba are
  one code (transformers' ``mamba2_chunk_scan`` and the mixer around it are the same lines in all
  four; their configs name the sizes differently, the modules the same): :class:`SsdMixer` as it
  is, except Falcon-H1's muP multipliers on the in-projection (``ssm_in_multiplier`` before it,
  the ``mup_vector`` buffer after it) and its optional gated norm (without ``mamba_rms_norm``:
  ``y * silu(z)``); Nemotron-H's own ``time_step_limit`` is ``(time_step_min, inf)``;
* their attention layers are the Llama layout (:class:`GqaMixer`'s default): Nemotron-H's is
  NoPE, Granite 4.0-H's has RoPE only with ``position_embedding_type="rope"`` and scales by
  ``attention_multiplier``, Falcon-H1's multiplies k by ``key_multiplier``, Bamba's rotates half
  of each head (``partial_rotary_factor`` 0.5); the decoder layers' multipliers (Falcon-H1's
  ``attention_in_multiplier``, Granite's ``residual_multiplier``, ...) stay in transformers' code;
* LFM2 and LFM2-MoE: a gated short conv (:class:`GatedShortConvMixer`) and GQA with per-head
  ``q_layernorm`` / ``k_layernorm`` and ``out_proj``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.mixers import GatedDeltaNetMixer, GatedShortConvMixer, GqaMixer
from fcp.integrations.hf.mixers import IndexedMlaMixer, KdaMixer, MlaMixer, SsdMixer
from fcp.integrations.hf.rope import (
    apply_rope,
    apply_rope_interleaved,
    rope_frequencies,
    rope_tables,
)

__all__ = [
    "ADAPTERS",
    "BailingHybridKdaAdapter",
    "BailingHybridMlaAdapter",
    "FalconH1AttentionAdapter",
    "FalconH1SsdAdapter",
    "GraniteMoeHybridAttentionAdapter",
    "Lfm2AttentionAdapter",
    "NemotronHAttentionAdapter",
    "OlmoHybridAttentionAdapter",
    "OlmoHybridGdnAdapter",
    "Qwen3NextAttentionAdapter",
    "Qwen3NextGdnAdapter",
    "Qwen3_5GdnAdapter",
]


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


class Qwen3_5GdnAdapter(GatedDeltaNetMixer):
    """Qwen3.5's (and Qwen3.5-MoE's) separate projections: ``in_proj_qkv`` is the conv input
    ``[q | k | v]`` as it is, ``in_proj_z`` the output gate, ``in_proj_b`` / ``in_proj_a`` the
    beta and decay logits."""

    def fcp_projections(self, x: torch.Tensor):
        z = self.in_proj_z(x).unflatten(-1, (self.num_v_heads, self.head_v_dim))
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


class OlmoHybridGdnAdapter(GatedDeltaNetMixer):
    """OLMo-Hybrid: ``q_proj`` / ``k_proj`` / ``v_proj`` concatenated into the conv input,
    ``g_proj`` the output gate, ``b_proj`` / ``a_proj`` the logits; ``beta = 2 sigmoid(b)`` when
    ``allow_neg_eigval`` (the transition may have negative eigenvalues); its gated norm and output
    projection are ``o_norm`` / ``o_proj``."""

    def fcp_projections(self, x: torch.Tensor):
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        z = self.g_proj(x).unflatten(-1, (self.num_v_heads, self.head_v_dim))
        return qkv, z, self.b_proj(x), self.a_proj(x)

    def fcp_beta(self, b: torch.Tensor) -> torch.Tensor:
        beta = b.sigmoid()
        return beta * 2.0 if self.allow_neg_eigval else beta

    def fcp_output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.o_norm(o.to(z.dtype), z).flatten(2))


class OlmoHybridAttentionAdapter(GqaMixer):
    """OLMo-Hybrid's attention: ``q_norm`` / ``k_norm`` over all heads of ``q_proj`` /
    ``k_proj`` (before the head split), no output gate; RoPE (full head dim, fp32 tables, the
    result cast back) only when the config sets ``rope_theta``: without it, NoPE."""

    @staticmethod
    def fcp_uses_rope(config) -> bool:
        return (getattr(config, "rope_parameters", None) or {}).get("rope_theta") is not None

    def fcp_qkv(self, x: torch.Tensor):
        shape = (*x.shape[:2], -1, self.head_dim)
        q = self.q_norm(self.q_proj(x)).view(shape)
        k = self.k_norm(self.k_proj(x)).view(shape)
        return q, k, self.v_proj(x).view(shape), None

    def fcp_rotate(self, q: torch.Tensor, k: torch.Tensor, ctx: PackedContext):
        if not self.fcp_uses_rope(self.config):
            return q, k
        cos, sin = rope_tables(self.config, ctx.local_position_ids, torch.float32)
        return apply_rope(q, cos, sin).to(q.dtype), apply_rope(k, cos, sin).to(k.dtype)


class BailingHybridKdaAdapter(KdaMixer):
    """Bailing-Hybrid's KDA: one full-width output gate ``g_proj`` (its ``o_norm`` gates by a
    sigmoid) in place of the low-rank ``g_a_proj`` / ``g_b_proj``; the forget gate is its own
    module (``forget_gate``, the kind's default)."""

    def fcp_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gate = self.g_proj(x).unflatten(-1, (-1, self.head_dim))
        return self.o_proj(self.o_norm(o.to(x.dtype), gate).flatten(2))


class BailingHybridMlaAdapter(MlaMixer):
    """Bailing-Hybrid's MLA: DeepSeek's interleaved RoPE (:func:`apply_rope_interleaved`) on the
    last ``qk_rope_head_dim`` query channels and the shared ``k_rope`` at document-local positions
    (tables from the layer's config, whose ``head_dim`` transformers sets to ``qk_rope_head_dim``),
    and a per-head sigmoid output gate ``g_proj`` before ``o_proj``."""

    @classmethod
    def fcp_check(cls, module) -> None:
        rope_frequencies(module.config)

    def fcp_rotate(self, q: torch.Tensor, k_rope: torch.Tensor, ctx: PackedContext):
        cos, sin = rope_tables(self.config, ctx.local_position_ids, q.dtype)
        nope = self.qk_nope_head_dim
        q = torch.cat([q[..., :nope], apply_rope_interleaved(q[..., nope:], cos, sin)], -1)
        return q, apply_rope_interleaved(k_rope[:, :, None], cos, sin)[:, :, 0]

    def fcp_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.g_proj(x).float()).to(x.dtype)
        return self.o_proj((o * gate[..., None]).flatten(2))


class NemotronHAttentionAdapter(GqaMixer):
    """Nemotron-H's attention: the Llama layout, NoPE (positions come from the Mamba2 layers)."""

    @staticmethod
    def fcp_uses_rope(config) -> bool:
        return False


class GraniteMoeHybridAttentionAdapter(GqaMixer):
    """Granite 4.0-H's attention: the Llama layout, scaled by ``attention_multiplier`` (its
    ``scaling``), RoPE only when ``position_embedding_type == "rope"`` (NoPE otherwise)."""

    @staticmethod
    def fcp_uses_rope(config) -> bool:
        return config.position_embedding_type == "rope"


class FalconH1SsdAdapter(SsdMixer):
    """Falcon-H1's Mamba2 layer: muP multipliers around ``in_proj`` (``ssm_in_multiplier`` on its
    input, the per-segment ``mup_vector`` on ``[z | x | B | C | dt]``), and without
    ``mamba_rms_norm`` the output gated as ``y * silu(z)`` with no norm."""

    def fcp_project(self, x: torch.Tensor) -> torch.Tensor:
        return self.in_proj(x * self.ssm_in_multiplier) * self.mup_vector

    def fcp_output(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = self.norm(y, z) if self.mamba_rms_norm else y * F.silu(z)
        return self.out_proj(y.to(dtype))


class FalconH1AttentionAdapter(GqaMixer):
    """Falcon-H1's attention: the Llama layout with k scaled by ``key_multiplier`` (before RoPE,
    as transformers does)."""

    def fcp_qkv(self, x: torch.Tensor):
        q, k, v, _ = super().fcp_qkv(x)
        return q, k * self.key_multiplier, v, None


class Lfm2AttentionAdapter(GqaMixer):
    """LFM2's (and LFM2-MoE's) attention: per-head RMSNorm of q and k (``q_layernorm``,
    ``k_layernorm``) before RoPE, output projection ``out_proj``."""

    def fcp_qkv(self, x: torch.Tensor):
        q, k, v, _ = super().fcp_qkv(x)
        return self.q_layernorm(q), self.k_layernorm(k), v, None

    def fcp_output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return self.out_proj(o)


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
    # Qwen3.5 (qwen3_5), Qwen3.5-MoE (qwen3_5_moe): their attention is Qwen3-Next's code
    "Qwen3_5GatedDeltaNet": Qwen3_5GdnAdapter,
    "Qwen3_5Attention": Qwen3NextAttentionAdapter,
    "Qwen3_5MoeGatedDeltaNet": Qwen3_5GdnAdapter,
    "Qwen3_5MoeAttention": Qwen3NextAttentionAdapter,
    # OLMo-Hybrid (olmo_hybrid)
    "OlmoHybridGatedDeltaNet": OlmoHybridGdnAdapter,
    "OlmoHybridAttention": OlmoHybridAttentionAdapter,
    # Bailing-Hybrid / Ling (bailing_hybrid)
    "BailingHybridDeltaAttention": BailingHybridKdaAdapter,
    "BailingHybridAttention": BailingHybridMlaAdapter,
    # Nemotron-H (nemotron_h): Mamba2, NoPE attention (its MoE / MLP blocks stay transformers')
    "NemotronHMamba2Mixer": SsdMixer,
    "NemotronHAttention": NemotronHAttentionAdapter,
    # Granite 4.0-H (granitemoehybrid)
    "GraniteMoeHybridMambaLayer": SsdMixer,
    "GraniteMoeHybridAttention": GraniteMoeHybridAttentionAdapter,
    # Falcon-H1 (falcon_h1): both mixers of every (parallel) layer
    "FalconH1Mixer": FalconH1SsdAdapter,
    "FalconH1Attention": FalconH1AttentionAdapter,
    # Bamba (bamba)
    "BambaMixer": SsdMixer,
    "BambaAttention": GqaMixer,
    # LFM2 (lfm2), LFM2-MoE (lfm2_moe): the same two mixers
    "Lfm2ShortConv": GatedShortConvMixer,
    "Lfm2Attention": Lfm2AttentionAdapter,
    "Lfm2MoeShortConv": GatedShortConvMixer,
    "Lfm2MoeAttention": Lfm2AttentionAdapter,
}
