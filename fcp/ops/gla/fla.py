"""Gated linear attention on FLA's scalar-gate chunk kernels (CUDA): the ``"fla"`` backend of
:func:`fcp.ops.gla.gla`.

FLA's ``chunk_simple_gla`` entry point is wrapped in ``torch.compiler.disable`` and registers no
op, so a ``fullgraph=True`` compile of a model calling it fails. fcp wraps FLA's *forward and
backward functions* (``chunk_simple_gla_fwd`` / ``chunk_simple_gla_bwd`` from
``fla.ops.simple_gla.chunk``, built on ``fla.ops.common.chunk_h`` / ``chunk_o``, with
``chunk_local_cumsum`` for the gate) as ``torch.library`` custom ops for CUDA
(``device_types="cuda"``), each with a fake kernel, tied together by ``register_autograd``.
There is no CPU kernel: off CUDA the dispatcher never picks this backend (the tests register
reference kernels for CPU to check the composition).

Ops (functional, no mutation, outputs never alias inputs; the backward op has no autograd
formula, so no double backward):

* ``fcp::fla_gla_fwd(q, k, v, g, scale, chunk_size) -> (o, final_state)``: dense (no
  ``cu_seqlens``) scalar-gate linear attention on ``[B, T, H, ...]`` from a zero state;
* ``fcp::fla_gla_bwd(q, k, v, g, do, dht, scale, chunk_size) -> (dq, dk, dv, dg)`` (recomputes
  the chunk-local cumulative gate, a ``[B, T, H]`` pass, rather than saving it).

FLA's ``chunk_fwd_h`` reads k and v with one head count, so q and k are repeated to the heads
(``repeat_interleave`` outside the op; autograd sums their gradients back over each group).

**Static mode** (:func:`gla_fla_static`): compile- and CUDA-graph-safe. The op runs FLA's *dense*
kernels on the whole ``[batch, local_seq]`` shard; no variable-length metadata exists, so no
shape depends on the packing (FLA's own ``cu_seqlens`` path needs host-side chunk indices and
split offsets, a host synchronisation per batch, so it is not wrapped). Documents restart by the
gate: ``a`` is replaced by :data:`RESET_LOG_DECAY` (natural log, ``-105``) at every run start of
the replicated doc-id map inside the shard (``torch.where``, so ``da`` there is an exact 0, which
is also the true gradient: the decay at a document start multiplies a zero state). The shard's
first token needs no reset: each row starts from a zero state, and the state entering the shard
under CP is added outside the op (see CP below). FLA multiplies gates by ``log2(e)`` and takes
chunk-local cumulative sums, so every decay factor that spans a run start has a log2 exponent
``<= -151.5`` and evaluates to exactly ``0.0`` in fp32 (``2**-150`` is below the smallest fp32
subnormal), the same 0 a state reset gives: no value ever crosses a document boundary.

Numerical consequence (the only one): FLA forms in-chunk decays as differences of the fp32
chunk-local cumulative sums ``G_t``, ``exp2(G_t - G_i)``, which round at ``|G|``'s scale: a
relative error of about ``|G| * 2**-24 * ln 2`` per factor. That is FLA's own rounding for any
strong decay (``|G|`` is the chunk's cumulative log decay, up to ``64 |a|``); a document start
inside the chunk adds ``151.5`` to ``|G|`` for the tokens after it, i.e. ``~6e-6`` relative per
reset (``<= ~4e-4`` for a chunk of 64 one-token documents) on fp32, invisible under bf16
(``2**-8``). Chunks without an interior run start are computed exactly as by FLA's dense
kernel. The gradient of ``a`` at tokens *before* a reset (same chunk) receives rounding-level
terms from the following document (FLA's reverse cumulative sum of ``dg`` includes them; they
cancel exactly in real arithmetic), and the rounding of a document's decays depends on the gates
earlier in its chunk: cross-document terms are exact zeros, but outputs are not *bitwise*
independent of other documents (fcp's ``"chunked"`` backend is). Nothing is ever ``inf`` or
``NaN``: FLA exponentiates only differences ``<= 0``, or masks the others with ``where`` after
the product (``chunk_fwd_kernel_o``, ``chunk_bwd_kernel_dqkwg``). FLA keeps the per-chunk states
of the forward in the input dtype (bf16 for bf16 inputs) and runs fp32 matmuls in TF32.

Under CP the state chain is composed *outside* the op, with no extra value columns: each rank
runs the op from a zero state (its final state is the shard's ``S_r``); the shard's transition
``m_r`` (a scalar per head: the product of its decays, 0 if a run starts inside it) and every
token's response to the incoming state (``exp(a_start + ... + a_t)`` for tokens of the run going
on at the shard start, else 0) come from ``a`` in PyTorch, chunk-wise with direct sums
(:func:`fcp.ops.kit.recurrence.boundary_decays`, :func:`~fcp.ops.kit.recurrence.entry_products`).
:func:`~fcp.ops.kit.recurrence.entering_state` (:func:`fcp.comm.state_chain` of every rank's
``(m_r I, S_r)``) gives this rank's ``S_in`` and
``o_t += scale * response_t * S_in^T q_t``. Cost: one fp32 ``[B, H, K, K + V]`` all-gather.

Version coupling: written against fla-core 0.6.0's ``chunk_simple_gla_fwd`` /
``chunk_simple_gla_bwd`` and ``chunk_local_cumsum`` (internal APIs; the GPU tests catch a
signature change). FLA 0.6.0 refuses the gated backward on Hopper with Triton >= 3.4, < 3.7.1
(its issue #640) unless tilelang is installed.
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

__all__ = ["FLA_CHUNK_SIZES", "RESET_LOG_DECAY", "fla_gla_bwd", "fla_gla_fwd", "gla_fla_static",
           "reset_decay"]  # fmt: skip

RESET_LOG_DECAY = -105.0
"""Natural-log decay written at document starts in static mode (``-151.5`` in FLA's log2 units)."""

FLA_CHUNK_SIZES = (64,)
"""Chunk sizes this backend runs FLA's kernels with (FLA's default and tested size)."""


# =============================================================================================
# fcp::fla_gla_fwd / fcp::fla_gla_bwd
# =============================================================================================
@torch.library.custom_op("fcp::fla_gla_fwd", mutates_args=(), device_types="cuda")
def fla_gla_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float,
                chunk_size: int) -> tuple[Tensor, Tensor]:
    """Dense scalar-gate GLA forward from a zero state: ``(o, final_state)``.

    ``q, k [B, T, H, K]``, ``v [B, T, H, V]`` (one dtype), ``g [B, T, H]`` natural-log decay
    applied before each token's update. ``o`` ``[B, T, H, V]`` in q's dtype; ``final_state`` fp32
    ``[B, H, K, V]``.
    """
    from fla.ops.simple_gla.chunk import chunk_simple_gla_fwd
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    with device_guard(q):
        gc = chunk_local_cumsum(g.contiguous(), chunk_size=chunk_size, scale=RCP_LN2)
        o, ht = chunk_simple_gla_fwd(
            q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=gc, g_gamma=None,
            scale=scale, initial_state=None, output_final_state=True, chunk_size=chunk_size,
        )
    return o.to(q.dtype), ht


