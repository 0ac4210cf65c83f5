"""DeepSeek-V4 (transformers' ``deepseek_v4``) on fcp: its attention, one adapter for the three
layer types.

``DeepseekV4Attention`` -> :class:`DeepseekV4AttentionAdapter`. What fcp reads from
transformers: the query path ``q_a_proj`` -> ``q_a_norm`` -> ``q_b_proj`` -> per-head unweighted
RMSNorm (``q_b_norm``), the one shared key/value head ``kv_proj`` -> ``kv_norm`` (K = V), the
per-head ``sinks``, ``sliding_window``, ``scaling``, the grouped output ``o_a_proj`` /
``o_b_proj``, the layer's ``rope_layer_type`` (``"main"``: sliding layers, ``"compress"``:
compressed ones) and, on compressed layers, ``compressor`` (``kv_proj``, ``gate_proj``,
``position_bias``, ``kv_norm``, ``compress_rate``) and its ``indexer`` (the same four at
``index_head_dim`` plus ``q_b_proj``, ``scorer.weights_proj``, ``scorer.softmax_scale``,
``scorer.weights_scaling``, ``index_topk``). RoPE is DeepSeek's interleaved pairing on the
*trailing* ``qk_rope_head_dim`` channels, at document-local positions (queries, keys, and the
conjugate rotation of the output); pools are rotated at their first document position.

* ``sliding_attention``: :func:`fcp.sliding_window_attention` with the sinks;
* ``heavily_compressed_attention`` (HCA): :func:`~fcp.ops.pooled_attention.gated_pools`
  (``compress_rate`` tokens per pool, softmax-gated per channel) and
  :func:`~fcp.ops.pooled_attention.pooled_window_attention` over the window and every visible
  pool, with the sinks;
* ``compressed_sparse_attention`` (CSA): the same with overlapping two-series pools (width
  ``2 * compress_rate``), and only the pools :func:`~fcp.ops.pooled_attention.pool_select` picks
  (the lightning indexer: its own overlapping pools, ``sum_h w_h relu(q_h . k)``, top
  ``index_topk``, equal scores to the earlier pool; no gradient, as in transformers).

transformers compresses each sequence from its first token; fcp's pools start at every document
start, so a document packed anywhere gets the pools it gets alone, and none straddles two
documents. Everything else (mHC hyper-connections, hash-routed and top-k MoE, norms) is per token
and stays transformers' code; the model's own masks and position embeddings are not used.

Under CP, per layer: the sliding window's ``min(window, band) - 1``-token left halo of the
shared K/V; on compressed layers also the pools' ``ratio - 1`` (HCA) or ``2 * ratio - 1`` (CSA,
and again for its indexer) token halo of ``[kv | gate]`` and an all-gather of ``ceil(L / ratio)``
pooled vectors per rank (``head_dim`` each; the indexer's ``index_head_dim`` ones, no gradient).
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.families.family import Family
from fcp.ops.pooled_attention import gated_pools, pool_select, pooled_window_attention
from fcp.ops.sliding_window import sliding_window_attention

__all__ = ["FAMILIES", "DeepseekV4AttentionAdapter"]

_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention",
                "heavily_compressed_attention")  # fmt: skip
#: rope types whose frequencies change with the sequence seen (``dynamic_rope_update``)
_SEQUENCE_DEPENDENT = ("dynamic", "longrope")


def _inv_freq(config, label: str, device) -> tuple[torch.Tensor, float]:
    """``(inv_freq [R / 2] fp32, attention_scaling)`` of ``config.rope_parameters[label]``, as
    ``DeepseekV4RotaryEmbedding`` computes them (``R = int(head_dim * partial_rotary_factor)``)."""
    params = config.rope_parameters[label]
    kind = params.get("rope_type", "default")
    if kind == "default":
        dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
        exponent = torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[kind](config, device, layer_type=label)


def _tables(config, label: str, positions: torch.Tensor, dtype: torch.dtype):
    """``(cos, sin)`` ``[*positions.shape, R / 2]`` in ``dtype`` at int64 ``positions``."""
    inv_freq, scaling = _inv_freq(config, label, positions.device)
    freqs = positions[..., None].float() * inv_freq
    return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's rotation of the trailing ``R = 2 * cos.shape[-1]`` channels of ``x [B, N, H,
    D]``, pairs ``(2i, 2i + 1)`` turned by frequency ``i``, interleaved layout kept, in fp32;
    ``cos``, ``sin`` ``[B, N, R / 2]``."""
    r = 2 * cos.shape[-1]
    cos = cos.repeat_interleave(2, -1)[:, :, None]
    sin = sin.repeat_interleave(2, -1)[:, :, None]
    nope, rope = x[..., :-r], x[..., -r:]
    turned = torch.stack([-rope[..., 1::2], rope[..., 0::2]], -1).flatten(-2)
    return torch.cat([nope, (rope.float() * cos + turned.float() * sin).to(x.dtype)], -1)


def _pools(config, module, x: torch.Tensor, ctx: PackedContext, overlap: bool) -> torch.Tensor:
    """``module``'s (a compressor's or an indexer's) pools ``[B, C, Dp]`` of ``x [B, L, hidden]``:
    :func:`~fcp.ops.pooled_attention.gated_pools` of its ``kv_proj`` under ``gate_proj`` plus the
    row's ``position_bias``, normed with its ``kv_norm`` and rotated at each pool's first
    document position."""
    ratio = module.compress_rate
    bias = module.position_bias[ctx.local_position_ids % ratio]  # [B, L, F]: row p % ratio
    gate = module.gate_proj(x) + bias
    pooled, start = gated_pools(module.kv_proj(x), gate, ctx, ratio, overlap=overlap)
    pooled = module.kv_norm(pooled)
    cos, sin = _tables(config, "compress", start, pooled.dtype)
    return _rope(pooled[:, :, None], cos, sin)[:, :, 0]


