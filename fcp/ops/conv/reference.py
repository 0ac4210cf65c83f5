"""The short conv's definition: ``F.conv1d`` run separately on every document of every row."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["short_conv_reference"]


def short_conv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         doc_ids: torch.Tensor, activation: str | None = None,
                         dilation: int = 1) -> torch.Tensor:
    """Single-process reference: ``F.conv1d`` run separately on every document of every row.

    ``x`` ``[batch, seq, channels]`` and ``doc_ids`` ``[batch, seq]`` are global; ``weight``
    ``[channels, width]`` (``weight[:, -1]`` multiplies the current token, ``weight[:, i]`` the
    token ``(width - 1 - i) * dilation`` before it). Host-side and loops
    over documents: the specification and test oracle, never inside a model.
    """
    out = torch.zeros_like(x)
    width = weight.shape[1]
    for b in range(x.shape[0]):
        ids = doc_ids[b]
        starts = torch.nonzero(torch.diff(ids, prepend=ids[:1] - 1)).flatten().tolist()
        ends = starts[1:] + [ids.numel()]
        for s, e in zip(starts, ends):
            seg = x[b, s:e].t().unsqueeze(0)  # [1, C, n]
            y = F.conv1d(F.pad(seg, ((width - 1) * dilation, 0)), weight.unsqueeze(1), bias,
                         dilation=dilation, groups=x.shape[-1])
            if activation is not None:
                y = F.silu(y)
            out[b, s:e] = y[0].t()
    return out
