"""Document-causal attention, the definition: query ``t`` attends to the keys ``s <= t`` of its own
(real) document; pad queries give zeros."""

from __future__ import annotations

import torch

from fcp.ops.kit.loops import windowed_rows

__all__ = ["doc_causal_attention_reference"]


def doc_causal_attention_reference(q, k, v, doc_ids, scale=None, *, sinks=None,
                                   softcap=None) -> torch.Tensor:
    """float64 ``[batch, seq, heads, Dv]`` from global ``q [b, seq, H, D]``, ``k``/``v``
    ``[b, seq, Hkv, D|Dv]`` and ``doc_ids [b, seq]``, one query at a time (tests only);
    ``sinks`` and ``softcap`` as :func:`~fcp.ops.kit.loops.windowed_rows`."""
    return windowed_rows(q, k, v, doc_ids, scale, None, sinks, softcap)
