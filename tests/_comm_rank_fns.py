"""Functions run on pool ranks by the collectives tests (must be importable by module path).

Each builds the same global tensors on every rank from a seed, runs the CP function on its
contiguous slice, and returns plain tensors; the test compares them with a single-process
reference computed on the concatenated global tensors.
"""

from __future__ import annotations

import torch

from fcp.comm import (
    all_gather_backward_anchor,
    all_gather_group,
    all_gather_sequence,
    left_halo,
    state_chain,
    with_left_halo,
)
from fcp.context import PackedContext


def _ctx(env, batch: int, local_len: int) -> PackedContext:
    doc_ids = torch.ones(batch, local_len * env.world_size, dtype=torch.long)
    return PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)


def gather_fwd_bwd(env, full: torch.Tensor, weights: torch.Tensor, dim: int, shard_div: int):
    """All-gather this rank's slice of ``full`` along ``dim``; loss uses per-rank ``weights[r]``."""
    n = full.shape[dim] // env.world_size
    x = full.narrow(dim, env.rank * n, n).clone().requires_grad_()
    local_len = n * shard_div
    ctx = _ctx(env, 1, local_len)
    if shard_div > 1:  # a compressed stream: the context form checks the fraction statically
        out = all_gather_sequence(x, ctx, dim=dim)
    else:
        out = all_gather_group(x, env.group, dim=dim)
    (out.float() * weights[env.rank]).sum().backward()
    return out.detach(), x.grad


def gather_not_differentiable(env, full: torch.Tensor):
    n = full.shape[1] // env.world_size
    x = full[:, env.rank * n : (env.rank + 1) * n].clone()
    out = all_gather_group(x, env.group, dim=1, differentiable=False)
    return out, out.requires_grad


def gather_unequal(env):
    x = torch.zeros(1, 2 + env.rank, 3)
    return all_gather_group(x, env.group, dim=1)


def halo_fwd_bwd(env, full: torch.Tensor, history: int, weights: torch.Tensor):
    local_len = full.shape[1] // env.world_size
    x = full[:, env.rank * local_len : (env.rank + 1) * local_len].clone().requires_grad_()
    halo = left_halo(x, _ctx(env, full.shape[0], local_len), history)
    loss = (halo.float() * weights[env.rank]).sum()
    if not loss.requires_grad:  # rank 0, no CP or history 0: the halo is constant zeros
        return halo.detach(), torch.zeros_like(x)
    loss.backward()
    return halo.detach(), x.grad


def widened_fwd_bwd(env, full: torch.Tensor, history: int, wg: torch.Tensor, wh: torch.Tensor,
                    compiled: bool = False):
    """``all_gather_sequence`` and ``with_left_halo`` with ``dtype=torch.float32`` on this rank's
    slice (two leaves); losses ``sum(gathered * wg[r])`` and ``sum(extended * wh[r])``. Returns
    both results and the two input gradients (eager, or compiled with fullgraph=True)."""
    local_len = full.shape[1] // env.world_size
    ctx = _ctx(env, full.shape[0], local_len)
    x = full[:, env.rank * local_len : (env.rank + 1) * local_len]
    xg, xh = x.clone().requires_grad_(), x.clone().requires_grad_()

    def block(a, b):
        g = all_gather_sequence(a, ctx, dtype=torch.float32)
        h = with_left_halo(b, ctx, history, dtype=torch.float32)
        return g, h, (g * wg[env.rank].to(g.dtype)).sum() + (h * wh[env.rank].to(h.dtype)).sum()

    if compiled:
        torch._dynamo.reset()
        block = torch.compile(block, fullgraph=True, backend="aot_eager")
    g, h, loss = block(xg, xh)
    loss.backward()
    return g.detach(), h.detach(), xg.grad, xh.grad


def halo_bytes(env, local_len: int, history: int, channels: int):
    """Bytes this rank sends and receives in one halo exchange, counted by a dispatch hook."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"send": 0, "recv": 0, "ops": []}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func)
            if "_c10d_functional" in name and "wait" not in name and "wrap_tensor" not in name:
                counts["ops"].append(name)
                counts["send"] += args[0].numel() * args[0].element_size()
                counts["recv"] += out.numel() * out.element_size()
            return out

    x = torch.randn(1, local_len, channels)
    with Count():
        left_halo(x, _ctx(env, 1, local_len), history)
    return counts


def chain_fwd_bwd(env, ms: torch.Tensor, ss: torch.Tensor, weights: torch.Tensor):
    m = ms[env.rank].clone().requires_grad_()
    s = ss[env.rank].clone().requires_grad_()
    s_in = state_chain(m, s, _ctx(env, 1, 1))
    loss = (s_in * weights[env.rank]).sum()
    if not loss.requires_grad:  # no CP: S_in is constant zeros
        return s_in.detach(), torch.zeros_like(m), torch.zeros_like(s), s_in.dtype
    loss.backward()
    return s_in.detach(), m.grad, s.grad, s_in.dtype


def anchor_case(env, full: torch.Tensor, idle_rank: int, use_anchor: bool):
    """Rank ``idle_rank``'s loss ignores the gathered tensor (e.g. it holds only padding)."""
    n = full.shape[1] // env.world_size
    x = full[:, env.rank * n : (env.rank + 1) * n].clone().requires_grad_()
    gathered = all_gather_group(x, env.group, dim=1)
    if env.rank == idle_rank:
        loss = (x * 2.0).sum()
    else:
        loss = (gathered * (env.rank + 1)).sum()
    if use_anchor:
        loss = loss + all_gather_backward_anchor(gathered)
    loss.backward()
    return loss.detach(), x.grad


def compiled_vs_eager(env, full: torch.Tensor, history: int):
    """Each collective compiled with fullgraph=True equals eager, forward and backward."""
    local_len = full.shape[1] // env.world_size
    ctx = _ctx(env, full.shape[0], local_len)
    k = full.shape[-1]

    def block(x):
        g = all_gather_sequence(x, ctx, dim=1)
        h = left_halo(x, ctx, history)
        m = torch.eye(k) * x[:, :1, :].mean() + x[0, :k, :k].t() * 0.1
        s = state_chain(m, x[0, :k, :], ctx)
        return g.pow(2).sum() + (h * 3).sum() + s.sum() + all_gather_backward_anchor(g)

    x = full[:, env.rank * local_len : (env.rank + 1) * local_len].clone()
    outs = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        xi = x.clone().requires_grad_()
        loss = fn(xi)
        loss.backward()
        outs.append((loss.detach(), xi.grad))
    return outs


def chain_inductor(env, ms: torch.Tensor, ss: torch.Tensor):
    """state_chain compiled with inductor, forward + backward, on every rank."""
    torch._dynamo.reset()
    ctx = _ctx(env, 1, 1)
    m = ms[env.rank].clone().requires_grad_()
    s = ss[env.rank].clone().requires_grad_()
    fn = torch.compile(lambda a, b: state_chain(a, b, ctx), backend="inductor", fullgraph=True)
    out = fn(m, s)
    out.sum().backward()
    return out.detach(), m.grad, s.grad
