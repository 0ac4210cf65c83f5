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
from tests.support import cp_jobs
from tests.support.inputs import attention_inputs, kda_inputs

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
    if op in ("kda", "gdn"):
        return kda_inputs(batch, seq, 2, 2, 4, 4, seed, gate=op)
    gen = torch.Generator().manual_seed(seed)
    if op == "gla":
        def r(*shape):
            return torch.randn(batch, seq, *shape, generator=gen)

        return dict(q=r(1, 4), k=r(1, 4), v=r(2, 4), a=-torch.rand(batch, seq, 2, generator=gen) * 2)
    if op == "short_conv":
        return dict(x=torch.randn(batch, seq, 6, generator=gen),
                    weight=torch.randn(6, 4, generator=gen), bias=torch.randn(6, generator=gen))
    return attention_inputs(seed, batch, seq, heads=4, kv_heads=2, dim=8)


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
    ctx = PackedContext(doc_ids) if env is None else cp_jobs.cp_context(env, doc_ids)
    names = TOKEN_INPUTS[op]
    params = [n for n in inputs if n not in names]
    return cp_jobs.forward_backward(lambda t, c: call(op, t, c), inputs, ctx, grad_out,
                                    cp_jobs.shard(ctx), grads=names, params=params)


def clean_and_poisoned(env, op, inputs, poisoned_inputs, doc_ids, grad_out, poisoned_grad):
    """``({"out": .., input: gradient}, same poisoned)`` of this rank (``env=None``: one
    process)."""
    return (_run(env, op, inputs, doc_ids, grad_out),
            _run(env, op, poisoned_inputs, doc_ids, poisoned_grad))  # fmt: skip
