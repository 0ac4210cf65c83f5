"""KDA's chunk recurrence by a log-depth scan versus the Python loop over chunks it replaced.

    .venv/bin/python benchmarks/bench_kda_scan.py [--eager-len 4096] [--compile-lens 1024 16384]

1. Eager (1 thread, CPU time, median): ``fcp.kda`` forward + backward at ``--eager-len`` tokens
   (4 heads, K = V = 64), and its chunk-recurrence section alone run both ways on the same inputs
   (the kit's DPLR scan :func:`fcp.ops.kit.recurrence.dplr_scan`, i.e. :func:`fcp.scan.chunk_scan`,
   and the loop, kept here as the baseline). The loop version of
   the whole operator is ``total - scan section + loop section``; the ratio is reported.
2. Compile: inductor compile time of ``fcp.kda`` forward + backward (``fullgraph=True``), each
   length in a fresh process with a fresh inductor cache (a cold compile), and the ratio of the
   longest to the shortest. With the loop the graph grows with the number of chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script too: the benchmarks package

from benchmarks.bench_kda import make  # noqa: E402  (KDA's benchmark inputs)

HEADS, DIM, CHUNK = 4, 64, 64


def loop(w, u0, kd, dec, s0=None):
    """The chunk loop fcp's KDA used before the scan: the baseline."""
    state = u0.new_zeros(*u0.shape[:-3], w.shape[-1], u0.shape[-1]) if s0 is None else s0
    states, pseudo = [], []
    kd_t, dec_col = kd.transpose(-1, -2), dec[..., None]
    for u0_i, w_i, kd_i, dec_i in zip(u0.unbind(-3), w.unbind(-3), kd_t.unbind(-3),
                                      dec_col.unbind(-3)):  # fmt: skip
        states.append(state)
        u = u0_i - w_i @ state
        pseudo.append(u)
        state = dec_i * state + kd_i @ u
    return torch.stack(states, -3), torch.stack(pseudo, -3), state


def cpu_time(fn, repeats: int) -> float:
    def once():
        t0 = time.process_time()
        fn()
        return time.process_time() - t0

    once()
    return statistics.median(once() for _ in range(repeats))


def eager(seq: int, repeats: int) -> dict:
    import fcp
    from fcp.ops.kit.recurrence import dplr_scan

    xs = make(seq, HEADS, DIM)
    ctx = fcp.PackedContext(torch.ones(1, seq, dtype=torch.long))

    def full():
        out = fcp.kda(*xs, ctx, chunk_size=CHUNK)
        out.backward(torch.ones_like(out))

    n = seq // CHUNK
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(1, HEADS, n, CHUNK, DIM, generator=gen) * 0.1 for _ in range(3)]
    dec = torch.rand(1, HEADS, n, DIM, generator=gen)
    sec = [p.requires_grad_() for p in (*parts, dec)]

    def section(fn):
        def run():
            states, pseudo, final = fn(sec[0], sec[1], sec[2], sec[3])
            (states.sum() + pseudo.sum() + final.sum()).backward()

        return run

    with torch.no_grad():
        a, b = dplr_scan(*sec), loop(*sec)
    agree = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))
    rows = {"total": [], "scan": [], "loop": []}
    for _ in range(repeats):  # interleaved: the machine's load hits all three alike
        rows["total"].append(cpu_time(full, 1))
        rows["scan"].append(cpu_time(section(dplr_scan), 1))
        rows["loop"].append(cpu_time(section(loop), 1))
    med = {k: statistics.median(v) for k, v in rows.items()}
    with_loop = med["total"] - med["scan"] + med["loop"]
    return dict(seq=seq, total_s=med["total"], scan_s=med["scan"], loop_s=med["loop"],
                ratio=med["total"] / with_loop, section_rel_diff=agree)  # fmt: skip


COMPILE_CHILD = """
import json, sys, time, torch
sys.path.insert(0, {root!r})
from benchmarks.bench_kda_scan import CHUNK, DIM, HEADS, make
import fcp
torch.set_num_threads(1)
seq = {seq}
xs = make(seq, HEADS, DIM)
ctx = fcp.PackedContext(torch.ones(1, seq, dtype=torch.long))
f = torch.compile(lambda *a: fcp.kda(*a, ctx, chunk_size=CHUNK), fullgraph=True)
t0 = time.perf_counter()
out = f(*xs)
out.backward(torch.ones_like(out))
print(json.dumps({{"seq": seq, "compile_s": time.perf_counter() - t0}}))
"""


def compile_time(seq: int) -> float:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONWARNINGS="ignore")
        out = subprocess.run([sys.executable, "-c", COMPILE_CHILD.format(root=str(ROOT), seq=seq)],
                             env=env, capture_output=True, text=True, timeout=1800)  # fmt: skip
        if out.returncode:
            raise RuntimeError(out.stderr[-2000:])
        return json.loads(out.stdout.strip().splitlines()[-1])["compile_s"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eager-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile-lens", type=int, nargs="*", default=[1024, 16384])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    e = eager(args.eager_len, args.repeats)
    print(f"eager fwd+bwd at {e['seq']} tokens (CPU s, median): kda {e['total_s']:.3f}; chunk "
          f"recurrence: scan {e['scan_s']:.3f} vs loop {e['loop_s']:.3f} (agree to "
          f"{e['section_rel_diff']:.1e}); kda with scan / kda with loop = {e['ratio']:.3f}")
    comp = {seq: compile_time(seq) for seq in args.compile_lens}
    for seq, t in comp.items():
        print(f"inductor compile of kda fwd+bwd at {seq} tokens (cold cache): {t:.1f} s")
    if len(comp) > 1:
        lo, hi = min(comp), max(comp)
        e["compile_ratio"] = comp[hi] / comp[lo]
        e["compile_lens"] = (lo, hi)
        print(f"compile time {hi} / {lo} tokens: {e['compile_ratio']:.2f}x (target <= 1.5x)")
    return e


if __name__ == "__main__":
    main()
