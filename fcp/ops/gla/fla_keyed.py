"""Gated linear attention with a decay per key dimension on FLA's ``chunk_gla`` kernels (CUDA):
the ``"fla"`` backend of :func:`fcp.ops.gla.gla` for ``a [B, L, H, K]``.

The same design as the scalar-gate backend (:mod:`fcp.ops.gla.fla`, which see), with FLA's
per-key-gate kernels (``chunk_gla_fwd`` / ``chunk_gla_bwd`` of ``fla.ops.gla.chunk``, built on
``chunk_fwd_h`` / ``chunk_bwd_dh`` with ``gk``):

* ``fcp::fla_gla_keyed_fwd(q, k, v, g, scale, chunk_size) -> (o, final_state)``: dense (no
  ``cu_seqlens``) GLA from a zero state, ``g [B, T, H, K]`` natural-log decays;
* ``fcp::fla_gla_keyed_bwd(q, k, v, g, do, dht, scale, chunk_size) -> (dq, dk, dv, dg)``
  (recomputes the chunk-local cumulative gate and FLA's in-chunk ``A`` rather than saving them).

Documents restart by the gate: every key's decay is :data:`RESET_LOG_DECAY` at
each run start inside the shard, so every in-chunk factor spanning a run start is an exact fp32
zero (FLA exponentiates ``exp2`` of within-chunk differences, ``<= -151.5`` across a reset).
FLA's per-key kernels factor in-chunk pairs through the start of the query's 16-token
sub-chunk and exponentiate only differences ``<= 0`` there; inside a sub-chunk they form
``exp2(g_i - g_j)`` for every pair and zero the upper triangle afterwards, as FLA does on its own
(the rounding note of :mod:`fcp.ops.gla.fla` applies: differences of fp32 chunk-local cumulative
sums). Under CP the state entering the shard is composed outside the op with a per-key response,
``o_t += scale (q_t * r_t)^T S_in`` with ``r_t = exp(a_start + ... + a_t)`` per key for the run
going on at the shard start (:func:`~fcp.ops.kit.recurrence.boundary_decays`), and the shard's
diagonal transition through :func:`~fcp.ops.kit.recurrence.entering_state`: one fp32
``[B, H, K, K + V]`` all-gather.

Version coupling: fla-core 0.6.0's ``chunk_gla_fwd``, ``chunk_gla_bwd``,
``chunk_gla_fwd_intra_gk`` and ``chunk_local_cumsum`` (internal APIs; the GPU tests catch a
signature change). Not yet run on a GPU by its author (no device was lent): the GPU tests
(``tests/test_gla_gpu.py``, ``@pytest.mark.gpu``) are its first check.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fcp.context import PackedContext
from fcp.ops.kit.common import default_scale
from fcp.ops.kit.fla import contiguous_or_none, device_guard, grad_like
from fcp.ops.kit.recurrence import (
    boundary_decays,
    chunk_runs,
    entering_state,
    entry_products,
    interior_starts,
)

__all__ = ["RESET_LOG_DECAY", "fla_gla_keyed_bwd", "fla_gla_keyed_fwd", "gla_keyed_fla_static"]

#: Natural-log decay written on every key at document starts (``-151.5`` in FLA's log2 units; the
#: scalar backend's value, :data:`fcp.ops.gla.fla.RESET_LOG_DECAY`: backends import no backend).
RESET_LOG_DECAY = -105.0


@torch.library.custom_op("fcp::fla_gla_keyed_fwd", mutates_args=(), device_types="cuda")
def fla_gla_keyed_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float,
                      chunk_size: int) -> tuple[Tensor, Tensor]:
    """Dense per-key-gate GLA forward from a zero state: ``(o, final_state)``.

    ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]`` (q, k, v one dtype). ``o`` ``[B, T, H, V]`` in
    q's dtype; ``final_state`` fp32 ``[B, H, K, V]``.
    """
    from fla.ops.gla.chunk import chunk_gla_fwd
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    with device_guard(q):
        gc = chunk_local_cumsum(g.float().contiguous(), chunk_size=chunk_size, scale=RCP_LN2)
        _, _, _, ht, o = chunk_gla_fwd(
            q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=None, g_cumsum=gc,
            scale=scale, initial_state=None, output_final_state=True, chunk_size=chunk_size,
        )
    return o.to(q.dtype), ht.float()


@fla_gla_keyed_fwd.register_fake
def _(q, k, v, g, scale, chunk_size):
    b, _, h, dk = q.shape
    final = q.new_empty(b, h, dk, v.shape[-1], dtype=torch.float32)
    return v.new_empty(v.shape, dtype=q.dtype), final


@torch.library.custom_op("fcp::fla_gla_keyed_bwd", mutates_args=(), device_types="cuda")
def fla_gla_keyed_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, do: Tensor,
                      dht: Optional[Tensor], scale: float,
                      chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Dense per-key-gate GLA backward: ``(dq, dk, dv, dg)``, each like its input."""
    from fla.ops.gla.chunk import chunk_gla_bwd, chunk_gla_fwd_intra_gk
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    with device_guard(q):
        qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
        gc = chunk_local_cumsum(g.float().contiguous(), chunk_size=chunk_size, scale=RCP_LN2)
        a_intra = chunk_gla_fwd_intra_gk(q=qc, k=kc, g=gc, scale=scale, chunk_size=chunk_size)
        dq, dk, dv, dg, _ = chunk_gla_bwd(
            q=qc, k=kc, v=vc, g=None, g_cumsum=gc, scale=scale, initial_state=None, h=None,
            A=a_intra, do=do.contiguous(), dht=contiguous_or_none(dht), chunk_size=chunk_size,
        )
    return grad_like(dq, q), grad_like(dk, k), grad_like(dv, v), grad_like(dg, g)


