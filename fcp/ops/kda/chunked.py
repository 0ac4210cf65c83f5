"""KDA's exact static-shape PyTorch path: chunked, documents reset exactly, exact under CP.

:func:`kda_chunked` evaluates :mod:`fcp.ops.kda.reference`'s recurrence chunk-wise (WY
representation, cost linear in the sequence length) with static shapes: documents are never
split into variable-length pieces. Instead every cross-document term is masked to an exact zero,
so a document's outputs are bitwise independent of every other token of the row. It is KDA's
*intra-chunk form* (:func:`_chunk_forms`) over the recurrence kit (:mod:`fcp.ops.kit.recurrence`),
which supplies the rest:

* runs (documents and the pad tail) numbered over the replicated global map
  (:func:`~fcp.ops.kit.recurrence.chunk_runs`); every cross-run term is removed with
  ``torch.where`` or :func:`~fcp.ops.kit.recurrence.masked_exp` (exact zeros), so no value of
  another document ever enters a document's arithmetic;
* in-chunk decays ``exp(sum of g over (i, t])`` and ``(I + A)^-1`` of the WY form from a binary
  block hierarchy (:func:`~fcp.ops.kit.recurrence.wy_forms`): every exponent is a direct sum of
  the g's it spans (<= 0: no overflow at any decay; no cancellation). A scalar gate per head
  (Gated DeltaNet, ``g [B, L, HV]``) is never broadcast over K: its pair decays form one
  ``[C, C]`` matrix per chunk (:func:`~fcp.ops.kit.recurrence.wy_forms_scalar`);
* the chunk recurrence ``S_{i+1} = A_i S_i + B_i`` with the diagonal-plus-low-rank transition
  ``A_i = diag(dec_i) - kd_i^T w_i``, composed by a log-depth scan so a compiled graph does not
  grow with the sequence length, and under CP the shard's map ``S_out = M_r S_in + S_r`` handed
  to :func:`fcp.comm.state_chain` (as :func:`~fcp.ops.kit.recurrence.dplr_outputs` does).

The shard's work (chunking, the in-chunk form, the scan, the read-out) runs inside one opaque
custom op, ``fcp::kda_local_fwd`` / ``_bwd`` (:mod:`fcp.ops.kit.opaque`); only the CP state chain
and the entering state's contribution stay in the traced graph.
"""

from __future__ import annotations

from typing import Optional

import torch

from fcp.context import PackedContext
from fcp.ops.kit.common import compute_dtype, default_scale, register_fp32_autocast
from fcp.ops.kit.opaque import autograd_in_kernel, recompute_vjp
from fcp.ops.kit.recurrence import (
    augmented_start,
    chunk_run_ids,
    entering_state,
    masked_exp,
    shard_runs,
    wy_forms,
    wy_forms_scalar,
)
from fcp.scan import TREE_SLACK, chunk_scan_bwd, chunk_scan_fwd

__all__ = ["kda_chunked"]


# ---------------------------------------------------------------------------------------------
# argument handling
# ---------------------------------------------------------------------------------------------
class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward returns a contiguous gradient.

    The chunked backward produces input gradients through permutes whose eager strides can
    differ from the strides the compiler's fake tensors predict; a caller's ``view`` of such a
    gradient (e.g. the backward of ``(x @ w).view(b, t, h, d)``) then fails in a compiled
    graph. Handing back contiguous gradients makes both agree.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


# ---------------------------------------------------------------------------------------------
# KDA's intra-chunk form over the recurrence kit
# ---------------------------------------------------------------------------------------------
def _chunk_forms(q, k, v, g, beta, seg, prev, scalar: bool):
    """Everything a chunk needs that does not depend on the incoming state (all chunks at once).

    Inputs: q, k ``[B, H, N, C, K]`` (q already scaled), g ``[B, H, N, C, K]`` or, ``scalar``,
    ``[B, H, N, C, 1]`` (every decay factor below then broadcasts over K), v
    ``[B, H, N, C, V]``, beta ``[B, H, N, C]``, seg ``[B, 1, N, C]`` run ids, prev ``[B, 1, N]``
    run id of the token before each chunk. With ``G`` the within-document cumulative decay from
    the chunk start and ``carry`` the tokens of the run that was going on before the chunk (those
    that see the incoming state ``S``), the chunk's outputs and final state are (WY
    representation)::

        U     = u0 - w @ S                       # pseudo-values, [C, V]
        o     = qg @ S + Aqk @ U
        S_end = dec * S + kd^T @ U

    with ``T = (I + A)^-1``, ``w = T (beta k exp(G) [carry])``, ``u0 = T (beta v)``,
    ``qg = q exp(G) [carry]``, ``kd = k exp(G_end - G) [last run]``, ``dec = exp(G_end) [carry]``.
    Returns ``(Aqk [.., C, C], w [.., C, K], u0 [.., C, V], qg [.., C, K], kd [.., C, K],
    dec [.., K or 1])``.
    """
    bk = beta[..., None]
    aqk, t_inv, fwd, rev = (wy_forms_scalar if scalar else wy_forms)(q, k, g, bk, seg)
    carry = (seg == prev[..., None])[..., None]  # [B, 1, N, C, 1]
    decay_in = masked_exp(carry, fwd)  # exp(G_t) for carried tokens, else exactly 0
    qg = q * decay_in
    w = t_inv @ (bk * k * decay_in)
    u0 = t_inv @ (bk * v)
    last_run = (seg == seg[..., -1:])[..., None]  # the run holding the chunk's last token
    kd = k * masked_exp(last_run, rev)
    dec = masked_exp(carry[..., -1, :], fwd[..., -1, :])  # [B, H, N, K]
    return aqk, w, u0, qg, kd, dec


