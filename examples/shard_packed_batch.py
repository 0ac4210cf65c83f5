"""Shard one packed batch across 4 CPU ranks and print what each rank holds.

    python examples/shard_packed_batch.py          # starts 4 gloo ranks itself
    torchrun --nproc-per-node 4 examples/shard_packed_batch.py

Every rank receives the same full batch, calls ``fcp.shard_batch`` and gets its contiguous token
interval plus the replicated global document map; nothing is communicated to plan the split.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fcp

TEXT = [b"def f(x):\n    return x\n", b"import os\n", b"print('hello, world')\n", b"#\n"]


def packed_batch() -> dict:
    docs = [torch.tensor(list(t), dtype=torch.long) for t in TEXT]
    ids = torch.cat(docs)
    return {
        "input_ids": ids,  # a THD row: [sequence]; the sharder restores the batch axis
        # transformers' unshifted labels: shard_batch turns them into next-token targets of the
        # same document (local["shift_labels"]) before it splits the row
        "labels": ids.clone(),
        "cu_seqlens": torch.tensor([0, *torch.cumsum(torch.tensor([len(d) for d in docs]), 0)]),
    }


def show(rank: int, world: int) -> str:
    batch = packed_batch()
    local, ctx = fcp.shard_batch(dist.group.WORLD, batch, pad_multiple=4)
    lines = [
        f"rank {rank}/{world}: global tokens [{ctx.seq_start}, {ctx.seq_end}) of "
        f"{ctx.global_seq_len} (original {ctx.original_seq_len})"
    ]
    ids, docs = local["input_ids"][0], ctx.local_doc_ids[0]
    for doc in torch.unique_consecutive(docs).tolist():
        sel = docs == doc
        text = bytes(ids[sel].tolist()).decode("utf-8", "replace") if doc else ""
        name = f"doc {doc}" if doc else "padding"
        lines.append(f"    {name:>8}: {int(sel.sum()):2d} tokens {text!r}")
    return "\n".join(lines)


def _worker(rank: int, world: int, store_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    run(rank, world)


def run(rank: int, world: int) -> None:
    report = show(rank, world)
    reports = [None] * world
    dist.all_gather_object(reports, report)  # print in rank order from rank 0
    if rank == 0:
        print("\n".join(reports))
    dist.destroy_process_group()


def main() -> None:
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        run(dist.get_rank(), dist.get_world_size())
        return
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store")), nprocs=world)


if __name__ == "__main__":
    main()
