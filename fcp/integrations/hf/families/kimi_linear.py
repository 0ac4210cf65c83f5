"""Kimi-Linear (transformers' ``kimi_linear``) on fcp: its mixers are kinds as they are.

* ``KimiLinearDeltaAttention`` -> :class:`~..mixers.kda.KdaMixer` (KDA: short convs, per-channel
  forget gate, low-rank output gate);
* ``KimiLinearAttention`` -> :class:`~..mixers.mla.MlaMixer` (NoPE MLA, causal within each
  document): under CP it all-gathers its expanded K/V (``heads * (qk_head_dim + v_head_dim)``
  per token).
"""

from __future__ import annotations

from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import KdaMixer, MlaMixer

__all__ = ["FAMILIES"]

#: KDA, NoPE MLA (kv latent 16, rope part 8, queries without LoRA), KDA.
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
             num_hidden_layers=3,
             layer_types=["linear_attention", "full_attention", "linear_attention"],
             mlp_layer_types=["dense", "sparse", "dense"], num_attention_heads=2,
             num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
             qk_rope_head_dim=8, v_head_dim=8, linear_num_heads=2, linear_head_dim=8,
             linear_conv_kernel_dim=4, num_local_experts=4, num_experts_per_tok=2, n_group=1,
             topk_group=1, n_shared_experts=1, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)  # fmt: skip

FAMILIES = (Family.of(
    "kimi_linear", "Kimi-Linear", "KimiLinearModel", _TINY,
    "KDA: a `W - 1`-token conv halo and one fp32 state-chain all-gather `[B, H, K, K + V]`; MLA: "
    "an all-gather of the expanded K/V (`heads * (qk_head_dim + v_head_dim)` per token)",
    KimiLinearDeltaAttention=KdaMixer, KimiLinearAttention=MlaMixer),)
