"""Grouped-query attention over a QSA token selection (Qwen4-Exp's ``Qwen4ExpTextAttention``,
the QSA layers of Qwen3.8-Flash-Next) on fcp's operators.

A :class:`~fcp.integrations.hf.mixers.gqa.GqaMixer` whose ``fcp_attend`` attends only to the
tokens the layer's QSA indexer selects::

    ids = fcp_qsa_select(x, ctx)              # int64 [B, L, budget + ratio - 1] global ids
    o = index_attention(q, k, v, ids, ctx)    # softmax over exactly those tokens, GQA

``fcp_qsa_select`` reads the indexer submodule ``self.indexer`` by Qwen4-Exp's names:
``index_qk_proj`` (``[index_heads * Di | Di]``: the raw index queries and the one index key
head), ``q_layernorm`` / ``k_layernorm`` (zero-centred RMSNorms), ``index_n_heads``,
``index_head_dim``, ``token_budget``, ``compress_ratio``. The RoPE tables are the attention's own
(``rope_tables`` of the layer's config at document-local positions; the index head's first
``R`` channels rotate, ``R = int(head_dim * partial_rotary_factor) <= Di``). The selection is
:func:`fcp.ops.qsa_indexer.qsa_indexer`, whose definition (NeMo's ``qsa.py``) is transformers'
``Qwen4ExpTextQSAIndexer`` on each document alone, step for step: blocks of ``ratio`` tokens
from the document start, the block key the fp32 mean of its raw keys cast back, normed, and
rotated at the block's **first** token; the query normed and rotated at its own position;
scores ``sum_h relu(q_h . k_p) / sqrt(Di)`` in fp32; every complete block while they fit the
budget, else the ``budget // ratio`` best; then the query's incomplete block (the tail).
transformers turns the selection into a boolean mask, fcp into a list of ids; both are sets to
the attention, so the order fcp lists them in does not matter. The one difference is ties at the
cutoff: transformers' ``topk`` leaves their order unspecified, fcp gives equal scores to the
earlier block. No gradient reaches the indexer, in transformers either.

Under CP: the indexer's ``ratio - 1`` token halo of its raw keys and RoPE tables, an
all-gather of ``ceil(L / ratio)`` compressed keys per rank, and the K/V all-gather of
:func:`~fcp.ops.index_attention.index_attention`.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.mixers.gqa import GqaMixer
from fcp.integrations.hf.rope import rope_tables
from fcp.ops.index_attention import index_attention
from fcp.ops.qsa_indexer import qsa_indexer

__all__ = ["QsaGqaMixer"]


class QsaGqaMixer(GqaMixer):
    """GQA attention over a QSA selection (module doc); an adapter defines ``fcp_qkv``."""

    @classmethod
    def fcp_check(cls, module) -> None:
        super().fcp_check(module)
        ix = module.indexer
        if ix.index_kv_heads != 1:
            raise NotImplementedError(f"{type(module).__name__}: fcp's QSA indexer has one index "
                                      f"key head, got {ix.index_kv_heads}")  # fmt: skip
        if ix.q_layernorm.eps != ix.k_layernorm.eps:
            raise NotImplementedError(f"{type(module).__name__}: fcp's QSA indexer norms share "
                                      f"one eps, got {ix.q_layernorm.eps} and "
                                      f"{ix.k_layernorm.eps}")  # fmt: skip

    def fcp_index_inputs(self, x: torch.Tensor, ctx: PackedContext):
        """:func:`~fcp.ops.qsa_indexer.qsa_indexer`'s tensors from ``x [B, L, D]``: raw index
        queries ``[B, L, Hi, Di]`` and keys ``[B, L, Di]``, the two norm weights ``[Di]``, and
        ``cos``, ``sin`` ``[B, L, R/2]`` at document-local positions (no gradient)."""
        ix = self.indexer
        with torch.no_grad():
            b, n, _ = x.shape
            q, k = torch.split(ix.index_qk_proj(x), [ix.index_n_heads * ix.index_head_dim,
                                                     ix.index_head_dim], dim=-1)  # fmt: skip
            cos, sin = rope_tables(self.config, ctx.local_position_ids, x.dtype)  # [B, L, R]
            half = cos.shape[-1] // 2  # the table holds each frequency twice
            return (q.view(b, n, ix.index_n_heads, ix.index_head_dim), k, ix.q_layernorm.weight,
                    ix.k_layernorm.weight, cos[..., :half], sin[..., :half])  # fmt: skip

    def fcp_qsa_select(self, x: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        """int64 ``[B, L, budget + ratio - 1]``: the global token ids each query attends to."""
        ix = self.indexer
        return qsa_indexer(*self.fcp_index_inputs(x, ctx), ctx, budget=ix.token_budget,
                           ratio=ix.compress_ratio, eps=ix.k_layernorm.eps)  # fmt: skip

    def fcp_attend(self, q, k, v, x: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        """``[B, L, H, Dh]``: softmax attention to the selected tokens of each query's document."""
        return index_attention(q, k, v, self.fcp_qsa_select(x, ctx), ctx, scale=self.scaling)
