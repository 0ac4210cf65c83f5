"""Gated linear attention with a scalar decay per head, the definition: the per-token
recurrence (tests only).

Per head ``h``, with a ``[K, V]`` state ``S`` that restarts at zero at every document start::

    S_t = exp(a_t) S_{t-1} + k_t v_t^T          # decay, then add (no delta rule)
    o_t = scale * S_t^T q_t

or, with a decay per key dimension (``a [B, T, H, K]``: GLA proper, Mamba1's selective scan),
``S_t = diag(exp(a_t)) S_{t-1} + k_t v_t^T``

where head ``h`` reads the query/key group ``h // (heads // groups)``. This is Mamba2's SSD (state
space duality) with ``q = C``, ``k = B``, ``v = dt * x``, ``a = dt * A`` and ``scale = 1``, and
FLA's ``chunk_simple_gla`` with ``g = a``. Every backend of :func:`fcp.ops.gla.gla` computes
this; the tests compare them with :func:`gla_reference`. O(sequence) Python steps: the
specification and test oracle, never a model's path.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.layout import document_starts
from fcp.ops.gla import check_gla_inputs
from fcp.ops.kit.common import default_scale
from fcp.ops.kit.loops import linear_recurrence, reference_doc_ids

__all__ = ["gla_reference", "gla_recurrence"]


def gla_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                   scale: float, starts: torch.Tensor | None = None,
                   initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B, T, H, V], final state [B, H, K, V])`` of ``S = exp(a_t) S + k_t v_t^T`` from
    ``q, k [B, T, G, K]``, ``v [B, T, H, V]``, ``a [B, T, H]`` (or ``[B, T, H, K]``: ``S =
    diag(exp(a_t)) S + k_t v_t^T``, a decay per key dimension); resets at ``starts``, an optional
    ``initial_state``, the compute dtype: :func:`~fcp.ops.kit.loops.linear_recurrence`."""
    def step(state, k_t, v_t, a_t):
        decay = a_t[..., None].exp() if keyed else a_t[..., None, None].exp()
        return state * decay + k_t[..., :, None] * v_t[..., None, :]

    keyed = a.dim() == 4  # one decay per key dimension: [B, T, H, K]

    return linear_recurrence(q, k, v, (a,), scale, step, starts, initial_state)


def gla_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                  ctx: PackedContext | torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
    """Single-process :func:`fcp.ops.gla.gla` by the per-token recurrence, state reset at every
    document start (and at the pad tail).

    Same shapes and conventions as :func:`fcp.ops.gla.gla` (which see); ``ctx`` is a non-CP
    :class:`~fcp.context.PackedContext` or directly the int64 doc-id map ``[batch, seq]``.
    Computes in fp32 (fp64 for fp64 inputs); returns ``v``'s dtype.
    """
    doc_ids = reference_doc_ids(ctx, "gla_reference")
    check_gla_inputs(q, k, v, a, doc_ids.shape[1], doc_ids.shape[0])
    scale = default_scale(q.shape[3], scale)
    o, _ = gla_recurrence(q, k, v, a, scale, starts=document_starts(doc_ids))
    return o.to(v.dtype)
