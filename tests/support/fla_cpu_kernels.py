"""CPU kernels for fcp's FLA custom ops, built from fcp's references (test doubles).

fcp's ``fcp::fla_*`` ops are CUDA-only. Importing this module registers a CPU kernel for each of
them that implements the same contract with the operators' references:

* ``fla_kda_fwd`` / ``fla_kda_varlen_fwd``: :func:`fcp.ops.kda.reference.kda_recurrence`
  (``g_cumsum`` as FLA defines it; FLA's intra-chunk matrices as zeros: only the backward op
  reads them, and these backward kernels recompute instead);
* the backward ops: autograd of the same forward (no hand-written backward), run on a helper
  thread so that the caller's dispatch state (autograd below the op, opcheck's schema mode)
  does not reach it, as none reaches a real kernel;
* ``fla_conv_varlen_fwd`` / ``_bwd``: the masked conv on a map rebuilt from ``cu_seqlens``;
* ``fla_gla_fwd`` / ``fla_gla_bwd``: :func:`fcp.ops.gla.reference.gla_recurrence` from a zero
  state, and autograd of it.

So the FLA backends' composition (gate resets, the CP state chain around the op, schemas, fake
kernels, autograd wiring) is testable on CPU, while FLA's kernels themselves run on a GPU or under
the Triton interpreter (:mod:`tests.support.fla_interpret`). FLA's own CP variants
(``group_name`` set) have no CPU double: they raise ``NotImplementedError``.
"""

from __future__ import annotations

import concurrent.futures
import math

import torch

import fcp.ops.conv.fla  # noqa: F401  (defines the conv ops)
import fcp.ops.gla.fla  # noqa: F401  (defines the GLA ops)
import fcp.ops.kda.fla  # noqa: F401  (defines the KDA ops)
from fcp.context import PackedContext
from fcp.layout import doc_ids_from_cu_seqlens, document_starts
from fcp.ops.conv.masked import short_conv_masked
from fcp.ops.kit.fla import state_dtype
from fcp.ops.gla.reference import gla_recurrence
from fcp.ops.kda.reference import kda_recurrence

__all__ = ["chunk_local_cumsum"]

RCP_LN2 = 1.0 / math.log(2.0)  # FLA keeps cumulative gates in log2 units


