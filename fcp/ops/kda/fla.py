"""KDA on FLA's Triton kernels (CUDA): the ``"fla"`` and ``"fla_varlen"`` backends of
:func:`fcp.ops.kda.kda`.

FLA's Python entry points (``chunk_kda``, its backend dispatcher) are wrapped in
``torch.compiler.disable`` and register no ops, so a ``fullgraph=True`` compile of a model that
calls them fails. fcp wraps FLA's *forward and backward functions* (``chunk_kda_fwd`` /
``chunk_kda_bwd``) as ``torch.library`` custom ops for CUDA (``device_types="cuda"``), each with a
fake kernel, tied together by ``register_autograd``; Dynamo sees opaque ops with known output
shapes and traces straight through. There is no CPU kernel: off CUDA the dispatcher never picks
these backends (the tests register reference kernels for CPU to check the composition).
A Gated DeltaNet gate (one per head, ``[B, T, HV]``) reaches these ops broadcast to
``[B, T, HV, K]`` by the dispatcher: FLA's ``chunk_gated_delta_rule`` is not wrapped.

Ops (functional, no mutation, outputs never alias inputs; the backward ops have no autograd
formula, so no double backward; outputs that only feed the backward are non-differentiable):

* ``fcp::fla_kda_fwd`` / ``fcp::fla_kda_bwd`` - dense KDA on ``[B, T, ...]`` with an optional fp32
  initial state and the final state as an output.
* ``fcp::fla_kda_varlen_fwd`` / ``fcp::fla_kda_varlen_bwd`` - FLA's variable-length path on one
  flattened row ``[1, T, ...]`` with ``cu_seqlens``, optionally with FLA's own CP metadata
  (``FLACPContext`` fields passed as scalars and the process-group name).

**Static mode** (:func:`kda_fla_static`, ``backend="fla"``): compile- and CUDA-graph-safe. The custom op
``fcp::fla_kda_fwd`` runs FLA's *dense* chunked KDA on the whole ``[batch, local_seq]`` shard; no
variable-length metadata exists, so no shape depends on the packing. Documents restart by the gate:
``g`` is replaced by :data:`RESET_LOG_DECAY` (natural log, ``-105``) at every run start of the
replicated doc-id map inside the shard (``torch.where``, so ``dg`` there is an exact 0, which is
also the true gradient: the decay at a document start multiplies a zero state); a run start at
the shard's first token is handled by the initial state instead (see CP below). FLA multiplies gates by
``log2(e)`` and takes chunk-local cumulative sums, so every decay factor that spans a run start has a
log2 exponent ``<= -151.5`` and evaluates to exactly ``0.0`` in fp32 (``2**-150`` is below the smallest
fp32 subnormal), the same 0 a state reset gives: no value ever crosses a document boundary.

Numerical consequence (the only one): within a 64-token chunk, the tokens after a reset carry
cumulative gates offset by ``-151.5 * (number of resets before them in the chunk)``, and FLA forms
within-document decays as differences of those fp32 cumulative sums. The difference is exact in
real arithmetic but rounds at the offset's scale: a relative error of about
``|G| * 2**-24 * ln 2``, i.e. ``~6e-6`` per reset in the chunk (``~1e-5`` for one document start,
``<= ~4e-4`` for a chunk of 64 one-token documents), on fp32; invisible under bf16 (``2**-8``).
Chunks without an interior document start are computed exactly as by FLA's dense kernel. The
gradient of ``g`` at tokens *before* a reset (same chunk) receives rounding-level terms from the
following document (FLA's reverse cumulative sum of ``dg`` includes them; they cancel exactly in
real arithmetic), and the rounding of a document's decays depends on the gates earlier in its
chunk: cross-document terms are exact zeros, but outputs are not *bitwise* independent of other
documents (fcp's pure-PyTorch ``kda`` is). Nothing is ever ``inf``/``NaN``: FLA's
non-``safe_gate`` kernels only exponentiate differences ``<= 0`` (or mask the others with
``where``).

Under CP, static mode composes the state chain *outside* the op: each rank runs the op once on
``v_aug = [v | 0_K]`` from ``h0 = [0 | I_K]`` (``[0 | 0]`` for a row whose shard starts a new
run); by linearity the final state is ``[S_r | M_r]`` (the shard's zero-start state and its
transition) and the last ``K`` output columns are each token's response ``R_t`` to the incoming
state (an interior reset zeroes both, exactly as above).
:func:`~fcp.ops.kit.recurrence.entering_state` (:func:`fcp.comm.state_chain`) turns every rank's
``(M_r, S_r)`` into this rank's incoming state ``S_in`` and ``o = o[..., :V] + R @ S_in``. Cost:
value width ``V + K`` instead of ``V`` on ``cp_size > 1`` (the non-CP path runs plain ``V``),
plus one ``[B, HV, K, K + V]`` fp32 all-gather.

**FLA-varlen mode** (:func:`kda_fla_varlen`, ``backend="fla_varlen"``): FLA's own
``cu_seqlens`` / ``cp_context`` path (``fcp::fla_kda_varlen_*``), one
flattened row per call, with the host-side :func:`~fcp.ops.kit.fla.build_fla_cp_context`
(memoised per row). Exact per-document resets; needs host metadata (it synchronises once per batch
and ints specialise a compiled graph), so it is the parity/reference mode, not the CUDA-graph one.

Version coupling: written against fla-core 0.6.0's ``chunk_kda_fwd`` / ``chunk_kda_bwd``
(internal APIs; the GPU tests catch a signature change).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fcp.context import PackedContext
from fcp.layout import document_starts
from fcp.ops.kit.common import default_scale
from fcp.ops.kit.fla import build_fla_cp_context, contiguous_or_none, device_guard, empty
from fcp.ops.kit.fla import grad_like, group_name, make_fla_cp_context, state_dtype
from fcp.ops.kit.recurrence import entering_state, interior_starts

__all__ = [
    "RESET_LOG_DECAY",
    "FLA_CHUNK_SIZES",
    "fla_kda_fwd",
    "fla_kda_varlen_fwd",
    "kda_fla_static",
    "kda_fla_varlen",
    "reset_gate",
]

RESET_LOG_DECAY = -105.0
"""Natural-log decay written at document starts in static mode (``-151.5`` in FLA's log2 units)."""

FLA_CHUNK_SIZES = (32, 64)
"""Chunk sizes FLA's KDA kernels support."""


# =============================================================================================
# dense KDA: fcp::fla_kda_fwd / fcp::fla_kda_bwd
# =============================================================================================
def _kda_fwd_shapes(q, k, v, g, chunk_size):
    bsz, length, _, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    st = state_dtype(q.dtype)
    return (
        ((bsz, length, hv, dv), q.dtype),  # o (FLA returns o in q's dtype)
        ((bsz, hv, dk, dv), st),  # final state
        ((bsz, length, hv, dk), st),  # g_cumsum
        ((bsz, length, hv, chunk_size), k.dtype),  # Aqk
        ((bsz, length, hv, chunk_size), k.dtype),  # Akk
    )


@torch.library.custom_op("fcp::fla_kda_fwd", mutates_args=(), device_types="cuda")
def fla_kda_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: Optional[Tensor],
                scale: float, chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Dense KDA forward: ``(o, final_state, g_cumsum, Aqk, Akk)``.

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]`` (natural-log decay, applied
    before each token's update), ``beta [B, T, HV]``, ``h0`` fp32 ``[B, HV, K, V]`` or ``None``.
    """
    from fla.ops.kda.chunk_fwd import chunk_kda_fwd

    with device_guard(q):
        o, ht, gc, aqk, akk, *_ = chunk_kda_fwd(
            q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous(),
            beta=beta.contiguous(), scale=scale, initial_state=contiguous_or_none(h0),
            output_final_state=True, chunk_size=chunk_size,
        )
    return o.to(q.dtype), ht, gc, aqk, akk


@fla_kda_fwd.register_fake
def _(q, k, v, g, beta, h0, scale, chunk_size):
    return tuple(q.new_empty(shape, dtype=dtype) for shape, dtype in _kda_fwd_shapes(q, k, v, g, chunk_size))


@torch.library.custom_op("fcp::fla_kda_bwd", mutates_args=(), device_types="cuda")
def fla_kda_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: Optional[Tensor],
                g_cumsum: Tensor, aqk: Tensor, akk: Tensor, do: Tensor, dht: Optional[Tensor],
                scale: float,
                chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Dense KDA backward: ``(dq, dk, dv, dg, dbeta, dh0)`` (``dh0`` is empty without ``h0``)."""
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd

    with device_guard(q):
        dq, dk, dv, db, dg, dh0, _, _ = chunk_kda_bwd(
            q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), beta=beta.contiguous(), Aqk=aqk,
            Akk=akk, scale=scale, initial_state=contiguous_or_none(h0), do=do.contiguous(),
            dht=contiguous_or_none(dht), g=g_cumsum, chunk_size=chunk_size,
        )
    dh0 = dh0 if h0 is not None else empty(q.device, state_dtype(q.dtype))
    return (
        grad_like(dq, q), grad_like(dk, k), grad_like(dv, v), grad_like(dg, g), grad_like(db, beta),
        dh0.contiguous(),
    )  # fmt: skip


