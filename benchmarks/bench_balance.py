"""Long documents: each CP rank's attention and indexer work, contiguous vs balanced queries.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_balance.py [--seq 8192] [--worlds 2 4 8]
        [--ops doc_causal kpool] [--repeats 2]

One row of ``--seq`` tokens, either one document filling it (``one``) or documents of at most
1024 tokens (``bounded``), on P gloo ranks. Each rank runs the operator forward + backward
(``doc_causal``: ``fcp.doc_causal_attention``, 8 query heads of 64, 2 KV heads; ``kpool``:
GLM-5.3-Flash's k-pool indexer, 4 index heads of 64, ``kpool=4``, ``topk=256``, forward only
(it selects, no gradient); ``compressed``: ``fcp.compressed_attention``, ratio 4, window 64)
with ``ctx.balance`` off (the contiguous layout) and on (:mod:`fcp.ops.kit.balance`),
interleaved; reported: each rank's own CPU time (``time.thread_time`` of the computing thread,
one intra-op thread; gloo's threads and the machine's other load do not count), the median over
``--repeats``, and the slowest rank over the mean (target: at most 1.10 balanced), and the bytes
each rank receives per call for the moved queries and outputs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fcp
from fcp.ops.kit.balance import attention_plan
from benchmarks.common import Table
from tests.support.rank_pool import RankPool

HEADS, KV_HEADS, DIM = 8, 2, 64
INDEX_HEADS, INDEX_DIM, KPOOL, TOPK = 4, 64, 4, 256
BOUNDED_DOC = 1024


def doc_ids_for(layout: str, seq: int) -> torch.Tensor:
    if layout == "one":
        return torch.ones(1, seq, dtype=torch.int64)
    return (torch.arange(seq) // BOUNDED_DOC + 1)[None]


def _inputs(op: str, local: int, seed: int):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).requires_grad_(op != "kpool")

    if op in ("doc_causal", "compressed"):
        return r(1, local, HEADS, DIM), r(1, local, KV_HEADS, DIM), r(1, local, KV_HEADS, DIM)
    return (r(1, local, INDEX_HEADS, INDEX_DIM), r(1, local, INDEX_DIM), r(1, local, INDEX_DIM),
            r(KPOOL, INDEX_DIM), r(1, local, INDEX_HEADS))  # fmt: skip


def _call(op: str, ctx, tensors):
    if op == "doc_causal":
        return fcp.doc_causal_attention(*tensors, ctx)
    if op == "compressed":
        return fcp.compressed_attention(*tensors, ctx, ratio=4, window=64)
    return fcp.kpool_indexer(*tensors, ctx, topk=TOPK, kpool=KPOOL)


def job(env, op: str, layout: str, seq: int, repeats: int) -> dict:
    """This rank's CPU seconds per call (median) with balance off and on, and the bytes it
    receives per balanced call beyond the contiguous one."""
    from examples.comm_accounting import CommBytes

    torch.set_num_threads(1)
    ctx = fcp.PackedContext(doc_ids_for(layout, seq), group=env.group, cp_size=env.world_size,
                            cp_rank=env.rank)  # fmt: skip
    contexts = {"off": ctx.replace(balance=False), "on": ctx}
    tensors = _inputs(op, ctx.local_seq_len, env.rank)
    times = {"off": [], "on": []}
    received = {}
    for i in range(repeats + 1):  # the first round warms up
        for mode, c in contexts.items():
            torch.distributed.barrier(group=env.group)
            with CommBytes(env.rank, env.world_size) as comm:
                t0 = time.thread_time()
                out = _call(op, c, tensors)
                if out.requires_grad:
                    out.float().square().mean().backward()
                spent = time.thread_time() - t0
            received[mode] = comm.received
            if i:
                times[mode].append(spent)
    return {m: statistics.median(t) for m, t in times.items()} | {
        "extra_bytes": received["on"] - received["off"],
        "moves": attention_plan(ctx).moves,
    }


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--ops", nargs="+", default=["doc_causal", "kpool"])
    p.add_argument("--layouts", nargs="+", default=["one", "bounded"])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    print(f"# per-rank CPU seconds per call, {args.seq} tokens, forward + backward "
          "(kpool: forward), contiguous vs balanced")
    table = Table(("op", ">10"), ("layout", ">8"), ("P", "2d"), ("moves", ">5"),
                  ("contiguous per rank s", ">40"), ("max/mean", "8.2f"),
                  ("balanced per rank s", ">40"), ("max/mean", "8.2f"),
                  ("slowest x", "9.2f"), ("MiB in/rank", "11.2f"))  # fmt: skip
    table.header()
    rows = []
    with RankPool(max(args.worlds), job_timeout=3600) as pool:
        for op in args.ops:
            for layout in args.layouts:
                for world in args.worlds:
                    res = pool.run(job, world, op, layout, args.seq, args.repeats)
                    off, on = [r["off"] for r in res], [r["on"] for r in res]
                    ratio = {k: max(v) / statistics.mean(v) for k, v in (("off", off), ("on", on))}
                    row = dict(op=op, layout=layout, world=world, off=off, on=on,
                               off_ratio=ratio["off"], on_ratio=ratio["on"],
                               speedup=max(off) / max(on), moves=res[0]["moves"],
                               extra_mib=max(r["extra_bytes"] for r in res) / 2**20)  # fmt: skip
                    rows.append(row)
                    table.row(op, layout, world, "yes" if row["moves"] else "no",
                              " ".join(f"{t:.2f}" for t in off), ratio["off"],
                              " ".join(f"{t:.2f}" for t in on), ratio["on"], row["speedup"],
                              row["extra_mib"])  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
