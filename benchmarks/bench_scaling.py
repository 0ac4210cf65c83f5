"""CP scaling of one hybrid layer (short conv -> KDA -> DSA index attention) on gloo ranks.

    .venv/bin/python benchmarks/bench_scaling.py [--lengths 1024 2048 4096] [--worlds 1 2 4]

For each global length and world size, every rank runs forward + backward on its shard; we
report the slowest rank's median time per global token (with the spread: min..max over
repeats), the activation bytes each rank saves for backward (the memory that CP divides), the
compiled (``fullgraph=True``) versus eager time, and how many times the compiled layer was
compiled across several packings of the same shape (1 means packings never recompile).

CPU gloo with 4 ranks on 2 cores oversubscribes the machine: read world-4 times as an upper
bound; the saved-activation ratio is exact.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import fcp
from fcp.layout import doc_ids_from_seq_lens
from tests.support.rank_pool import RankPool

D, HEADS, DK = 64, 2, 32


def _params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    return {"conv": r(D, 4), "wq": r(D, HEADS * DK), "wk": r(D, HEADS * DK),
            "wv": r(D, HEADS * DK), "wg": r(D, HEADS * DK), "wb": r(D, HEADS),
            "iq": r(D, 2 * 16), "ik": r(D, 16), "iw": r(D, 2)}


def layer(x, p, ctx, ops=fcp):
    """[B, L, D] -> [B, L, HEADS * DK]: conv -> KDA -> index attention over the KDA output, on
    the tokens a k-pool indexer picks (pools of 16, 64 tokens from complete pools + the tail).
    ``ops``: where the operators come from (``fcp``; a variant for side-by-side measurements)."""
    b, n, _ = x.shape
    h = ops.short_conv(x, p["conv"], None, ctx, activation="silu")
    q = torch.nn.functional.normalize((h @ p["wq"]).view(b, n, HEADS, DK), dim=-1)
    k = torch.nn.functional.normalize((h @ p["wk"]).view(b, n, HEADS, DK), dim=-1)
    v = (h @ p["wv"]).view(b, n, HEADS, DK)
    g = -torch.nn.functional.softplus((h @ p["wg"]).view(b, n, HEADS, DK))
    beta = torch.sigmoid(h @ p["wb"])
    o = ops.kda(q, k, v, g, beta, ctx)
    iq = (x @ p["iq"]).view(b, n, 2, 16)
    ik = x @ p["ik"]
    iw = x @ p["iw"]
    ape = torch.zeros(16, 16)  # zero gate logits and position embedding: mean pooling
    idx = ops.kpool_indexer(iq, ik, torch.zeros_like(ik), ape, iw, ctx, topk=64, kpool=16)
    a = ops.index_attention(o, o, o, idx, ctx)
    return a.flatten(2)


def _packing(total: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(16, max(17, total // 3), (1, 64), generator=g)
    lens = torch.where(lens.cumsum(1) > total, torch.full_like(lens, -1000), lens)
    return doc_ids_from_seq_lens(lens, total)


def scaling_case(env, total: int, repeats: int, compile_packings: int):
    torch.manual_seed(0)
    p = {k: v.requires_grad_() for k, v in _params().items()}
    doc_ids = _packing(total, 0)
    ctx = fcp.PackedContext(doc_ids, group=env.group if env.world_size > 1 else None,
                            cp_size=env.world_size, cp_rank=env.rank)
    x = torch.randn(1, total, D, generator=torch.Generator().manual_seed(1))[:, ctx.seq_start:ctx.seq_end]

    def step(fn, c):
        out = fn(x, p, c)
        (out.pow(2).mean() + fcp.all_gather_backward_anchor(out)).backward()

    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(layer, ctx)

    def timed(fn):
        step(fn, ctx)  # warm-up (and compilation)
        ts = []
        for _ in range(repeats):
            if env.world_size > 1:
                dist.barrier(env.group)
            t0 = time.perf_counter()
            step(fn, ctx)
            ts.append(time.perf_counter() - t0)
        return ts

    eager = timed(layer)
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    comp = timed(compiled)
    for seed in range(1, compile_packings):
        c2 = ctx.replace(doc_ids=_packing(total, seed))
        step(compiled, c2)
    return {"eager": eager, "compiled": comp, "saved_bytes": saved[0],
            "frames": counter.frame_count}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--packings", type=int, default=5)
    args = ap.parse_args(argv)
    rows = []
    print("# one hybrid layer (conv -> KDA -> DSA index attention), forward + backward, fp32")
    print(f"{'tokens':>7} {'world':>5} {'us/token':>9} {'spread':>15} {'saved MB/rank':>13} "
          f"{'vs 1 rank':>9} {'compiled/eager':>14} {'compiles':>8}")
    with RankPool(max_world_size=max(args.worlds), timeout=600, job_timeout=3600) as pool:
        for total in args.lengths:
            base = None
            for world in args.worlds:
                res = pool.run(scaling_case, world, total, args.repeats, args.packings)
                slowest = [max(r["eager"][i] for r in res) for i in range(args.repeats)]
                comp = [max(r["compiled"][i] for r in res) for i in range(args.repeats)]
                med = statistics.median(slowest)
                saved = max(r["saved_bytes"] for r in res)
                base = base or med
                row = dict(tokens=total, world=world, us_per_token=med / total * 1e6,
                           spread_us=(min(slowest) / total * 1e6, max(slowest) / total * 1e6),
                           saved_mb=saved / 2**20, speedup=base / med,
                           compiled_over_eager=statistics.median(comp) / med,
                           compiles=max(r["frames"] for r in res))
                rows.append(row)
                print(f"{total:7d} {world:5d} {row['us_per_token']:9.1f} "
                      f"{row['spread_us'][0]:7.1f}..{row['spread_us'][1]:<7.1f}"
                      f"{row['saved_mb']:13.2f} {row['speedup']:9.2f} "
                      f"{row['compiled_over_eager']:14.2f} {row['compiles']:8d}")
    return rows


if __name__ == "__main__":
    main()
