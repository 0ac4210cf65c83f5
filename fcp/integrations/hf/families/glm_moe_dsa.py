"""GLM-5 (transformers' ``glm_moe_dsa``) on fcp: its adapter.

* ``GlmMoeDsaAttention`` -> :class:`GlmMoeDsaAttentionAdapter` (an
  :class:`~..mixers.mla.IndexedMlaMixer`): DeepSeek-V3.2 sparse attention, i.e. MLA with a
  decoupled RoPE key over the tokens a token-level DSA "lightning" indexer selects.

What fcp reads from transformers: the MLA projections (``q_a_proj``, ``q_a_layernorm``,
``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, the sizes
``kv_lora_rank`` / ``qk_nope_head_dim`` / ``qk_rope_head_dim`` / ``v_head_dim``, ``scaling``),
the layer's ``config`` (its RoPE: ``rope_parameters``, ``head_dim = qk_rope_head_dim``), and the
indexer's ``wq_b``, ``wk``, ``k_norm``, ``weights_proj``, ``n_heads``, ``head_dim``,
``index_topk``, ``softmax_scale``.

The indexer (:func:`fcp.ops.token_indexer.token_indexer`, no gradient, as transformers'
``@torch.no_grad`` indexer) scores every earlier token of the query's document with
``sum_h w_h relu(scale * q_h . k)`` on fp32, ``q = wq_b(q_resid)`` per index head and ``k =
LayerNorm(wk x)`` one shared head, both with interleaved RoPE on their first
``qk_rope_head_dim`` channels at document-local positions, ``w = weights_proj(x) * heads**-0.5``;
it is fcp's k-pool indexer with pools of one token (equal scores go to the earlier token).
transformers masks the invisible tokens and takes ``topk(min(index_topk, n))``: for a query
with fewer visible tokens the extra picks are future tokens its causal mask drops, so the
attended set is the same.

Selection shared across layers: ``config.indexer_types[i] == "shared"`` layers have no
indexer and reuse the ``topk_indices`` of the layer before (every layer returns the selection
it used, so a run of shared layers reuses the last ``"full"`` layer's); the first layer must be
``"full"``. Under CP the ids are global positions, the same on every rank's view.

Attention: the query ``[q_nope | rope(q_rope)]`` attends (softmax ``scaling``) only to its
selected tokens, keys ``[kv_b_proj_k(c) | rope(k_rope)]`` with ``k_rope`` shared by the heads,
values ``kv_b_proj_v(c)``: :class:`~..mixers.mla.IndexedMlaMixer`'s forward, whose
:func:`fcp.ops.latent_attention.latent_attention` takes the rotated ``k_rope`` beside the
latent.

What crosses ranks per layer: an all-gather of ``[c | k_rope]`` (``kv_lora_rank +
qk_rope_head_dim`` per token, DeepSeek's MLA cache entry; never the expanded K/V) and, on
``"full"`` layers, an all-gather of the index keys (``index_head_dim`` per token). Everything
else (MoE, norms, the dense MLPs) is per token and stays transformers' code.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import IndexedMlaMixer
from fcp.integrations.hf.rope import apply_rope_interleaved, rope_frequencies, rope_tables
from fcp.ops.token_indexer import token_indexer

__all__ = ["FAMILIES", "GlmMoeDsaAttentionAdapter"]


def _rotate_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the first ``R = cos.shape[-1]`` channels of ``x [B, L, H, D]`` (the
    indexer's layout: rotated channels first, the rest pass through)."""
    r = cos.shape[-1]
    return torch.cat([apply_rope_interleaved(x[..., :r], cos, sin), x[..., r:]], -1)


class GlmMoeDsaAttentionAdapter(IndexedMlaMixer):
    """GLM-5's DSA attention (module doc): MLA with interleaved RoPE on its
    ``qk_rope_head_dim`` channels (queries' last, the shared ``k_rope``) at document-local
    positions, over a token-level indexer's selection, shared by ``"shared"`` layers."""

    @classmethod
    def fcp_check(cls, module) -> None:
        rope_frequencies(module.config)  # refuses RoPE types that rescale with the length
        if module.attention_dropout:  # transformers drops attention weights in training
            raise NotImplementedError(f"{type(module).__name__}: attention dropout "
                                      f"({module.attention_dropout}) is not supported")  # fmt: skip
        ix = module.indexer
        if ix is not None and ix.head_dim < ix.qk_rope_head_dim:
            raise NotImplementedError(f"{type(module).__name__}: index_head_dim={ix.head_dim} < "
                                      f"qk_rope_head_dim={ix.qk_rope_head_dim}")  # fmt: skip

    def fcp_rotate(self, q: torch.Tensor, k_rope: torch.Tensor, ctx: PackedContext):
        if not self.qk_rope_head_dim:
            return q, k_rope
        cos, sin = rope_tables(self.config, ctx.local_position_ids, q.dtype)
        nope = self.qk_nope_head_dim
        q = torch.cat([q[..., :nope], apply_rope_interleaved(q[..., nope:], cos, sin)], -1)
        return q, apply_rope_interleaved(k_rope[:, :, None], cos, sin)[:, :, 0]

    def fcp_select(self, x: torch.Tensor, q_resid: torch.Tensor, ctx: PackedContext):
        """int64 global token ids ``[B, L, index_topk]`` (-1: none) from the indexer's
        projections, RoPE'd at document-local positions."""
        ix = self.indexer
        with torch.no_grad():
            b, n, _ = x.shape
            index_q = ix.wq_b(q_resid).view(b, n, ix.n_heads, ix.head_dim)
            index_k = ix.k_norm(ix.wk(x))
            if ix.qk_rope_head_dim:
                cos, sin = rope_tables(self.config, ctx.local_position_ids, index_q.dtype)
                index_q = _rotate_first(index_q, cos, sin)
                index_k = _rotate_first(index_k[:, :, None], cos, sin)[:, :, 0]
            # weights_proj is kept in fp32 by transformers (_keep_in_fp32_modules): its input too
            weights = ix.weights_proj(x.to(ix.weights_proj.weight.dtype)).float()
            return token_indexer(index_q, index_k, weights * ix.n_heads**-0.5, ctx,
                                 topk=ix.index_topk, scale=ix.softmax_scale)  # fmt: skip


#: MLA with query LoRA 16, kv latent 16, interleaved RoPE on 4 of 12 query/key channels per
#: head; the indexer: 2 heads of 8 (RoPE on the first 4), top 4 tokens, its selection shared by
#: the middle layer; a dense MLP then MoE (4 experts, top 2, a shared expert).
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
             num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
             n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
             first_k_dense_replace=1, index_topk=4, index_head_dim=8, index_n_heads=2,
             indexer_types=["full", "shared", "full"], rope_theta=10000.0, pad_token_id=0,
             eos_token_id=2)  # fmt: skip

_CROSSES = ("DSA MLA: an all-gather of the KV latent with its RoPE key (`kv_lora_rank + "
            "qk_rope_head_dim` per token) and, on layers with an indexer, of the index keys "
            "(`index_head_dim` per token)")  # fmt: skip
FAMILIES = (Family.of("glm_moe_dsa", "GLM-5", "GlmMoeDsaModel", _TINY, _CROSSES,
                      GlmMoeDsaAttention=GlmMoeDsaAttentionAdapter),)  # fmt: skip
