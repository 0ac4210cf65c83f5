"""Rotary position embeddings at document-local positions, from a mixer's own configuration.

A packed document must see the angles it sees alone, so RoPE is applied at
``cp_context.local_position_ids`` (positions restarting at every document start), never at the
row positions transformers computes for the packed row. The tables come from the mixer's own
``config``, exactly as transformers' rotary embedding module of that model computes them (the
same frequencies and ``attention_scaling``; bitwise on CPU), with no reference to the enclosing
model and no new buffer::

    cos, sin = rope_tables(self.config, ctx.local_position_ids, dtype=x.dtype)   # [B, L, R]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)                      # [B, L, H, D]

``R = int(head_dim * partial_rotary_factor)``; the last ``D - R`` channels pass through.
:func:`apply_rope_interleaved` is DeepSeek's pairing (channels ``(0, 1), (2, 3), ...``), used by
Bailing-Hybrid's MLA on its ``qk_rope_head_dim`` channels, with the same tables.

mRoPE (Qwen3.5's 3-D text / height / width positions) takes frequency ``i`` from the position on
axis 0, 1 or 2 (interleaved by ``mrope_section``). For text tokens all three axes carry the same
position, so its tables are exactly these 1-D tables at that position: transformers'
``Qwen3_5TextRotaryEmbedding`` given ``position_ids.expand(3, B, L)`` equals :func:`rope_tables`
bitwise, fp32 and bf16 (``tests/test_hf_qwen35_olmo_bailing.py``). Image and video tokens, whose
axes differ, are not supported under a ``cp_context`` (:mod:`.core` raises on their inputs).
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "apply_rope_interleaved", "rope_frequencies", "rope_tables"]

#: rope types whose frequencies depend on the sequence seen (transformers' ``dynamic_rope_update``)
_SEQUENCE_DEPENDENT = ("dynamic", "longrope")


def rope_frequencies(config, device=None) -> tuple[torch.Tensor, float]:
    """``(inv_freq [R / 2] fp32, attention_scaling)`` of ``config.rope_parameters``.

    ``"default"``: ``1 / theta ** (arange(0, R, 2) / R)``, scaling 1; the scaled types
    (``"linear"``, ``"yarn"``, ``"llama3"``, ...) through transformers' own init functions.
    Traceable: called inside a compiled mixer, it becomes constants of the graph.
    """
    params = config.rope_parameters
    kind = params.get("rope_type", "default")
    if kind in _SEQUENCE_DEPENDENT:
        raise NotImplementedError(f"rope_type={kind!r} rescales with the sequence length; "
                                  "fcp applies RoPE at document-local positions")  # fmt: skip
    if kind == "default":
        head_dim = getattr(config, "head_dim", None)
        head_dim = head_dim or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        exponent = torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[kind](config, device)


def rope_tables(config, positions: torch.Tensor, dtype: torch.dtype):
    """``(cos, sin)`` ``[B, L, R]`` in ``dtype`` (computed in fp32) at int64 ``positions``
    ``[B, L]``, each frequency twice (transformers' ``rotate_half`` layout)."""
    inv_freq, scaling = rope_frequencies(config, positions.device)
    freqs = positions[..., None].float() * inv_freq
    angles = torch.cat([freqs, freqs], -1)
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``R = cos.shape[-1]`` channels of every head of ``x [B, L, H, D]`` (the
    rest pass through), channel ``i < R/2`` paired with ``i + R/2``; ``cos``, ``sin``
    ``[B, L, R]``."""
    r = cos.shape[-1]
    cos, sin = cos[:, :, None], sin[:, :, None]
    rot, rest = x[..., :r], x[..., r:]
    first, second = rot[..., : r // 2], rot[..., r // 2 :]
    return torch.cat([rot * cos + torch.cat([-second, first], -1) * sin, rest], -1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE on all ``R`` channels of ``x [B, L, H, R]``: channel pair ``(2i, 2i + 1)``
    turns by frequency ``i``, and the result is laid out de-interleaved, ``[even' | odd']`` (as
    transformers' ``apply_rotary_pos_emb_interleave`` returns it: queries and keys get the same
    permutation, so their products are those of the interleaved rotation); ``cos``, ``sin``
    ``[B, L, R]`` from :func:`rope_tables` (each frequency twice: the first half is read)."""
    r = x.shape[-1]
    cos, sin = cos[:, :, None, : r // 2], sin[:, :, None, : r // 2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], -1)
