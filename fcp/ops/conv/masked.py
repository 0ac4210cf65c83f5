"""The short conv's exact static-shape path (``backend="masked"``): document-masked taps.

``y[t] = act(bias + sum_i weight[:, i] * x[t - (W-1-i) * dilation])`` over the taps whose token
lies in ``t``'s own document. Under CP the ``(W - 1) * dilation`` tokens before a shard come from
:func:`fcp.comm.left_halo` (several ranks back when a shard is shorter than that), and the
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

__all__ = ["ACTIVATIONS", "check_conv_inputs", "short_conv_masked"]

ACTIVATIONS = (None, "silu", "swish")


def check_conv_inputs(x, weight, bias, context: PackedContext, activation, dilation=1) -> None:
    """Arguments of :func:`fcp.ops.conv.short_conv` (``ValueError``/``TypeError`` naming them)."""
    if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1:
        raise ValueError(f"dilation must be a positive int, got {dilation!r}")
    if not isinstance(context, PackedContext):
        raise TypeError(f"context must be a PackedContext, got {type(context).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be [batch, local_seq, channels], got {shape}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be [channels, width], got {getattr(weight, 'shape', weight)}")
    channels, width = weight.shape
    if x.shape[-1] != channels or width < 1:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x channels {x.shape[-1]}")
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"bias must be [{channels}], got {tuple(bias.shape)}")
    if x.shape[0] != context.batch_size or x.shape[1] != context.local_seq_len:
        raise ValueError(
            f"x is [batch={x.shape[0]}, local_seq={x.shape[1]}] but the context has batch "
            f"{context.batch_size} and local_seq_len {context.local_seq_len}"
        )


def short_conv_masked(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    context: PackedContext,
    activation: str | None = None,
    dilation: int = 1,
) -> torch.Tensor:
    """The ``"masked"`` backend of :func:`fcp.ops.conv.short_conv` (arguments checked there).

    Guarantees: exact (fp32 accumulation); every tap of another document is *selected away*
    (``torch.where``), so documents are bitwise independent and non-finite values stay in their
    document, forward and backward; deterministic; sync-free, static shapes.
    """
    width = weight.shape[1]
    history = (width - 1) * dilation
    xx = torch.cat([left_halo(x, context, history), x], 1).float()
    # halo + shard doc ids; positions before the global start match no token
    start, length = context.seq_start - history, history + context.local_seq_len
    doc = doc_ids_window(context.doc_ids, start, length)
    own = doc[:, history:]
    w = weight.float()
    out = x.new_zeros(x.shape, dtype=torch.float32)
    length = x.shape[1]
    for i in range(width):  # static taps (width ~4): vectorised over tokens and channels
        j = i * dilation  # tap i reads token t - (width - 1 - i) * dilation
        same = (doc[:, j : j + length] == own).unsqueeze(-1)
        out = out + torch.where(same, xx[:, j : j + length], 0.0) * w[:, i]
    if bias is not None:
        out = out + bias.float()
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)
