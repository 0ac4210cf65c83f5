"""FLA's own context-parallel path (varlen mode) on CPU: Triton interpreter + gloo ranks.

``python -m tests._fla_interpret_cp`` starts a fresh 2-rank gloo pool (``TRITON_INTERPRET=1`` is
inherited by the spawned ranks), runs :func:`kda_fla_varlen` and :func:`short_conv_fla_varlen`
with CP on each rank (FLA's kernels, FLA's CP state exchange and conv halo, fed by
:func:`build_fla_cp_context` through the ``fcp::`` ops) and prints one JSON line: max relative
errors of the concatenated outputs (KDA: and gradients) against fcp's single-process references.
The conv is checked forward only: the interpreter cannot run FLA's conv backward with a halo.
Nothing here may run in the pytest process.
"""

from __future__ import annotations

import json
import os
import time

import torch

from fcp.context import PackedContext
from tests.support.cp_jobs import cat_ranks, cp_context, leaves, shard
from tests.support.inputs import KDA_NAMES as NAMES, kda_inputs, rel_err
from tests.support.packing import doc_ids_from_lengths


def cp_rank_job(env, inputs, doc, grad_out, x, w, b):
    from tests.support import fla_interpret

    fla_interpret.enable(allow_cpu_cp=True)
    from fcp.ops.conv.fla import short_conv_fla_varlen
    from fcp.ops.kda.fla import kda_fla_varlen

    ctx = cp_context(env, doc)
    xs = leaves(inputs, shard(ctx), grads=NAMES)
    out = kda_fla_varlen(*(xs[n] for n in NAMES), ctx, chunk_size=32)
    (out * grad_out[:, shard(ctx)]).sum().backward()
    # conv: forward only; the Triton interpreter cannot run FLA's conv backward with a halo
    # (initial_state) kernel ("mask has unsupported dtype"), the GPU can
    with torch.no_grad():
        y = short_conv_fla_varlen(x[:, shard(ctx)], w, b, ctx, "silu")
    return {"out": out.detach(), **{n: xs[n].grad for n in NAMES}, "conv": y}


def main() -> None:
    from fcp.ops.conv.reference import short_conv_reference
    from fcp.ops.kda.reference import kda_reference
    from tests.support.rank_pool import RankPool

    assert os.environ.get("TRITON_INTERPRET") == "1"
    t0 = time.perf_counter()
    world = 2
    doc = doc_ids_from_lengths([([5, 20, 9, 1, 21], 8)])  # 64 tokens: docs across the boundary
    t = doc.shape[1]
    inputs = kda_inputs(1, t, 1, 1, 16, 16, seed=11)
    gen = torch.Generator().manual_seed(12)
    grad_out = torch.randn(1, t, 1, 16, generator=gen)
    x, w, b = torch.randn(1, t, 8, generator=gen), torch.randn(8, 4, generator=gen), torch.randn(8, generator=gen)
    with RankPool(max_world_size=world, timeout=300, start_timeout=300) as pool:
        res = pool.run(cp_rank_job, world, inputs, doc, grad_out, x, w, b, timeout=300, job_timeout=600)
    out, grads = cat_ranks(res, "out"), {n: cat_ranks(res, n) for n in NAMES}
    xs = {n: v.clone().requires_grad_() for n, v in inputs.items()}
    ref = kda_reference(*(xs[n] for n in NAMES), PackedContext(doc))
    (ref * grad_out).sum().backward()
    report = {"kda": {"out": rel_err(out, ref)} | {f"d{n}": rel_err(grads[n], xs[n].grad) for n in NAMES}}
    report["conv"] = {"out": rel_err(cat_ranks(res, "conv"), short_conv_reference(x, w, b, doc, "silu"))}
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
