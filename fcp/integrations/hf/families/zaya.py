"""ZAYA (transformers' ``zaya``: Zyphra's ZAYA1) on fcp: its attention adapter.

``ZayaAttention`` -> :class:`ZayaAttentionAdapter`: GQA whose q, k, v come from ZAYA's
Compressed Convolutional Attention projection (``qkv_proj``, a ``ZayaCCAProjection``), every
layer either full (``"hybrid"``) or sliding-window (``"hybrid_sliding"``, ``sliding_window``
keys):

* ``[q | k] = [q_proj(x) | k_proj(x)]`` ``[B, L, (H + Hkv) Dh]`` runs through two causal convs:
  a depthwise one (``conv_qk_depthwise``, width ``cca_time0``, bias) and then a grouped one
  (``conv_qk_grouped``, width ``cca_time1``, one group of ``Dh`` channels per head, bias);
  residual paths add the mean of q and the repeated k back. transformers zero-pads the row by
  ``cca_time0 + cca_time1 - 2`` tokens, so before a document the grouped conv reads the
  depthwise conv's **bias** (its output over zeros), not zeros: fcp's grouped taps read that
  bias wherever a tap falls outside the token's document;
* ``v`` is half current (``v_proj_current(x)``) and half the previous token's
  ``v_proj_delayed`` (``v_proj_delayed(0)``, its bias, at a document's first token);
* ``qk_norm``: q and k scaled to norm ``sqrt(Dh)``, k by a learned per-kv-head ``temp``;
* RoPE per layer type (``config.rope_parameters[layer_type]``: each type its own base and
  partial rotary factor) at document-local positions, then :class:`~..mixers.gqa.GqaMixer`'s
  attention (sliding-window layers: ``fcp_window() = sliding_window``) and ``o_proj``.

fcp reads from transformers the attention's ``qkv_proj`` (its ``q_proj``, ``k_proj``,
``v_proj_current``, ``v_proj_delayed``, the two ``nn.Conv1d`` and their widths),
``qk_norm``, ``o_proj``, ``scaling``, ``sliding_window``, ``layer_type`` and ``config``; the
decoder layers (residual scalings, the router that carries its state from layer to layer, MoE)
are per token and stay transformers' code.

Under CP: the depthwise conv's ``cca_time0 - 1``-token halo of ``[B, L, (H + Hkv) Dh]``, the
grouped conv's ``cca_time1 - 1``-token halo of its input (same width), a one-token halo of
``v_proj_delayed(x)`` ``[B, L, Hkv Dh / 2]``, and the attention's K/V exchange (an all-gather
for full layers, a ``sliding_window - 1``-token halo for sliding ones).
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.layer_rope import LayerRopeConfig
from fcp.integrations.hf.mixers import GqaMixer
from fcp.integrations.hf.rope import apply_rope, rope_frequencies, rope_tables
from fcp.ops.conv import short_conv
from fcp.ops.token_lags import token_lags

__all__ = ["FAMILIES", "ZayaAttentionAdapter"]


def _layer_rope(attention) -> LayerRopeConfig:
    """The attention's config seen with its layer type's rope parameters (ZAYA keeps one dict
    per layer type in ``config.rope_parameters``)."""
    return LayerRopeConfig(attention.config, attention.config.rope_parameters[attention.layer_type])


def _cca_qkv(proj, x: torch.Tensor, ctx: PackedContext):
    """ZAYA's CCA projection (module doc) of ``x [B, L, D]`` on packed documents: ``(q [B, L, H,
    Dh], k [B, L, Hkv, Dh], v [B, L, Hkv, Dh])`` as ``ZayaCCAProjection`` gives each document
    alone."""
    b, n, _ = x.shape
    heads, kv_heads, dh = proj.num_attention_heads, proj.num_key_value_heads, proj.head_dim
    groups = heads // kv_heads
    q_lin, k_lin = proj.q_proj(x), proj.k_proj(x)
    # residual paths: q averaged with its kv head's k, k the mean of its group's new q
    q_res = (q_lin.view(b, n, heads, dh) + k_lin.view(b, n, kv_heads, 1, dh).expand(
        b, n, kv_heads, groups, dh).reshape(b, n, heads, dh)) * 0.5  # fmt: skip
    k_res = q_res.view(b, n, kv_heads, groups, dh).mean(dim=-2)
    # the depthwise conv (masked taps, bias); then the grouped conv, whose taps outside the
    # token's document read the depthwise conv's output over transformers' zero padding: its bias
    dw, gr = proj.conv_qk_depthwise, proj.conv_qk_grouped
    mixed = short_conv(torch.cat([q_lin, k_lin], -1), dw.weight[:, 0, :], dw.bias, ctx)
    lags = token_lags(mixed, ctx, gr.kernel_size[0], fill=0.0 if dw.bias is None else dw.bias)
    n_groups, width = gr.groups, gr.kernel_size[0]
    # [group, out, in, lag]: nn.Conv1d's tap width - 1 - j reads the token j back
    weight = gr.weight.view(n_groups, dh, dh, width).flip(-1)
    out = torch.einsum("bljgi,goij->blgo", lags.view(b, n, width, n_groups, dh),
                       weight).reshape(b, n, -1)  # fmt: skip
    if gr.bias is not None:
        out = out + gr.bias
    q = out[..., : heads * dh].view(b, n, heads, dh) + q_res
    k = out[..., heads * dh :].view(b, n, kv_heads, dh) + k_res
    # the value: half this token's, half the previous token's delayed projection (at a
    # document's first token the projection of zeros, as transformers' zero initial state)
    first = proj.v_proj_delayed(x.new_zeros(1, 1, x.shape[-1]))[0, 0]
    delayed = token_lags(proj.v_proj_delayed(x), ctx, 2, fill=first)[:, :, 1]
    v = torch.cat([proj.v_proj_current(x), delayed], -1).view(b, n, kv_heads, dh)
    return q, k, v


class ZayaAttentionAdapter(GqaMixer):
    """ZAYA's attention (module doc): CCA projections, ``qk_norm``, RoPE of the layer's type,
    full or sliding-window GQA, ``o_proj``."""

    @classmethod
    def fcp_check(cls, module) -> None:
        rope_frequencies(_layer_rope(module))  # a rope type fcp cannot apply raises now

    def fcp_rotate_qk(self, q: torch.Tensor, k: torch.Tensor, ctx: PackedContext):
        cos, sin = rope_tables(_layer_rope(self), ctx.local_position_ids, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, **_):
        q, k, v = _cca_qkv(self.qkv_proj, hidden_states, ctx)
        q, k = self.qk_norm(q, k)
        q, k = self.fcp_rotate_qk(q, k, ctx)
        o = self.fcp_attend(q, k, v, hidden_states, ctx)
        return self.fcp_attention_output(o.flatten(2), None), None


_CROSSES = ("CCA: a `cca_time0 - 1`- and a `cca_time1 - 1`-token halo of `[B, L, (H + Hkv) Dh]` "
            "(the two q/k convs) and a one-token halo of the delayed value half; attention: an "
            "all-gather of K/V (full layers) or a `sliding_window - 1`-token K/V halo (sliding "
            "layers)")  # fmt: skip

#: sliding (window 6), full, sliding; 4 heads, 2 kv heads, head_dim 8; CCA convs of widths 3 and
#: 2 (a 3-token history: shorter than some test documents, longer than others); projection and
#: conv biases; each layer type its own rope base, half the head rotated; MoE of 4 experts (top
#: 1, plus ZAYA's skip expert) with the router state carried across layers.
_TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3,
             layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"], num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, sliding_window=6, cca_time0=3, cca_time1=2,
             attention_bias=True, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=1,
             router_hidden_size=16, pad_token_id=0, bos_token_id=2, eos_token_id=3,
             rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": 5000.0,
                                         "partial_rotary_factor": 0.5},
                              "hybrid_sliding": {"rope_type": "default", "rope_theta": 100.0,
                                                 "partial_rotary_factor": 0.5}})  # fmt: skip

FAMILIES = (Family.of("zaya", "ZAYA", "ZayaModel", _TINY, _CROSSES,
                      ZayaAttention=ZayaAttentionAdapter),)  # fmt: skip
