"""OLMo-Hybrid (transformers' ``olmo_hybrid``) on fcp: its adapters.

* ``OlmoHybridGatedDeltaNet`` -> :class:`OlmoHybridGdnAdapter` (Gated DeltaNet with separate
  q/k/v/a/b/g projections, ``beta = 2 sigmoid(b)`` when ``allow_neg_eigval``);
* ``OlmoHybridAttention`` -> :class:`OlmoHybridAttentionAdapter` (q/k norm over all heads at
  once, no output gate, RoPE only when ``rope_parameters["rope_theta"]`` is set, NoPE otherwise,
  in fp32 tables).

Under CP: as Qwen3-Next.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.families.qwen3_next import GDN_ATTENTION_CROSSES
from fcp.integrations.hf.mixers import GatedDeltaNetMixer, GqaMixer
from fcp.integrations.hf.rope import apply_rope, rope_tables

__all__ = ["FAMILIES", "OlmoHybridAttentionAdapter", "OlmoHybridGdnAdapter"]


class OlmoHybridGdnAdapter(GatedDeltaNetMixer):
    """OLMo-Hybrid: ``q_proj`` / ``k_proj`` / ``v_proj`` concatenated into the conv input,
    ``g_proj`` the output gate, ``b_proj`` / ``a_proj`` the logits; ``beta = 2 sigmoid(b)`` when
    ``allow_neg_eigval`` (the transition may have negative eigenvalues); its gated norm and output
    projection are ``o_norm`` / ``o_proj``."""

    def fcp_projections(self, x: torch.Tensor):
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        z = self.g_proj(x).unflatten(-1, (self.num_v_heads, self.head_v_dim))
        return qkv, z, self.b_proj(x), self.a_proj(x)

    def fcp_beta_from_logit(self, b: torch.Tensor) -> torch.Tensor:
        beta = b.sigmoid()
        return beta * 2.0 if self.allow_neg_eigval else beta

    def fcp_gated_output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
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

    def fcp_rotate_qk(self, q: torch.Tensor, k: torch.Tensor, ctx: PackedContext):
        if not self.fcp_uses_rope(self.config):
            return q, k
        cos, sin = rope_tables(self.config, ctx.local_position_ids, torch.float32)
        return apply_rope(q, cos, sin).to(q.dtype), apply_rope(k, cos, sin).to(k.dtype)


#: GDN (2 key heads, 4 value heads, beta scaled by 2), attention with q/k norm over all heads and
#: RoPE (head_dim 8), post-norm decoder layers.
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
             layer_types=["linear_attention", "full_attention", "linear_attention"],
             num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             linear_conv_kernel_dim=4, pad_token_id=0, eos_token_id=2,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip

FAMILIES = (Family.of("olmo_hybrid", "OLMo-Hybrid", "OlmoHybridModel", _TINY,
                      GDN_ATTENTION_CROSSES,
                      OlmoHybridGatedDeltaNet=OlmoHybridGdnAdapter,
                      OlmoHybridAttention=OlmoHybridAttentionAdapter),)  # fmt: skip
