"""LFM2 and LFM2-MoE (transformers' ``lfm2``, ``lfm2_moe``) on fcp: one adapter for both (the
same two mixers; the MoE is per token).

* ``Lfm2(Moe)ShortConv`` -> :class:`~..mixers.short_conv.GatedShortConvMixer` (a gated
  depthwise short conv): exchanges its ``W - 1``-token halo of ``[B, L, hidden]`` under CP;
* ``Lfm2(Moe)Attention`` -> :class:`Lfm2AttentionAdapter` (GQA with per-head ``q_layernorm`` /
  ``k_layernorm``, RoPE, ``out_proj``): all-gathers K/V.
"""

from __future__ import annotations

import torch

from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import GatedShortConvMixer, GqaMixer

__all__ = ["FAMILIES", "Lfm2AttentionAdapter"]


class Lfm2AttentionAdapter(GqaMixer):
    """LFM2's (and LFM2-MoE's) attention: per-head RMSNorm of q and k (``q_layernorm``,
    ``k_layernorm``) before RoPE, output projection ``out_proj``."""

    def fcp_qkv(self, x: torch.Tensor):
        q, k, v, _ = super().fcp_qkv(x)
        return self.q_layernorm(q), self.k_layernorm(k), v, None

    def fcp_attention_output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return self.out_proj(o)


_CROSSES = ("gated short conv: a `W - 1`-token halo of `[B, L, hidden]`; attention: an "
            "all-gather of K/V")  # fmt: skip

#: gated short conv (width 3, with biases), GQA with per-head q/k norm and RoPE (4 heads, 2 kv
#: heads, head_dim 8), gated short conv.
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
             layer_types=["conv", "full_attention", "conv"], num_attention_heads=4,
             num_key_value_heads=2, conv_L_cache=3, conv_bias=True, block_auto_adjust_ff_dim=False,
             pad_token_id=0,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip

#: LFM2's mixers; a dense first layer, then MoE (4 experts, top 2, expert bias).
_MOE_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                 num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                 num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3,
                 num_dense_layers=1, num_experts=4, num_experts_per_tok=2, pad_token_id=0,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip

#: LFM2 and LFM2-MoE: the same mixers under the class prefix ``Lfm2`` / ``Lfm2Moe``
FAMILIES = tuple(Family.of(name, title, f"{prefix}Model", config, _CROSSES,
                           **{f"{prefix}ShortConv": GatedShortConvMixer,
                              f"{prefix}Attention": Lfm2AttentionAdapter})
                 for name, title, prefix, config in (("lfm2", "LFM2", "Lfm2", _TINY),
                                                     ("lfm2_moe", "LFM2-MoE", "Lfm2Moe",
                                                      _MOE_TINY)))  # fmt: skip