@fla_gla_keyed_bwd.register_fake
def _(q, k, v, g, do, dht, scale, chunk_size):
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g))


def _setup(ctx, inputs, output):
    q, k, v, g, scale, chunk_size = inputs
    ctx.save_for_backward(q, k, v, g)
    ctx.scale, ctx.chunk_size = scale, chunk_size


def _backward(ctx, do, dht):
    q, k, v, g = ctx.saved_tensors
    if do is None:
        do = v.new_zeros(v.shape, dtype=q.dtype)
    dq, dk, dv, dg = fla_gla_keyed_bwd(q, k, v, g, do, dht, ctx.scale, ctx.chunk_size)
    return dq, dk, dv, dg, None, None


fla_gla_keyed_fwd.register_autograd(_backward, setup_context=_setup)


def _entry_response(a: torch.Tensor, ctx: PackedContext, chunk_size: int):
    """``(response [B, L, H, K], transition [B, H, K])`` fp32: each token's per-key factor on the
    state entering the shard, and the shard's diagonal transition."""
    bsz, length, heads, dk = a.shape
    n = -(-length // chunk_size)
    ac = torch.nn.functional.pad(a.float(), (0, 0, 0, 0, 0, n * chunk_size - length))
    ac = ac.reshape(bsz, n, chunk_size, heads, dk).permute(0, 3, 4, 1, 2)  # [B, H, K, N, C]
    seg, prev = chunk_runs(ctx, n, chunk_size)
    decay_in, dec = boundary_decays(ac, seg[:, None, None], prev[:, None, None])
    prefix, total = entry_products(dec)  # [B, H, K, N], [B, H, K]
    response = (decay_in * prefix[..., None]).permute(0, 3, 4, 1, 2).reshape(bsz, -1, heads, dk)
    return response[:, :length], total


def gla_keyed_fla_static(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                         ctx: PackedContext, scale: float | None = None,
                         chunk_size: int = 64) -> torch.Tensor:
    """The ``"fla"`` backend for ``a [B, L, H, K]``: FLA's dense per-key-gate kernels with decay
    resets (module doc). Same arguments as :func:`fcp.ops.gla.gla` (checked there).

    Guarantees as :func:`fcp.ops.gla.fla.gla_fla_static`: cross-document terms are exact zeros,
    not bitwise document-independent; static shapes, no host synchronisation. Under CP, one
    :func:`~fcp.comm.state_chain` all-gather of fp32 ``[B, H, K, K + V]``.
    """
    scale = default_scale(q.shape[-1], scale)
    rep = v.shape[2] // q.shape[2]
    q, k = (x.to(v.dtype).repeat_interleave(rep, dim=2) for x in (q, k))
    reset = torch.full((), RESET_LOG_DECAY, dtype=a.dtype, device=a.device)
    g = torch.where(interior_starts(ctx)[..., None, None], reset, a)
    o, ht = fla_gla_keyed_fwd(q, k, v, g, scale, chunk_size)
    if not ctx.cp_enabled:
        return o.to(v.dtype)
    response, total = _entry_response(a, ctx, chunk_size)
    s_in = entering_state(torch.diag_embed(total), ht, ctx)  # fp32 [B, H, K, V]
    entering = torch.einsum("bthk,bhkv->bthv", q.float() * response, s_in)
    return (o.float() + scale * entering).to(v.dtype)
