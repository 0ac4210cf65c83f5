"""Functions run on pool ranks by the FLA-interop tests, and helpers shared with the tests.

Self-contained on purpose (the KDA tests' helpers are another worker's file).
"""

from __future__ import annotations

import dataclasses

import torch

from fcp.context import PackedContext
import tests.support.fla_cpu_kernels  # noqa: F401  (CPU kernels of the fcp::fla_* ops)
from fcp.ops.kit.fla import build_fla_cp_context
from fcp.ops.kda.fla import kda_fla_static

NAMES = ("q", "k", "v", "g", "beta")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def make_inputs(batch, seq, heads, value_heads, dk, dv, seed, dtype=torch.float32) -> dict:
    """KDA inputs: L2-normalised keys, beta in (0, 1), log decays in [-8, 0] (mostly small)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    out = dict(
        q=rand(batch, seq, heads, dk),
        k=torch.nn.functional.normalize(rand(batch, seq, heads, dk), dim=-1),
        v=rand(batch, seq, value_heads, dv),
        g=-8.0 * torch.rand(batch, seq, value_heads, dk, generator=gen, dtype=torch.float64) ** 3,
        beta=torch.rand(batch, seq, value_heads, generator=gen, dtype=torch.float64),
    )
    return {n: x.to(dtype) for n, x in out.items()}


def doc_ids_from_lengths(rows: list[tuple[list[int], int]]) -> torch.Tensor:
    """int64 ``[batch, seq]`` from per-row ``(document lengths, pad length)``."""
    out = []
    for lens, pad in rows:
        ids = torch.repeat_interleave(torch.arange(1, len(lens) + 1), torch.tensor(lens, dtype=torch.long))
        out.append(torch.cat([ids, torch.zeros(pad, dtype=torch.long)]))
    return torch.stack(out)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (0 when both are all zero)."""
    a, ref = a.double(), ref.double()
    den = ref.abs().max().item()
    num = (a - ref).abs().max().item()
    return num / den if den else num


def _ctx(env, doc_ids: torch.Tensor) -> PackedContext:
    return PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)


def _local(env, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[1] // env.world_size
    return x[:, env.rank * n : (env.rank + 1) * n]


# ---------------------------------------------------------------------------------------------
# rank functions
# ---------------------------------------------------------------------------------------------
def static_kda_fwd_bwd(env, inputs: dict, doc_ids, grad_out, chunk_size: int, compiled=False):
    """Local output and gradients of :func:`kda_fla_static` (the ops' CPU test doubles)."""
    ctx = _ctx(env, doc_ids)
    xs = {n: _local(env, inputs[n]).clone().requires_grad_() for n in NAMES}
    fn = kda_fla_static
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(kda_fla_static, fullgraph=True, backend="aot_eager")
    out = fn(*(xs[n] for n in NAMES), ctx, chunk_size=chunk_size)
    (out.double() * _local(env, grad_out)).sum().backward()
    return out.detach(), {n: xs[n].grad for n in NAMES}


def fla_context_fields(env, doc_ids, row: int, conv_kernel_size):
    """Our context and FLA's ``build_cp_context`` on the real group, as comparable dicts.

    Also reports whether the context holds the group object and whether a second call hits the
    cache (the same object).
    """
    from fla.ops.cp import build_cp_context

    ctx = _ctx(env, doc_ids)
    ours = build_fla_cp_context(ctx, row, env.group, conv_kernel_size)
    again = build_fla_cp_context(ctx, row, env.group, conv_kernel_size)
    dev, cpu = ctx.row_cu_seqlens(row)
    theirs = build_cp_context(dev, env.group, conv_kernel_size, cu_seqlens_cpu=cpu)

    def fields(c):
        out = {}
        for f in dataclasses.fields(c):
            value = getattr(c, f.name)
            if f.name == "group":
                value = value is env.group
            elif isinstance(value, torch.Tensor):
                value = (value.dtype, value.device.type, value.tolist())
            out[f.name] = value
        return out

    return fields(ours), fields(theirs), again is ours
