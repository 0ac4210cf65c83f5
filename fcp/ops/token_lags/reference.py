"""Token lags, the definition (tests only): for token ``t`` of a real document, entry ``j`` is
``x[t - j]`` when ``t - j`` is in ``t``'s document, else ``fill``; entry 0 is ``x[t]`` for every
token, a pad token's other entries are ``fill``. One token at a time, in float64."""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.layout import PAD_DOC_ID
from fcp.ops.kit.loops import reference_doc_ids

__all__ = ["token_lags_reference"]


def token_lags_reference(x: torch.Tensor, ctx: PackedContext | torch.Tensor, size: int, *,
                         fill: float | torch.Tensor = 0.0) -> torch.Tensor:  # fmt: skip
    """float64 ``[batch, seq, size, channels]`` from global ``x [batch, seq, channels]`` and a
    single-process context (or the doc-id map ``[batch, seq]``).

    >>> token_lags_reference(torch.tensor([[[4.0], [5.0]]]), torch.tensor([[1, 1]]), 2)[..., 0]
    tensor([[[4., 0.],
             [5., 4.]]], dtype=torch.float64)
    """
    doc_ids = reference_doc_ids(ctx, "token_lags_reference")
    batch, seq, channels = x.shape
    fill = torch.as_tensor(fill, dtype=torch.float64).expand(channels)
    out = fill.expand(batch, seq, size, channels).clone()
    for b in range(batch):
        doc = doc_ids[b].tolist()
        for t in range(seq):
            out[b, t, 0] = x[b, t].double()
            for j in range(1, size if doc[t] != PAD_DOC_ID else 1):
                if t - j < 0 or doc[t - j] != doc[t]:
                    break
                out[b, t, j] = x[b, t - j].double()
    return out
