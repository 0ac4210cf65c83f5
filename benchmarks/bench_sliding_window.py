"""Sliding-window attention under CP: bytes per layer against a K/V all-gather, cost per token.

    .venv/bin/python benchmarks/bench_sliding_window.py [--seq 32768] [--world 4]
        [--window 4096] [--lengths 8192 16384 32768 65536] [--repeats 3]

1. Bytes each rank sends and receives per sliding-window layer (forward) at ``--seq`` tokens on
   ``--world`` gloo ranks, window ``--window``, 8 query heads of 128, GQA 2 (4 K/V heads), bf16:
   the operator's one collective (the K/V left halo of :func:`fcp.ops.sliding_window` , measured
   by counting the funcol buffers, :class:`examples.comm_accounting.CommBytes`) next to an
   all-gather of K/V (what full-row CP attention moves, measured the same way); expected ratio
   about ``window / seq``. (``tests/test_attention.py`` checks the whole operator moves only
   the halo.)
2. Forward + backward time of :func:`fcp.sliding_window_attention` in one process (one thread)
   for one document filling rows of ``--lengths`` tokens: microseconds per token and the ratio
   to the shortest row (flat: about 1.0). Smaller heads than part 1 (2 heads of 64, one K/V
   head, fp32) keep a CPU run short; the work per token is ``window`` keys either way.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import Table
from examples.comm_accounting import CommBytes
from fcp.comm import all_gather_sequence
from fcp.context import PackedContext
from fcp.ops.sliding_window import halo_tokens, sliding_window_attention
from fcp.ops.sliding_window.keys import window_keys
from tests.support.rank_pool import RankPool

HEADS, KV_HEADS, DIM = 8, 4, 128  # part 1: 8 heads of 128, 2 query heads per K/V head
T_HEADS, T_KV, T_DIM = 2, 1, 64  # part 2


def bytes_job(env, seq: int, window: int) -> dict:
    """Bytes this rank moves in one layer: the halo, and an all-gather of K/V, both bf16."""
    doc_ids = torch.ones(1, seq, dtype=torch.long)  # one document: the band is the whole row
    ctx = PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)
    g = torch.Generator().manual_seed(env.rank)
    k, v = (torch.randn(1, ctx.local_seq_len, KV_HEADS, DIM, generator=g).bfloat16()
            for _ in range(2))  # fmt: skip
    out = {}
    with torch.no_grad():
        with CommBytes(env.rank, env.world_size) as comm:
            window_keys(k, v, ctx, halo_tokens(ctx, window))
        out["halo"] = (comm.sent, comm.received)
        with CommBytes(env.rank, env.world_size) as comm:
            all_gather_sequence(torch.cat([k, v], -1), ctx)
        out["all_gather"] = (comm.sent, comm.received)
    return out


def time_job(env, seq: int, window: int, repeats: int) -> float:
    """Median seconds of forward + backward for one document filling a row of ``seq``."""
    import statistics
    import time

    torch.set_num_threads(1)
    ctx = PackedContext(torch.ones(1, seq, dtype=torch.long))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, T_HEADS, T_DIM, generator=g, requires_grad=True)
    k, v = (torch.randn(1, seq, T_KV, T_DIM, generator=g, requires_grad=True) for _ in range(2))
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        sliding_window_attention(q, k, v, ctx, window).sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    rows = []
    with RankPool(max_world_size=args.world, timeout=1200) as pool:
        print(f"# bytes per rank per layer (forward, bf16): {args.seq} tokens, {args.world} "
              f"ranks, window {args.window}, {HEADS} heads of {DIM}, {KV_HEADS} K/V heads")
        table = Table(("rank", "4d"), ("halo sent", "10d"), ("halo recv", "10d"),
                      ("gather sent", "11d"), ("gather recv", "11d"), ("recv ratio", "10.4f"))
        table.header()
        res = pool.run(bytes_job, args.world, args.seq, args.window)
        for rank, r in enumerate(res):
            (hs, hr), (gs, gr) = r["halo"], r["all_gather"]
            table.row(rank, hs, hr, gs, gr, hr / gr)
            rows.append(dict(part="bytes", rank=rank, halo_sent=hs, halo_received=hr,
                             gather_sent=gs, gather_received=gr))  # fmt: skip
        worst = max(r["halo"][1] for r in res) / max(r["all_gather"][1] for r in res)
        print(f"# busiest rank: halo / all-gather bytes received = {worst:.4f} "
              f"(window / seq = {args.window / args.seq:.4f})")
        print(f"# forward + backward, one document per row, window {args.window}, "
              f"{T_HEADS} heads of {T_DIM}, 1 thread")
        table = Table(("tokens", "7d"), ("seconds", "9.3f"), ("us/token", "9.1f"),
                      ("vs first", "9.2f"))
        table.header()
        first = None
        for seq in args.lengths:
            sec = pool.run(time_job, 1, seq, args.window, args.repeats)[0]
            per = sec / seq * 1e6
            first = first or per
            table.row(seq, sec, per, per / first)
            rows.append(dict(part="time", tokens=seq, seconds=sec, us_per_token=per))
    return rows


if __name__ == "__main__":
    main()
