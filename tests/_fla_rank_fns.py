"""Functions run on pool ranks by the FLA-interop tests, and helpers shared by those tests.

Importing it registers fcp's CPU test doubles of the ``fcp::fla_*`` ops
(:mod:`tests.support.fla_cpu_kernels`), in the test process and on every rank that runs a job
from here.
"""

from __future__ import annotations

import dataclasses

import torch

import tests.support.fla_cpu_kernels  # noqa: F401  (CPU kernels of the fcp::fla_* ops)
from fcp.ops.kit.fla import build_fla_cp_context
from fcp.ops.kda.fla import kda_fla_static
from fcp.ops.conv import short_conv
from tests import _kda_rank_fns
from tests.support import cp_jobs


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def fla_context_dict(c, group=None) -> dict:
    """Every field of an ``FLACPContext``, tensors as (dtype, device type, values) and the
    group as whether it is ``group``."""
    out = {}
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        if f.name == "group" and group is not None:
            value = value is group
        elif isinstance(value, torch.Tensor):
            value = (value.dtype, value.device.type, value.tolist())
        out[f.name] = value
    return out


class Block(torch.nn.Module):
    """A KDA + short-conv block: conv(x) -> q, k, v; linear -> g, beta; ``mixer`` (``fcp.kda``
    or a function of its signature) with ``mixer_kw``; linear out."""

    def __init__(self, d=8, h=1, hv=2, dk=4, dv=4, width=3, mixer=kda_fla_static,
                 mixer_kw=(("chunk_size", 32),)):  # fmt: skip
        super().__init__()
        self.h, self.hv, self.dk, self.dv = h, hv, dk, dv
        self.mixer, self.mixer_kw = mixer, dict(mixer_kw)
        self.proj = torch.nn.Linear(d, 2 * h * dk + hv * dv, bias=False)
        self.conv_w = torch.nn.Parameter(torch.randn(2 * h * dk + hv * dv, width) * 0.3)
        self.gate = torch.nn.Linear(d, hv * dk + hv)
        self.out = torch.nn.Linear(hv * dv, d, bias=False)

    def forward(self, x, context):
        b, t, _ = x.shape
        h, hv, dk, dv = self.h, self.hv, self.dk, self.dv
        qkv = short_conv(self.proj(x), self.conv_w, None, context, "silu")
        q, k, v = qkv.split([h * dk, h * dk, hv * dv], -1)
        q = q.reshape(b, t, h, dk)
        k = torch.nn.functional.normalize(k.reshape(b, t, h, dk), dim=-1)
        v = v.reshape(b, t, hv, dv)
        gb = self.gate(x)
        g = -torch.nn.functional.softplus(gb[..., : hv * dk]).reshape(b, t, hv, dk)
        beta = torch.sigmoid(gb[..., hv * dk :])
        o = self.mixer(q, k, v, g, beta, context, **self.mixer_kw)
        return self.out(o.reshape(b, t, -1))


# ---------------------------------------------------------------------------------------------
# rank functions
# ---------------------------------------------------------------------------------------------
def static_kda_fwd_bwd(env, inputs: dict, doc_ids, grad_out, chunk_size: int, compiled=False):
    """This rank's output and gradients of :func:`kda_fla_static` (the ops' CPU test doubles):
    :func:`tests._kda_rank_fns.kda_fwd_bwd`."""
    return _kda_rank_fns.kda_fwd_bwd(env, inputs, doc_ids, grad_out, chunk_size, compiled,
                                     fn=kda_fla_static)  # fmt: skip


def fla_context_fields(env, doc_ids, row: int, conv_kernel_size):
    """Our context and FLA's ``build_cp_context`` on the real group, as comparable dicts.

    Also reports whether the context holds the group object and whether a second call hits the
    cache (the same object).
    """
    from fla.ops.cp import build_cp_context

    ctx = cp_jobs.cp_context(env, doc_ids)
    ours = build_fla_cp_context(ctx, row, env.group, conv_kernel_size)
    again = build_fla_cp_context(ctx, row, env.group, conv_kernel_size)
    dev, cpu = ctx.row_cu_seqlens(row)
    theirs = build_cp_context(dev, env.group, conv_kernel_size, cu_seqlens_cpu=cpu)

    return (fla_context_dict(ours, env.group), fla_context_dict(theirs, env.group),
            again is ours)  # fmt: skip
