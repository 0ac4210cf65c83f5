"""The elementwise scan's exact static-shape PyTorch path: a log-depth scan over the tokens,
documents reset exactly, exact under CP.

:func:`elementwise_scan_tree` evaluates :mod:`fcp.ops.elementwise_scan.reference`'s recurrence
``h_t = a_t h_{t-1} + x_t`` with every token a step of :func:`fcp.scan.decay_scan` (the affine
maps ``h -> a_t h + x_t`` composed by an up- and a down-sweep: ``2 log2(L)`` passes, no Python
loop over the tokens, so a compiled graph does not grow with the sequence length; the hand-
written backward is the reverse scan of the same tree).

How it stays exact and static:

* A run start (document or pad tail, from the replicated global map) gets the decay ``0``
  (``torch.where``, whatever ``a`` holds there): the composed maps then carry exact zeros
  across it, so no value of another document reaches a token except multiplied by an exact 0,
  and the state restarts at ``x_t``. A document's outputs are bitwise independent of the values
  of every other document (its operations and their order depend on positions only).
* fp32 products and sums (fp64 for fp64 inputs), the output cast to ``x``'s dtype once.
* Under CP, each channel's shard is the map ``h_out = m h_in + h_0`` (``m``: the product of the
  shard's decays, an exact 0 if a run starts inside it; ``h_0``: the state reached from zero).
  The scan runs on the augmented state ``[h | p]`` from ``[0 | 1]`` (inputs ``[x | 0]``): ``p_t``
  is how token ``t`` responds to the state entering the shard (the product of the decays up to
  it, an exact 0 after the shard's first run start) and the final ``p`` is ``m``, in the same
  pass. :func:`~fcp.ops.kit.recurrence.entering_state` (:func:`fcp.comm.state_chain` over the
  ``[1, 1]`` maps of every channel) hands each rank ``h_in``; then ``h_t += p_t h_in``.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.layout import document_starts
from fcp.ops.kit.common import compute_dtype
from fcp.ops.kit.recurrence import entering_state
from fcp.scan import decay_scan

__all__ = ["elementwise_scan_tree"]


def elementwise_scan_tree(x: torch.Tensor, a: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
    """The ``"tree"`` backend of :func:`fcp.ops.elementwise_scan.elementwise_scan` (same
    arguments, checked there).

    Guarantees: exact to fp32 rounding (fp64 for fp64 inputs); a document's outputs are bitwise
    independent of the values outside it; deterministic; no host synchronisation and no
    data-dependent shapes (a new packing never recompiles). Under CP, one
    :func:`~fcp.comm.state_chain` all-gather of fp32 ``[batch, channels, 1, 2]`` per call.
    """
    bsz, length = x.shape[:2]
    dt = compute_dtype(x, a)
    xs = x.reshape(bsz, length, -1).to(dt)  # [B, L, C]
    starts = document_starts(ctx.doc_ids)[:, ctx.seq_start : ctx.seq_end, None]  # [B, L, 1]
    dec = torch.where(starts, 0.0, a.reshape(bsz, length, -1).to(dt))[..., None]  # [B, L, C, 1]
    if ctx.cp_enabled:
        # the augmented state [h | p] from [0 | 1]: p is the response to the entering state
        b = torch.stack([xs, torch.zeros_like(xs)], -1)  # [B, L, C, 2]
        s0 = torch.stack([xs.new_zeros(bsz, xs.shape[2]), xs.new_ones(bsz, xs.shape[2])], -1)
    else:
        b, s0 = xs[..., None], None  # [B, L, C, 1], zero
    # decay_scan's states are the ones *entering* each token: h_t is the next one (the final
    # state for the last token)
    states, final = decay_scan(dec, b, s0)
    h = torch.cat([states[:, 1:], final[:, None]], 1)  # [B, L, C, 1 or 2]
    if ctx.cp_enabled:
        h_in = entering_state(final[..., 1], final[..., None, :1], ctx)  # [B, C, 1, 1], fp32
        h = torch.addcmul(h[..., 0], h[..., 1], h_in[:, None, :, 0, 0].to(dt))
    else:
        h = h[..., 0]
    return h.reshape(x.shape).to(x.dtype)
