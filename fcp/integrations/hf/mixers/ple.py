"""Per-Layer Embeddings (PLE: Qwen4-Exp's ``Qwen4ExpTextPLELayer``) on packed documents, exact
under contiguous CP.

A PLE layer adds to the hyper-connection streams ``h [B, L, hc * D]`` hashed n-gram embeddings of
the token ids, gated per stream, plus a dilated causal conv of them::

    ids  = fcp_ngram_ids(input_ids, ctx)          # [B, L, ngram_heads] rows of the hashed table
    e    = ngram_embedding(ids).flatten(-2)       # [B, L, ple_embed_dim]
    g    = <norm_key(key_proj(e)), norm_query(h)>_stream / sqrt(D)   # per stream, signed sqrt
    y    = sigmoid(g) * value_proj(e)             # [B, L, hc * D]
    out  = y + short_conv(norm_conv(y), conv1d, ctx, "silu", dilation=ngram_size)

Only two steps look at other tokens, and both stay inside the document:

* the n-gram ids read, for each token, the previous ``ngram_size - 1`` token ids of the **same
  document** (the operator :func:`fcp.ops.token_history.token_history`).
  transformers fills the history with the end-of-sequence id before a sequence starts and after
  every end-of-sequence token; fcp does the same at every document start and after every
  end-of-sequence token inside a document. Under CP the operator brings the previous
  ``ngram_size - 1`` ids from the previous rank(s) (no gradient);
* the conv (``fcp.short_conv(dilation=)``): a ``(width - 1) * dilation`` token halo.

The gating is per token (the arithmetic of transformers' ``forward``, written out because its
n-gram and conv steps take no context); the hashing reads the embedding module's own buffers
(``layer_multipliers``, ``ngram_heads_vocab_sizes``, ``ngram_heads_offsets``).

The layer's decoder calls it positionally, without ``cp_context`` (``self.ple(h, ids, cache,
conv_mask=...)``): under a context the decoder layer's adapter calls it as
``ple(h, input_ids=ids, cp_context=ctx)`` (:mod:`fcp.integrations.hf.families.qwen4_exp`), and the
guard (:mod:`fcp.integrations.hf.core`) makes a call without the context raise.
"""

from __future__ import annotations

import math

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.ops.conv import short_conv
from fcp.ops.token_history import token_history

__all__ = ["PleMixer", "hashed_ngram_ids"]


def hashed_ngram_ids(history: torch.Tensor, multipliers: torch.Tensor, vocab_sizes: torch.Tensor,
                     offsets: torch.Tensor, heads_per_ngram: int) -> torch.Tensor:  # fmt: skip
    """int64 ``[B, L, (size - 1) * heads_per_ngram]``: the embedding rows of every n-gram
    (``n = 2 .. size``) and hash head.

    The n-gram ending at a token hashes as ``xor_{s < n} history[..., s] * multipliers[s]``
    (int64, wrapping), then head ``i`` of that order takes it modulo its prime
    ``vocab_sizes[i]`` and adds its table offset ``offsets[i]``.
    """
    mixed = history[..., 0] * multipliers[0]
    out = []
    for n in range(2, history.shape[-1] + 1):
        mixed = torch.bitwise_xor(mixed, history[..., n - 1] * multipliers[n - 1])
        heads = slice((n - 2) * heads_per_ngram, (n - 1) * heads_per_ngram)
        out.append(torch.remainder(mixed[..., None], vocab_sizes[heads]) + offsets[heads])
    return torch.cat(out, -1)


class PleMixer(FcpMixer):
    """A PLE layer (module doc), Qwen4-Exp's attribute names."""

    def fcp_ngram_ids(self, input_ids: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        """int64 ``[B, L, ngram_heads]``: rows of ``ple_embedding.ngram_embedding``."""
        emb = self.ple_embedding
        # transformers restarts the history at a sequence start and after every end-of-sequence
        # token, filling it with that id
        eos = emb.eos_token_id
        history = token_history(input_ids, ctx, emb.ngram_size, fill=eos, reset=eos)
        return hashed_ngram_ids(history, emb.layer_multipliers, emb.ngram_heads_vocab_sizes,
                                emb.ngram_heads_offsets, emb.heads_per_ngram)  # fmt: skip

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, *,
                    input_ids: torch.Tensor, **_) -> torch.Tensor:  # fmt: skip
        """``hidden_states [B, L, hc * D]`` -> the PLE term ``[B, L, hc * D]`` (added by the
        caller); ``input_ids [B, L]``: this rank's token ids."""
        d, hc = self.hidden_size, self.hc_count
        e = self.ple_embedding.ngram_embedding(self.fcp_ngram_ids(input_ids, ctx)).flatten(-2)
        key = self.norm_key(self.key_proj(e)).unflatten(-1, (hc, d))
        query = self.norm_query(hidden_states).unflatten(-1, (hc, d))
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(d)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()  # signed square root
        gated = (torch.sigmoid(gate) * self.value_proj(e).unsqueeze(-2)).flatten(-2)
        conv = short_conv(self.norm_conv(gated), self.conv1d.weight[:, 0, :], self.conv1d.bias,
                          ctx, activation="silu", dilation=self.conv1d.dilation[0])  # fmt: skip
        return gated + conv
