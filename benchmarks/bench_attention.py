"""Attention operators under CP on gloo ranks: bytes moved and time versus one process.

    .venv/bin/python benchmarks/bench_attention.py [--lengths 512 1024 2048] [--worlds 2 4]
                                                   [--repeats 5]

1. Bytes received per rank in the forward pass, for each operator, next to a full K/V all-gather
   (what a naive CP attention moves): computed from the shapes and measured by counting the
   funcol collectives' buffers with a dispatch hook (the backward reduce-scatter mirrors the
   differentiable gathers). ``compressed`` moves ``1/ratio`` of K/V plus a ``window - 1`` halo.
   (Index attention and the indexers: ``bench_index_attention.py``.)
2. Forward + backward time of each operator on ``world`` CP ranks (max over ranks of the median)
   versus the same global batch in one process, at growing global lengths, as a ratio
   ``single / CP`` (> 1: CP is faster). Every process runs with one intra-op thread, so the ratio
   reads as "work split across ranks + communication"; on a machine with fewer free cores than
   ranks, the ranks share cores and the ratio is pessimistic.

Shapes: batch 1, heads 4, kv_heads 2, D 32, fp32; random packings with a pad tail;
``compressed``: ratio 4, window 16.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from fcp.context import PackedContext
from fcp.layout import doc_ids_from_seq_lens
from fcp.ops.compressed import compressed_attention
from fcp.ops.doc_causal import doc_causal_attention
from benchmarks.common import Table
from examples.comm_accounting import CommBytes
from tests.support.rank_pool import RankPool

HEADS, KV_HEADS, DIM = 4, 2, 32
RATIO, WINDOW = 4, 16
OPS = ("doc_causal", "compressed")


def make_batch(seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lens, left = [], seq - seq // 16  # a pad tail of seq/16 tokens
    while left > 0:
        lens.append(min(left, int(torch.randint(1, seq // 4, (), generator=g))))
        left -= lens[-1]
    doc_ids = doc_ids_from_seq_lens(torch.tensor([lens]), seq)

    def r(*shape):
        return torch.randn(1, seq, *shape, generator=g)

    t = dict(q=r(HEADS, DIM), k=r(KV_HEADS, DIM), v=r(KV_HEADS, DIM))
    return doc_ids, t


def run_op(name, t, ctx):
    if name == "doc_causal":
        return doc_causal_attention(t["q"], t["k"], t["v"], ctx)
    return compressed_attention(t["q"], t["k"], t["v"], ctx, ratio=RATIO, window=WINDOW)


def fwd_bwd(name, full, ctx):
    sl = slice(ctx.seq_start, ctx.seq_end)
    t = {n: x[:, sl].clone().requires_grad_(n in ("q", "k", "v")) for n, x in full.items()}
    run_op(name, t, ctx).sum().backward()


def predicted_bytes(name: str, world: int, local: int) -> tuple[int, int]:
    """(operator, full K/V all-gather) bytes received per rank in the forward, from shapes."""
    kv_token = KV_HEADS * 2 * DIM * 4
    full = (world - 1) * local * kv_token
    if name == "doc_causal":
        return full, full
    # compressed: the last rank's halo is the full window - 1 tokens
    return (world - 1) * (local // RATIO) * kv_token + (WINDOW - 1) * kv_token, full


def count_bytes(name, full, ctx) -> int:
    """Bytes this rank receives from collectives in one forward (:class:`CommBytes`)."""
    sl = slice(ctx.seq_start, ctx.seq_end)
    with torch.no_grad(), CommBytes(ctx.cp_rank, ctx.cp_size) as comm:
        run_op(name, {n: x[:, sl] for n, x in full.items()}, ctx)
    return comm.received


def _median_time(fn, repeats, group=None):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cp_job(env, name, seq, repeats):
    torch.set_num_threads(1)
    doc_ids, full = make_batch(seq)
    ctx = PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)
    received = count_bytes(name, full, ctx)
    return _median_time(lambda: fwd_bwd(name, full, ctx), repeats, env.group), received


def single_job(env, name, seq, repeats):
    torch.set_num_threads(1)
    doc_ids, full = make_batch(seq)
    return _median_time(lambda: fwd_bwd(name, full, PackedContext(doc_ids)), repeats)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    rows = []
    with RankPool(max_world_size=max(args.worlds), timeout=600) as pool:
        print("# forward bytes received per rank (fp32): operator vs full K/V all-gather")
        table = Table(("op", ">10"), ("world", "5d"), ("seq", "6d"), ("predicted", "10d"),
                      ("measured", "10d"), ("full K/V", "10d"), ("op/full", "8.3f"))
        table.header()
        print("# per-op forward+backward time: single process vs CP (1 thread per process)")
        for seq in args.lengths:
            for name in OPS:
                t_single = pool.run(single_job, 1, name, seq, args.repeats)[0]
                for world in args.worlds:
                    res = pool.run(cp_job, world, name, seq, args.repeats)
                    t_cp = max(r[0] for r in res)
                    measured = max(r[1] for r in res)
                    pred, full = predicted_bytes(name, world, seq // world)
                    rows.append(dict(op=name, world=world, seq=seq, single_ms=t_single * 1e3,
                                     cp_ms=t_cp * 1e3, speedup=t_single / t_cp,
                                     predicted_bytes=pred, measured_bytes=measured,
                                     full_kv_bytes=full))
                    table.row(name, world, seq, pred, measured, full, pred / full,
                              tail=f"   single {t_single*1e3:8.1f} ms  CP {t_cp*1e3:8.1f} ms  "
                                   f"single/CP {t_single / t_cp:5.2f}")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
