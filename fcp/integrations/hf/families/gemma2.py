"""Gemma 2 (transformers' ``gemma2``: ``Gemma2Model``) on fcp: one adapter.

``Gemma2Attention`` -> :class:`Gemma2AttentionAdapter`: the Llama layout, scores scaled by
``query_pre_attn_scalar ** -0.5`` (its ``scaling``) and **soft-capped**,
``attn_logit_softcapping * tanh(s / attn_logit_softcapping)`` (transformers passes the cap to its
attention function, unlike Gemma 3); layers alternate between sliding-window attention
(``sliding_window`` tokens, itself included) and global attention, one RoPE for both. All of it
is :class:`~fcp.integrations.hf.mixers.GqaMixer`'s default steps (``fcp_window``,
``fcp_softcap``); the adapter only refuses bidirectional attention
(``use_bidirectional_attention``, Gemma 2 as an encoder).

Under CP a sliding layer exchanges a left halo of ``min(window, band) - 1`` tokens' K/V, a global
layer all-gathers K/V. The final-logit soft-cap is in ``Gemma2ForCausalLM``'s head: per token,
transformers' code.
"""

from __future__ import annotations

from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import GqaMixer

__all__ = ["FAMILIES", "Gemma2AttentionAdapter"]


class Gemma2AttentionAdapter(GqaMixer):
    """Gemma 2's attention: :class:`GqaMixer` as it is (window, soft-cap and scaling are the
    layer's attributes), causal only."""

    @classmethod
    def fcp_check(cls, module) -> None:
        if getattr(module.config, "use_bidirectional_attention", False):
            raise NotImplementedError(
                "Gemma 2 with use_bidirectional_attention=True attends to later tokens; fcp "
                "runs causal (document-causal, sliding-window) attention only")  # fmt: skip
        super().fcp_check(module)


_CROSSES = ("sliding-window attention: a left halo of `min(window, band) - 1` tokens' K/V; "
            "global attention: an all-gather of K/V")  # fmt: skip

#: sliding (window 5), global, sliding layers; 4 heads, 2 kv heads of 8; query_pre_attn_scalar
#: 6 (not head_dim); a soft-cap of 1.5, low enough that tanh bends the tiny model's scores
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=6,
             sliding_window=5, attn_logit_softcapping=1.5, final_logit_softcapping=None,
             pad_token_id=0, eos_token_id=1, bos_token_id=2,
             rope_parameters={"rope_type": "default", "rope_theta": 100.0})  # fmt: skip

FAMILIES = (Family.of("gemma2", "Gemma 2", "Gemma2Model", _TINY, _CROSSES,
                      Gemma2Attention=Gemma2AttentionAdapter),)  # fmt: skip
