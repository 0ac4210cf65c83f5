"""Functions run on pool ranks by the WKV tests (importable by module path), and their inputs.

Every rank receives the same global inputs, runs :func:`fcp.ops.wkv.wkv` on its contiguous
slice and returns plain tensors; the test process concatenates them in rank order (the
parameters' gradients ``a``, ``u`` are per-rank partial sums: the test sums them).
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.wkv import wkv

NAMES = ("k", "v", "a", "u")


def make_inputs(batch, seq, channels, seed, dtype=torch.float32, key_scale=3.0) -> dict:
    """RWKV-like inputs: keys of scale ``key_scale`` (exponents far apart: the stabiliser
    matters), unit values, decays ``-exp(w)`` for ``w`` in [-5, 3] (RWKV's init spans [-5, 3]),
    bonuses around 0."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    w = -5.0 + 8.0 * torch.rand(channels, generator=gen, dtype=torch.float64)
    out = dict(k=key_scale * rand(batch, seq, channels), v=rand(batch, seq, channels),
               a=-torch.exp(w), u=rand(channels))  # fmt: skip
    return {n: x.to(dtype) for n, x in out.items()}


def wkv_fwd_bwd(env, inputs: dict, doc_ids, grad_out, compiled=False):
    """Local output and gradients of k, v (local) and a, u (this rank's partial sums) for
    ``sum(out * grad_out)``."""
    ctx = PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)
    xs = {n: (ctx.shard(inputs[n]) if inputs[n].dim() == 3 else inputs[n]).clone()
          for n in NAMES}  # fmt: skip
    for x in xs.values():
        x.requires_grad_()
    fn = wkv
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = fn(*(xs[n] for n in NAMES), ctx)
    (out.double() * ctx.shard(grad_out).double()).sum().backward()
    return out.detach(), {n: xs[n].grad for n in NAMES}
