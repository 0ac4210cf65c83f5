"""The Mamba2 hybrids on fcp: Nemotron-H (``nemotron_h``), Granite 4.0-H
(``granitemoehybrid``), Falcon-H1 (``falcon_h1``) and Bamba (``bamba``), one row each, and Mamba2
itself (``mamba2``: ``Mamba2Mixer`` layers only).

Their Mamba2 layers are one code (transformers' ``mamba2_chunk_scan`` and the mixer around it
are the same lines in all five, gated norm included; their configs name the sizes differently,
the modules the same):
:class:`~..mixers.mamba2.SsdMixer` as it is, except Falcon-H1's muP multipliers on the
in-projection (``ssm_in_multiplier`` before it, the ``mup_vector`` buffer after it) and its
optional gated norm (without ``mamba_rms_norm``: ``y * silu(z)``); Nemotron-H's own
``time_step_limit`` is ``(time_step_min, inf)``.

Their attention layers are the Llama layout (:class:`~..mixers.gqa.GqaMixer`'s default):
Nemotron-H's is NoPE, Granite 4.0-H's has RoPE only with ``position_embedding_type="rope"`` and
scales by ``attention_multiplier``, Falcon-H1's multiplies k by ``key_multiplier`` (every Falcon-H1
layer runs Mamba2 and attention side by side), Bamba's rotates half of each head
(``partial_rotary_factor`` 0.5). The decoder layers' multipliers (Falcon-H1's
``attention_in_multiplier``, Granite's ``residual_multiplier``, ...) and the MoE blocks stay in
transformers' code.

Under CP a Mamba2 layer exchanges the ``W - 1``-token halo of its conv over ``[x, B, C]`` and one
fp32 state-chain all-gather of ``[B, H, N, N + P]`` (``N`` the SSM state size, ``P`` the head
dim); an attention layer all-gathers K/V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import GqaMixer, SsdMixer

__all__ = ["FAMILIES", "FalconH1AttentionAdapter", "FalconH1SsdAdapter",
           "GraniteMoeHybridAttentionAdapter", "NemotronHAttentionAdapter"]  # fmt: skip


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

    def fcp_ssd_output(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = self.norm(y, z) if self.mamba_rms_norm else y * F.silu(z)
        return self.out_proj(y.to(dtype))


class FalconH1AttentionAdapter(GqaMixer):
    """Falcon-H1's attention: the Llama layout with k scaled by ``key_multiplier`` (before RoPE,
    as transformers does)."""

    def fcp_qkv(self, x: torch.Tensor):
        q, k, v, _ = super().fcp_qkv(x)
        return q, k * self.key_multiplier, v, None


_CROSSES = ("Mamba2: a `W - 1`-token halo of its conv over `[x, B, C]` and one fp32 state-chain "
            "all-gather `[B, H, N, N + P]`; attention: an all-gather of K/V")  # fmt: skip
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

#: Mamba2 (4 heads of 8, 2 groups, state 8, conv 4, chunks of 8 tokens), a MoE block (4 experts,
#: top 2, shared expert), NoPE GQA attention (4 heads, 2 kv heads), Mamba2.
_NEMOTRON_H_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                        layers_block_type=["linear_attention", "moe", "full_attention",
                                           "linear_attention"],
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
                        conv_kernel=4, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                        pad_token_id=0)  # fmt: skip

#: Mamba2 (4 heads of 16, 2 groups, state 8, chunks of 8), GQA with RoPE and attention_multiplier
#: scaling, Mamba2; MoE (4 experts, top 2) + shared MLP; muP multipliers.
_GRANITE_HYBRID_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=16,
                            shared_intermediate_size=32, num_hidden_layers=3,
                            layer_types=["linear_attention", "full_attention",
                                         "linear_attention"],
                            num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4,
                            mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                            mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2,
                            position_embedding_type="rope", embedding_multiplier=2.0,
                            residual_multiplier=0.5, attention_multiplier=0.3,
                            rope_parameters=dict(_ROPE), pad_token_id=0)  # fmt: skip

#: every layer runs Mamba2 (4 heads of 8, 2 groups, state 8, chunks of 8, gated RMSNorm per
#: group, gate after the norm) and RoPE GQA in parallel; every muP multiplier != 1.
_FALCON_H1_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=32,
                       mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                       mamba_chunk_size=8, mamba_rms_norm=True, mamba_norm_before_gate=True,
                       ssm_multipliers=[0.5, 1.5, 0.7, 1.2, 0.9], ssm_in_multiplier=1.3,
                       ssm_out_multiplier=0.8, attention_in_multiplier=0.9,
                       attention_out_multiplier=1.1, key_multiplier=0.7,
                       mlp_multipliers=[1.2, 0.8], embedding_multiplier=1.5,
                       time_step_limit=(0.0, 3.0), rope_parameters=dict(_ROPE),
                       pad_token_id=0)  # fmt: skip

#: Mamba2 (4 heads of 16, 2 groups, state 8, chunks of 8), GQA with RoPE on half of each head
#: (Bamba's fixed partial_rotary_factor 0.5), Mamba2.
_BAMBA_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                   attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2,
                   mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                   mamba_expand=2, mamba_chunk_size=8, pad_token_id=0,
                   rope_parameters=dict(_ROPE))  # fmt: skip

#: Four families, one mixer code: (model type, title, transformers prefix, Mamba2 layer class,
#: its fcp mixer, the attention's adapter, the tiny config)
_ROWS = (("nemotron_h", "Nemotron-H", "NemotronH", "NemotronHMamba2Mixer", SsdMixer,
          NemotronHAttentionAdapter, _NEMOTRON_H_TINY),
         ("granitemoehybrid", "Granite 4.0-H", "GraniteMoeHybrid", "GraniteMoeHybridMambaLayer",
          SsdMixer, GraniteMoeHybridAttentionAdapter, _GRANITE_HYBRID_TINY),
         ("falcon_h1", "Falcon-H1", "FalconH1", "FalconH1Mixer", FalconH1SsdAdapter,
          FalconH1AttentionAdapter, _FALCON_H1_TINY),
         ("bamba", "Bamba", "Bamba", "BambaMixer", SsdMixer, GqaMixer, _BAMBA_TINY))  # fmt: skip
#: Mamba2 alone: two layers of 4 heads of 16, 2 groups, state 8, conv 4, chunks of 8 tokens
_MAMBA2_TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                    expand=2, n_groups=2, state_size=8, conv_kernel=4, chunk_size=8,
                    pad_token_id=0)  # fmt: skip

FAMILIES = (*(Family.of(name, title, f"{prefix}Model", config, _CROSSES,
                        **{mamba: ssd, f"{prefix}Attention": attention})
              for name, title, prefix, mamba, ssd, attention, config in _ROWS),
            Family.of("mamba2", "Mamba2", "Mamba2Model", _MAMBA2_TINY,
                      "a `W - 1`-token halo of its conv over `[x, B, C]` and one fp32 state-chain "
                      "all-gather `[B, H, N, N + P]`", Mamba2Mixer=SsdMixer))  # fmt: skip
