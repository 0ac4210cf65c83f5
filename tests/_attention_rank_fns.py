"""Inputs and per-rank jobs for the attention tests (importable by module path for RankPool).

Every job receives the *global* tensors, slices its own contiguous interval, runs the operator
under CP and returns plain tensors; the tests compare them with the single-process operator (or
the float64 references in ``tests/test_attention.py``) on the global tensors.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.compressed import compressed_attention
from fcp.ops.doc_causal import doc_causal_attention

OPS = ("doc_causal", "compressed")
QKV = ("q", "k", "v")


def make_inputs(
    seed: int,
    batch: int,
    seq: int,
    heads: int = 2,
    kv_heads: int = 1,
    dim: int = 4,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Global random inputs of every operator (CPU)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "q": r(batch, seq, heads, dim),
        "k": r(batch, seq, kv_heads, dim),
        "v": r(batch, seq, kv_heads, dim),
    }


def call_op(name: str, t: dict[str, torch.Tensor], ctx: PackedContext, kwargs: dict):
    if name == "doc_causal":
        return doc_causal_attention(t["q"], t["k"], t["v"], ctx, **kwargs)
    if name == "compressed":
        return compressed_attention(t["q"], t["k"], t["v"], ctx, **kwargs)
    raise ValueError(name)


def forward_backward(name, inputs, ctx, kwargs, grad_out, sl=slice(None)):
    """Run ``name`` on ``inputs[:, sl]`` (q/k/v as fresh leaves); loss ``sum(out * grad_out)``."""
    t = {n: x[:, sl].clone() for n, x in inputs.items()}
    for n in QKV:
        t[n].requires_grad_()
    out = call_op(name, t, ctx, kwargs)
    (out.float() * grad_out[:, sl]).sum().backward()
    return {"out": out.detach(), **{n: t[n].grad for n in QKV}}


def single_process(name, inputs, doc_ids, kwargs, grad_out):
    return forward_backward(name, inputs, PackedContext(doc_ids), kwargs, grad_out)


def cp_rank(env, name, inputs, doc_ids, kwargs, grad_out):
    """One rank of a CP run: this rank's out and q/k/v grads."""
    ctx = PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)
    sl = slice(ctx.seq_start, ctx.seq_end)
    return forward_backward(name, inputs, ctx, kwargs, grad_out, sl)


def cp_error(env, name, inputs, doc_ids, kwargs):
    """The ValueError message a CP call raises (``None`` if it does not raise)."""
    ctx = PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)
    sl = slice(ctx.seq_start, ctx.seq_end)
    try:
        call_op(name, {n: x[:, sl] for n, x in inputs.items()}, ctx, kwargs)
    except ValueError as e:
        return str(e)
    return None


# ------------------------------------------------------------------------------ compile
FORBIDDEN_OPS = ("_local_scalar_dense", "aten.nonzero", "aten.item")


def recording_backend(graphs: list):
    """``aot_eager`` rebuilt from its parts (AOTAutograd, boxed eager run of the aten graphs) so
    the forward and backward aten graphs can be recorded as text."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, example_inputs):
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record)


def compile_packings(name, inputs, doc_ids_list, kwargs, grad_out, ctx_fn):
    """Compile ``name`` once (``fullgraph=True``, aot_eager) and run it over many packings.

    Returns ``(frame_count, forbidden aten ops found, max |compiled - eager|, graphs recorded)``
    over outputs and q/k/v gradients. ``frame_count`` comes from
    ``torch._dynamo.testing.CompileCounterWithBackend`` (one per compilation: 1 means no
    recompilation across the packings; a graph break would raise under ``fullgraph``).
    """
    import torch._dynamo.testing

    torch._dynamo.reset()
    graphs: list[str] = []
    counter = torch._dynamo.testing.CompileCounterWithBackend(recording_backend(graphs))

    def op(t, ctx):
        return call_op(name, t, ctx, kwargs)

    compiled = torch.compile(op, backend=counter, fullgraph=True)
    worst = 0.0
    for doc_ids in doc_ids_list:
        ctx = ctx_fn(doc_ids)
        sl = slice(ctx.seq_start, ctx.seq_end)
        results = []
        for fn in (op, compiled):
            t = {n: x[:, sl].clone() for n, x in inputs.items()}
            for n in QKV:
                t[n].requires_grad_()
            out = fn(t, ctx)
            (out.float() * grad_out[:, sl]).sum().backward()
            results.append([out.detach()] + [t[n].grad for n in QKV])
        for a, b in zip(*results):
            worst = max(worst, (a.float() - b.float()).abs().max().item())
    found = sorted({op for g in graphs for op in FORBIDDEN_OPS if op in g})
    return counter.frame_count, found, worst, len(graphs)


def cp_compile_rank(env, name, inputs, doc_ids_list, kwargs, grad_out):
    def ctx_fn(doc_ids):
        return PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)

    return compile_packings(name, inputs, doc_ids_list, kwargs, grad_out, ctx_fn)
