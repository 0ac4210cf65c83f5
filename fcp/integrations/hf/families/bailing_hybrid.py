"""Bailing-Hybrid / Ling (transformers' ``bailing_hybrid``) on fcp: its adapters.

* ``BailingHybridDeltaAttention`` -> :class:`BailingHybridKdaAdapter` (KDA with its own forget
  gate module and a single full-width output gate ``g_proj``, sigmoid-gated norm);
* ``BailingHybridAttention`` -> :class:`BailingHybridMlaAdapter` (DeepSeek MLA with interleaved
  RoPE on the ``qk_rope_head_dim`` channels and a per-head sigmoid output gate ``g_proj``).

Under CP: as Kimi-Linear (the MLA layer all-gathers its expanded K/V).
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import KdaMixer, MlaMixer
from fcp.integrations.hf.rope import apply_rope_interleaved, rope_frequencies, rope_tables

__all__ = ["FAMILIES", "BailingHybridKdaAdapter", "BailingHybridMlaAdapter"]


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


#: KDA (2 heads of 8), MLA with query LoRA 16, kv latent 16, interleaved RoPE on 4 channels per
#: head and a per-head output gate, MoE (4 experts, top 2, shared expert).
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
             num_hidden_layers=3,
             layer_types=["linear_attention", "full_attention", "linear_attention"],
             mlp_layer_types=["dense", "sparse", "dense"], num_attention_heads=2,
             num_key_value_heads=2, head_dim=8, q_lora_rank=16, kv_lora_rank=16,
             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts=4,
             num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
             short_conv_kernel_size=4, rope_theta=10000.0, pad_token_id=0,
             eos_token_id=2)  # fmt: skip

_CROSSES = ("KDA: a `W - 1`-token conv halo and one fp32 state-chain all-gather "
            "`[B, H, K, K + V]`; MLA: an all-gather of the expanded K/V")  # fmt: skip
FAMILIES = (Family.of("bailing_hybrid", "Bailing-Hybrid / Ling", "BailingHybridModel", _TINY,
                      _CROSSES,
                      BailingHybridDeltaAttention=BailingHybridKdaAdapter,
                      BailingHybridAttention=BailingHybridMlaAdapter),)  # fmt: skip
