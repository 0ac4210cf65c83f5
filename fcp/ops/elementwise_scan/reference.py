"""The elementwise scan, the definition: the per-token recurrence in float64 (tests only).

Per channel, with a scalar state ``h`` that restarts at zero at every document start::

    h_t = a_t * h_{t-1} + x_t          (h_t = x_t at a run's first token)

This is transformers' ``RecurrentGemmaRglru._rnn_scan`` (its ``recurrent_gate * ~reset``) and
the diagonal special case of :mod:`fcp.ops.gla.reference` (``K = V = 1`` per channel, ``a`` not
in log space). Every backend of :func:`fcp.ops.elementwise_scan.elementwise_scan` computes
this; the tests compare them with :func:`elementwise_scan_reference`. O(sequence) Python steps:
the specification and test oracle, never a model's path.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.layout import document_starts
from fcp.ops.elementwise_scan import check_elementwise_scan_inputs
from fcp.ops.kit.loops import reference_doc_ids

__all__ = ["elementwise_scan_reference"]


def elementwise_scan_reference(x: torch.Tensor, a: torch.Tensor,
                               ctx: PackedContext | torch.Tensor) -> torch.Tensor:
    """Single-process :func:`fcp.ops.elementwise_scan.elementwise_scan` by the per-token loop in
    float64, the state reset (``torch.where``: exact whatever it holds) at every document start
    and at the pad tail.

    Same shapes as :func:`~fcp.ops.elementwise_scan.elementwise_scan`; ``ctx`` is a non-CP
    :class:`~fcp.context.PackedContext` or directly the int64 doc-id map ``[batch, seq]``.
    Differentiable by autograd; returns ``x``'s dtype.

    >>> x = torch.tensor([1.0, 1.0, 1.0]).view(1, 3, 1)
    >>> elementwise_scan_reference(x, 0.5 * torch.ones_like(x), torch.tensor([[1, 1, 2]])).flatten()
    tensor([1.0000, 1.5000, 1.0000])
    """
    doc_ids = reference_doc_ids(ctx, "elementwise_scan_reference")
    check_elementwise_scan_inputs(x, a, doc_ids.shape[1], doc_ids.shape[0])
    starts = document_starts(doc_ids)
    xd, ad = x.double(), a.double()
    h = xd.new_zeros(xd[:, 0].shape)
    out = []
    for t in range(x.shape[1]):
        restart = starts[:, t].view(-1, *([1] * (h.dim() - 1)))
        h = torch.where(restart, 0.0, ad[:, t] * h) + xd[:, t]
        out.append(h)
    return torch.stack(out, 1).to(x.dtype)
