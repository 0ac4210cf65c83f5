"""Rank functions of the non-finite isolation properties: one operator, clean and poisoned.

Each rank runs the operator on its contiguous slice of the global inputs twice (clean, then with
one document poisoned in an input or in the upstream gradient) and returns both local outputs and
both sets of local input gradients; the test compares them outside the poisoned document.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.ops.compressed import compressed_attention
from fcp.ops.doc_causal import doc_causal_attention
from fcp.ops.conv import short_conv
from fcp.ops.gla import gla
from fcp.ops.kda import kda

#: per operator: its token inputs (poisonable, differentiated) in call order
TOKEN_INPUTS = {
    "kda": ("q", "k", "v", "g", "beta"),
    "gdn": ("q", "k", "v", "g", "beta"),  # kda with one gate per head (Gated DeltaNet)
    "gla": ("q", "k", "v", "a"),  # gated linear attention, GQA (Mamba2's SSD)
    "short_conv": ("x",),
    "doc_causal": ("q", "k", "v"),
    "compressed": ("q", "k", "v"),
}


def make_inputs(op: str, batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """Global fp32 inputs of ``op`` (and its parameters, which are never poisoned)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(batch, seq, *shape, generator=gen)

    if op in ("kda", "gdn"):
        gate = (2, 4) if op == "kda" else (2,)
        return dict(q=r(2, 4), k=torch.nn.functional.normalize(r(2, 4), dim=-1), v=r(2, 4),
                    g=-torch.rand(batch, seq, *gate, generator=gen) * 2,
                    beta=torch.rand(batch, seq, 2, generator=gen))  # fmt: skip
    if op == "gla":
        return dict(q=r(1, 4), k=r(1, 4), v=r(2, 4), a=-torch.rand(batch, seq, 2, generator=gen) * 2)
    if op == "short_conv":
        return dict(x=r(6), weight=torch.randn(6, 4, generator=gen), bias=torch.randn(6, generator=gen))
    return dict(q=r(4, 8), k=r(2, 8), v=r(2, 8))


def call(op: str, t: dict, ctx: PackedContext) -> torch.Tensor:
    if op in ("kda", "gdn"):
        return kda(t["q"], t["k"], t["v"], t["g"], t["beta"], ctx, chunk_size=4)
    if op == "gla":
        return gla(t["q"], t["k"], t["v"], t["a"], ctx, chunk_size=4)
    if op == "short_conv":
        return short_conv(t["x"], t["weight"], t["bias"], ctx, "silu")
    if op == "doc_causal":
        return doc_causal_attention(t["q"], t["k"], t["v"], ctx)
    return compressed_attention(t["q"], t["k"], t["v"], ctx, ratio=2, window=3)


def _run(env, op, inputs, doc_ids, grad_out):
    if env is None:
        ctx, sl = PackedContext(doc_ids), slice(None)
    else:
        ctx = PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)
        sl = slice(ctx.seq_start, ctx.seq_end)
    names = TOKEN_INPUTS[op]
    t = {n: (x[:, sl] if n in names else x).clone().requires_grad_(n in names)
         for n, x in inputs.items()}  # fmt: skip
    out = call(op, t, ctx)
    out.backward(grad_out[:, sl])
    return out.detach(), {n: t[n].grad for n in names}


def clean_and_poisoned(env, op, inputs, poisoned_inputs, doc_ids, grad_out, poisoned_grad):
    """``((out, grads) clean, (out, grads) poisoned)`` of this rank (``env=None``: one process)."""
    return (_run(env, op, inputs, doc_ids, grad_out),
            _run(env, op, poisoned_inputs, doc_ids, poisoned_grad))  # fmt: skip
