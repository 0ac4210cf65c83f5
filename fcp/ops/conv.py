"""Document-masked short causal convolution (the KDA q/k/v pre-mixer), exact under contiguous CP.

``y[t] = act(bias + sum_i weight[:, i] * x[t - (W-1) + i])`` over the taps whose token lies in
``t``'s own document. Under CP the ``W - 1`` tokens before a shard come from
:func:`fcp.comm.left_halo` (several ranks back when a shard is shorter than ``W - 1``), and the
replicated doc-id map masks them, so no state crosses a document boundary, padding included.

Parameter gradients (``weight``, ``bias``) are per-rank partial sums under CP, the usual contract:
the data-parallel gradient reduction over the CP ranks sums them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fcp.comm import left_halo
from fcp.context import PackedContext
from fcp.layout import doc_ids_window

__all__ = ["short_conv", "short_conv_reference"]

_ACTIVATIONS = (None, "silu", "swish")


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    context: PackedContext,
    activation: str | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d that never mixes two documents.

    Args:
        x: ``[batch, local_seq, channels]``, this rank's shard (any float dtype).
        weight: ``[channels, width]``; ``weight[:, -1]`` multiplies the current token (the layout
            of ``nn.Conv1d(groups=channels).weight[:, 0]`` and FLA's ``causal_conv1d``).
        bias: ``[channels]`` or ``None``.
        context: the rank's :class:`~fcp.context.PackedContext`.
        activation: ``None`` or ``"silu"`` (``"swish"`` is accepted as an alias).

    Returns:
        ``[batch, local_seq, channels]`` in ``x``'s dtype, accumulated in fp32.

    Example (width 2, weight ``[[1, 1]]``, no bias): ``x = [1, 2, 3]`` with doc ids
    ``[1, 1, 2]`` gives ``[1, 3, 3]``: the third token starts document 2 and sees only itself.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if x.dim() != 3:
        raise ValueError(f"x must be [batch, local_seq, channels], got shape {tuple(x.shape)}")
    channels, width = weight.shape
    if x.shape[-1] != channels:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x channels {x.shape[-1]}")
    if x.shape[0] != context.batch_size:
        raise ValueError(f"x batch {x.shape[0]} != context batch {context.batch_size}")
    history = width - 1
    xx = torch.cat([left_halo(x, context, history), x], 1).float()
    # halo + shard doc ids; positions before the global start match no token
    start, length = context.seq_start - history, history + context.local_seq_len
    doc = doc_ids_window(context.doc_ids, start, length)
    own = doc[:, history:]
    w = weight.float()
    out = x.new_zeros(x.shape, dtype=torch.float32)
    length = x.shape[1]
    for i in range(width):  # static taps (width ~4): vectorised over tokens and channels
        same = (doc[:, i : i + length] == own).unsqueeze(-1)
        out = out + torch.where(same, xx[:, i : i + length], 0.0) * w[:, i]
    if bias is not None:
        out = out + bias.float()
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)


def short_conv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    doc_ids: torch.Tensor,
    activation: str | None = None,
) -> torch.Tensor:
    """Single-process reference: ``F.conv1d`` run separately on every document of every row.

    ``x`` ``[batch, seq, channels]`` and ``doc_ids`` ``[batch, seq]`` are global. Host-side and
    loops over documents: for tests and benchmarks, never inside a model.
    """
    out = torch.zeros_like(x)
    width = weight.shape[1]
    for b in range(x.shape[0]):
        ids = doc_ids[b]
        starts = torch.nonzero(torch.diff(ids, prepend=ids[:1] - 1)).flatten().tolist()
        ends = starts[1:] + [ids.numel()]
        for s, e in zip(starts, ends):
            seg = x[b, s:e].t().unsqueeze(0)  # [1, C, n]
            y = F.conv1d(F.pad(seg, (width - 1, 0)), weight.unsqueeze(1), bias, groups=x.shape[-1])
            if activation is not None:
                y = F.silu(y)
            out[b, s:e] = y[0].t()
    return out