def _select(attn, x: torch.Tensor, q_resid: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
    """int64 ``[B, L, index_topk]`` global slot ids (-1: none): the lightning indexer of the CSA
    layer ``attn`` (its own overlapping pools, queries from the query latent ``q_resid [B, L,
    q_lora_rank]``), no gradient."""
    ix = attn.compressor.indexer
    with torch.no_grad():
        keys = _pools(attn.config, ix, x, ctx, overlap=True)  # [B, C, Di]
        b, n, _ = x.shape
        q = ix.q_b_proj(q_resid).view(b, n, ix.num_heads, ix.head_dim)
        cos, sin = _tables(attn.config, "compress", ctx.local_position_ids, q.dtype)
        q = _rope(q, cos, sin)
        weights = ix.scorer.weights_proj(x).float() * ix.scorer.weights_scaling
        return pool_select(q, keys, weights, ctx, ix.compress_rate, ix.index_topk,
                           ix.scorer.softmax_scale)  # fmt: skip


class DeepseekV4AttentionAdapter(FcpMixer):
    """DeepSeek-V4's attention (sliding, CSA or HCA) on fcp (module doc).

    ``fcp_forward(hidden_states [B, L, hidden], ctx) -> (out [B, L, hidden], None)``.
    """

    @classmethod
    def fcp_check(cls, module) -> None:
        name = type(module).__name__
        config = module.config
        if module.layer_type not in _LAYER_TYPES:
            raise NotImplementedError(f"{name}: unknown layer type {module.layer_type!r}")
        if getattr(config, "num_key_value_heads", 1) != 1:
            raise NotImplementedError(f"{name}: fcp runs DeepSeek-V4's one shared K = V head, "
                                      f"got num_key_value_heads="
                                      f"{config.num_key_value_heads}")  # fmt: skip
        if module.attention_dropout:
            raise NotImplementedError(f"{name}: attention dropout "
                                      f"({module.attention_dropout}) is not supported")  # fmt: skip
        for label in ("main", "compress"):
            kind = config.rope_parameters[label].get("rope_type", "default")
            if kind in _SEQUENCE_DEPENDENT:
                raise NotImplementedError(f"{name}: rope_type={kind!r} rescales with the "
                                          "sequence length; fcp rotates at document-local "
                                          "positions")  # fmt: skip
        if module.compressor is not None and module.layer_type == "compressed_sparse_attention":
            ix = module.compressor.indexer
            if ix.head_dim < config.qk_rope_head_dim:
                raise NotImplementedError(f"{name}: index_head_dim={ix.head_dim} is smaller "
                                          f"than the rotated {config.qk_rope_head_dim} "
                                          "channels")  # fmt: skip

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, **_):
        x = hidden_states
        b, n, _ = x.shape
        cos, sin = _tables(self.config, self.rope_layer_type, ctx.local_position_ids, x.dtype)
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_norm(self.q_b_proj(q_resid).view(b, n, -1, self.head_dim))
        q = _rope(q, cos, sin)  # [B, L, H, D]
        kv = _rope(self.kv_norm(self.kv_proj(x))[:, :, None], cos, sin)  # [B, L, 1, D]
        if self.compressor is None:
            o = sliding_window_attention(q, kv, kv, ctx, self.sliding_window, self.scaling,
                                         sinks=self.sinks)  # fmt: skip
        else:
            csa = self.layer_type == "compressed_sparse_attention"
            pooled = _pools(self.config, self.compressor, x, ctx, overlap=csa)
            selected = _select(self, x, q_resid, ctx) if csa else None
            o = pooled_window_attention(q, kv[:, :, 0], pooled, ctx, self.compressor.compress_rate,
                                        self.sliding_window, self.scaling, sinks=self.sinks,
                                        selected=selected)  # fmt: skip
        o = _rope(o, cos, -sin)  # the values' rotation undone at the query's position
        grouped = self.o_a_proj(o.reshape(b, n, self.config.o_groups, -1)).flatten(2)
        return self.o_b_proj(grouped), None


#: 3 layers (sliding, CSA, HCA) of 4 heads of 16 channels (8 rotated), window 6; CSA pools of 4
#: tokens (8 wide, overlapping), its indexer 4 heads of 8 keeping 2 pools; HCA pools of 8; MoE
#: of 4 experts (a hash-routed first layer), 2 hyper-connection streams.
_TINY = dict(vocab_size=128, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, head_dim=16, q_lora_rank=16, partial_rotary_factor=0.5,
             n_routed_experts=4, num_experts_per_tok=2,
             layer_types=["sliding_attention", "compressed_sparse_attention",
                          "heavily_compressed_attention"],
             compress_rates={"compressed_sparse_attention": 4,
                             "heavily_compressed_attention": 8},
             mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=2, hc_sinkhorn_iters=3,
             sliding_window=6, o_groups=2, o_lora_rank=8, index_n_heads=4, index_head_dim=8,
             index_topk=2, pad_token_id=0)  # fmt: skip

_CROSSES = ("a `min(window, band) - 1`-token halo of the shared K = V; compressed layers also a "
            "`ratio - 1` (HCA) or `2 * ratio - 1` (CSA, and its indexer) token halo of "
            "`[kv | gate]` and all-gathers of `ceil(L / ratio)` pooled vectors per "
            "rank")  # fmt: skip
FAMILIES = (Family.of("deepseek_v4", "DeepSeek-V4", "DeepseekV4Model", _TINY, _CROSSES,
                      DeepseekV4Attention=DeepseekV4AttentionAdapter),)