def _prologue(q, k, v, g, beta, runs, before, chunk: int):
    """Token layout -> the chunk maps and the chunk form, all in the compute dtype.

    q (already scaled), k ``[B, L, H, K]``, v ``[B, L, HV, V]``, g ``[B, L, HV(, K)]``, beta
    ``[B, L, HV]``, ``(runs, before)`` of :func:`~fcp.ops.kit.recurrence.shard_runs`. Returns
    ``(w, u0, kd, dec, qg, aqk)`` (``[B, HV, N, ..]``, :func:`_chunk_forms`; ``dec`` on the
    state's diagonal, ``[.., K]``)."""
    scalar = g.dim() == 3  # one gate per head (GDN): [B, L, HV]
    bsz, length, h, dk = q.shape
    hv = v.shape[2]
    dt = compute_dtype(q, k, v, g, beta)
    n = -(-length // chunk)
    n_pad = n * chunk - length

    def chunked(x: torch.Tensor, heads_repeat: int = 1) -> torch.Tensor:
        # [B, T, heads, D] -> [B, HV, N, C, D] in the compute dtype, zero-padded at the end
        x = x.to(dt)
        if heads_repeat > 1:
            x = x.repeat_interleave(heads_repeat, dim=2)
        if n_pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, n_pad))
        return x.reshape(bsz, n, chunk, hv, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qc, kc = chunked(q, hv // h), chunked(k, hv // h)
    vc, gc = chunked(v), chunked(g[..., None] if scalar else g)
    bc = chunked(beta[..., None])[..., 0]
    seg, prev = chunk_run_ids(runs, before, n, chunk)
    seg, prev = seg[:, None], prev[:, None]
    aqk, w, u0, qg, kd, dec = _chunk_forms(qc, kc, vc, gc, bc, seg, prev, scalar)
    dec = dec.expand(*dec.shape[:-1], dk)  # a scalar gate's chunk decay, on the state's diagonal
    return w, u0, kd, dec, qg, aqk


def _epilogue(qg, aqk, states, pseudo, length: int):
    """``o = qg @ S + aqk @ (u0 - w S)`` per chunk, in token layout ``[B, L, HV, V']``."""
    out = qg @ states + aqk @ pseudo  # [B, HV, N, C, V']
    bsz, hv, n, c, dv = out.shape
    return out.permute(0, 2, 3, 1, 4).reshape(bsz, n * c, hv, dv)[:, :length].contiguous()


# The shard's local work as one opaque custom op (:mod:`fcp.ops.kit.opaque`): chunking, the
# in-chunk WY hierarchy, the chunk scan and the read-out. Traced, its hundreds of small ops over
# shapes in ``ceil(L / C)`` made a dynamic-length compile ~5x a static one and guarded on the
# chunk count (a third compile at KDA's default chunk when a row's chunk count left 2).
@torch.library.custom_op("fcp::kda_local_fwd", mutates_args=())
def kda_local_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, runs: torch.Tensor, before: torch.Tensor, chunk: int,
                  cp: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                     torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(out [B, L, HV, V'], final [B, HV, K, V'], states, pseudo, a, upper)`` in the compute
    dtype (``V' = V + K`` under CP: the response to the state entering the shard, and ``final``
    is ``[S_r | M_r]``); the last four are the scan's, kept for the backward."""
    w, u0, kd, dec, qg, aqk = _prologue(q, k, v, g, beta, runs, before, chunk)
    s0 = None  # zero
    if cp:
        u0, s0 = augmented_start(u0, q.shape[-1])
    states, pseudo, final, a, upper = chunk_scan_fwd(w, u0, kd, dec, s0)
    return _epilogue(qg, aqk, states, pseudo, q.shape[1]), final, states, pseudo, a, upper


@kda_local_fwd.register_fake
def _(q, k, v, g, beta, runs, before, chunk, cp):
    bsz, length, _, dk = q.shape
    hv, dv = v.shape[2], v.shape[3] + (dk if cp else 0)
    n = -(-length // chunk)
    dt = compute_dtype(q, k, v, g, beta)

    def new(*shape):
        return q.new_empty(*shape, dtype=dt)

    return (new(bsz, length, hv, dv), new(bsz, hv, dk, dv), new(bsz, hv, n, dk, dv),
            new(bsz, hv, n, chunk, dv), new(bsz, hv, n, dk, dk),
            new(bsz, hv, n + TREE_SLACK, dk, dk))  # fmt: skip


@torch.library.custom_op("fcp::kda_local_bwd", mutates_args=())
def kda_local_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, runs: torch.Tensor, before: torch.Tensor, chunk: int,
                  cp: bool, states: torch.Tensor, pseudo: torch.Tensor, a: torch.Tensor,
                  upper: torch.Tensor, g_out: Optional[torch.Tensor],
                  g_final: Optional[torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor]:  # fmt: skip
    """``(dq, dk, dv, dg, dbeta)`` of :func:`kda_local_fwd`: the read-out and the prologue by
    recomputation with autograd (:func:`~fcp.ops.kit.opaque.autograd_in_kernel`), the scan by
    its own hand-written backward (:func:`fcp.scan.chunk_scan_bwd`) on the states the forward
    kept."""
    with autograd_in_kernel():
        xs = [t.detach().requires_grad_() for t in (q, k, v, g, beta)]
        w, u0, kd, dec, qg, aqk = _prologue(*xs, runs, before, chunk)
        if cp:
            u0 = augmented_start(u0, q.shape[-1])[0]
        forms = (w, u0, kd, dec, qg, aqk)
        g_qg, g_aqk, g_states, g_pseudo = recompute_vjp(
            lambda *x: (_epilogue(*x, q.shape[1]),), (qg, aqk, states, pseudo), (), (g_out,))
        with torch.no_grad():
            dw, du0, dkd, ddec, _ = chunk_scan_bwd(w, kd, states, pseudo, a, upper, g_states,
                                                   g_pseudo, g_final, False)  # fmt: skip
        grads = torch.autograd.grad(
            forms, xs, (dw.to(w.dtype), du0.to(u0.dtype), dkd.to(kd.dtype), ddec.to(dec.dtype),
                        g_qg, g_aqk), allow_unused=True, materialize_grads=True)  # fmt: skip
    return tuple(d.contiguous() for d in grads)


@kda_local_bwd.register_fake
def _(q, k, v, g, beta, runs, before, chunk, cp, states, pseudo, a, upper, g_out, g_final):
    return tuple(t.new_empty(t.shape) for t in (q, k, v, g, beta))


def _kda_local_setup(ctx, inputs, output):
    q, k, v, g, beta, runs, before, chunk, cp = inputs
    _, _, states, pseudo, a, upper = output
    ctx.chunk, ctx.cp = chunk, cp
    ctx.mark_non_differentiable(states, pseudo, a, upper)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, g, beta, runs, before, states, pseudo, a, upper)


def _kda_local_backward(ctx, g_out, g_final, *_):
    q, k, v, g, beta, runs, before, states, pseudo, a, upper = ctx.saved_tensors
    grads = kda_local_bwd(q, k, v, g, beta, runs, before, ctx.chunk, ctx.cp, states, pseudo, a,
                          upper, g_out, g_final)  # fmt: skip
    return (*grads, None, None, None, None)


kda_local_fwd.register_autograd(_kda_local_backward, setup_context=_kda_local_setup)
register_fp32_autocast(kda_local_fwd, kda_local_bwd)


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, ctx: PackedContext, scale: float | None = None,
                chunk_size: int = 64) -> torch.Tensor:
    """The ``"chunked"`` backend of :func:`fcp.ops.kda.kda` (same arguments; inputs checked
    there). ``chunk_size`` is a power of two; the shard is padded internally to a multiple of it.

    Guarantees: exact to fp32 rounding (fp64 for fp64 inputs); a document's outputs are bitwise
    independent of every token outside it; deterministic; no host synchronisation and no
    data-dependent shapes (CUDA-graph safe; a new packing never recompiles). Under CP, one
    :func:`~fcp.comm.state_chain` all-gather of ``[batch, value_heads, K, K + V]`` per call.
    The shard's work is one opaque custom op (``fcp::kda_local_fwd`` / ``_bwd``), so a compiled
    graph holds a few nodes whatever the length and a dynamic length costs about what a static
    one does.
    """
    q, k, v, g, beta = (_ContiguousGrad.apply(t) for t in (q, k, v, g, beta))
    dt = compute_dtype(q, k, v, g, beta)
    dv = v.shape[3]
    # scaled here, not in the op: a symbolic head dimension makes the scale a SymFloat, which a
    # custom op's float argument would specialise
    q = q.to(dt) * default_scale(q.shape[-1], scale)
    runs, before = shard_runs(ctx)
    cp = ctx.cp_enabled
    out, final, *_ = kda_local_fwd(q, k, v, g, beta, runs, before, chunk_size, cp)
    if cp:
        # the state entering the shard reaches the tokens of its first run through their
        # response rows (exact zeros for every other token)
        s_in = entering_state(final[..., dv:], final[..., :dv], ctx).to(out.dtype)
        out = out[..., :dv] + torch.einsum("blhk,bhkv->blhv", out[..., dv:], s_in)
    return out.to(v.dtype)
