"""Pieces the benchmarks share: their command lines, thread settings, interleaved timing, bytes
saved for the backward, CP-2-vs-1-rank runs, and the fixed-width tables they print.

    table = Table(("tokens", "7d"), ("1 rank s", "9.3f"), ("note", ">6"))
    table.header()                  #  tokens  1 rank s   note
    table.row(1024, 0.5, "-")       #    1024     0.500      -
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch
import torch.distributed as dist


class Table:
    """A text table printed row by row: ``columns`` of ``(title, format spec)``, the spec's width
    the column's (titles right-aligned to it; a ``str`` value in a numeric column too)."""

    def __init__(self, *columns: tuple[str, str]):
        self.columns = [(title, spec, int(re.search(r"\d+", spec).group()))
                        for title, spec in columns]  # fmt: skip

    def header(self) -> None:
        print(" ".join(f"{title:>{width}}" for title, _, width in self.columns))

    def row(self, *values, tail: str = "") -> None:
        """One row of ``values`` (in column order), then ``tail``; flushed."""
        cells = [f"{v:>{width}}" if isinstance(v, str) else format(v, spec)
                 for v, (_, spec, width) in zip(values, self.columns, strict=True)]  # fmt: skip
        print(" ".join(cells) + tail, flush=True)


def parser(doc: str, lengths: list[int], repeats: int, wall: bool = False):
    """An argument parser described by ``doc``'s first line, with ``--lengths`` (default
    ``lengths``), ``--repeats``, ``--threads`` (default 1) and, with ``wall``, ``--wall``."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=lengths)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--threads", type=int, default=1)
    if wall:
        p.add_argument("--wall", action="store_true", help="time wall clock instead of CPU time")
    return p


def with_threads(threads: int, fn, *args):
    """``fn(*args)`` with ``threads`` torch threads, restored afterwards (``python -m
    benchmarks`` runs the other benchmarks in the same process)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)


def interleaved_medians(steps: dict, repeats: int, clock=time.process_time) -> dict:
    """``{name: median seconds}`` of each ``steps[name]()`` over ``repeats`` rounds after one
    warm-up each, the steps interleaved within a round (process CPU time by default: steadier
    than wall time on a shared machine)."""
    for step in steps.values():
        step()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            t0 = clock()
            step()
            times[name].append(clock() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def saved_bytes(fn):
    """``(fn(), bytes of every tensor autograd saved for the backward while it ran)``."""
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved[0]


def rank_times(step, module, repeats: int, group) -> tuple[list, list]:
    """``(wall seconds, process CPU seconds)`` of ``repeats`` calls of ``step()``, the gradients
    of ``module`` cleared and the ranks of ``group`` (if any) aligned by a barrier before each."""
    wall, cpu = [], []
    for _ in range(repeats):
        module.zero_grad(set_to_none=True)
        if group is not None:
            dist.barrier(group)
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def one_and_two_ranks(job, lengths, *args):
    """For each length: ``(length, job's result on 1 rank, its results on 2 ranks)``, every job
    ``job(env, length, *args)`` in one pool of 2 gloo ranks."""
    from tests.support.rank_pool import RankPool

    with RankPool(max_world_size=2, timeout=600, job_timeout=3600) as pool:
        for seq in lengths:
            yield seq, pool.run(job, 1, seq, *args)[0], pool.run(job, 2, seq, *args)
