"""Functions run on pool ranks by the elementwise-scan tests (importable by module path), and
the input helpers those tests share.

Every rank receives the same global inputs, runs
:func:`fcp.ops.elementwise_scan.elementwise_scan` on its contiguous slice and returns plain
tensors; the test process concatenates them in rank order.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.elementwise_scan import elementwise_scan

NAMES = ("x", "a")


def make_inputs(batch, seq, channels, seed, dtype=torch.float32, log_low=-4.0) -> dict:
    """RG-LRU-like inputs: ``x`` of unit scale and decays ``a = exp(log_a)``, ``log_a`` in
    ``[log_low, 0]`` (mostly small); ``channels`` an int or a tuple (``(heads, P)``)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, seq, *((channels,) if isinstance(channels, int) else channels))
    log_a = log_low * torch.rand(*shape, generator=gen, dtype=torch.float64) ** 3
    out = dict(x=torch.randn(*shape, generator=gen, dtype=torch.float64), a=log_a.exp())
    return {n: t.to(dtype) for n, t in out.items()}


def _rank_context(env, doc_ids: torch.Tensor) -> PackedContext:
    return PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)


def scan_fwd_bwd(env, inputs: dict, doc_ids, grad_out, compiled=False):
    """Local output and local gradients of x and a for ``sum(out * grad_out)``."""
    ctx = _rank_context(env, doc_ids)
    xs = {n: ctx.shard(inputs[n]).clone().requires_grad_() for n in NAMES}
    fn = elementwise_scan
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = fn(*(xs[n] for n in NAMES), ctx)
    (out.double() * ctx.shard(grad_out).double()).sum().backward()
    return out.detach(), {n: xs[n].grad for n in NAMES}


def scan_leak(env, inputs: dict, perturbed: dict, doc_ids):
    """Local outputs for two input sets (no grad), to compare bitwise outside the changed doc."""
    ctx = _rank_context(env, doc_ids)
    with torch.no_grad():
        return tuple(elementwise_scan(*(ctx.shard(xs[n]) for n in NAMES), ctx)
                     for xs in (inputs, perturbed))  # fmt: skip
