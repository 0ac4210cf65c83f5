"""Jobs for the low-precision CP property (``property_tests/test_precision_properties.py``).

Every job gets the *global* inputs (fp64 tensors holding bf16-representable values), casts them
to the run's dtype, runs one operator on its contiguous slice and returns its slice of the output
and of the input gradients of ``sum(out * grad_out)`` as fp64. ``env=None`` is one process.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.compressed import compressed_attention
from fcp.ops.conv import short_conv
from fcp.ops.doc_causal import doc_causal_attention
from fcp.ops.index_attention import index_attention
from fcp.ops.kda import kda

OPS = ("doc_causal", "compressed", "index_attention", "short_conv", "kda")
#: the differentiable per-token inputs of each operator (the gradients the property compares)
GRADS = {
    "doc_causal": ("q", "k", "v"),
    "compressed": ("q", "k", "v"),
    "index_attention": ("q", "k", "v"),
    "short_conv": ("x",),
    "kda": ("q", "k", "v", "g", "beta"),
}
#: inputs that are not per token (never sliced by rank)
PARAMS = ("weight", "bias")


def make_inputs(name: str, seed: int, batch: int, seq: int, dtype=torch.bfloat16) -> dict:
    """Global fp64 inputs of ``name`` whose values are exactly representable in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    if name == "short_conv":
        t = {"x": r(batch, seq, 8), "weight": r(8, 4, scale=0.5), "bias": r(8, scale=0.1)}
    elif name == "kda":
        t = {"q": r(batch, seq, 2, 8),
             "k": torch.nn.functional.normalize(r(batch, seq, 2, 8), dim=-1),
             "v": r(batch, seq, 2, 8),
             "g": -4.0 * torch.rand(batch, seq, 2, 8, generator=gen, dtype=torch.float64) ** 3,
             "beta": torch.rand(batch, seq, 2, generator=gen, dtype=torch.float64)}  # fmt: skip
    else:
        t = {"q": r(batch, seq, 4, 8), "k": r(batch, seq, 2, 8), "v": r(batch, seq, 2, 8)}
        if name == "index_attention":
            t["indices"] = torch.randint(-1, seq, (batch, seq, 12), generator=gen)
    return {n: x.to(dtype).double() if x.is_floating_point() else x for n, x in t.items()}


def output_shape(name: str, inputs: dict) -> tuple[int, ...]:
    if name == "short_conv":
        return tuple(inputs["x"].shape)
    if name == "kda":
        return tuple(inputs["v"].shape)
    return (*inputs["q"].shape[:3], inputs["v"].shape[-1])


def _call(name: str, t: dict, ctx: PackedContext) -> torch.Tensor:
    if name == "doc_causal":
        return doc_causal_attention(t["q"], t["k"], t["v"], ctx)
    if name == "compressed":
        return compressed_attention(t["q"], t["k"], t["v"], ctx, ratio=2, window=3)
    if name == "index_attention":
        return index_attention(t["q"], t["k"], t["v"], t["indices"], ctx)
    if name == "short_conv":
        return short_conv(t["x"], t["weight"], t["bias"], ctx, activation="silu")
    if name == "kda":
        return kda(t["q"], t["k"], t["v"], t["g"], t["beta"], ctx, chunk_size=8)
    raise ValueError(name)


def run(env, name: str, inputs: dict, doc_ids, grad_out, dtype) -> dict:
    """This rank's ``{"out": ..., <input>: grad}`` (fp64) of ``sum(out * grad_out)`` in ``dtype``
    (``env=None``: one process)."""
    if env is None:
        ctx = PackedContext(doc_ids)
    else:
        ctx = PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)
    sl = slice(*ctx.interval)
    t = {n: (x if n in PARAMS else x[:, sl]).clone() for n, x in inputs.items()}
    t = {n: x.to(dtype) if x.is_floating_point() else x for n, x in t.items()}
    for n in GRADS[name]:
        t[n].requires_grad_()
    out = _call(name, t, ctx)
    (out * grad_out[:, sl].to(dtype)).sum().backward()
    return {"out": out.detach().double(), **{n: t[n].grad.double() for n in GRADS[name]}}
