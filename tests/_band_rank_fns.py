"""Per-rank job of the band tests (importable by RankPool): one operator under several
``(band, query_chunk)`` settings on the same rank, every result returned for comparison.

Operators: ``"doc_causal"``, ``"compressed"`` (forward and q/k/v gradients) and ``"kpool"``,
``"qsa"`` (selected ids), all from ``tests/_attention_rank_fns.py``.
"""

from __future__ import annotations

from fcp.context import PackedContext
from tests import _attention_rank_fns as attention_fns

ATTENTION = ("doc_causal", "compressed")
INDEXERS = ("kpool", "qsa")


def band_variants(env, name, inputs, doc_ids, kw, grad_out, settings):
    """``[result per (band, query_chunk) in settings]`` of ``name`` on this rank."""
    out = []
    for band, chunk in settings:
        ctx = PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank,
                            band=band)  # fmt: skip
        opts = dict(kw) if chunk is None else dict(kw, query_chunk=chunk)
        out.append(attention_fns.run_in(name, inputs, ctx, opts, grad_out))
    return out