@fla_kda_bwd.register_fake
def _(q, k, v, g, beta, h0, g_cumsum, aqk, akk, do, dht, scale, chunk_size):
    dh0 = h0.new_empty(h0.shape) if h0 is not None else q.new_empty(0, dtype=state_dtype(q.dtype))
    return (
        q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
        beta.new_empty(beta.shape), dh0,
    )  # fmt: skip


def _kda_setup(ctx, inputs, output):
    q, k, v, g, beta, h0, scale, chunk_size = inputs
    _, _, gc, aqk, akk = output
    ctx.save_for_backward(q, k, v, g, beta, h0, gc, aqk, akk)
    ctx.scale, ctx.chunk_size = scale, chunk_size
    ctx.mark_non_differentiable(gc, aqk, akk)


def _kda_backward(ctx, do, dht, _dgc, _daqk, _dakk):
    q, k, v, g, beta, h0, gc, aqk, akk = ctx.saved_tensors
    if do is None:
        do = q.new_zeros(*q.shape[:2], *v.shape[2:])
    dq, dk, dv, dg, db, dh0 = fla_kda_bwd(
        q, k, v, g, beta, h0, gc, aqk, akk, do, dht, ctx.scale, ctx.chunk_size
    )
    return dq, dk, dv, dg, db, (dh0 if h0 is not None else None), None, None


