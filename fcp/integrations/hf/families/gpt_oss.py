"""gpt-oss (transformers' ``gpt_oss``) on fcp.

* ``GptOssAttention`` -> :class:`~..mixers.gqa.GqaMixer` as it is: the Llama layout with biases
  on ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``, no q/k norm, no output gate; YaRN RoPE
  (``rope_parameters["rope_type"] == "yarn"``: its frequencies and ``attention_scaling`` come
  from transformers' own init function, :func:`~fcp.integrations.hf.rope.rope_frequencies`) at
  document-local positions. transformers' ``_apply_rotary_emb`` pairs channel ``i`` with
  ``i + head_dim / 2`` from ``[head_dim / 2]`` tables: the ``rotate_half`` rotation fcp applies.
  The kind's default steps read the rest from the module: ``sliding_window`` (the config's on
  ``"sliding_attention"`` layers, ``None`` on ``"full_attention"`` ones) and ``sinks`` (one
  learned logit per query head, ``[H]``, on both layer types: an extra softmax-denominator
  column whose value is zero, transformers' ``s_aux``), scale ``head_dim ** -0.5``.

The MoE (router with bias, clamped SwiGLU experts) is per token and stays transformers' code.

Under CP a sliding-window layer receives a left halo of ``min(window, band) - 1`` tokens' K/V
(``2 * kv_heads * head_dim`` per token, K already rotated); a full-attention layer all-gathers
K/V. The sinks are replicated parameters: nothing of them crosses ranks in the forward, their
gradient is each rank's partial sum.
"""

from __future__ import annotations

from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import GqaMixer

__all__ = ["FAMILIES"]

#: what one layer of each kind sends between CP ranks
_CROSSES = ("attention with sinks, sliding-window layers: a left halo of `min(window, band) - 1` "
            "tokens' K/V; full layers: an all-gather of K/V")  # fmt: skip

#: alternating sliding (window 6) / full attention with sinks (4 query heads, 2 kv heads,
#: head_dim 8, biased projections), YaRN RoPE as gpt-oss ships it (factor 32, original length
#: 4096: of head_dim 8's 4 frequencies two are extrapolated, one interpolated, one blended),
#: MoE of 4 experts, top 2.
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
             num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, eos_token_id=2,
             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                              "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                              "original_max_position_embeddings": 4096})  # fmt: skip

FAMILIES = (Family.of("gpt_oss", "gpt-oss", "GptOssModel", _TINY, _CROSSES,
                      GptOssAttention=GqaMixer),)  # fmt: skip
