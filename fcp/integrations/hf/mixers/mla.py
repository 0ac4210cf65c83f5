"""Multi-head latent attention (MLA) on fcp's operators: Kimi-Linear's full NoPE MLA
(``KimiLinearAttention``), Bailing-Hybrid's full MLA with RoPE (``BailingHybridAttention``) and
GLM-5.3-Flash's k-pool DSA indexed MLA (``Glm5NextTextAttention``).

Both read the DeepSeek attribute names (``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``scaling``).

:class:`MlaMixer` ``fcp_forward(hidden_states [B, L, D], ctx) -> (out, None)``::

    q, _ = fcp_query(x)                        # [B, L, H, nope + rope]
    latent, k_rope = fcp_latent(x)             # [B, L, kv_lora_rank] (normed), [B, L, rope]
    q, k_rope = fcp_rotate(q, k_rope, ctx)     # NoPE: unchanged (a RoPE model rotates here)
    k, v = fcp_expand(latent, k_rope)          # per head; k = [k_nope | k_rope shared]
    o = doc_causal_attention(q, k, v, ctx)     # under CP: an all-gather of the expanded K/V
    out = fcp_output(o, x)                     # o_proj (Bailing-Hybrid: its head-wise gate first)

:class:`IndexedMlaMixer` ``-> (out, None, topk or None)`` (transformers' return): the k-pool
indexer (:func:`fcp.ops.kpool_indexer.kpool_indexer`, no gradient) selects global token ids, or
a previous layer's selection is reused on "shared" layers, and
:func:`fcp.ops.latent_attention.latent_attention` attends to exactly those tokens, its keys and
values expanded with ``kv_b_proj`` from the latent (under CP the latent, ``kv_lora_rank`` per
token, is what crosses ranks, never the expanded K/V).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.ops.doc_causal import doc_causal_attention
from fcp.ops.kpool_indexer import kpool_indexer
from fcp.ops.latent_attention import latent_attention

__all__ = ["IndexedMlaMixer", "MlaMixer"]


class MlaMixer(FcpMixer):
    """Full causal MLA within each document (module doc)."""

    def fcp_query(self, x: torch.Tensor):
        """``(q [B, L, H, qk_head_dim], q_resid)``: ``q_resid`` is the normed query latent
        ``[B, L, q_lora_rank]`` (``None`` without query LoRA), which a DSA indexer reads."""
        if self.q_lora_rank is None:
            q, q_resid = self.q_proj(x), None
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        return q.view(*x.shape[:2], -1, self.qk_head_dim), q_resid

    def fcp_latent(self, x: torch.Tensor):
        """``(latent [B, L, kv_lora_rank], k_rope [B, L, qk_rope_head_dim])``, latent normed."""
        sizes = [self.kv_lora_rank, self.qk_rope_head_dim]
        latent, k_rope = torch.split(self.kv_a_proj_with_mqa(x), sizes, dim=-1)
        return self.kv_a_layernorm(latent), k_rope

    def fcp_rotate(self, q: torch.Tensor, k_rope: torch.Tensor, ctx: PackedContext):
        """Positions on ``q[..., qk_nope_head_dim:]`` and ``k_rope``: none (NoPE)."""
        return q, k_rope

    def fcp_expand(self, latent: torch.Tensor, k_rope: torch.Tensor | None):
        """Per-head ``(k [B, S, H, qk_head_dim], v [B, S, H, v_head_dim])`` from the latent."""
        b, s, _ = latent.shape
        kv = self.kv_b_proj(latent).view(b, s, -1, self.qk_nope_head_dim + self.v_head_dim)
        k, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        if k_rope is not None:
            k = torch.cat([k, k_rope[:, :, None].expand(-1, -1, k.shape[2], -1)], -1)
        return k, v

    def fcp_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``o [B, L, H, v_head_dim]`` -> ``[B, L, D]``."""
        return self.o_proj(o.flatten(2))

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, **_):
        q, _ = self.fcp_query(hidden_states)
        latent, k_rope = self.fcp_latent(hidden_states)
        q, k_rope = self.fcp_rotate(q, k_rope, ctx)
        k, v = self.fcp_expand(latent, k_rope)
        o = doc_causal_attention(q, k, v, ctx, scale=self.scaling)
        return self.fcp_output(o, hidden_states), None


class IndexedMlaMixer(MlaMixer):
    """DSA: MLA over the tokens a k-pool indexer selects, top-k shared across layers (module
    doc). NoPE (``qk_rope_head_dim == 0``, GLM-5.3-Flash) unless an adapter rotates
    (``fcp_rotate``: GLM-5's, whose rotary key then travels beside the latent)."""

    @classmethod
    def fcp_check(cls, module) -> None:
        if module.qk_rope_head_dim:
            raise NotImplementedError(f"{type(module).__name__}: fcp's indexed MLA is NoPE "
                                      f"(qk_rope_head_dim == 0), got "
                                      f"{module.qk_rope_head_dim}")  # fmt: skip

    def fcp_select(self, x: torch.Tensor, q_resid: torch.Tensor, ctx: PackedContext):
        """int64 global token ids ``[B, L, W]`` (-1: none) from the DSA indexer's projections
        (``wq_b``, ``wk``, ``k_norm``, ``weights_proj``, the k-pool gate and position terms)."""
        ix = self.indexer
        with torch.no_grad():
            b, n, _ = x.shape
            index_q = ix.wq_b(q_resid).view(b, n, ix.n_heads, ix.head_dim)
            index_k = ix.k_norm(ix.wk(x))
            gate = F.linear(x, ix.index_kpool_compress_gate)
            weights = ix.weights_proj(x).float() * ix.n_heads**-0.5
            return kpool_indexer(index_q, index_k, gate, ix.index_kpool_compress_ape, weights, ctx,
                                 topk=ix.index_topk, kpool=ix.index_kpool,
                                 select_tail=ix.index_kpool_always_select_tail,
                                 scale=ix.softmax_scale)  # fmt: skip

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, *,
                    prev_topk_indices=None, **_):  # fmt: skip
        q, q_resid = self.fcp_query(hidden_states)
        latent, k_rope = self.fcp_latent(hidden_states)
        q, k_rope = self.fcp_rotate(q, k_rope, ctx)
        if self.indexer is not None:
            topk = self.fcp_select(hidden_states, q_resid, ctx)
        elif prev_topk_indices is None:
            raise ValueError("Shared DSA layers require top-k indices from a previous full "
                             "indexer layer.")  # fmt: skip
        else:
            topk = prev_topk_indices
        # the operator all-gathers the latent (and the rotary key shared by the heads) and
        # expands it with kv_b_proj (fcp_expand's arithmetic, per head keys then values)
        o = latent_attention(q, latent, self.kv_b_proj.weight, topk, ctx,
                             kv_bias=self.kv_b_proj.bias,
                             k_rope=k_rope if self.qk_rope_head_dim else None,
                             scale=self.scaling)  # fmt: skip
        # the selection a "shared" next layer reuses: GLM-5.3-Flash hands it on where its
        # layer says so (next_skip_topk), GLM-5's layers always do
        hand_on = getattr(self, "next_skip_topk", True)
        return self.fcp_output(o, hidden_states), None, topk if hand_on else None
