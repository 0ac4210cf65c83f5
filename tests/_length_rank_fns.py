"""Functions run on pool ranks (or in the test process) by tests/test_lengths.py.

:func:`block` chains every kind of operator a hybrid layer stack uses (a short conv, KDA with a
per-key gate, gated linear attention, document-causal softmax attention) on one rank's shard;
:func:`lengths_run` runs it compiled over rows of several lengths and reports the number of
compiled frames after each, with the compiled results checked against eager ones.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import fcp
from fcp.context import PackedContext

HEADS, DIM = 2, 8


def block(x: torch.Tensor, conv_w: torch.Tensor, ctx: PackedContext,
          chunk_size: int = 16) -> torch.Tensor:
    """``x [batch, local_seq, HEADS * DIM]`` -> the same shape; KDA and GLA in chunks of
    ``chunk_size`` tokens (64 is their default)."""
    h = fcp.short_conv(x, conv_w, None, ctx)
    b, n, _ = h.shape
    q = h.view(b, n, HEADS, DIM)
    k = F.normalize(q, dim=-1)
    gate = -F.softplus(q)  # per-key log decay <= 0
    beta = torch.sigmoid(h[..., :HEADS])
    o = fcp.kda(q, k, q, gate, beta, ctx, chunk_size=chunk_size)
    o = fcp.gla(q, k, o, -F.softplus(h[..., HEADS : 2 * HEADS]), ctx, chunk_size=chunk_size)
    return fcp.doc_causal_attention(o, k, o, ctx).flatten(2)


def row(seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x [1, seq, HEADS * DIM], conv weight [HEADS * DIM, 4], doc_ids [1, seq])``: documents
    of 1 to 40 tokens, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    lens, total = [], 0
    while total < seq:
        lens.append(min(int(torch.randint(1, 41, (), generator=gen)), seq - total))
        total += lens[-1]
    doc_ids = torch.repeat_interleave(torch.arange(1, len(lens) + 1), torch.tensor(lens))[None]
    x = torch.randn(1, seq, HEADS * DIM, generator=gen)
    return x, torch.randn(HEADS * DIM, 4, generator=gen) / 2, doc_ids


def lengths_run(env, seqs: list[int], dynamic: bool | None, chunk_size: int = 16) -> dict:
    """:func:`block` (chunks of ``chunk_size``) under ``torch.compile(fullgraph=True,
    backend=aot_eager, dynamic=dynamic)`` over rows of the global lengths ``seqs`` (sharded by
    :func:`fcp.shard_batch` with its default arguments on ``env``'s group, or one process for
    ``env=None``): ``{"frames": compiled frames after each row, "local": local lengths, "diff":
    largest |compiled - eager| over outputs and gradients, relative to the largest |eager| of
    each}``. On ranks, eager (static lengths) balances document-causal attention's queries and
    the dynamic graph does not: its key gradients sum in another order, not bitwise the same."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    run = functools.partial(block, chunk_size=chunk_size)
    compiled = torch.compile(run, backend=counter, fullgraph=True, dynamic=dynamic)
    group = None if env is None else env.group
    frames, local, diff = [], [], 0.0
    for i, seq in enumerate(seqs):
        x_full, w, doc_ids = row(seq, seed=i)
        batch = {"inputs_embeds": x_full, "doc_ids": doc_ids}
        shard, ctx = fcp.shard_batch(group, batch)
        results = []
        for fn in (run, compiled):
            x = shard["inputs_embeds"].clone().requires_grad_()
            wi = w.clone().requires_grad_()
            out = fn(x, wi, ctx)
            out.square().sum().backward()
            results.append((out.detach(), x.grad, wi.grad))
        diff = max(diff, *((a - b).abs().max().item() / b.abs().max().item()
                           for a, b in zip(*results)))  # fmt: skip
        frames.append(counter.frame_count)
        local.append(ctx.local_seq_len)
    return {"frames": frames, "local": local, "diff": diff}
