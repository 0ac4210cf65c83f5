"""``torch.library`` custom ops (namespace ``fcp``) around FLA's KDA and causal-conv kernels.

FLA's Python entry points (``chunk_kda``, its backend dispatcher) are wrapped in
``torch.compiler.disable`` and register no ops, so a ``fullgraph=True`` compile of a model that calls
them fails. These ops wrap FLA's *forward and backward functions* (``chunk_kda_fwd`` /
``chunk_kda_bwd``, ``causal_conv1d_fwd`` / ``causal_conv1d_bwd``) instead, each as a separate op with
a fake (meta) kernel, and tie them together with ``register_autograd``; Dynamo then sees opaque ops
with known output shapes and traces straight through.

Ops (all functional, no mutation, outputs never alias inputs):

* ``fcp::fla_kda_fwd`` / ``fcp::fla_kda_bwd`` - dense (fixed-length) KDA on ``[B, T, ...]`` with an
  optional fp32 initial state and the final state as an output. No variable-length metadata, so
  shapes never depend on the packing: the *static* mode (:func:`fcp.ops.fla.fla_kda_static`)
  builds document resets into ``g`` and the CP state chain around this op.
* ``fcp::fla_kda_varlen_fwd`` / ``fcp::fla_kda_varlen_bwd`` - FLA's variable-length path on one
  flattened row ``[1, T, ...]`` with ``cu_seqlens``, optionally with FLA's own CP metadata
  (``FLACPContext`` fields passed as scalars and the process-group name).
* ``fcp::fla_conv_varlen_fwd`` / ``fcp::fla_conv_varlen_bwd`` - FLA's ``causal_conv1d`` on one row
  with ``cu_seqlens``, optionally with FLA's CP halo exchange.

Real kernels: on CUDA they call FLA (imported lazily, on first call). On any other device they
run a pure-PyTorch implementation of the same contract (per-token recurrence / masked taps, with
hand-written backwards that need no autograd inside the op), so ``torch.library.opcheck`` and CPU
compiles work; FLA's CP variants need CUDA and raise ``NotImplementedError`` elsewhere. The
fallbacks are O(seq) Python steps: for tests, not for training on CPU (use :func:`fcp.ops.fla.fla_kda`,
which routes CPU tensors to fcp's chunked pure-PyTorch ``kda``).

The backward ops have no autograd formula themselves (no double backward). Outputs that only exist
to feed the backward (FLA's chunk-local cumulative gate ``g_cumsum`` and the intra-chunk matrices
``Aqk`` / ``Akk``, what FLA's own autograd function saves) are marked non-differentiable. On the
PyTorch fallback they are zeros of the right shape (the fallback backward recomputes instead).

Version coupling: written against fla-core 0.6.0's ``chunk_kda_fwd`` / ``chunk_kda_bwd`` /
``causal_conv1d_fwd`` / ``causal_conv1d_bwd`` and ``CausalConv1dFunctionCP``'s two static helpers
(internal APIs; the GPU tests catch a signature change).
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["RCP_LN2", "force_fla_kernels", "fla_kernels_forced"]

RCP_LN2 = 1.0 / math.log(2.0)  # FLA keeps gates in log2 units internally

_FORCE_FLA = False  # test hook: run FLA's kernels on non-CUDA tensors (Triton interpreter)


@contextlib.contextmanager
def force_fla_kernels(enabled: bool = True):
    """Make the ops call FLA's Triton kernels on non-CUDA tensors (for ``TRITON_INTERPRET=1``)."""
    global _FORCE_FLA
    old, _FORCE_FLA = _FORCE_FLA, enabled
    try:
        yield
    finally:
        _FORCE_FLA = old


def fla_kernels_forced() -> bool:
    return _FORCE_FLA


def _on_fla(t: Tensor) -> bool:
    return t.is_cuda or _FORCE_FLA