fla_kda_fwd.register_autograd(_kda_backward, setup_context=_kda_setup)


# =============================================================================================
# varlen KDA (FLA's cu_seqlens / cp_context path): fcp::fla_kda_varlen_fwd / _bwd
# =============================================================================================
def _varlen_plan(cu_seqlens, cu_seqlens_cpu, chunk_size, group_name, pre, post, first, last):
    """FLA's ``FLACPContext`` (``None`` without CP) and chunk indices of one varlen row, from the
    scalar fields a custom-op schema can carry; inside the op's kernel, on its device."""
    from fla.ops.utils import prepare_chunk_indices

    cp = make_fla_cp_context(cu_seqlens, cu_seqlens_cpu, group_name, pre, post, first, last) \
        if group_name else None  # fmt: skip
    return cp, prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)


@torch.library.custom_op("fcp::fla_kda_varlen_fwd", mutates_args=(), device_types="cuda")
def fla_kda_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       cu_seqlens: Tensor, cu_seqlens_cpu: Tensor, scale: float, chunk_size: int,
                       group_name: str, pre_num_ranks: int, post_num_ranks: int,
                       is_first_rank: bool,
                       is_last_rank: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """FLA varlen KDA forward on one row ``[1, T, ...]``: ``(o, g_cumsum, Aqk, Akk, h0)``.

    ``group_name`` non-empty: FLA's CP path with the given ``FLACPContext`` fields; ``h0`` is then
    FLA's compressed incoming state ``[1, HV, K, V]`` (kept for the backward), else empty.
    """
    from fla.ops.kda.chunk_fwd import chunk_kda_fwd

    with device_guard(q):
        cp, chunk_indices = _varlen_plan(cu_seqlens, cu_seqlens_cpu, chunk_size, group_name,
                                         pre_num_ranks, post_num_ranks, is_first_rank,
                                         is_last_rank)  # fmt: skip
        o, _, gc, aqk, akk, *_, h0 = chunk_kda_fwd(
            q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous(),
            beta=beta.contiguous(), scale=scale, initial_state=None, output_final_state=False,
            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
            chunk_size=chunk_size, cp_context=cp,
        )
    if h0 is None:
        h0 = empty(q.device, state_dtype(q.dtype))
    return o.to(q.dtype), gc, aqk, akk, h0.contiguous()


