"""Functions run on pool ranks by the gated-linear-attention tests (importable by module path),
and the input helpers those tests share.

Every rank receives the same global inputs, runs :func:`fcp.ops.gla.gla` (or the ``"fla"``
backend's static composition on the ops' CPU test doubles) on its contiguous slice and returns
plain tensors; the test process concatenates them in rank order.
"""

from __future__ import annotations

import torch

import tests.support.fla_cpu_kernels  # noqa: F401  (CPU kernels of the fcp::fla_* ops)
from fcp.context import PackedContext
from fcp.ops.gla import gla
from fcp.ops.gla.fla import gla_fla_static
from fcp.ops.gla.fla_keyed import gla_keyed_fla_static
from tests.support.fla_cpu_kernels import _gla_bwd, _gla_fwd, _opaque

# CPU doubles of the per-key ops: the scalar ops' doubles, whose reference recurrence takes a
# decay per key as well
for _name, _fn in (("fcp::fla_gla_keyed_fwd", _gla_fwd), ("fcp::fla_gla_keyed_bwd", _gla_bwd)):
    torch.library.register_kernel(_name, "cpu", _opaque(_fn))

NAMES = ("q", "k", "v", "a")


def make_inputs(batch, seq, groups, heads, dk, dv, seed, dtype=torch.float32) -> dict:
    """Mamba2-like inputs: q (C), k (B) and v of unit scale, log decays in [-4, 0] (mostly
    small), ``heads`` a multiple of ``groups``."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    out = dict(q=rand(batch, seq, groups, dk), k=rand(batch, seq, groups, dk),
               v=rand(batch, seq, heads, dv),
               a=-4.0 * torch.rand(batch, seq, heads, generator=gen, dtype=torch.float64) ** 3)
    return {n: x.to(dtype) for n, x in out.items()}


def make_keyed_inputs(batch, seq, groups, heads, dk, dv, seed, dtype=torch.float32,
                      strength: float = 4.0) -> dict:  # fmt: skip
    """:func:`make_inputs` with a decay per key dimension: ``a [batch, seq, heads, dk]`` in
    ``[-strength, 0]`` (mostly small; ``strength`` 12: many entries below -8)."""
    out = make_inputs(batch, seq, groups, heads, dk, dv, seed, torch.float64)
    gen = torch.Generator().manual_seed(seed + 1)
    a = -strength * torch.rand(batch, seq, heads, dk, generator=gen, dtype=torch.float64) ** 3
    return {n: x.to(dtype) for n, x in dict(out, a=a).items()}


def _rank_context(env, doc_ids: torch.Tensor) -> PackedContext:
    return PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)


def gla_fwd_bwd(env, inputs: dict, doc_ids, grad_out, chunk_size: int, compiled=False,
                static_fla=False):  # fmt: skip
    """Local output and local gradients of q, k, v, a for ``sum(out * grad_out)``;
    ``static_fla``: the ``"fla"`` backend's composition on the CPU doubles of its ops."""
    ctx = _rank_context(env, doc_ids)
    xs = {n: ctx.shard(inputs[n]).clone().requires_grad_() for n in NAMES}
    if static_fla:
        static = gla_keyed_fla_static if inputs["a"].dim() == 4 else gla_fla_static

        def fn(*args, chunk_size):
            return static(*args, chunk_size=chunk_size)
    else:
        fn = gla
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = fn(*(xs[n] for n in NAMES), ctx, chunk_size=chunk_size)
    (out.double() * ctx.shard(grad_out).double()).sum().backward()
    return out.detach(), {n: xs[n].grad for n in NAMES}


def gla_leak(env, inputs: dict, perturbed: dict, doc_ids, chunk_size: int):
    """Local outputs for two input sets (no grad), to compare bitwise outside the changed doc."""
    ctx = _rank_context(env, doc_ids)
    with torch.no_grad():
        return tuple(gla(*(ctx.shard(xs[n]) for n in NAMES), ctx, chunk_size=chunk_size)
                     for xs in (inputs, perturbed))  # fmt: skip
