"""The CP ranks' agreement check of ``fcp.shard_batch``: its cost per step next to a demo step.

    .venv/bin/python -m benchmarks.bench_agreement [--repeats 20]

Before anything depends on it, ``shard_batch`` checks that every CP rank holds the same batch:
a 128-bit hash of the document map (host) and one exchange of 48 bytes per rank through the
process group's store (five small store requests per rank: round counter, write, wait, read,
delete), which also bounds how long a rank waits for one that never comes (``join_timeout``).
Measured on 4 gloo ranks (the demo's CP size), slowest rank, medians, the variants interleaved,
next to one bare all-gather of the same 48 bytes and to the store exchange alone, on the pool's
``FileStore`` (what the demo and the tests use: torch's ``FileStore.wait`` polls every 10 ms)
and on a ``TCPStore`` (what ``torchrun`` / ``env://`` give: the server answers a wait when the
last key arrives):

1. the demo's batch (one 512-token row of packed stdlib text): ``shard_batch`` with and without
   the check, and the demo model's forward + backward on the local batch (eager; the demo's real
   step also runs FSDP and the optimizer, so the reported fraction is an upper bound);
2. one 1M-token row of 100k documents: the check next to ``shard_batch``'s own time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import fcp
from benchmarks.bench_glm5_cp import train_step
from benchmarks.common import Table
from benchmarks.bench_layout import random_seq_lens
from examples.data import PackedDocuments
from examples.glm5_hf import Glm5NextLM
from fcp.comm import all_gather_group
from fcp.groups import resolve_group
from fcp.shard import _store_exchange, _store_of
from tests.support.rank_pool import RankPool


def job(env, batch: dict, repeats: int, with_step: bool) -> dict:
    torch.set_num_threads(1)

    def timed(fn) -> float:
        dist.barrier(env.group)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    times = {"check": [], "skip": [], "gather": [], "file_store": [], "tcp_store": [], "step": []}
    summary = torch.zeros(1, 6, dtype=torch.int64)
    info, row = resolve_group(env.group), [0] * 6
    file_store, tcp_store = _store_of(env.group), _tcp_store(env)
    for _ in range(repeats + 1):  # the first round warms up
        times["check"].append(timed(lambda: fcp.shard_batch(env.group, batch)))
        times["skip"].append(timed(lambda: fcp.shard_batch(env.group, batch,
                                                           check_agreement=False)))  # fmt: skip
        times["gather"].append(timed(lambda: all_gather_group(summary, env.group, 0)))
        for name, store in (("file_store", file_store), ("tcp_store", tcp_store)):
            times[name].append(timed(lambda: _store_exchange(store, info, row, 60.0, "bench")))
    dist.barrier(env.group)  # rank 0 serves the TCPStore: nobody may still be reading from it
    if with_step:
        model = Glm5NextLM.from_config()
        local, ctx = fcp.shard_batch(env.group, batch, pad_multiple=model.pad_multiple)
        for _ in range(max(3, repeats // 4) + 1):
            model.zero_grad(set_to_none=True)
            times["step"].append(timed(lambda: train_step(model, local, ctx)))
    return {k: statistics.median(v[1:]) for k, v in times.items() if v}


def _tcp_store(env):
    """A ``TCPStore`` served by rank 0 on a free port (what ``torchrun`` gives every job)."""
    port = [None]
    if env.rank == 0:
        server = dist.TCPStore("127.0.0.1", 0, env.world_size, is_master=True,
                               wait_for_workers=False)  # fmt: skip
        port = [server.port]
    dist.broadcast_object_list(port, src=0, group=env.group)
    store = server if env.rank == 0 else dist.TCPStore("127.0.0.1", port[0], env.world_size,
                                                       is_master=False)  # fmt: skip
    dist.barrier(env.group)
    return dist.PrefixStore("bench_agreement", store)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--world", type=int, default=4)
    args = p.parse_args(argv)
    demo = PackedDocuments(512, 1, seed=0).batches(1)[0]
    big_lens = random_seq_lens(1_000_000, 100_000)
    ids = torch.randint(0, 256, (1, 1_000_000), generator=torch.Generator().manual_seed(0))
    big = {"input_ids": ids, "shift_labels": ids.roll(-1, 1), "seq_lens": big_lens}
    rows = []
    print(f"# shard_batch's agreement check on {args.world} gloo ranks (slowest rank, medians)")
    table = Table(("batch", ">26"), ("with s", "9.5f"), ("without s", "9.5f"), ("check s", "9.5f"),
                  ("48 B gather", "11.5f"), ("FileStore xchg", "14.5f"),
                  ("TCPStore xchg", "13.5f"), ("demo step s", "11.4f"), ("check / step", "12.2%"),
                  ("check / shard", "13.1%"))  # fmt: skip
    table.header()
    with RankPool(max_world_size=args.world, timeout=600, job_timeout=3600) as pool:
        for name, batch, with_step, repeats in (("demo: 1 x 512 tokens", demo, True,
                                                 args.repeats),
                                                ("1 x 1M tokens, 100k docs", big, False,
                                                 max(3, args.repeats // 4))):  # fmt: skip
            res = pool.run(job, args.world, batch, repeats, with_step)
            t = {k: max(r[k] for r in res) for k in res[0]}
            check = max(t["check"] - t["skip"], 0.0)
            row = dict(batch=name, world=args.world, with_check_s=t["check"],
                       without_s=t["skip"], check_s=check, gather_s=t["gather"],
                       file_store_exchange_s=t["file_store"], tcp_store_exchange_s=t["tcp_store"],
                       step_s=t.get("step"),
                       check_over_step=check / t["step"] if "step" in t else None,
                       check_over_shard=check / t["skip"])  # fmt: skip
            rows.append(row)
            step = (t["step"], row["check_over_step"]) if "step" in t else ("-", "-")
            table.row(name, t["check"], t["skip"], check, t["gather"], t["file_store"],
                      t["tcp_store"], *step, row["check_over_shard"])  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
