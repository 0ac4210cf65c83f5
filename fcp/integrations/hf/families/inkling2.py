"""Inkling-2 (transformers' ``inkling2``: Thinking Machines' Inkling-2, its text model) on fcp.

Every part of the text model that looks at other tokens runs on fcp's operators; the rest
(normed embeddings, the block attention residuals over earlier layers' outputs, the L2 clips
and RMS norms of each head, the softcapped MoE) is per token and stays transformers' code:

* ``Inkling2ShortConvolution`` -> :class:`Inkling2ShortConvAdapter`: a depthwise causal conv
  (``conv1d``, no bias) in fp32 plus its input, over ``sqrt(width + 1)``; the decoder layers'
  ``post_attention_convolution`` / ``post_mlp_convolution`` and the key and value convs of the
  sliding layers (swapped too, but the attention adapter runs those as functions: a module call
  inside a compiled attention would guard on the conv's context mark and recompile for every
  layer). Under CP a ``width - 1``-token halo of its input;
* ``Inkling2SlidingAttention`` and ``Inkling2FullAttention`` -> :class:`Inkling2AttentionAdapter`,
  GQA without RoPE:

  - ``q = q_proj(x)``: a linear, a learned per-channel scale, an L2 clip of each head and, in
    full layers, a log scale by the token's **document-local** position;
  - ``k``, ``v``: a linear, a short conv (sliding layers: the static one above; full layers:
    ``Inkling2DynamicShortConvolution``, whose taps add per-token weights projected from the
    key's / value's input, one set per kv head), then an L2 clip (k) or an RMS norm (v);
  - the scores get a **relative position bias**: the token's relative states (a linear, a
    scale, an L2 clip, a log scale in full layers) times the trained bank of profiles ``proj``,
    i.e. a table ``[B, L, H, E]`` per query over the backward distance (``E`` the window in
    sliding layers, ``rel_extent`` in full ones; no bias further back), and one **sink** logit
    per query and head (``sink_proj(x)``);
  - sliding layers attend to the last ``sliding_window`` tokens, full layers to the whole
    document: :func:`fcp.ops.relative_attention.relative_attention` (fcp's softmax attention
    cannot add a per-query table of distances), then the gated output projection ``o_proj``
    (``linear(o * sigmoid(gate_proj(x)))``).

  Under CP: the key and value convs' ``width - 1``-token halos of their inputs ``[B, L, Hkv
  Dh]`` (a dynamic conv's per-token weights are projected from the token's own input: they
  never cross), then a ``min(window, band) - 1``-token K/V halo (sliding layers) or an
  all-gather of K/V (full layers). The bias tables and sinks are per query and stay on their
  rank.

fcp reads from transformers the attention's ``q_proj`` (called as it is, with document-local
positions), ``k_proj`` / ``v_proj`` (``linear``, ``sconv``, ``norm``), ``relative_position_bias``
(``linear``, ``norm``, ``proj``, ``num_heads``), ``sink_proj``, ``o_proj`` (``gate_proj``,
``linear``), ``scaling``, ``sliding_window``; the convs' ``conv1d`` / ``static_weight`` /
``weight_proj`` and widths. The decoder layers hand ``cp_context`` to their attention and convs
through ``**kwargs``; the full layers pass their separately normed key and value inputs
(``key_hidden_states``, ``value_hidden_states``) by keyword. The ``position_ids`` and
``relative_distance`` the text model computes for the packed row are not read (transformers
still builds ``relative_distance`` as two ``[L, L]`` int64 tables per forward).
"""

from __future__ import annotations

import math

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import GqaMixer
from fcp.ops.conv import short_conv
from fcp.ops.relative_attention import relative_attention
from fcp.ops.token_lags import token_lags

__all__ = ["FAMILIES", "Inkling2AttentionAdapter", "Inkling2ShortConvAdapter"]


class Inkling2ShortConvAdapter(FcpMixer):
    """``(conv(x) + x) / sqrt(width + 1)`` in fp32 (``x [B, L, C]``, any float dtype; the result
    in ``x``'s dtype): a depthwise causal conv without bias that never mixes two documents."""

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, **_) -> torch.Tensor:
        return _static_conv(self, hidden_states, ctx)


