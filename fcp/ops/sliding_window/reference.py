"""Sliding-window attention, the definition: query ``t`` attends to the keys ``t - window < s <= t``
of its own (real) document; pad queries give zeros."""

from __future__ import annotations

import torch

from fcp.ops.kit.loops import windowed_rows

__all__ = ["sliding_window_attention_reference"]


def sliding_window_attention_reference(q, k, v, doc_ids, window: int, scale=None, *, sinks=None,
                                       softcap=None) -> torch.Tensor:  # fmt: skip
    """float64 ``[batch, seq, heads, Dv]`` from global ``q [b, seq, H, D]``, ``k``/``v``
    ``[b, seq, Hkv, D|Dv]`` and ``doc_ids [b, seq]``, one query at a time (tests only);
    ``sinks`` and ``softcap`` as :func:`~fcp.ops.kit.loops.windowed_rows`."""
    return windowed_rows(q, k, v, doc_ids, scale, window, sinks, softcap)
