"""Gemma 3's text model (transformers' ``gemma3``: ``Gemma3TextModel``, the language model of
``Gemma3ForCausalLM`` / ``Gemma3ForConditionalGeneration``) on fcp: one adapter.

``Gemma3Attention`` -> :class:`Gemma3AttentionAdapter`: the Llama layout with per-head RMSNorm of
q and k (``q_norm`` / ``k_norm``, Gemma's ``1 + weight``) before RoPE, scores scaled by
``query_pre_attn_scalar ** -0.5`` (its ``scaling``). Layers alternate (5:1 in the checkpoints)
between sliding-window attention (``sliding_window`` tokens, itself included: the layer's
``sliding_window`` attribute) and global attention (``None``); each layer type has its own rotary
parameters, ``config.rope_parameters[layer_type]`` (in the checkpoints: base 10k on the sliding
layers; base 1M, linearly scaled by 8 in the larger models, on the full ones), which fcp reads
through the layer's ``layer_type`` (:class:`~fcp.integrations.hf.layer_rope.LayerRopeConfig`)
and applies at document-local positions.

``attn_logit_softcapping`` is *not* applied: transformers' Gemma 3 keeps it in its config and on
the module (inherited from Gemma 2) but never passes it to its attention function, so Gemma 3
attends without a cap whatever the value (its checkpoints set none; q/k norms replaced it).
Bidirectional attention (``use_bidirectional_attention``, Gemma 3 as an encoder) is refused.

Under CP a sliding layer exchanges a left halo of ``min(window, band) - 1`` tokens' K/V, a global
layer all-gathers K/V. Decoder layers, their four norms, the scaled embedding and the MLPs are
per token and stay transformers' code.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.layer_rope import LayerRopeConfig
from fcp.integrations.hf.mixers import GqaMixer
from fcp.integrations.hf.rope import apply_rope, rope_frequencies, rope_tables

__all__ = ["FAMILIES", "Gemma3AttentionAdapter"]


def _layer_rope(config, layer_type: str) -> LayerRopeConfig:
    """``config`` as ``Gemma3RotaryEmbedding`` reads it for ``layer_type``: that type's flat
    rotary parameters (its default rope turns the whole head, whatever
    ``partial_rotary_factor`` says)."""
    params = dict(config.rope_parameters[layer_type])
    if params.get("rope_type", "default") == "default":
        params.pop("partial_rotary_factor", None)
    return LayerRopeConfig(config, params)


class Gemma3AttentionAdapter(GqaMixer):
    """Gemma 3's attention (module doc): q/k norms, ``query_pre_attn_scalar`` scaling, the
    layer's window, RoPE of its layer type, no softcap."""

    @classmethod
    def fcp_check(cls, module) -> None:
        if getattr(module.config, "use_bidirectional_attention", False):
            raise NotImplementedError(
                "Gemma 3 with use_bidirectional_attention=True attends to later tokens; fcp "
                "runs causal (document-causal, sliding-window) attention only")  # fmt: skip
        rope_frequencies(_layer_rope(module.config, module.layer_type))  # a bad rope raises now

    def fcp_qkv(self, x: torch.Tensor):
        q, k, v, _ = super().fcp_qkv(x)
        return self.q_norm(q), self.k_norm(k), v, None

    def fcp_rotate_qk(self, q: torch.Tensor, k: torch.Tensor, ctx: PackedContext):
        rope = _layer_rope(self.config, self.layer_type)
        cos, sin = rope_tables(rope, ctx.local_position_ids, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def fcp_softcap(self) -> float | None:
        # transformers' Gemma3Attention never passes attn_logit_softcapping on (module doc)
        return None


_CROSSES = ("sliding-window attention: a left halo of `min(window, band) - 1` tokens' K/V; "
            "global attention: an all-gather of K/V")  # fmt: skip

#: sliding (window 6), global, sliding attention layers; 4 heads, 2 kv heads of 8, q/k norms,
#: query_pre_attn_scalar 6 (not head_dim); local RoPE base 10 (default), global base 1000 with
#: linear scaling 2; attn_logit_softcapping set (2.0) where transformers ignores it: fcp must too.
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=6,
             sliding_window=6, attn_logit_softcapping=2.0, pad_token_id=0, eos_token_id=1,
             bos_token_id=2,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                              "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 1000.0}})  # fmt: skip

FAMILIES = (Family.of("gemma3", "Gemma 3", "Gemma3TextModel", _TINY, _CROSSES,
                      Gemma3Attention=Gemma3AttentionAdapter),)  # fmt: skip
