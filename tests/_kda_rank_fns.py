"""Functions run on pool ranks by the KDA / Gated DeltaNet tests (importable by module path).

Every rank receives the same global inputs, runs :func:`fcp.ops.kda.kda` (or another function
of the same signature) on its contiguous slice and returns plain tensors
(:mod:`tests.support.cp_jobs`); the test process concatenates them in rank order and compares
with a single-process run on the global tensors.
"""

from __future__ import annotations

import torch

from fcp.ops.kda import kda
from tests.support import cp_jobs
from tests.support.inputs import KDA_NAMES


def _call(fn, chunk_size: int):
    def call(t, ctx):
        return fn(*(t[n] for n in KDA_NAMES), ctx, chunk_size=chunk_size)

    return call


def kda_fwd_bwd(env, inputs: dict, doc_ids, grad_out, chunk_size: int, compiled=False, fn=kda):
    """``{"out": .., "q": .., "k": .., "v": .., "g": .., "beta": ..}``: this rank's output and
    input gradients for ``sum(out * grad_out)``; ``compiled``: ``fn`` under
    ``torch.compile(fullgraph=True, backend="aot_eager")``, compiled from scratch."""
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    ctx = cp_jobs.cp_context(env, doc_ids)
    return cp_jobs.forward_backward(_call(fn, chunk_size), inputs, ctx, grad_out,
                                    cp_jobs.shard(ctx), grads=KDA_NAMES)  # fmt: skip


def kda_leak(env, inputs: dict, perturbed: dict, doc_ids, chunk_size: int):
    """Local outputs for two input sets (no grad), to compare bitwise outside the changed doc."""
    ctx = cp_jobs.cp_context(env, doc_ids)
    call = _call(kda, chunk_size)
    with torch.no_grad():
        return tuple(call(cp_jobs.leaves(x, cp_jobs.shard(ctx)), ctx) for x in (inputs, perturbed))
