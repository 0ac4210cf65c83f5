"""Functions run on pool ranks by the mLSTM tests (importable by module path), their inputs, and
the mLSTM composed as xLSTM's mixer composes it (the stabiliser + gated linear attention)."""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.gla import gla
from fcp.ops.mlstm import mlstm_stabilizer

NAMES = ("q", "k", "v", "log_f", "log_i")


def make_inputs(batch, seq, heads, dk, dv, seed, dtype=torch.float32, gate_scale=4.0) -> dict:
    """Unit q, k, v; forget gates ``logsigmoid`` of N(2, 2) (mostly remembering, some strong
    forgetting), input preactivations of scale ``gate_scale`` (the stabiliser switches between
    the initial state's term and the input gates)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    out = dict(q=rand(batch, seq, heads, dk), k=rand(batch, seq, heads, dk),
               v=rand(batch, seq, heads, dv),
               log_f=torch.nn.functional.logsigmoid(2.0 + 2.0 * rand(batch, seq, heads)),
               log_i=gate_scale * rand(batch, seq, heads))  # fmt: skip
    return {n: x.to(dtype) for n, x in out.items()}


def mlstm_composed(q, k, v, log_f, log_i, ctx, eps: float = 1e-6) -> torch.Tensor:
    """``h [B, L, H, V]``: the mLSTM as :class:`~fcp.integrations.hf.mixers.mlstm.MlstmMixer`
    computes it (:func:`fcp.ops.mlstm.mlstm_stabilizer`'s docstring)."""
    m, m_prev = mlstm_stabilizer(log_f, log_i, ctx)
    r, r_prev = m.detach(), m_prev.detach()
    dv = v.shape[-1]
    keys = k * torch.exp(log_i - r)[..., None].to(k.dtype)
    values = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    y = gla(q, keys, values, (log_f + r_prev - r).to(q.dtype), ctx, scale=q.shape[-1] ** -0.5)
    den = torch.maximum(y[..., dv:].abs(), torch.exp(-r)[..., None].to(y.dtype))
    return y[..., :dv] / (den + eps * torch.exp(m - r)[..., None].to(y.dtype))


def _ctx(env, doc_ids):
    return PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)


def mlstm_fwd_bwd(env, inputs: dict, doc_ids, grad_out):
    """Local output and input gradients of :func:`mlstm_composed` for ``sum(out * grad_out)``."""
    ctx = _ctx(env, doc_ids)
    xs = {n: ctx.shard(inputs[n]).clone().requires_grad_() for n in NAMES}
    out = mlstm_composed(*(xs[n] for n in NAMES), ctx)
    (out.double() * ctx.shard(grad_out).double()).sum().backward()
    return out.detach(), {n: xs[n].grad for n in NAMES}


def stabilizer_fwd_bwd(env, inputs: dict, doc_ids, grads):
    """Local ``(m, m_prev)`` and the gradients of ``log_f``, ``log_i`` for ``sum(m * g_m +
    m_prev * g_prev)``."""
    ctx = _ctx(env, doc_ids)
    xs = {n: ctx.shard(inputs[n]).clone().requires_grad_() for n in ("log_f", "log_i")}
    m, m_prev = mlstm_stabilizer(xs["log_f"], xs["log_i"], ctx)
    (m * ctx.shard(grads[0]) + m_prev * ctx.shard(grads[1])).sum().backward()
    return (m.detach(), m_prev.detach()), {n: x.grad for n, x in xs.items()}
