"""Token history, the definition (tests only).

For token ``t`` of a real document and ``s = 1 .. size - 1``, column ``s`` is ``tokens[t - s]``
when ``t - s`` is in ``t``'s document and none of ``tokens[t - s + 1 .. t - 1]`` is the reset id;
otherwise ``fill``. Column 0 is ``tokens[t]`` for every token; a pad token's other columns are
``fill``. Evaluated one token at a time with Python loops (slow, obviously correct).
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.layout import PAD_DOC_ID
from fcp.ops.kit.loops import reference_doc_ids

__all__ = ["token_history_reference"]


def token_history_reference(tokens: torch.Tensor, ctx: PackedContext | torch.Tensor, size: int, *,
                            fill: int, reset: int | None = None) -> torch.Tensor:  # fmt: skip
    """int64 ``[batch, seq, size]`` from global ``tokens [batch, seq]`` and a single-process
    context (or the doc-id map ``[batch, seq]``) in one process.

    >>> token_history_reference(torch.tensor([[4, 5, 6]]), torch.tensor([[1, 1, 2]]), 2, fill=0)
    tensor([[[4, 0],
             [5, 4],
             [6, 0]]])
    """
    doc_ids = reference_doc_ids(ctx, "token_history_reference")
    batch, seq = doc_ids.shape
    out = torch.full((batch, seq, size), fill, dtype=torch.int64)
    for b in range(batch):
        doc, ids = doc_ids[b].tolist(), tokens[b].tolist()
        for t in range(seq):
            out[b, t, 0] = ids[t]
            for s in range(1, size if doc[t] != PAD_DOC_ID else 1):
                if t - s < 0 or doc[t - s] != doc[t] or (s > 1 and ids[t - s + 1] == reset):
                    break
                out[b, t, s] = ids[t - s]
    return out
