"""Functions run on pool ranks by the KDA tests (importable by module path).

Every rank receives the same global inputs, runs :func:`fcp.ops.kda.kda` on its contiguous slice
and returns plain tensors; the test process concatenates them in rank order and compares with a
single-process run on the global tensors.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.kda import kda

NAMES = ("q", "k", "v", "g", "beta")


def _ctx(env, doc_ids: torch.Tensor) -> PackedContext:
    return PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)


def _local(env, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[1] // env.world_size
    return x[:, env.rank * n : (env.rank + 1) * n]


def kda_fwd_bwd(env, inputs: dict, doc_ids, grad_out, chunk_size: int, compiled=False):
    """Local output and local gradients of q, k, v, g, beta for ``sum(out * grad_out)``."""
    ctx = _ctx(env, doc_ids)
    xs = {n: _local(env, inputs[n]).clone().requires_grad_() for n in NAMES}
    fn = kda
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(kda, fullgraph=True, backend="aot_eager")
    out = fn(*(xs[n] for n in NAMES), ctx, chunk_size=chunk_size)
    (out.float() * _local(env, grad_out)).sum().backward()
    return out.detach(), {n: xs[n].grad for n in NAMES}


def kda_leak(env, inputs: dict, perturbed: dict, doc_ids, chunk_size: int):
    """Local outputs for two input sets (no grad), to compare bitwise outside the changed doc."""
    ctx = _ctx(env, doc_ids)
    with torch.no_grad():
        a = kda(*(_local(env, inputs[n]) for n in NAMES), ctx, chunk_size=chunk_size)
        b = kda(*(_local(env, perturbed[n]) for n in NAMES), ctx, chunk_size=chunk_size)
    return a, b


# ---------------------------------------------------------------------------------------------
# helpers shared by tests/test_kda.py and property_tests/test_kda_properties.py
# ---------------------------------------------------------------------------------------------
def make_inputs(batch, seq, heads, value_heads, dk, dv, seed, dtype=torch.float32) -> dict:
    """Realistic KDA inputs: L2-normalised keys, beta in (0, 1), log decays in [-8, 0]."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    g = -8.0 * torch.rand(batch, seq, value_heads, dk, generator=gen, dtype=torch.float64) ** 3
    out = dict(
        q=rand(batch, seq, heads, dk),
        k=torch.nn.functional.normalize(rand(batch, seq, heads, dk), dim=-1),
        v=rand(batch, seq, value_heads, dv),
        g=g,
        beta=torch.rand(batch, seq, value_heads, generator=gen, dtype=torch.float64),
    )
    return {n: x.to(dtype) for n, x in out.items()}


def doc_ids_from_lengths(rows: list[tuple[list[int], int]]) -> torch.Tensor:
    """int64 ``[batch, seq]`` from per-row ``(document lengths, pad length)``."""
    out = []
    for lens, pad in rows:
        counts = torch.tensor(lens, dtype=torch.long)
        ids = torch.repeat_interleave(torch.arange(1, len(lens) + 1), counts)
        out.append(torch.cat([ids, torch.zeros(pad, dtype=torch.long)]))
    return torch.stack(out)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (0 when both are all zero)."""
    a, ref = a.double(), ref.double()
    den = ref.abs().max().item()
    num = (a - ref).abs().max().item()
    return num / den if den else num
