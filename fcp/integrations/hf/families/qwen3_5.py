"""Qwen3.5 and Qwen3.5-MoE (transformers' ``qwen3_5``, ``qwen3_5_moe``) on fcp: one adapter
for both (their mixers are the same layers; the MoE is per token).

* ``Qwen3_5(Moe)GatedDeltaNet`` -> :class:`Qwen3_5GdnAdapter` (Gated DeltaNet with separate
  projections; Qwen4-Exp's is the same layer);
* ``Qwen3_5(Moe)Attention`` -> Qwen3-Next's :class:`~.qwen3_next.Qwen3NextAttentionAdapter`
  (the same code); its mRoPE text positions have three equal axes, i.e. 1-D RoPE at
  document-local positions (:mod:`fcp.integrations.hf.rope`).

Qwen3.5's vision-language wrappers hold the same text model: text runs on fcp, and image or video
inputs given with a ``cp_context`` raise a ``ValueError`` (not supported yet). Under CP: as
Qwen3-Next.
"""

from __future__ import annotations

import torch

from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.families.qwen3_next import GDN_ATTENTION_CROSSES
from fcp.integrations.hf.families.qwen3_next import Qwen3NextAttentionAdapter
from fcp.integrations.hf.mixers import GatedDeltaNetMixer

__all__ = ["FAMILIES", "Qwen3_5GdnAdapter"]


class Qwen3_5GdnAdapter(GatedDeltaNetMixer):
    """Separate projections: ``in_proj_qkv`` is the conv input ``[q | k | v]`` as it is,
    ``in_proj_z`` the output gate, ``in_proj_b`` / ``in_proj_a`` the beta and decay logits per
    value head."""

    def fcp_projections(self, x: torch.Tensor):
        z = self.in_proj_z(x).unflatten(-1, (self.num_v_heads, self.head_v_dim))
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


#: Qwen3-Next's shapes with separate GDN projections; mRoPE text positions (rotary dim 8: 4
#: frequencies split over the three axes by mrope_section).
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
             layer_types=["linear_attention", "full_attention", "linear_attention"],
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             linear_conv_kernel_dim=4, pad_token_id=0,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]})  # fmt: skip

#: the same mixers, a sparse MoE (4 experts, top 2, shared expert) per layer
_MOE_TINY = dict({k: v for k, v in _TINY.items() if k != "intermediate_size"}, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=16,
                 shared_expert_intermediate_size=16)  # fmt: skip

#: Qwen3.5 and Qwen3.5-MoE: the same mixers under the class prefix ``Qwen3_5`` /
#: ``Qwen3_5Moe``
FAMILIES = tuple(Family.of(name, title, f"{prefix}TextModel", config, GDN_ATTENTION_CROSSES,
                           **{f"{prefix}GatedDeltaNet": Qwen3_5GdnAdapter,
                              f"{prefix}Attention": Qwen3NextAttentionAdapter})
                 for name, title, prefix, config in (("qwen3_5", "Qwen3.5", "Qwen3_5", _TINY),
                                                     ("qwen3_5_moe", "Qwen3.5-MoE", "Qwen3_5Moe",
                                                      _MOE_TINY)))  # fmt: skip
