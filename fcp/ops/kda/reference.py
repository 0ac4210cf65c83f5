"""Kimi Delta Attention, the definition: the per-token recurrence (tests only).

Per value head, with a ``[K, V]`` state ``S`` that restarts at zero at every document start::

    S   <- diag(exp(g_t)) S                              # per-key-dimension decay (KDA)
    S   <- S + beta_t k_t (v_t - S^T k_t)^T              # delta rule
    o_t  = scale * S^T q_t

(the recurrence of FLA's ``naive_recurrent_kda``, run separately on every document). With a
scalar gate per head (``g [B, T, HV]``), the first line is ``S <- exp(g_t) S``: Gated DeltaNet
(GDN; FLA's ``chunk_gated_delta_rule``, transformers' ``torch_chunk_gated_delta_rule``), i.e.
KDA with ``g`` broadcast over the K key dimensions. Every
backend of :func:`fcp.ops.kda.kda` computes this; the tests compare them with
:func:`kda_reference`. O(sequence) Python steps: the specification and test oracle, never a
model's path.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.layout import document_starts
from fcp.ops.kda import check_kda_inputs
from fcp.ops.kit.common import default_scale
from fcp.ops.kit.loops import linear_recurrence, reference_doc_ids

__all__ = ["kda_reference", "kda_recurrence"]


def kda_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, scale: float, starts: torch.Tensor | None = None,
                   initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B, T, HV, V], final state [B, HV, K, V])`` of the module docstring's recurrence from
    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]`` or ``[B, T, HV]`` (one gate per
    head), ``beta [B, T, HV]``; resets at ``starts``, an optional ``initial_state``, the compute
    dtype: :func:`~fcp.ops.kit.loops.linear_recurrence`."""
    if g.dim() == 3:  # one gate per head: broadcast over the key dimension
        g = g[..., None]

    def step(state, k_t, v_t, g_t, beta_t):
        state = state * g_t[..., None].exp()
        resid = v_t - torch.einsum("bhk,bhkv->bhv", k_t, state)
        return state + beta_t[..., None, None] * k_t[..., None] * resid[..., None, :]

    return linear_recurrence(q, k, v, (g, beta), scale, step, starts, initial_state)


def kda_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, ctx: PackedContext | torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
    """Single-process KDA by the per-token recurrence, state reset at every document start.

    Same shapes and conventions as :func:`fcp.ops.kda.kda` (which see); ``ctx`` is a non-CP
    :class:`~fcp.context.PackedContext` or directly the int64 doc-id map ``[batch, seq]``.
    Computes in fp32 (fp64 for fp64 inputs); returns ``v``'s dtype.
    """
    doc_ids = reference_doc_ids(ctx, "kda_reference")
    check_kda_inputs(q, k, v, g, beta, doc_ids.shape[1], doc_ids.shape[0])
    scale = default_scale(q.shape[3], scale)
    o, _ = kda_recurrence(q, k, v, g, beta, scale, starts=document_starts(doc_ids))
    return o.to(v.dtype)
