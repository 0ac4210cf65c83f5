"""Qwen4-Exp (transformers' ``qwen4_exp``: Qwen3.8-Flash-Next) on fcp: its adapters.

Every part of the text model that looks at other tokens runs on fcp's operators; the rest
(embeddings, hyper-connections, MoE, norms) is per token and stays transformers' code:

* ``Qwen4ExpTextGatedDeltaNet`` -> Qwen3.5's :class:`~.qwen3_5.Qwen3_5GdnAdapter` (the same
  layer: separate ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``): conv halo +
  one fp32 state-chain all-gather under CP;
* ``Qwen4ExpTextAttention`` -> :class:`Qwen4ExpAttentionAdapter` (the QSA kind,
  :mod:`..mixers.qsa`, with Qwen3-Next's gated projections and per-head q/k norms; RoPE at
  document-local positions, the mRoPE tables of text tokens): ``ratio - 1`` token halo +
  ``ceil(L / ratio)`` compressed index keys per rank + K/V all-gathers;
* ``Qwen4ExpTextPLELayer`` -> :class:`~..mixers.ple.PleMixer` (hashed n-gram ids with a
  document-local history, dilated conv): an integer halo of ``ngram_size - 1`` token ids + the
  conv's ``(width - 1) * ngram_size`` token halo;
* ``Qwen4ExpTextDecoderLayer`` -> :class:`Qwen4ExpDecoderLayerAdapter`: transformers' decoder
  layer calls its PLE positionally (``self.ple(h, ids, cache, conv_mask=...)``), so
  ``cp_context`` would never reach it; under a context this adapter runs the layer's steps
  itself and hands the context to the PLE and to the token mixer. Without one it is
  transformers' layer.

The wrappers (``Qwen4ExpForCausalLM``, ``Qwen4ExpModel``, ``Qwen4ExpForConditionalGeneration``)
forward ``cp_context`` through their ``**kwargs``; text-only inputs work, image or video inputs
with a ``cp_context`` raise (:data:`~fcp.integrations.hf.core.MULTIMODAL_INPUTS`).
``position_ids`` (3-D mRoPE positions included) are ignored under a context: for text tokens the
three axes carry one position, and fcp applies the document-local one, where mRoPE's
interleaved tables reduce to 1-D RoPE (``tests/test_hf_qwen4_exp.py`` checks transformers'
rotary module against :func:`~fcp.integrations.hf.rope.rope_tables`).
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.families.qwen3_5 import Qwen3_5GdnAdapter
from fcp.integrations.hf.families.qwen3_next import Qwen3NextAttentionAdapter
from fcp.integrations.hf.mixers import PleMixer, QsaGqaMixer

__all__ = ["FAMILIES", "Qwen4ExpAttentionAdapter", "Qwen4ExpDecoderLayerAdapter"]


class Qwen4ExpAttentionAdapter(QsaGqaMixer):
    """QSA attention with Qwen3-Next's gated projections (``q_proj`` holds per head
    ``[query | output gate]``; ``q_norm``, ``k_norm`` per head)."""

    fcp_qkv = Qwen3NextAttentionAdapter.fcp_qkv


class Qwen4ExpDecoderLayerAdapter(FcpMixer):
    """Qwen4-Exp's decoder layer under a context (module doc)::

        h = h + ple(h, input_ids=ple_input_ids, cp_context=ctx)     # PLE layers only
        x, streams, w = attn_hyper_connection(h)
        h = streams + (mixer(x, cp_context=ctx) per stream * w)   # linear_attn or self_attn
        x, streams, w = mlp_hyper_connection(h)
        h = streams + (mlp(x) per stream * w)

    ``hidden_states`` ``[B, L, hc_count * hidden]`` -> the same shape.
    """

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, *,
                    ple_input_ids: torch.Tensor | None = None, position_embeddings=None,
                    attention_mask=None, conv_mask=None, cache=None, **kwargs) -> torch.Tensor:  # fmt: skip
        h = hidden_states
        if self.ple is not None:
            if ple_input_ids is None:
                raise ValueError(f"{type(self).__name__}: a PLE layer needs `ple_input_ids` (the "
                                 "token ids; the text model passes them)")  # fmt: skip
            h = h + self.ple(h, input_ids=ple_input_ids, cp_context=ctx)
        x, streams, weights = self.attn_hyper_connection(h)
        if self.layer_type == "linear_attention":
            out = self.linear_attn(x, cp_context=ctx, **kwargs)
        else:
            out, _ = self.self_attn(x, cp_context=ctx, **kwargs)
        h = streams + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)
        x, streams, weights = self.mlp_hyper_connection(h)
        return streams + (self.mlp(x).unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


#: Gated DeltaNet (2 key heads, 4 value heads) with PLE, Gated DeltaNet, QSA attention (4 query
#: heads, 2 kv heads, head_dim 16, partial rotary 0.5: 8 rotated channels, mRoPE sections
#: [2, 1, 1]; 2 index heads of 8, blocks of 4, budget 8 = 2 blocks), Gated DeltaNet with PLE; MoE
#: everywhere, 2 hyper-connection streams; PLE: 3-grams (2 hashed orders x 2 heads of 4 over
#: primes after 50), a width-4 conv at dilation 3; eos id 2.
_TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4,
             layer_types=["linear_attention", "linear_attention", "indexed_attention",
                          "linear_attention"],
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]},
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
             hc_count=2, hc_lowrank=8, ple_layer_ids=[1, 4], ple_embed_dim=16,
             ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
             make_ngram_vocab_size_divisible_by=8, indexer_n_heads=2, indexer_kv_heads=1,
             indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4, pad_token_id=0,
             eos_token_id=2)  # fmt: skip

#: the PLE layer's exchange is an integer halo (no gradient) and a conv halo; the decoder layer's
#: adapter only hands the context on
_CROSSES = ("Gated DeltaNet: a `W - 1`-token conv halo and one fp32 state-chain all-gather; QSA "
            "attention: the indexer's `ratio - 1`-token halo, an all-gather of `ceil(L / ratio)` "
            "compressed keys per rank and of K/V; PLE: an integer halo of `ngram_size - 1` token "
            "ids and the dilated conv's `(width - 1) * ngram_size`-token halo; decoder layer: "
            "nothing")  # fmt: skip
FAMILIES = (Family.of("qwen4_exp", "Qwen4-Exp / Qwen3.8-Flash-Next", "Qwen4ExpTextModel", _TINY,
                      _CROSSES, Qwen4ExpTextGatedDeltaNet=Qwen3_5GdnAdapter,
                      Qwen4ExpTextAttention=Qwen4ExpAttentionAdapter,
                      Qwen4ExpTextPLELayer=PleMixer,
                      Qwen4ExpTextDecoderLayer=Qwen4ExpDecoderLayerAdapter),)  # fmt: skip