@fla_kda_varlen_fwd.register_fake
def _(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, scale, chunk_size, group_name, pre, post,
      first, last):  # fmt: skip
    shapes = _kda_fwd_shapes(q, k, v, g, chunk_size)
    st = shapes[1][1]
    h0 = q.new_empty((1, *shapes[1][0][1:]), dtype=st) if group_name else q.new_empty(0, dtype=st)
    o, _, gc, aqk, akk = (q.new_empty(s, dtype=d) for s, d in shapes)
    return o, gc, aqk, akk, h0


@torch.library.custom_op("fcp::fla_kda_varlen_bwd", mutates_args=(), device_types="cuda")
def fla_kda_varlen_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, g_cumsum: Tensor,
                       aqk: Tensor, akk: Tensor, h0: Tensor, do: Tensor, cu_seqlens: Tensor,
                       cu_seqlens_cpu: Tensor, scale: float, chunk_size: int, group_name: str,
                       pre_num_ranks: int, post_num_ranks: int, is_first_rank: bool,
                       is_last_rank: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """FLA varlen KDA backward: ``(dq, dk, dv, dg, dbeta)``."""
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd

    with device_guard(q):
        cp, chunk_indices = _varlen_plan(cu_seqlens, cu_seqlens_cpu, chunk_size, group_name,
                                         pre_num_ranks, post_num_ranks, is_first_rank,
                                         is_last_rank)  # fmt: skip
        dq, dk, dv, db, dg, *_ = chunk_kda_bwd(
            q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), beta=beta.contiguous(), Aqk=aqk,
            Akk=akk, scale=scale, initial_state=h0 if h0.numel() else None, do=do.contiguous(),
            dht=None, g=g_cumsum, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
            chunk_size=chunk_size, cp_context=cp,
        )
    return grad_like(dq, q), grad_like(dk, k), grad_like(dv, v), grad_like(dg, g), grad_like(db, beta)


@fla_kda_varlen_bwd.register_fake
def _(q, k, v, g, beta, g_cumsum, aqk, akk, h0, do, cu_seqlens, cu_seqlens_cpu, scale, chunk_size,
      group_name, pre, post, first, last):  # fmt: skip
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g, beta))


_VARLEN_META = ("cu_seqlens", "cu_seqlens_cpu", "scale", "chunk_size", "group_name",
                "pre_num_ranks", "post_num_ranks", "is_first_rank", "is_last_rank")  # fmt: skip


def _kda_varlen_setup(ctx, inputs, output):
    q, k, v, g, beta, *meta = inputs
    _, gc, aqk, akk, h0 = output
    ctx.save_for_backward(q, k, v, g, beta, gc, aqk, akk, h0, meta[0], meta[1])
    ctx.meta = tuple(meta[2:])
    ctx.mark_non_differentiable(gc, aqk, akk, h0)


def _kda_varlen_backward(ctx, do, *_):
    q, k, v, g, beta, gc, aqk, akk, h0, cu, cu_cpu = ctx.saved_tensors
    if do is None:
        do = q.new_zeros(*q.shape[:2], *v.shape[2:])
    grads = fla_kda_varlen_bwd(q, k, v, g, beta, gc, aqk, akk, h0, do, cu, cu_cpu, *ctx.meta)
    return (*grads,) + (None,) * len(_VARLEN_META)


