"""Scale check for fcp.layout: one 1M-token row holding 100k documents.

Each function is timed (median of several runs) and reported next to one
``torch.cumsum`` over the same row, so the ratios say how far each function is
from a single memory-bound pass.  Not a test; run by hand:

    .venv/bin/python benchmarks/bench_layout.py [--tokens N] [--docs D] [--repeats R] [--threads T]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fcp.groups import GroupInfo
from fcp.layout import (
    doc_ids_from_seq_lens,
    position_ids_from_doc_ids,
    segment_cu_seqlens,
    validate_doc_ids,
)


def median_seconds(cases: dict, repeats: int) -> dict:
    """Round-robin timing, so load from other processes on a shared machine
    hits every case (and the baseline) alike."""
    for fn in cases.values():
        fn()  # warm-up: allocator and first-call overheads
    times = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def random_seq_lens(tokens: int, docs: int, seed: int = 0) -> torch.Tensor:
    """``[1, docs]`` positive lengths summing to ``tokens`` (random cut points)."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(tokens - 1, generator=gen)[: docs - 1].add_(1).sort().values
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])])
    return bounds.diff()[None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    seq_lens = random_seq_lens(args.tokens, args.docs)
    doc_ids = doc_ids_from_seq_lens(seq_lens, args.tokens)
    assert int(doc_ids[0, -1]) == args.docs

    from fcp.shard import shard_batch

    ids = torch.randint(0, 256, (1, args.tokens))
    batch = {"input_ids": ids, "shift_labels": ids.roll(-1, 1), "seq_lens": seq_lens}
    # Each CP rank runs the same host-side planning on the replicated batch; GroupInfo stands in
    # for an 8-rank group (without the ranks' agreement check, shard_batch issues no collective,
    # so no processes are needed; benchmarks/bench_agreement.py measures the check).
    ranks = [GroupInfo(object(), 8, r) for r in range(8)]

    cases = {
        "torch.cumsum (baseline)": lambda: torch.cumsum(doc_ids, dim=-1),
        "shard_batch, one of 8 ranks": lambda: shard_batch(ranks[3], batch, check_agreement=False),
        "shard_batch, all 8 ranks": lambda: [shard_batch(g, batch, check_agreement=False)
                                             for g in ranks],
        "doc_ids_from_seq_lens": lambda: doc_ids_from_seq_lens(seq_lens, args.tokens),
        "segment_cu_seqlens": lambda: segment_cu_seqlens(doc_ids[0]),
        "position_ids_from_doc_ids": lambda: position_ids_from_doc_ids(doc_ids),
        "validate_doc_ids": lambda: validate_doc_ids(doc_ids),
    }
    medians = median_seconds(cases, args.repeats)
    baseline = medians["torch.cumsum (baseline)"]
    print(
        f"{args.tokens} tokens, {args.docs} documents, median of {args.repeats}, "
        f"{torch.get_num_threads()} threads"
    )
    for name, t in medians.items():
        print(f"  {name:28s} {t * 1e3:9.3f} ms   {t / baseline:6.1f}x cumsum")


if __name__ == "__main__":
    main()