def _static_conv(conv, x: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
    """``Inkling2ShortConvolution`` (:class:`Inkling2ShortConvAdapter`) of ``x [B, L, C]``."""
    xf = x.float()
    out = short_conv(xf, conv.conv1d.weight[:, 0, :], conv.conv1d.bias, ctx)
    return ((out + xf) / math.sqrt(conv.conv_kernel_size + 1)).to(x.dtype)


def _dynamic_conv(conv, x: torch.Tensor, dynamic_input: torch.Tensor,
                  ctx: PackedContext) -> torch.Tensor:  # fmt: skip
    """``Inkling2DynamicShortConvolution`` on packed documents: ``x [B, L, C]`` and the weights'
    input ``dynamic_input [B, L, D]`` -> ``[B, L, C]`` in ``x``'s dtype. Tap ``lag`` (the token
    ``lag`` steps back, 0: the token itself) weighs ``static_weight[lag]`` plus the token's own
    projected weight of its kv head; taps outside the token's document read zeros."""
    b, n, c = x.shape
    width, heads = conv.conv_kernel_size, conv.num_heads
    dynamic = conv.weight_proj(dynamic_input).float().view(b, n, heads, 1, width)
    weights = conv.static_weight.float().T.view(heads, -1, width) + dynamic  # [B, L, Hkv, C/Hkv, W]
    xf = x.float()
    windows = token_lags(xf, ctx, width).transpose(2, 3).reshape(b, n, heads, -1, width)
    out = (windows * weights).sum(-1).reshape(b, n, c)
    return ((out + xf) / math.sqrt(2 * width + 1)).to(x.dtype)


def _key_value(proj, x: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
    """``Inkling2KeyValueProjection`` of ``x [B, L, D]``: ``[B, L, Hkv, Dh]`` (linear, the
    document-masked short conv, then the per-head L2 clip or RMS norm)."""
    states = proj.linear(x)
    # called as functions, not as modules (module doc)
    if hasattr(proj.sconv, "weight_proj"):  # Inkling2DynamicShortConvolution
        states = _dynamic_conv(proj.sconv, states, x, ctx)
    else:
        states = _static_conv(proj.sconv, states, ctx)
    return proj.norm(states.view(*states.shape[:-1], -1, proj.head_dim))


class Inkling2AttentionAdapter(GqaMixer):
    """Inkling-2's sliding-window and full attention (module doc): no RoPE; ``fcp_attend`` adds
    the relative position bias and the per-query sinks of the query input ``x``. The layers
    differ only in their modules (full ones: ``sliding_window`` ``None``, log-scaled query and
    relative states, dynamic k/v convs, separately normed key and value inputs), which the steps
    call as they are."""

    @staticmethod
    def fcp_uses_rope(config) -> bool:
        return False

    def fcp_sinks(self, x: torch.Tensor) -> torch.Tensor:
        """One sink logit per query and head, ``sink_proj(x)`` ``[B, L, H]``."""
        return self.sink_proj(x)

    def fcp_attend(self, q, k, v, x: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        """``[B, L, H, Dh]``: softmax over the visible keys (the last ``fcp_window()`` in
        sliding layers) of ``scale * q . k`` plus the bias table ``[B, L, H, E]`` of each
        query's relative states, with the sinks of ``x``."""
        rpb = self.relative_position_bias
        states = rpb.linear(x).view(*x.shape[:-1], rpb.num_heads, -1)
        table = rpb.norm(states, ctx.local_position_ids) @ rpb.proj  # [B, L, H, E]
        return relative_attention(q, k, v, table, ctx, scale=self.scaling,
                                  window=self.fcp_window(), sinks=self.fcp_sinks(x))  # fmt: skip

    def fcp_attention_output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """``o [B, L, H Dh]`` gated by ``sigmoid(gate)`` in fp32 (``gate``: ``gate_proj`` of the
        query input), then ``o_proj.linear``."""
        o = (o.float() * torch.sigmoid(gate.float())).to(o.dtype)
        return self.o_proj.linear(o)

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, *,
                    key_hidden_states: torch.Tensor | None = None,
                    value_hidden_states: torch.Tensor | None = None, **_):  # fmt: skip
        """``hidden_states [B, L, D]`` (the query input; also of k and v unless
        ``key_hidden_states`` / ``value_hidden_states`` are given) -> ``(out [B, L, D],
        None)``."""
        x = hidden_states
        xk = x if key_hidden_states is None else key_hidden_states
        xv = x if value_hidden_states is None else value_hidden_states
        q = self.q_proj(x, ctx.local_position_ids).transpose(1, 2)  # [B, L, H, Dh]
        k, v = _key_value(self.k_proj, xk, ctx), _key_value(self.v_proj, xv, ctx)
        o = self.fcp_attend(q, k, v, x, ctx)
        return self.fcp_attention_output(o.flatten(2), self.o_proj.gate_proj(x)), None


_CROSSES = ("short conv: a `W - 1`-token halo of `[B, L, C]`; sliding attention: the k/v convs' "
            "`W - 1`-token halos and a `min(window, band) - 1`-token K/V halo; full attention: "
            "the dynamic k/v convs' `W - 1`-token halos and an all-gather of K/V (bias tables "
            "and sinks stay local)")  # fmt: skip

#: sliding (window 6: the bias over the whole window), full (rel_extent 8 < the longest test
#: document, so far keys get no bias), sliding; sliding layers 4 heads / 1 kv head, full ones 4
#: / 2 (head_dim 8); short convs of width 3; attention-residual blocks of 2 layers (a boundary
#: at layer 2); log scaling from position 4 (alpha 0.5) so every test document longer than 3
#: tokens is scaled; L2 clip thresholds near the typical norms (some heads clipped, some not);
#: weights at std 0.2 so that scores are far from uniform; MoE of 4 experts, top 2. The final
#: logit softcap is set far above the tiny logits (the causal-LM test compares the head's
#: logits with ``lm_head`` of the backbone's output).
_TINY = dict(vocab_size=128, unpadded_vocab_size=128, hidden_size=32, num_hidden_layers=3,
             layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"], num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4,
             swa_num_key_value_heads=1, swa_head_dim=8, sliding_window_size=6, d_rel=4,
             rel_extent=8, log_scaling_n_floor=4, log_scaling_alpha=0.5, conv_kernel_size=3,
             moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
             n_layers_per_attn_res_block=2, qk_l2_clip_threshold=3.0, rel_l2_clip_threshold=2.0,
             initializer_range=0.2, final_logit_softcapping=1e6, pad_token_id=0,
             eos_token_id=2)  # fmt: skip

FAMILIES = (Family.of("inkling2", "Inkling-2", "Inkling2TextModel", _TINY, _CROSSES,
                      Inkling2ShortConvolution=Inkling2ShortConvAdapter,
                      Inkling2SlidingAttention=Inkling2AttentionAdapter,
                      Inkling2FullAttention=Inkling2AttentionAdapter),)  # fmt: skip