def _device_guard(t: Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """FLA's fp32 states / cumulative gates; fp64 stays fp64 on the PyTorch fallback."""
    return torch.promote_types(torch.float32, dtype)


def _resolve_group(name: str):
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _c(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.contiguous()


def _empty(device, dtype) -> Tensor:
    return torch.empty(0, device=device, dtype=dtype)


# =============================================================================================
# pure-PyTorch KDA (fallback): the per-token recurrence, optional resets and initial state
# =============================================================================================
def _kda_prepare(q, k, v, g, beta, scale):
    h, hv = q.shape[2], v.shape[2]
    dt = _state_dtype(torch.promote_types(q.dtype, v.dtype))
    rep = hv // h
    qf = q.to(dt).repeat_interleave(rep, 2) * scale
    kf = k.to(dt).repeat_interleave(rep, 2)
    return qf, kf, v.to(dt), g.to(dt), beta.to(dt)


def _kda_recurrent(q, k, v, g, beta, scale, h0=None, starts=None, keep=False):
    """``(o, final_state)`` of KDA on ``[B, T, ...]`` by the per-token recurrence.

    ``starts`` bool ``[B, T]`` zeroes the state before a token (exact resets); ``h0`` is the
    initial state. Computes in fp32 (fp64 for fp64 inputs). ``keep=True`` also returns the
    per-token intermediates the hand-written backward needs.
    """
    bsz, length = q.shape[:2]
    hv, dk, dv = v.shape[2], q.shape[3], v.shape[3]
    qf, kf, vf, gf, bf = _kda_prepare(q, k, v, g, beta, scale)
    state = h0.to(qf.dtype) if h0 is not None else qf.new_zeros(bsz, hv, dk, dv)
    outs, saved = [], []
    for t in range(length):
        if starts is not None:
            state = torch.where(starts[:, t, None, None, None], 0.0, state)
        decayed = state * gf[:, t, :, :, None].exp()
        k_t = kf[:, t]
        resid = vf[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, decayed)
        state = decayed + bf[:, t, :, None, None] * k_t[..., None] * resid[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", qf[:, t], state))
        if keep:
            saved.append((decayed, resid, state))
    o = torch.stack(outs, 1) if outs else qf.new_zeros(bsz, 0, hv, dv)
    return (o, state, saved) if keep else (o, state)


def _kda_recurrent_bwd(q, k, v, g, beta, scale, h0, starts, do, dht):
    """Reverse-mode of :func:`_kda_recurrent` by hand (no autograd / functorch, so it runs under
    any dispatch context): ``(dq, dk, dv, dg, dbeta, dh0)`` in the compute dtype."""
    bsz, length, h, dk = q.shape
    hv = v.shape[2]
    qf, kf, vf, gf, bf = _kda_prepare(q, k, v, g, beta, scale)
    _, _, saved = _kda_recurrent(q, k, v, g, beta, scale, h0, starts, keep=True)
    do = do.to(qf.dtype)
    d_state = dht.to(qf.dtype) if dht is not None else qf.new_zeros(bsz, hv, dk, v.shape[3])
    dq, dk_, dv, dg, db = [], [], [], [], []
    for t in reversed(range(length)):
        decayed, resid, state = saved[t]
        k_t, beta_t = kf[:, t], bf[:, t, :, None]
        d_state = d_state + qf[:, t, :, :, None] * do[:, t, :, None, :]
        dq.append(torch.einsum("bhkv,bhv->bhk", state, do[:, t]))
        # state = decayed + beta k resid^T
        db.append(torch.einsum("bhk,bhkv,bhv->bh", k_t, d_state, resid))
        d_resid = beta_t * torch.einsum("bhkv,bhk->bhv", d_state, k_t)
        dk_t = beta_t * torch.einsum("bhkv,bhv->bhk", d_state, resid)
        # resid = v - decayed^T k
        dv.append(d_resid)
        d_decayed = d_state - k_t[..., None] * d_resid[..., None, :]
        dk_.append(dk_t - torch.einsum("bhkv,bhv->bhk", decayed, d_resid))
        # decayed = prev * exp(g)
        dg.append((d_decayed * decayed).sum(-1))
        d_state = d_decayed * gf[:, t, :, :, None].exp()
        if starts is not None:
            d_state = torch.where(starts[:, t, None, None, None], 0.0, d_state)

    def stack(xs, like):
        return torch.stack(xs[::-1], 1) if xs else like.new_zeros(like.shape)

    rep = hv // h
    dq = (stack(dq, qf) * scale).reshape(bsz, length, h, rep, dk).sum(3)
    dk_ = stack(dk_, kf).reshape(bsz, length, h, rep, dk).sum(3)
    return dq, dk_, stack(dv, vf), stack(dg, gf), stack(db, bf), d_state


def _chunk_local_cumsum(g: Tensor, chunk_size: int, dtype: torch.dtype) -> Tensor:
    """FLA's ``g_cumsum``: per-chunk cumulative sum of ``g`` in log2 units (fp32)."""
    bsz, length = g.shape[:2]
    n = -(-length // chunk_size)
    pad = n * chunk_size - length
    x = F.pad(g.to(dtype), (0, 0, 0, 0, 0, pad))
    x = x.reshape(bsz, n, chunk_size, *g.shape[2:]).cumsum(2) * RCP_LN2
    return x.reshape(bsz, n * chunk_size, *g.shape[2:])[:, :length].contiguous()


def _grad_or_zeros(grad: Optional[Tensor], like: Tensor) -> Tensor:
    return torch.zeros_like(like) if grad is None else grad


def _to_like(grad: Optional[Tensor], like: Tensor) -> Tensor:
    if grad is None:
        return torch.zeros_like(like, memory_format=torch.contiguous_format)
    return grad.to(like.dtype).contiguous()


# =============================================================================================
# dense KDA: fcp::fla_kda_fwd / fcp::fla_kda_bwd
# =============================================================================================
def _kda_fwd_shapes(q, k, v, g, chunk_size):
    bsz, length, _, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    st = _state_dtype(q.dtype)
    return (
        ((bsz, length, hv, dv), q.dtype),  # o (FLA returns o in q's dtype)
        ((bsz, hv, dk, dv), st),  # final state
        ((bsz, length, hv, dk), st),  # g_cumsum
        ((bsz, length, hv, chunk_size), k.dtype),  # Aqk
        ((bsz, length, hv, chunk_size), k.dtype),  # Akk
    )


@torch.library.custom_op("fcp::fla_kda_fwd", mutates_args=())
def fla_kda_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    h0: Optional[Tensor],
    scale: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Dense KDA forward: ``(o, final_state, g_cumsum, Aqk, Akk)``.

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]`` (natural-log decay, applied
    before each token's update), ``beta [B, T, HV]``, ``h0`` fp32 ``[B, HV, K, V]`` or ``None``.
    """
    if _on_fla(q):
        from fla.ops.kda.chunk_fwd import chunk_kda_fwd

        with _device_guard(q):
            o, ht, gc, aqk, akk, *_ = chunk_kda_fwd(
                q=q.contiguous(),
                k=k.contiguous(),
                v=v.contiguous(),
                g=g.contiguous(),
                beta=beta.contiguous(),
                scale=scale,
                initial_state=_c(h0),
                output_final_state=True,
                chunk_size=chunk_size,
            )
        return o.to(q.dtype), ht, gc, aqk, akk
    o, ht = _kda_recurrent(q, k, v, g, beta, scale, h0)
    shapes = _kda_fwd_shapes(q, k, v, g, chunk_size)
    return (
        o.to(q.dtype),
        ht.to(shapes[1][1]),
        _chunk_local_cumsum(g, chunk_size, shapes[2][1]),
        q.new_zeros(shapes[3][0], dtype=k.dtype),
        q.new_zeros(shapes[4][0], dtype=k.dtype),
    )


@fla_kda_fwd.register_fake
def _(q, k, v, g, beta, h0, scale, chunk_size):
    return tuple(q.new_empty(shape, dtype=dtype) for shape, dtype in _kda_fwd_shapes(q, k, v, g, chunk_size))


@torch.library.custom_op("fcp::fla_kda_bwd", mutates_args=())
def fla_kda_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    h0: Optional[Tensor],
    g_cumsum: Tensor,
    aqk: Tensor,
    akk: Tensor,
    do: Tensor,
    dht: Optional[Tensor],
    scale: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Dense KDA backward: ``(dq, dk, dv, dg, dbeta, dh0)`` (``dh0`` is empty without ``h0``)."""
    if _on_fla(q):
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd

        with _device_guard(q):
            dq, dk, dv, db, dg, dh0, _, _ = chunk_kda_bwd(
                q=q.contiguous(),
                k=k.contiguous(),
                v=v.contiguous(),
                beta=beta.contiguous(),
                Aqk=aqk,
                Akk=akk,
                scale=scale,
                initial_state=_c(h0),
                do=do.contiguous(),
                dht=_c(dht),
                g=g_cumsum,
                chunk_size=chunk_size,
            )
        dh0 = dh0 if h0 is not None else _empty(q.device, _state_dtype(q.dtype))
        return (
            _to_like(dq, q), _to_like(dk, k), _to_like(dv, v), _to_like(dg, g), _to_like(db, beta),
            dh0.contiguous(),
        )  # fmt: skip
    got = _kda_recurrent_bwd(q, k, v, g, beta, scale, h0, None, do, dht)
    res = [_to_like(d, x) for d, x in zip(got[:5], (q, k, v, g, beta))]
    dh0 = _to_like(got[5], h0) if h0 is not None else _empty(q.device, _state_dtype(q.dtype))
    return (*res, dh0)


@fla_kda_bwd.register_fake
def _(q, k, v, g, beta, h0, g_cumsum, aqk, akk, do, dht, scale, chunk_size):
    dh0 = h0.new_empty(h0.shape) if h0 is not None else q.new_empty(0, dtype=_state_dtype(q.dtype))
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
def _fla_cp_context(cu_seqlens, cu_seqlens_cpu, group_name, pre, post, first, last, conv=None,
                    pre_conv=None):  # fmt: skip
    from fla.ops.cp import FLACPContext

    return FLACPContext(
        group=_resolve_group(group_name),
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        pre_num_ranks=pre,
        post_num_ranks=post,
        is_first_rank=first,
        is_last_rank=last,
        conv1d_kernel_size=conv,
        pre_num_conv_tokens=pre_conv,
    )


def _starts_from_cu(cu_seqlens_cpu: Tensor, length: int, device) -> Tensor:
    starts = torch.zeros(1, length, dtype=torch.bool)
    starts[0, cu_seqlens_cpu[:-1].long().clamp(max=max(length - 1, 0))] = True
    return starts.to(device)


def _no_cp_off_cuda(group_name: str, what: str) -> None:
    if group_name:
        raise NotImplementedError(
            f"{what}: FLA's context-parallel path needs CUDA tensors (got a process group on a "
            "non-CUDA device); use fcp's static mode or pure-PyTorch operators instead"
        )


@torch.library.custom_op("fcp::fla_kda_varlen_fwd", mutates_args=())
def fla_kda_varlen_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor,
    cu_seqlens_cpu: Tensor,
    scale: float,
    chunk_size: int,
    group_name: str,
    pre_num_ranks: int,
    post_num_ranks: int,
    is_first_rank: bool,
    is_last_rank: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """FLA varlen KDA forward on one row ``[1, T, ...]``: ``(o, g_cumsum, Aqk, Akk, h0)``.

    ``group_name`` non-empty: FLA's CP path with the given ``FLACPContext`` fields; ``h0`` is then
    FLA's compressed incoming state ``[1, HV, K, V]`` (kept for the backward), else empty.
    """
    if _on_fla(q):
        from fla.ops.kda.chunk_fwd import chunk_kda_fwd
        from fla.ops.utils import prepare_chunk_indices

        cp = (
            _fla_cp_context(cu_seqlens, cu_seqlens_cpu, group_name, pre_num_ranks,
                            post_num_ranks, is_first_rank, is_last_rank)
            if group_name else None
        )  # fmt: skip
        with _device_guard(q):
            chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)
            o, _, gc, aqk, akk, *_, h0 = chunk_kda_fwd(
                q=q.contiguous(),
                k=k.contiguous(),
                v=v.contiguous(),
                g=g.contiguous(),
                beta=beta.contiguous(),
                scale=scale,
                initial_state=None,
                output_final_state=False,
                cu_seqlens=cu_seqlens,
                cu_seqlens_cpu=cu_seqlens_cpu,
                chunk_indices=chunk_indices,
                chunk_size=chunk_size,
                cp_context=cp,
            )
        if h0 is None:
            h0 = _empty(q.device, _state_dtype(q.dtype))
        return o.to(q.dtype), gc, aqk, akk, h0.contiguous()
    _no_cp_off_cuda(group_name, "fla_kda_varlen_fwd")
    starts = _starts_from_cu(cu_seqlens_cpu, q.shape[1], q.device)
    o, _ = _kda_recurrent(q, k, v, g, beta, scale, None, starts)
    shapes = _kda_fwd_shapes(q, k, v, g, chunk_size)
    return (
        o.to(q.dtype),
        _chunk_local_cumsum(g, chunk_size, shapes[2][1]),
        q.new_zeros(shapes[3][0], dtype=k.dtype),
        q.new_zeros(shapes[4][0], dtype=k.dtype),
        _empty(q.device, _state_dtype(q.dtype)),
    )


@fla_kda_varlen_fwd.register_fake
def _(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, scale, chunk_size, group_name, pre, post,
      first, last):  # fmt: skip
    shapes = _kda_fwd_shapes(q, k, v, g, chunk_size)
    st = shapes[1][1]
    h0 = q.new_empty((1, *shapes[1][0][1:]), dtype=st) if group_name else q.new_empty(0, dtype=st)
    o, _, gc, aqk, akk = (q.new_empty(s, dtype=d) for s, d in shapes)
    return o, gc, aqk, akk, h0


@torch.library.custom_op("fcp::fla_kda_varlen_bwd", mutates_args=())
def fla_kda_varlen_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    g_cumsum: Tensor,
    aqk: Tensor,
    akk: Tensor,
    h0: Tensor,
    do: Tensor,
    cu_seqlens: Tensor,
    cu_seqlens_cpu: Tensor,
    scale: float,
    chunk_size: int,
    group_name: str,
    pre_num_ranks: int,
    post_num_ranks: int,
    is_first_rank: bool,
    is_last_rank: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """FLA varlen KDA backward: ``(dq, dk, dv, dg, dbeta)``."""
    if _on_fla(q):
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd
        from fla.ops.utils import prepare_chunk_indices

        cp = (
            _fla_cp_context(cu_seqlens, cu_seqlens_cpu, group_name, pre_num_ranks,
                            post_num_ranks, is_first_rank, is_last_rank)
            if group_name else None
        )  # fmt: skip
        with _device_guard(q):
            chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)
            dq, dk, dv, db, dg, *_ = chunk_kda_bwd(
                q=q.contiguous(),
                k=k.contiguous(),
                v=v.contiguous(),
                beta=beta.contiguous(),
                Aqk=aqk,
                Akk=akk,
                scale=scale,
                initial_state=h0 if h0.numel() else None,
                do=do.contiguous(),
                dht=None,
                g=g_cumsum,
                cu_seqlens=cu_seqlens,
                chunk_indices=chunk_indices,
                chunk_size=chunk_size,
                cp_context=cp,
            )
        return _to_like(dq, q), _to_like(dk, k), _to_like(dv, v), _to_like(dg, g), _to_like(db, beta)
    _no_cp_off_cuda(group_name, "fla_kda_varlen_bwd")
    starts = _starts_from_cu(cu_seqlens_cpu, q.shape[1], q.device)
    got = _kda_recurrent_bwd(q, k, v, g, beta, scale, None, starts, do, None)
    return tuple(_to_like(d, x) for d, x in zip(got[:5], (q, k, v, g, beta)))


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
# varlen causal conv (FLA's causal_conv1d with cu_seqlens / cp_context)
# =============================================================================================
def _fla_activation(activation: str) -> Optional[str]:
    return activation or None


def _conv_taps(x, weight, starts):
    """Per tap ``i`` (``weight[:, i]``, lag ``W - 1 - i``): the lagged input, zero where the
    lagged token is in another document (or before the row). fp32 (fp64 for fp64)."""
    width = weight.shape[1]
    dt = _state_dtype(x.dtype)
    run = torch.cumsum(starts.long(), 1)
    xf = x.to(dt)
    taps = []
    for i in range(width):
        lag = width - 1 - i
        shifted = F.pad(xf, (0, 0, lag, 0))[:, : x.shape[1]]
        prev_run = F.pad(run, (lag, 0), value=-1)[:, : x.shape[1]]
        taps.append(torch.where((prev_run == run)[..., None], shifted, 0.0))
    return taps


def _conv_torch(x, weight, bias, starts, activation):
    """Document-masked depthwise causal conv on ``[B, T, D]`` (fallback): ``(y, pre_activation)``."""
    taps = _conv_taps(x, weight, starts)
    w = weight.to(taps[0].dtype)
    pre = sum(tap * w[:, i] for i, tap in enumerate(taps))
    if bias is not None:
        pre = pre + bias.to(pre.dtype)
    y = F.silu(pre) if activation else pre
    return y.to(x.dtype), pre


def _conv_torch_bwd(x, weight, bias, starts, activation, dy):
    """Hand-written backward of :func:`_conv_torch`: ``(dx, dweight, dbias)`` (compute dtype)."""
    taps = _conv_taps(x, weight, starts)
    width, length = weight.shape[1], x.shape[1]
    w = weight.to(taps[0].dtype)
    dpre = dy.to(w.dtype)
    if activation:
        pre = sum(tap * w[:, i] for i, tap in enumerate(taps))
        if bias is not None:
            pre = pre + bias.to(pre.dtype)
        sig = torch.sigmoid(pre)
        dpre = dpre * sig * (1 + pre * (1 - sig))
    dw = torch.stack([(tap * dpre).sum((0, 1)) for tap in taps], -1)
    run = torch.cumsum(starts.long(), 1)
    dx = torch.zeros_like(dpre)
    for i in range(width):
        lag = width - 1 - i
        prev_run = F.pad(run, (lag, 0), value=-1)[:, :length]
        contrib = torch.where((prev_run == run)[..., None], dpre * w[:, i], 0.0)
        dx = dx + F.pad(contrib, (0, 0, 0, lag))[:, lag:]  # output t feeds input t - lag
    db = dpre.sum((0, 1)) if bias is not None else None
    return dx, dw, db


def _conv_cp_state_shape(x, weight, cu_seqlens, group_name, is_first_rank):
    d, w = weight.shape
    if group_name and not is_first_rank and w > 1:
        return (cu_seqlens.shape[0] - 1, d, w)
    return (0, d, w)


@torch.library.custom_op("fcp::fla_conv_varlen_fwd", mutates_args=())
def fla_conv_varlen_fwd(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    cu_seqlens: Tensor,
    cu_seqlens_cpu: Tensor,
    activation: str,
    group_name: str,
    pre_num_conv_tokens: int,
    is_first_rank: bool,
) -> tuple[Tensor, Tensor]:
    """FLA ``causal_conv1d`` forward on one row ``[1, T, D]``: ``(y, initial_state)``.

    ``weight [D, W]`` (``weight[:, -1]`` multiplies the current token), ``activation`` ``""`` or
    ``"silu"``/``"swish"``. With ``group_name``: FLA's CP halo exchange (single hop: every shard
    needs ``>= W - 1`` tokens); ``initial_state`` ``[segments, D, W]`` is the received halo, kept
    for the backward (empty on the first rank and without CP).
    """
    if _on_fla(x):
        from fla.modules.causal_conv1d.ops import causal_conv1d_fwd

        x, weight, bias = x.contiguous(), weight.contiguous(), _c(bias)
        state = None
        with _device_guard(x):
            if group_name:
                from fla.modules.causal_conv1d.cp import CausalConv1dFunctionCP

                cp = _fla_cp_context(cu_seqlens, cu_seqlens_cpu, group_name, None, None,
                                     is_first_rank, None, weight.shape[1], pre_num_conv_tokens)  # fmt: skip
                state = CausalConv1dFunctionCP._prepare_initial_state_for_cp(
                    x=x, weight=weight, cu_seqlens=cu_seqlens, context=cp, group=cp.group
                )
            y, _ = causal_conv1d_fwd(
                x=x,
                weight=weight,
                bias=bias,
                residual=None,
                initial_state=state,
                output_final_state=False,
                activation=_fla_activation(activation),
                cu_seqlens=cu_seqlens,
                cu_seqlens_cpu=cu_seqlens_cpu,
            )
        if state is None:
            state = x.new_zeros(_conv_cp_state_shape(x, weight, cu_seqlens, "", True))
        return y.contiguous(), state.contiguous()
    _no_cp_off_cuda(group_name, "fla_conv_varlen_fwd")
    starts = _starts_from_cu(cu_seqlens_cpu, x.shape[1], x.device)
    y, _ = _conv_torch(x, weight, bias, starts, activation)
    return y.contiguous(), x.new_zeros(_conv_cp_state_shape(x, weight, cu_seqlens, "", True))


@fla_conv_varlen_fwd.register_fake
def _(x, weight, bias, cu_seqlens, cu_seqlens_cpu, activation, group_name, pre, first):
    shape = _conv_cp_state_shape(x, weight, cu_seqlens, group_name, first)
    return x.new_empty(x.shape), x.new_empty(shape)


@torch.library.custom_op("fcp::fla_conv_varlen_bwd", mutates_args=())
def fla_conv_varlen_bwd(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    initial_state: Tensor,
    dy: Tensor,
    cu_seqlens: Tensor,
    cu_seqlens_cpu: Tensor,
    activation: str,
    group_name: str,
    pre_num_conv_tokens: int,
    is_first_rank: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """FLA ``causal_conv1d`` backward: ``(dx, dweight, dbias)`` (``dbias`` empty without bias)."""
    if _on_fla(x):
        from fla.modules.causal_conv1d.ops import causal_conv1d_bwd

        x, weight, bias = x.contiguous(), weight.contiguous(), _c(bias)
        state = initial_state if initial_state.numel() else None
        with _device_guard(x):
            dx, dw, db, _, dh0 = causal_conv1d_bwd(
                x=x,
                dy=dy.contiguous(),
                dht=None,
                weight=weight,
                bias=bias,
                residual=None,
                initial_state=state,
                activation=_fla_activation(activation),
                cu_seqlens=cu_seqlens,
                cu_seqlens_cpu=cu_seqlens_cpu,
            )
            if group_name:
                from fla.modules.causal_conv1d.cp import CausalConv1dFunctionCP

                cp = _fla_cp_context(cu_seqlens, cu_seqlens_cpu, group_name, None, None,
                                     is_first_rank, None, weight.shape[1], pre_num_conv_tokens)  # fmt: skip
                CausalConv1dFunctionCP._correct_dx_for_cp(
                    dx=dx, dh0=dh0, W=weight.shape[1], group=cp.group, cp_context=cp
                )
        db = db.contiguous() if bias is not None else _empty(x.device, x.dtype)
        return dx.contiguous(), dw.contiguous(), db
    _no_cp_off_cuda(group_name, "fla_conv_varlen_bwd")
    starts = _starts_from_cu(cu_seqlens_cpu, x.shape[1], x.device)
    got = _conv_torch_bwd(x, weight, bias, starts, activation, dy)
    dx, dw = _to_like(got[0], x), _to_like(got[1], weight)
    db = _to_like(got[2], bias) if bias is not None else _empty(x.device, x.dtype)
    return dx, dw, db


@fla_conv_varlen_bwd.register_fake
def _(x, weight, bias, initial_state, dy, cu_seqlens, cu_seqlens_cpu, activation, group_name, pre,
      first):  # fmt: skip
    db = bias.new_empty(bias.shape) if bias is not None else x.new_empty(0)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


def _conv_setup(ctx, inputs, output):
    x, weight, bias, cu, cu_cpu, *meta = inputs
    _, state = output
    ctx.save_for_backward(x, weight, bias, state, cu, cu_cpu)
    ctx.meta = tuple(meta)
    ctx.mark_non_differentiable(state)


def _conv_backward(ctx, dy, _dstate):
    x, weight, bias, state, cu, cu_cpu = ctx.saved_tensors
    dy = _grad_or_zeros(dy, x)
    dx, dw, db = fla_conv_varlen_bwd(x, weight, bias, state, dy, cu, cu_cpu, *ctx.meta)
    return dx, dw, (db if bias is not None else None), None, None, None, None, None, None


fla_conv_varlen_fwd.register_autograd(_conv_backward, setup_context=_conv_setup)
