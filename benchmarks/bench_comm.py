"""Collectives on 4 gloo ranks: fcp's halo and state chain versus naive baselines, side by side.

    .venv/bin/python benchmarks/bench_comm.py [--world 4] [--repeats 15]

* halo: ``fcp.left_halo`` (one all-to-all, static splits) versus an all-gather of the whole
  shard followed by a slice, for a conv-sized history (3) and a chunk-sized one (64), at growing
  local lengths. Bytes are counted per rank from the collectives' buffers.
* state chain: ``fcp.state_chain`` (one all-gather of [K, K+V] per rank, local fp32 chain) versus
  a sequential rank-to-rank pass (rank r waits for r-1's state, applies its own step, sends on):
  world-1 dependent hops.

Prints medians over ``repeats`` (after a warm-up) and the ratio naive / fcp. These machines are
noisy; ratios measured in one run are what to read.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from fcp.comm import left_halo, state_chain
from fcp.context import PackedContext
from tests.support.rank_pool import RankPool


def _ctx(env, local_len):
    doc_ids = torch.ones(1, local_len * env.world_size, dtype=torch.long)
    return PackedContext(doc_ids, group=env.group, cp_size=env.world_size, cp_rank=env.rank)


def _naive_halo(x, ctx, history):
    full = funcol.all_gather_single(x.movedim(1, 0).contiguous(), 0, ctx.group).wait()
    full = full.movedim(0, 1)
    start = ctx.seq_start
    left = max(0, start - history)
    out = full[:, left:start]
    return torch.cat([out.new_zeros(out.shape[0], history - out.shape[1], *out.shape[2:]), out], 1)


def _time(fn, repeats, group):
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def halo_case(env, local_len, channels, history, repeats):
    ctx = _ctx(env, local_len)
    x = torch.randn(1, local_len, channels)
    assert torch.equal(left_halo(x, ctx, history), _naive_halo(x, ctx, history))
    t_fcp = _time(lambda: left_halo(x, ctx, history), repeats, env.group)
    t_naive = _time(lambda: _naive_halo(x, ctx, history), repeats, env.group)
    item = x.element_size() * channels
    sent_fcp = min(history, local_len) * item if env.rank < env.world_size - 1 else 0
    sent_naive = local_len * item  # the whole shard, to every rank
    return t_fcp, t_naive, sent_fcp, sent_naive


def _sequential_chain(m, s, env):
    """Rank r receives S_in from r-1, sends S_out = M_r S_in + S_r to r+1."""
    s_in = torch.zeros_like(s)
    if env.rank > 0:
        dist.recv(s_in, group=env.group, group_src=env.rank - 1)
    if env.rank < env.world_size - 1:
        dist.send((m @ s_in + s).contiguous(), group=env.group, group_dst=env.rank + 1)
    return s_in


def chain_case(env, heads, k, v, repeats):
    ctx = _ctx(env, 1)
    m = torch.randn(heads, k, k) * 0.1
    s = torch.randn(heads, k, v)
    ref = _sequential_chain(m, s, env)
    torch.testing.assert_close(state_chain(m, s, ctx), ref, rtol=1e-4, atol=1e-4)
    t_fcp = _time(lambda: state_chain(m, s, ctx), repeats, env.group)
    t_seq = _time(lambda: _sequential_chain(m, s, env), repeats, env.group)
    return t_fcp, t_seq


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    rows = []
    with RankPool(max_world_size=args.world, timeout=120) as pool:
        print(f"# halo on {args.world} gloo ranks (channels 256, fp32); times are medians")
        print(f"{'local_len':>9} {'history':>7} {'fcp ms':>8} {'naive ms':>9} {'time x':>7} "
              f"{'fcp B/rank':>11} {'naive B/rank':>13} {'bytes x':>8}")
        for local_len in (256, 1024, 4096, 16384):
            for history in (3, 64):
                res = pool.run(halo_case, args.world, local_len, 256, history, args.repeats)
                t_fcp = max(r[0] for r in res)
                t_naive = max(r[1] for r in res)
                b_fcp = max(r[2] for r in res)
                b_naive = max(r[3] for r in res)
                rows.append(dict(kind="halo", local_len=local_len, history=history,
                                 fcp_ms=t_fcp * 1e3, naive_ms=t_naive * 1e3,
                                 time_ratio=t_naive / t_fcp, fcp_bytes=b_fcp,
                                 naive_bytes=b_naive, bytes_ratio=b_naive / b_fcp))
                print(f"{local_len:9d} {history:7d} {t_fcp*1e3:8.3f} {t_naive*1e3:9.3f} "
                      f"{t_naive/t_fcp:7.2f} {b_fcp:11d} {b_naive:13d} {b_naive/b_fcp:8.1f}")
        print(f"\n# state chain on {args.world} gloo ranks (fp32 [heads, K, K+V])")
        print(f"{'heads':>5} {'K=V':>4} {'fcp ms':>8} {'seq ms':>8} {'time x':>7}")
        for heads, k in ((4, 64), (16, 128), (32, 128)):
            # p2p sends/recvs differ per rank by design: skip the equal-count check
            res = pool.run(chain_case, args.world, heads, k, k, args.repeats,
                           check_collectives=False)
            t_fcp = max(r[0] for r in res)
            t_seq = max(r[1] for r in res)
            rows.append(dict(kind="state_chain", heads=heads, k=k, fcp_ms=t_fcp * 1e3,
                             naive_ms=t_seq * 1e3, time_ratio=t_seq / t_fcp))
            print(f"{heads:5d} {k:4d} {t_fcp*1e3:8.3f} {t_seq*1e3:8.3f} {t_seq/t_fcp:7.2f}")
    return rows


if __name__ == "__main__":
    main()
