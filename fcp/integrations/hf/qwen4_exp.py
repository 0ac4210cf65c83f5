"""Qwen4-Exp (transformers' ``qwen4_exp``: Qwen3.8-Flash-Next) on fcp: its adapters.

Every part of the text model that looks at other tokens runs on fcp's operators; the rest
(embeddings, hyper-connections, MoE, norms) is per token and stays transformers' code:

* ``Qwen4ExpTextGatedDeltaNet`` -> :class:`Qwen4ExpGdnAdapter` (the Gated DeltaNet kind with
  separate ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``; Qwen3.5's layout):
  conv halo + one fp32 state-chain all-gather under CP;
* ``Qwen4ExpTextAttention`` -> :class:`Qwen4ExpAttentionAdapter` (the QSA kind,
  :mod:`.mixers.qsa`, with Qwen3-Next's gated projections and per-head q/k norms; RoPE at
  document-local positions, the mRoPE tables of text tokens): ``ratio - 1`` token halo +
  ``ceil(L / ratio)`` compressed index keys per rank + K/V all-gathers;
* ``Qwen4ExpTextPLELayer`` -> :class:`~.mixers.ple.PleMixer` (hashed n-gram ids with a
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
from fcp.integrations.hf.mixers.gdn import GatedDeltaNetMixer
from fcp.integrations.hf.mixers.ple import PleMixer
from fcp.integrations.hf.mixers.qsa import QsaGqaMixer
from fcp.integrations.hf.models import Qwen3NextAttentionAdapter

__all__ = ["ADAPTERS", "Qwen4ExpAttentionAdapter", "Qwen4ExpDecoderLayerAdapter",
           "Qwen4ExpGdnAdapter"]  # fmt: skip


class Qwen4ExpGdnAdapter(GatedDeltaNetMixer):
    """Separate projections: ``in_proj_qkv`` is the conv input ``[q | k | v]``; ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a`` the output gate, beta and decay logits per value head."""

    def fcp_projections(self, x: torch.Tensor):
        z = self.in_proj_z(x).view(*x.shape[:2], self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


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


#: Qwen4-Exp's rows of :data:`fcp.integrations.hf.SUPPORTED`.
ADAPTERS: dict[str, type[FcpMixer]] = {
    "Qwen4ExpTextGatedDeltaNet": Qwen4ExpGdnAdapter,
    "Qwen4ExpTextAttention": Qwen4ExpAttentionAdapter,
    "Qwen4ExpTextPLELayer": PleMixer,
    "Qwen4ExpTextDecoderLayer": Qwen4ExpDecoderLayerAdapter,
}