def chunk_local_cumsum(g: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """FLA's ``g_cumsum``: per-chunk cumulative sum of ``g`` in log2 units (fp32)."""
    bsz, length = g.shape[:2]
    n = -(-length // chunk_size)
    x = g.to(state_dtype(g.dtype))
    x = torch.cat([x, x.new_zeros(bsz, n * chunk_size - length, *g.shape[2:])], 1)
    x = x.reshape(bsz, n, chunk_size, *g.shape[2:]).cumsum(2) * RCP_LN2
    return x.reshape(bsz, n * chunk_size, *g.shape[2:])[:, :length].contiguous()


def _no_cp(group_name: str, op: str) -> None:
    if group_name:
        raise NotImplementedError(f"{op}: FLA's own CP path has no CPU test double")


def _starts(cu_seqlens_cpu: torch.Tensor, length: int, device) -> torch.Tensor:
    return document_starts(doc_ids_from_cu_seqlens(cu_seqlens_cpu.long(), length)).to(device)


def _intra_zeros(q, v, chunk_size):
    shape = (q.shape[0], q.shape[1], v.shape[2], chunk_size)
    return q.new_zeros(shape), q.new_zeros(shape)


# ---------------------------------------------------------------------------------------------
# dense KDA
# ---------------------------------------------------------------------------------------------
def _kda_fwd(q, k, v, g, beta, h0, scale, chunk_size):
    o, ht = kda_recurrence(q, k, v, g, beta, scale, initial_state=h0)
    st = state_dtype(q.dtype)
    return (o.to(q.dtype), ht.to(st), chunk_local_cumsum(g, chunk_size),
            *_intra_zeros(q, v, chunk_size))  # fmt: skip


def _kda_bwd(q, k, v, g, beta, h0, g_cumsum, aqk, akk, do, dht, scale, chunk_size):
    primals = (q, k, v, g, beta) + (() if h0 is None else (h0,))

    def f(q, k, v, g, beta, h0=None):
        return kda_recurrence(q, k, v, g, beta, scale, initial_state=h0)

    st = state_dtype(q.dtype)
    ht_shape = (q.shape[0], v.shape[2], q.shape[3], v.shape[3])
    dht = torch.zeros(ht_shape, dtype=st) if dht is None else dht
    grads = _vjp(f, primals, (do, dht))
    out = [d.to(x.dtype).contiguous() for d, x in zip(grads[:5], (q, k, v, g, beta))]
    dh0 = grads[5].contiguous() if h0 is not None else q.new_empty(0, dtype=st)
    return (*out, dh0)


# ---------------------------------------------------------------------------------------------
# varlen KDA
# ---------------------------------------------------------------------------------------------
def _kda_varlen_fwd(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, scale, chunk_size, group_name,
                    pre, post, first, last):  # fmt: skip
    _no_cp(group_name, "fla_kda_varlen_fwd")
    starts = _starts(cu_seqlens_cpu, q.shape[1], q.device)
    o, _ = kda_recurrence(q, k, v, g, beta, scale, starts=starts)
    return (o.to(q.dtype), chunk_local_cumsum(g, chunk_size), *_intra_zeros(q, v, chunk_size),
            q.new_empty(0, dtype=state_dtype(q.dtype)))  # fmt: skip


def _kda_varlen_bwd(q, k, v, g, beta, g_cumsum, aqk, akk, h0, do, cu_seqlens, cu_seqlens_cpu,
                    scale, chunk_size, group_name, pre, post, first, last):  # fmt: skip
    _no_cp(group_name, "fla_kda_varlen_bwd")
    starts = _starts(cu_seqlens_cpu, q.shape[1], q.device)
    grads = _vjp(lambda *a: kda_recurrence(*a, scale, starts=starts)[0], (q, k, v, g, beta), (do,))
    return tuple(d.to(x.dtype).contiguous() for d, x in zip(grads, (q, k, v, g, beta)))


# ---------------------------------------------------------------------------------------------
# dense scalar-gate GLA
# ---------------------------------------------------------------------------------------------
def _gla_fwd(q, k, v, g, scale, chunk_size):
    o, ht = gla_recurrence(q, k, v, g, scale)
    return o.to(q.dtype), ht.float()


def _gla_bwd(q, k, v, g, do, dht, scale, chunk_size):
    dht = torch.zeros(q.shape[0], *q.shape[2:], v.shape[3]) if dht is None else dht
    grads = _vjp(lambda *xs: gla_recurrence(*xs, scale), (q, k, v, g), (do, dht))
    return tuple(d.to(x.dtype).contiguous() for d, x in zip(grads, (q, k, v, g)))


# ---------------------------------------------------------------------------------------------
# varlen conv
# ---------------------------------------------------------------------------------------------
def _conv(x, weight, bias, cu_seqlens_cpu, activation):
    ctx = PackedContext(doc_ids_from_cu_seqlens(cu_seqlens_cpu.long(), x.shape[1]).to(x.device))
    return short_conv_masked(x, weight, bias, ctx, activation or None)


def _conv_fwd(x, weight, bias, cu_seqlens, cu_seqlens_cpu, activation, group_name, pre, first):
    _no_cp(group_name, "fla_conv_varlen_fwd")
    return _conv(x, weight, bias, cu_seqlens_cpu, activation).contiguous(), x.new_zeros(
        0, *weight.shape
    )


def _conv_bwd(x, weight, bias, initial_state, dy, cu_seqlens, cu_seqlens_cpu, activation,
              group_name, pre, first):  # fmt: skip
    _no_cp(group_name, "fla_conv_varlen_bwd")
    primals = (x, weight) + (() if bias is None else (bias,))
    grads = _vjp(lambda x, w, b=None: _conv(x, w, b, cu_seqlens_cpu, activation), primals, (dy,))
    db = grads[2].contiguous() if bias is not None else x.new_empty(0)
    return grads[0].contiguous(), grads[1].contiguous(), db


_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fla-cpu-double")


def _opaque(fn):
    """Run ``fn`` as an opaque kernel on a fresh thread: thread-local dispatch state (autograd
    excluded below a custom op, Python dispatch modes) starts clean there."""

    def run(*args):
        with torch.no_grad():  # a kernel's outputs carry no autograd history
            out = fn(*args)
        # fresh, contiguous, offset-0 outputs, as a kernel writes them (and the fake kernels say)
        return tuple(t.clone(memory_format=torch.contiguous_format) for t in out)

    def kernel(*args):
        return _THREAD.submit(run, *args).result()

    return kernel


def _vjp(f, primals, cotangents):
    """Gradients of ``f(*primals)`` (a tensor or tuple) against ``cotangents`` by autograd."""
    with torch.enable_grad():
        leaves = [p.detach().requires_grad_() for p in primals]
        out = f(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        cots = [c.to(o.dtype) for c, o in zip(cotangents, outs)]
        grads = torch.autograd.grad(outs, leaves, cots, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, primals)]


for _name, _fn in (
    ("fcp::fla_kda_fwd", _kda_fwd),
    ("fcp::fla_kda_bwd", _kda_bwd),
    ("fcp::fla_kda_varlen_fwd", _kda_varlen_fwd),
    ("fcp::fla_kda_varlen_bwd", _kda_varlen_bwd),
    ("fcp::fla_conv_varlen_fwd", _conv_fwd),
    ("fcp::fla_conv_varlen_bwd", _conv_bwd),
    ("fcp::fla_gla_fwd", _gla_fwd),
    ("fcp::fla_gla_bwd", _gla_bwd),
):
    torch.library.register_kernel(_name, "cpu", _opaque(_fn))
