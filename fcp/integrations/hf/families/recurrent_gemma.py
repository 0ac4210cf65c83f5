"""RecurrentGemma (transformers' ``recurrent_gemma``: ``RecurrentGemmaModel``, Griffin) on fcp.

* ``RecurrentGemmaRecurrentBlock`` -> :class:`~..mixers.rglru.RglruMixer` (the kind as it is:
  RecurrentGemma is the model it is written for): ``linear_x`` / ``linear_y`` branches, a
  depthwise causal ``conv_1d`` with bias, the RG-LRU (block-diagonal input and recurrence
  gates, ``a = exp(-8 r softplus(recurrent_param))``, the input scaled by ``sqrt(1 - a^2)``
  except at a document's first token) as :func:`fcp.ops.elementwise_scan.elementwise_scan`,
  restarted at every document start (transformers restarts it where ``position_ids == 0``; fcp
  at the context's document starts, the same tokens for a document run alone), ``linear_out``
  of ``h * gelu(y)``.
* ``RecurrentGemmaAttention`` -> :class:`RecurrentGemmaAttentionAdapter`: local attention,
  every attention layer sliding over ``attention_window_size`` tokens (itself included;
  transformers' ``self.sliding_window``), the Llama layout with a biased ``o_proj``, scores
  scaled by ``head_dim ** -0.5``, partial RoPE (``partial_rotary_factor``, 0.5 by default, in
  the config's ``rope_parameters``) at document-local positions: all of it
  :class:`~fcp.integrations.hf.mixers.GqaMixer`'s default steps; the adapter refuses a layer
  without a window.

The embedding scale (``normalizer``, a bf16 constant), the MLPs, norms and the final-logit
soft-cap of ``RecurrentGemmaForCausalLM`` are per token: transformers' code.
"""

from __future__ import annotations

from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import GqaMixer
from fcp.integrations.hf.mixers.rglru import RglruMixer

__all__ = ["FAMILIES", "RecurrentGemmaAttentionAdapter"]


class RecurrentGemmaAttentionAdapter(GqaMixer):
    """RecurrentGemma's local attention: :class:`GqaMixer` as it is, over its window."""

    @classmethod
    def fcp_check(cls, module) -> None:
        if not getattr(module, "sliding_window", None):
            raise NotImplementedError(
                f"{type(module).__name__}: RecurrentGemma's attention is local; this layer has "
                f"no attention window (sliding_window={getattr(module, 'sliding_window', None)})")
        super().fcp_check(module)


_CROSSES = ("recurrent block: a `W - 1`-token halo of `[B, L, lru_width]` and one fp32 state-chain "
            "all-gather of `[B, lru_width, 1, 2]`; local attention: a left halo of "
            "`min(window, band) - 1` tokens' K/V")  # fmt: skip

#: recurrent, local attention, recurrent blocks; lru_width 32 in 4 blocks of 8, conv width 4;
#: 4 heads of 8 (2 kv heads), half of each rotated; a window of 5 tokens; the causal LM's logit
#: soft-cap so high that it is the identity to fp32 rounding (its tests compare the logits with
#: lm_head of the backbone's output)
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
             block_types=["recurrent", "attention", "recurrent"], num_attention_heads=4,
             num_key_value_heads=2, lru_width=32, conv1d_width=4, sliding_window=5,
             logits_soft_cap=1e6, pad_token_id=0, eos_token_id=1, bos_token_id=2,
             rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                              "partial_rotary_factor": 0.5})  # fmt: skip

FAMILIES = (Family.of("recurrent_gemma", "RecurrentGemma", "RecurrentGemmaModel", _TINY,
                      _CROSSES, RecurrentGemmaRecurrentBlock=RglruMixer,
                      RecurrentGemmaAttention=RecurrentGemmaAttentionAdapter),)  # fmt: skip
