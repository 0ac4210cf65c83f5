"""Lara-Mini (transformers' ``lara_mini``) on fcp: Gated DeltaNet beside sliding-window attention
with RoPE and full attention without.

* ``LaraMiniGatedDeltaNet`` -> Qwen3.5's :class:`~.qwen3_5.Qwen3_5GdnAdapter`: the same layer
  (separate ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``; one depthwise conv
  over ``[q | k | v]``, no bias, ``hidden_act`` (SiLU); ``beta = sigmoid(b)``; one log decay per
  value head ``-exp(A_log) * softplus(a + dt_bias)`` in fp32; q and k L2-normalised in fp32 (eps
  1e-6), q scaled by ``head_k_dim ** -0.5``; value head ``h`` reads key head ``h // (num_v_heads
  // num_k_heads)``; the SiLU-gated RMSNorm ``norm`` per value head, then ``out_proj``);
* ``LaraMiniAttention`` -> :class:`LaraMiniAttentionAdapter` (GQA with per-head ``q_norm`` /
  ``k_norm``, no output gate; ``"sliding_attention"`` layers: ``sliding_window`` and RoPE at
  document-local positions, tables in the activations' dtype; ``"full_attention"`` layers: NoPE,
  transformers hands them no position embeddings).

The MoE (softmax router in fp32, top-k, an ungated shared expert) is per token and stays
transformers' code.

Under CP a Gated DeltaNet layer exchanges a ``W - 1``-token left halo of its conv input and one
fp32 state-chain all-gather of ``[B, HV, K, K + V]``; a sliding-window layer receives a left halo
of ``min(window, band) - 1`` tokens' K/V (``2 * kv_heads * head_dim`` per token, K already
rotated); a full-attention layer all-gathers K/V.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.families.qwen3_5 import Qwen3_5GdnAdapter
from fcp.integrations.hf.mixers import GqaMixer

__all__ = ["FAMILIES", "LaraMiniAttentionAdapter"]


class LaraMiniAttentionAdapter(GqaMixer):
    """Lara-Mini's attention: per-head RMSNorm of q and k (``q_norm``, ``k_norm``) before RoPE,
    no output gate; RoPE only on ``"sliding_attention"`` layers (its full-attention layers are
    NoPE)."""

    def fcp_qkv(self, x: torch.Tensor):
        shape = (*x.shape[:2], -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(shape))
        k = self.k_norm(self.k_proj(x).view(shape))
        return q, k, self.v_proj(x).view(shape), None

    def fcp_rotate_qk(self, q: torch.Tensor, k: torch.Tensor, ctx: PackedContext):
        if self.layer_type != "sliding_attention":
            return q, k  # LaraMiniModel passes position_embeddings to sliding layers only
        return super().fcp_rotate_qk(q, k, ctx)


#: what one layer of each kind sends between CP ranks
_CROSSES = ("Gated DeltaNet: a `W - 1`-token conv halo and one fp32 state-chain all-gather "
            "`[B, HV, K, K + V]`; sliding-window attention: a left halo of `min(window, band) - 1` "
            "tokens' K/V; full attention: an all-gather of K/V")  # fmt: skip

#: Gated DeltaNet (2 key heads, 4 value heads, conv width 4), sliding-window attention with RoPE
#: (window 7), NoPE full attention (4 heads, 2 kv heads, head_dim 8); MoE of 4 experts, top 2,
#: and a shared expert.
_TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3,
             layer_types=["linear_attention", "sliding_attention", "full_attention"],
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=7,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
             pad_token_id=0, eos_token_id=2,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip

FAMILIES = (Family.of("lara_mini", "Lara-Mini", "LaraMiniModel", _TINY, _CROSSES,
                      LaraMiniGatedDeltaNet=Qwen3_5GdnAdapter,
                      LaraMiniAttention=LaraMiniAttentionAdapter),)  # fmt: skip
