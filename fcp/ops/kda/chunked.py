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
  to :func:`fcp.comm.state_chain` (:func:`~fcp.ops.kit.recurrence.dplr_outputs`).
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fcp.context import PackedContext
from fcp.ops.kit.common import compute_dtype, default_scale, trim
from fcp.ops.kit.recurrence import chunk_runs, dplr_outputs, masked_exp, wy_forms, wy_forms_scalar

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


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, ctx: PackedContext, scale: float | None = None,
                chunk_size: int = 64) -> torch.Tensor:
    """The ``"chunked"`` backend of :func:`fcp.ops.kda.kda` (same arguments; inputs checked
    there). ``chunk_size`` is a power of two; the shard is padded internally to a multiple of it.

    Guarantees: exact to fp32 rounding (fp64 for fp64 inputs); a document's outputs are bitwise
    independent of every token outside it; deterministic; no host synchronisation and no
    data-dependent shapes (CUDA-graph safe; a new packing never recompiles). Under CP, one
    :func:`~fcp.comm.state_chain` all-gather of ``[batch, value_heads, K, K + V]`` per call.
    """
    q, k, v, g, beta = (_ContiguousGrad.apply(t) for t in (q, k, v, g, beta))
    scalar = g.dim() == 3  # one gate per head (GDN): [B, L, HV]
    bsz, length, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    dt = compute_dtype(q, k, v, g, beta)
    scale = default_scale(dk, scale)
    c = chunk_size
    n = -(-length // c)
    n_pad = n * c - length

    def chunked(x: torch.Tensor, heads_repeat: int = 1) -> torch.Tensor:
        # [B, T, heads, D] -> [B, HV, N, C, D] in the compute dtype, zero-padded at the end
        x = x.to(dt)
        if heads_repeat > 1:
            x = x.repeat_interleave(heads_repeat, dim=2)
        if not statically_known_true(n_pad == 0):
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, n_pad))
        return x.reshape(bsz, n, c, hv, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qc = chunked(q, hv // h) * scale
    kc = chunked(k, hv // h)
    vc, gc = chunked(v), chunked(g[..., None] if scalar else g)
    bc = chunked(beta[..., None])[..., 0]
    seg, prev = chunk_runs(ctx, n, c)  # [B, N, C], [B, N]: run ids, shared by the heads
    seg, prev = seg[:, None], prev[:, None]

    aqk, w, u0, qg, kd, dec = _chunk_forms(qc, kc, vc, gc, bc, seg, prev, scalar)
    dec = dec.expand(*dec.shape[:-1], dk)  # a scalar gate's chunk decay, on the state's diagonal
    out = dplr_outputs(w, u0, kd, dec, qg, aqk, ctx)  # [B, HV, N, C, V]
    return trim(out.permute(0, 2, 3, 1, 4).reshape(bsz, n * c, hv, dv), length, v.dtype)
