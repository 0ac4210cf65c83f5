"""Qwen3-Next (transformers' ``qwen3_next``) on fcp: its adapters.

* ``Qwen3NextGatedDeltaNet`` -> :class:`Qwen3NextGdnAdapter` (Gated DeltaNet with interleaved
  fused projections; ONE depthwise conv over ``[q, k, v]``, no bias, SiLU, as in every Gated
  DeltaNet family);
* ``Qwen3NextAttention`` -> :class:`Qwen3NextAttentionAdapter` (gated GQA: the output gate
  fused into ``q_proj``, q/k RMSNorm per head, partial RoPE at **document-local** positions
  computed from the layer's own config, :mod:`fcp.integrations.hf.rope`).

Under CP a Gated DeltaNet layer exchanges a ``W - 1``-token left halo of its conv input and one
fp32 state-chain all-gather of ``[B, HV, K, K + V]``; an attention layer all-gathers K/V
(``2 * kv_heads * head_dim`` per token, K already rotated).
"""

from __future__ import annotations

import torch

from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import GatedDeltaNetMixer, GqaMixer

__all__ = ["FAMILIES", "GDN_ATTENTION_CROSSES", "Qwen3NextAttentionAdapter",
           "Qwen3NextGdnAdapter"]  # fmt: skip

#: what a Gated DeltaNet + GQA family sends between ranks per layer (Qwen3-Next, Qwen3.5, OLMo)
GDN_ATTENTION_CROSSES = ("Gated DeltaNet: a `W - 1`-token conv halo and one fp32 state-chain "
                         "all-gather `[B, HV, K, K + V]`; attention: an all-gather of K/V "
                         "(`2 * kv_heads * head_dim` per token)")  # fmt: skip


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


#: Gated DeltaNet (2 key heads, 4 value heads), gated GQA attention (4 query heads, 2 kv heads,
#: head_dim 16, partial rotary 0.25: 4 rotated channels), Gated DeltaNet.
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
             layer_types=["linear_attention", "full_attention", "linear_attention"],
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=16, shared_expert_intermediate_size=16,
             pad_token_id=0)  # fmt: skip

FAMILIES = (Family.of("qwen3_next", "Qwen3-Next", "Qwen3NextModel", _TINY,
                      GDN_ATTENTION_CROSSES,
                      Qwen3NextGatedDeltaNet=Qwen3NextGdnAdapter,
                      Qwen3NextAttention=Qwen3NextAttentionAdapter),)  # fmt: skip