fla_kda_varlen_fwd.register_autograd(_kda_varlen_backward, setup_context=_kda_varlen_setup)


# =============================================================================================
# the two backends
# =============================================================================================
def reset_gate(g: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
    """``g`` with :data:`RESET_LOG_DECAY` at every run start *inside* this rank's slice.

    Local position 0 is left alone: the kernel starts each row from its initial state, which is
    zero without CP and, under CP, carries the incoming state only when the shard continues a run
    (:func:`kda_fla_static` masks it otherwise). So a row without interior document starts gets
    FLA's plain dense numerics. Static shapes, no host sync.
    """
    reset = torch.full((), RESET_LOG_DECAY, dtype=g.dtype, device=g.device)
    return torch.where(interior_starts(ctx)[:, :, None, None], reset, g)


def kda_fla_static(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, ctx: PackedContext, scale: float | None = None,
                   chunk_size: int = 64) -> torch.Tensor:
    """The ``"fla"`` backend: FLA's dense kernel with gate resets (static mode, module docstring).

    Same arguments as :func:`fcp.ops.kda.kda` (checked there).

    Guarantees: cross-document terms are exact zeros (nothing crosses a document), but outputs
    are not bitwise independent of other documents: ``~6e-6`` relative rounding per document
    start inside a 64-token chunk on fp32 (module docstring); FLA's kernels are deterministic
    per launch configuration; no host synchronisation and static shapes (CUDA-graph safe).
    """
    dk, dv = q.shape[-1], v.shape[-1]
    scale = default_scale(dk, scale)
    g = reset_gate(g, ctx)
    if not ctx.cp_enabled:
        return fla_kda_fwd(q, k, v, g, beta, None, scale, chunk_size)[0].to(v.dtype)
    bsz, length, hv = v.shape[:3]
    st = state_dtype(q.dtype)
    v_aug = torch.cat([v, v.new_zeros(bsz, length, hv, dk)], -1)
    # the incoming state enters only if the shard continues the run before it
    carry = ~document_starts(ctx.doc_ids)[:, ctx.seq_start]
    eye = torch.eye(dk, dtype=st, device=q.device) * carry[:, None, None, None].to(st)
    h0 = torch.cat([eye.new_zeros(bsz, hv, dk, dv), eye.expand(bsz, hv, dk, dk)], -1)
    o, ht = fla_kda_fwd(q, k, v_aug, g, beta, h0, scale, chunk_size)[:2]
    s_in = entering_state(ht[..., dv:], ht[..., :dv], ctx)  # fp32 [B, HV, K, V]
    out = o[..., :dv].to(st) + torch.einsum("bthk,bhkv->bthv", o[..., dv:].to(st), s_in.to(st))
    return out.to(v.dtype)


def kda_fla_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, ctx: PackedContext, scale: float | None = None,
                   chunk_size: int = 64) -> torch.Tensor:
    """The ``"fla_varlen"`` backend: FLA's variable-length path (``cu_seqlens``, and FLA's own
    ``cp_context`` under CP), one op call per batch row.

    Guarantees: exact per-document resets (FLA's kernel rounding); host-side metadata per batch
    (:func:`~fcp.ops.kit.fla.build_fla_cp_context`, memoised in the context): it synchronises
    once per batch and its integers specialise a compiled graph, so it is neither CUDA-graph safe
    nor recompile-free across packings. The parity / reference mode of the FLA backends.
    """
    scale = default_scale(q.shape[-1], scale)
    name = group_name(ctx)
    outs = []
    for row in range(q.shape[0]):
        plan = build_fla_cp_context(ctx, row, ctx.group if name else None, None)
        meta = (plan.cu_seqlens, plan.cu_seqlens_cpu, scale, chunk_size, name,
                int(plan.pre_num_ranks), int(plan.post_num_ranks), bool(plan.is_first_rank),
                bool(plan.is_last_rank))  # fmt: skip
        xs = (x[row : row + 1] for x in (q, k, v, g, beta))
        outs.append(fla_kda_varlen_fwd(*xs, *meta)[0])
    return torch.cat(outs, 0).to(v.dtype)