@fla_gla_fwd.register_fake
def _(q, k, v, g, scale, chunk_size):
    b, _, h, dk = q.shape
    final = q.new_empty(b, h, dk, v.shape[-1], dtype=torch.float32)
    return v.new_empty(v.shape, dtype=q.dtype), final


@torch.library.custom_op("fcp::fla_gla_bwd", mutates_args=(), device_types="cuda")
def fla_gla_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, do: Tensor,
                dht: Optional[Tensor], scale: float,
                chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Dense scalar-gate GLA backward: ``(dq, dk, dv, dg)``, each like its input."""
    from fla.ops.simple_gla.chunk import chunk_simple_gla_bwd
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    with device_guard(q):
        gc = chunk_local_cumsum(g.contiguous(), chunk_size=chunk_size, scale=RCP_LN2)
        dq, dk, dv, dg, _ = chunk_simple_gla_bwd(
            q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=gc, g_gamma=None,
            initial_state=None, do=do.contiguous(), dht=contiguous_or_none(dht), scale=scale,
            chunk_size=chunk_size,
        )
        dg = chunk_local_cumsum(dg, chunk_size=chunk_size, reverse=True)
    return grad_like(dq, q), grad_like(dk, k), grad_like(dv, v), grad_like(dg, g)


@fla_gla_bwd.register_fake
def _(q, k, v, g, do, dht, scale, chunk_size):
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g))


def _gla_setup(ctx, inputs, output):
    q, k, v, g, scale, chunk_size = inputs
    ctx.save_for_backward(q, k, v, g)
    ctx.scale, ctx.chunk_size = scale, chunk_size


def _gla_backward(ctx, do, dht):
    q, k, v, g = ctx.saved_tensors
    if do is None:
        do = v.new_zeros(v.shape, dtype=q.dtype)
    dq, dk, dv, dg = fla_gla_bwd(q, k, v, g, do, dht, ctx.scale, ctx.chunk_size)
    return dq, dk, dv, dg, None, None


fla_gla_fwd.register_autograd(_gla_backward, setup_context=_gla_setup)


# =============================================================================================
# the backend
# =============================================================================================
def reset_decay(a: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
    """``a [B, L, H]`` with :data:`RESET_LOG_DECAY` at every run start *inside* this rank's slice
    (local position 0 is left alone: each row starts from a zero state). Static shapes, no host
    sync."""
    reset = torch.full((), RESET_LOG_DECAY, dtype=a.dtype, device=a.device)
    return torch.where(interior_starts(ctx)[..., None], reset, a)


def _entry_response(a: torch.Tensor, ctx: PackedContext, chunk_size: int):
    """``(response [B, L, H], transition [B, H])`` fp32: each token's factor on the state entering
    the shard, and the shard's transition (module docstring, CP)."""
    bsz, length, heads = a.shape
    n = -(-length // chunk_size)
    ac = torch.nn.functional.pad(a.float(), (0, 0, 0, n * chunk_size - length))
    ac = ac.reshape(bsz, n, chunk_size, heads).permute(0, 3, 1, 2)  # [B, H, N, C]
    seg, prev = chunk_runs(ctx, n, chunk_size)
    decay_in, dec = boundary_decays(ac, seg[:, None], prev[:, None])
    prefix, total = entry_products(dec)
    response = (decay_in * prefix[..., None]).permute(0, 2, 3, 1).reshape(bsz, -1, heads)
    return response[:, :length], total


def gla_fla_static(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                   ctx: PackedContext, scale: float | None = None,
                   chunk_size: int = 64) -> torch.Tensor:
    """The ``"fla"`` backend: FLA's dense kernels with decay resets (static mode, module
    docstring). Same arguments as :func:`fcp.ops.gla.gla` (checked there).

    Guarantees: cross-document terms are exact zeros (nothing crosses a document), but outputs
    are not bitwise independent of other documents (``~6e-6`` relative rounding per document
    start inside a 64-token chunk on fp32, module docstring); FLA's kernels are deterministic
    per launch configuration; no host synchronisation and static shapes (CUDA-graph safe).
    Under CP, one :func:`~fcp.comm.state_chain` all-gather of fp32 ``[B, H, K, K + V]``.
    """
    scale = default_scale(q.shape[-1], scale)
    rep = v.shape[2] // q.shape[2]
    q, k = (x.to(v.dtype).repeat_interleave(rep, dim=2) for x in (q, k))
    o, ht = fla_gla_fwd(q, k, v, reset_decay(a, ctx), scale, chunk_size)
    if not ctx.cp_enabled:
        return o.to(v.dtype)
    response, total = _entry_response(a, ctx, chunk_size)
    s_in = entering_state(total, ht, ctx)  # fp32 [B, H, K, V]; the shard's map is total * I
    entering = torch.einsum("bthk,bhkv->bthv", q.float(), s_in)
    return (o.float() + (scale * response[..., None]) * entering).to(v.dtype)
