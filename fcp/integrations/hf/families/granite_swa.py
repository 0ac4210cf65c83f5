"""Granite-SWA and Granite-MoE-SWA (transformers' ``granite_swa``, ``granitemoe_swa``) on fcp: one
adapter for both (their attention layers are the same code; the MoE is per token).

``GraniteSWAAttention`` / ``GraniteMoeSWAAttention`` -> :class:`GraniteSWAAttentionAdapter`: the
Llama layout (no q/k norm, no gate) scaled by the muP ``attention_multiplier`` (its ``scaling``),
with

* a window per layer: ``sliding_window`` tokens (itself included) on ``"sliding_attention"``
  layers, none on ``"full_attention"`` ones (the layer's ``sliding_window`` attribute);
* a learnable sink per head (``sinks [H]``): transformers scales each head's output by
  ``sigmoid(lse - sink)``, which is a logit ``sink`` with a zero value column in the softmax
  denominator, what fcp's ``sinks`` argument is (its gradient flows to the parameter);
* a RoPE base per layer, ``layer_rope_theta[layer_idx]`` (``0``: NoPE for that layer), with the
  model's other rotary parameters (``rope_type`` and its scaling), as transformers' per-theta
  rotary embeddings compute it (:class:`~fcp.integrations.hf.layer_rope.LayerRopeConfig`).

The other muP multipliers (embedding, residual, logits) are outside the mixers and stay
transformers' code. Under CP a sliding layer exchanges a left halo of ``min(window, band) - 1``
tokens' K/V, a full layer all-gathers K/V; the sinks are parameters, nothing of them crosses.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.layer_rope import LayerRopeConfig
from fcp.integrations.hf.mixers import GqaMixer
from fcp.integrations.hf.rope import apply_rope, rope_frequencies, rope_tables

__all__ = ["FAMILIES", "GraniteSWAAttentionAdapter"]


def _layer_rope(config, layer_idx: int) -> LayerRopeConfig | None:
    """``config`` as the rotary embedding of layer ``layer_idx`` reads it (the model's rotary
    parameters at the layer's base; a default rope turns the whole head, whatever
    ``partial_rotary_factor`` says), ``None`` for a NoPE layer (base ``0``)."""
    theta = config.layer_rope_theta[layer_idx]
    if not theta:
        return None
    params = {**config.rope_parameters, "rope_theta": theta}
    if params.get("rope_type", "default") == "default":
        params.pop("partial_rotary_factor", None)
    return LayerRopeConfig(config, params)


class GraniteSWAAttentionAdapter(GqaMixer):
    """Granite-SWA's attention (module doc): ``attention_multiplier`` scaling, the layer's window,
    per-head sinks, the layer's RoPE base or NoPE."""

    @classmethod
    def fcp_check(cls, module) -> None:
        rope = _layer_rope(module.config, module.layer_idx)
        if rope is not None:
            rope_frequencies(rope)  # a rope type fcp cannot apply raises now, not mid-step

    def fcp_rotate_qk(self, q: torch.Tensor, k: torch.Tensor, ctx: PackedContext):
        rope = _layer_rope(self.config, self.layer_idx)
        if rope is None:
            return q, k
        cos, sin = rope_tables(rope, ctx.local_position_ids, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


_CROSSES = ("sliding-window attention: a left halo of `min(window, band) - 1` tokens' K/V; "
            "full attention: an all-gather of K/V (the per-head sinks are parameters)")  # fmt: skip

_DIMS = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             num_attention_heads=4, num_key_value_heads=2, sliding_window=7,
             layer_rope_theta=[10.0, 0, 1000.0], embedding_multiplier=2.0,
             residual_multiplier=0.5, attention_multiplier=0.3, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)  # fmt: skip

#: sliding (window 7, RoPE base 10), full (NoPE), sliding (base 1000) attention layers; 4 heads,
#: 2 kv heads of 8, per-head sinks, muP multipliers != 1
_TINY = dict(_DIMS, intermediate_size=64,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip

#: the same attention layers with linear-scaled RoPE (factor 2) at each layer's base; MoE (4
#: experts, top 2) with a shared MLP
_MOE_TINY = dict(_DIMS, intermediate_size=16, shared_intermediate_size=32, num_local_experts=4,
                 num_experts_per_tok=2,
                 rope_parameters={"rope_type": "linear", "factor": 2.0,
                                  "rope_theta": 10000.0})  # fmt: skip

#: Granite-SWA and Granite-MoE-SWA: the same attention under the class prefix of each
FAMILIES = tuple(Family.of(name, title, f"{prefix}Model", config, _CROSSES,
                           **{f"{prefix}Attention": GraniteSWAAttentionAdapter})
                 for name, title, prefix, config in (
                     ("granite_swa", "Granite-SWA", "GraniteSWA", _TINY),
                     ("granitemoe_swa", "Granite-MoE-SWA", "GraniteMoeSWA",
                      _MOE_TINY)))  # fmt: skip
