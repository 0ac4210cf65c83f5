"""Checks of the transformers integration that run in the test process (no ranks): a context that
does not reach a mixer, the guard's marks, one attention layer enabled on its own."""

from __future__ import annotations

import torch

import fcp
from fcp.integrations.hf import FcpMixer


def drop_context(module: torch.nn.Module) -> None:
    """Make ``module``'s forward drop its ``cp_context`` (a decoder layer or wrapper that stopped
    forwarding ``**kwargs``); ``del module.forward`` restores it."""
    forward = module.forward
    module.forward = lambda *args, cp_context=None, **kwargs: forward(*args, **kwargs)


def assert_unmarked(model: torch.nn.Module) -> None:
    """No mixer of ``model`` still expects a context (nothing left marked by the guard)."""
    assert all(m.fcp_expected_by == () for m in model.modules() if isinstance(m, FcpMixer))


def check_attention_alone(attn, tables, rows=((13, 5, 8), (22,)), seq: int = 30) -> None:
    """``attn``, one attention layer enabled on its own (no enclosing model, no rotary module),
    on packed rows of random documents of the lengths ``rows`` (padded to ``seq``) equals
    transformers' code on each document alone, to 1e-5: given a causal mask and ``tables(doc,
    positions)``, the RoPE tables at positions ``0 .. n-1`` (or ``None`` for NoPE)."""
    hidden = attn.config.hidden_size
    x = torch.randn(len(rows), seq, hidden, generator=torch.Generator().manual_seed(1))
    width = max(map(len, rows))
    seq_lens = torch.tensor([list(row) + [-1000] * (width - len(row)) for row in rows])
    ctx = fcp.PackedContext(fcp.doc_ids_from_seq_lens(seq_lens, seq))
    with torch.no_grad():
        got = attn(x, position_embeddings=None, attention_mask=None, cp_context=ctx)[0]
        for r, row in enumerate(rows):
            start = 0
            for n in row:
                doc = x[r : r + 1, start : start + n]
                causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
                want = attn(doc, position_embeddings=tables(doc, torch.arange(n)[None]),
                            attention_mask=causal)[0]  # fmt: skip
                torch.testing.assert_close(got[r : r + 1, start : start + n], want,
                                           atol=1e-5, rtol=1e-5)  # fmt: skip
                start += n
