"""Grouped-query softmax attention (Qwen3-Next's gated ``Qwen3NextAttention``, Qwen3.5's,
OLMo-Hybrid's, LFM2's, and the attention layers of the Mamba2 hybrids Nemotron-H, Granite 4.0-H,
Falcon-H1 and Bamba) on fcp's operators.

``fcp_forward(hidden_states [B, L, D], ctx) -> (out [B, L, D], None)``::

    q, k, v, gate = fcp_qkv(x)           # [B, L, H, Dh], [B, L, Hkv, Dh] x 2, [B, L, H * Dh] | None
    q, k = fcp_rotate_qk(q, k, ctx)      # RoPE at document-local positions (.rope)
    o = fcp_attend(q, k, v, x, ctx)      # causal within each document, scale self.scaling,
                                         # over fcp_window() tokens, with fcp_sinks(x) and
                                         # fcp_softcap() where the layer has them
    out = fcp_attention_output(o, gate)  # o * sigmoid(gate) if gated, then o_proj

``fcp_qkv`` defaults to the Llama layout (``q_proj`` / ``k_proj`` / ``v_proj`` split into heads of
``head_dim``, no norm, no gate); an adapter overrides it where the model differs (per-head or
full-width q/k norms, a fused output gate, a key multiplier). ``fcp_rotate_qk`` computes the
tables from the mixer's own ``config`` (partial rotary: the first ``int(head_dim *
partial_rotary_factor)`` channels); where ``fcp_uses_rope(config)`` is false (NoPE: Nemotron-H,
Granite 4.0-H without ``position_embedding_type="rope"``, OLMo-Hybrid without ``rope_theta``) it
returns ``q, k``. ``fcp_attend`` is
:func:`fcp.ops.doc_causal.doc_causal_attention` (under CP: an all-gather of K/V), or, where
``fcp_window()`` is a window (transformers' ``self.sliding_window``, set on sliding layers),
:func:`fcp.ops.sliding_window.sliding_window_attention` (under CP: a left halo of ``window - 1``
tokens' K/V); both with the layer's attention sinks (``fcp_sinks(x)``: ``self.sinks``, gpt-oss
style, ``[H]``) and soft-capping (``fcp_softcap()``: ``self.attn_logit_softcapping``) when it has
them. A sparse attention (Qwen4-Exp's QSA selection) overrides ``fcp_attend``. The ``position_embeddings`` transformers
passes (computed at row positions) are ignored. The steps' contracts: :class:`~.protocols.GqaSteps`.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.rope import apply_rope, rope_frequencies, rope_tables
from fcp.ops.doc_causal import doc_causal_attention
from fcp.ops.sliding_window import sliding_window_attention

__all__ = ["GqaMixer"]


class GqaMixer(FcpMixer):
    """Causal GQA attention with RoPE (or none) at document-local positions (module doc)."""

    @classmethod
    def fcp_check(cls, module) -> None:
        if cls.fcp_uses_rope(module.config):
            rope_frequencies(module.config)  # a rope type fcp cannot apply raises now, not mid-step

    @staticmethod
    def fcp_uses_rope(config) -> bool:
        """Whether the layer rotates q and k (``False``: NoPE)."""
        return True

    def fcp_qkv(self, x: torch.Tensor):
        """``(q [B, L, H, Dh], k [B, L, Hkv, Dh], v [B, L, Hkv, Dh], gate [B, L, H * Dh] | None)``,
        q and k normalised as the model does."""
        shape = (*x.shape[:2], -1, self.head_dim)
        q, k, v = (proj(x).view(shape) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return q, k, v, None

    def fcp_rotate_qk(self, q: torch.Tensor, k: torch.Tensor, ctx: PackedContext):
        if not self.fcp_uses_rope(self.config):
            return q, k
        cos, sin = rope_tables(self.config, ctx.local_position_ids, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def fcp_window(self) -> int | None:
        """The sliding window (a query sees itself and ``window - 1`` earlier tokens) or
        ``None`` (the whole document): transformers' ``self.sliding_window``."""
        return getattr(self, "sliding_window", None)

    def fcp_sinks(self, x: torch.Tensor) -> torch.Tensor | None:
        """Attention-sink logits ``[H]`` or ``[B, L, H]`` (``x [B, L, D]``, for sinks projected
        from it) or ``None``: transformers' ``self.sinks``."""
        return getattr(self, "sinks", None)

    def fcp_softcap(self) -> float | None:
        """Soft-capping of the scaled scores or ``None``: ``self.attn_logit_softcapping``."""
        return getattr(self, "attn_logit_softcapping", None)

    def fcp_attend(self, q, k, v, x: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        """``[B, L, H, Dh]``: softmax attention to the earlier tokens of each query's document
        (the last ``fcp_window()`` of them, if set)."""
        window, sinks, softcap = self.fcp_window(), self.fcp_sinks(x), self.fcp_softcap()
        if window is None:
            return doc_causal_attention(q, k, v, ctx, scale=self.scaling, sinks=sinks,
                                        softcap=softcap)  # fmt: skip
        return sliding_window_attention(q, k, v, ctx, window, scale=self.scaling, sinks=sinks,
                                        softcap=softcap)  # fmt: skip

    def fcp_attention_output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, **_):
        q, k, v, gate = self.fcp_qkv(hidden_states)
        q, k = self.fcp_rotate_qk(q, k, ctx)
        o = self.fcp_attend(q, k, v, hidden_states, ctx)
        return self.fcp_attention_output(o.flatten(2), gate), None
