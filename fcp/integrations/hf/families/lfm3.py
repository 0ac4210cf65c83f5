"""LFM3 (transformers' ``lfm3``) on fcp: LFM2's gated short conv beside sliding-window and full
attention layers.

* ``Lfm3ShortConv`` -> :class:`~..mixers.short_conv.GatedShortConvMixer` as it is (LFM2's layer:
  ``in_proj`` -> ``B, C, x``, ``C * conv(B * x)``, ``out_proj``; ``conv`` of width
  ``conv_L_cache``, optional bias): exchanges its ``W - 1``-token halo of ``[B, L, hidden]``;
* ``Lfm3Attention`` -> :class:`Lfm3AttentionAdapter` (GQA with per-head ``q_norm`` /
  ``k_norm``, RoPE per layer type, a sigmoid output gate per head ``g_proj`` when
  ``use_attention_gate``; ``sliding_window`` on ``"sliding_attention"`` layers).

RoPE per layer type: ``config.rope_parameters`` is nested, ``{layer type: parameters}`` (by
default plain RoPE at theta 1e4 on sliding layers, ``"proportional"`` RoPE at theta 1e6 on the
first half of each half-head on full layers). fcp reads the layer's own entry
(``self.layer_type``, through :class:`~fcp.integrations.hf.layer_rope.LayerRopeConfig`) and
computes the tables as ``Lfm3RotaryEmbedding`` does: fp32 tables, the rotation computed in fp32
and cast back.

Under CP a short conv layer exchanges its ``W - 1``-token halo; a sliding-window layer receives a
left halo of ``min(window, band) - 1`` tokens' K/V (``2 * kv_heads * head_dim`` per token, K
already rotated); a full-attention layer all-gathers K/V. The gate is per token: nothing of it
crosses ranks.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.layer_rope import LayerRopeConfig
from fcp.integrations.hf.mixers import GatedShortConvMixer, GqaMixer
from fcp.integrations.hf.rope import apply_rope, rope_frequencies, rope_tables

__all__ = ["FAMILIES", "Lfm3AttentionAdapter"]


def _layer_rope(config, layer_type: str) -> LayerRopeConfig:
    """``config`` seen with the flat rotary parameters of ``layer_type``: what
    ``Lfm3RotaryEmbedding`` computes that layer type's tables from. Its ``"default"`` type rotates
    the whole head (``compute_default_rope_parameters`` reads no ``partial_rotary_factor``);
    ``"proportional"`` returns ``head_dim / 2`` frequencies, the unrotated ones zero."""
    params = dict(config.rope_parameters[layer_type])
    if params.get("rope_type", "default") == "default":
        params.pop("partial_rotary_factor", None)
    return LayerRopeConfig(config, params)


class Lfm3AttentionAdapter(GqaMixer):
    """LFM3's attention: per-head RMSNorm of q and k (``q_norm``, ``k_norm``) before RoPE; RoPE
    from ``config.rope_parameters[self.layer_type]`` in fp32; the output of head ``h`` scaled by
    ``sigmoid(g_proj(x))[h]`` before ``o_proj`` (no gate without ``use_attention_gate``)."""

    @classmethod
    def fcp_check(cls, module) -> None:
        # a rope type fcp cannot apply raises now, not mid-step
        rope_frequencies(_layer_rope(module.config, module.layer_type))

    def fcp_qkv(self, x: torch.Tensor):
        shape = (*x.shape[:2], -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(shape))
        k = self.k_norm(self.k_proj(x).view(shape))
        gate = None
        if self.g_proj is not None:
            # one gate per head, repeated over its channels: the [B, L, H * Dh] gate of the kind
            gate = self.g_proj(x).repeat_interleave(self.head_dim, dim=-1)
        return q, k, self.v_proj(x).view(shape), gate

    def fcp_rotate_qk(self, q: torch.Tensor, k: torch.Tensor, ctx: PackedContext):
        # transformers rotates in fp32 (its tables are fp32) and casts back
        cos, sin = rope_tables(_layer_rope(self.config, self.layer_type), ctx.local_position_ids,
                               torch.float32)  # fmt: skip
        return apply_rope(q, cos, sin).to(q.dtype), apply_rope(k, cos, sin).to(k.dtype)


#: what one layer of each kind sends between CP ranks
_CROSSES = ("gated short conv: a `W - 1`-token halo of `[B, L, hidden]`; sliding-window "
            "attention: a left halo of `min(window, band) - 1` tokens' K/V; full attention: an "
            "all-gather of K/V")  # fmt: skip

#: gated short conv (width 3, with biases), sliding-window attention (window 5), full attention
#: with proportional RoPE (4 heads, 2 kv heads, head_dim 8: 2 of 4 frequencies rotate), both with
#: per-head q/k norm and output gate; sandwich norms.
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
             layer_types=["conv", "sliding_attention", "full_attention"], num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, sliding_window=5, conv_L_cache=3, conv_bias=True,
             use_sandwich_norm=True, use_attention_gate=True, pad_token_id=0, bos_token_id=1,
             eos_token_id=2,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "proportional",
                                                 "rope_theta": 1000000.0,
                                                 "partial_rotary_factor": 0.5}})  # fmt: skip

FAMILIES = (Family.of("lfm3", "LFM3", "Lfm3Model", _TINY, _CROSSES,
                      Lfm3ShortConv=GatedShortConvMixer,
                      Lfm3Attention=Lfm3AttentionAdapter),)  # fmt: skip
