"""CPU benchmark: fcp.gla (Mamba2's SSD on fcp) versus transformers' pure-PyTorch Mamba2 SSD.

Both compute one Mamba2 SSD layer's scan, forward + backward: dt softplus + bias + clamp,
``A = -exp(A_log)``, the scan, the ``D`` skip. transformers' side is ``mamba2_chunk_scan`` (what
``Mamba2Mixer`` runs without mamba_ssm; its PyTorch function even where a kernel would replace
it), with its configured chunk (``--hf-chunk``, Mamba2's default 256); fcp's side is the
documented mapping onto :func:`fcp.gla` (``q = C``, ``k = B``, ``v = dt x``, ``a = dt A``,
``scale = 1``, ``+ D x``) on its exact ``"chunked"`` backend. One document per row (transformers
has no packing: on packed rows it would run once per document). Shapes: Mamba2-like, batch 1,
``--heads`` 8, ``--groups`` 1, head_dim (V) 64, d_state (K) 128, fp32.

1. At ``--compare-len`` tokens (4k): both, side by side; time ratio and the relative difference
   of their outputs (``max |fcp - hf| / max |hf|``: equal results).
2. ``--lengths`` 1k-16k: fcp alone, time and minor page faults per token (flat = linear cost),
   each sweep in a fresh process, twice: with glibc's default allocator, which maps every block
   above 32 MiB fresh from the kernel (``mmap``) and page-faults on its first touch, and with
   the heap only (``mallopt(M_MMAP_MAX, 0)``), where freed blocks are reused. Tensors cross
   32 MiB at 8-16k tokens with 8 heads (a few hundred tokens with a real model's heads), so
   the first sweep shows the allocator's step and the second the operator's own cost.

Time: median of ``--repeats`` runs after one warm-up, process CPU time with ``--threads`` 1 (the
variants interleaved; steadier than wall time on a shared machine).

    .venv/bin/python -m benchmarks.bench_gla
    .venv/bin/python -m benchmarks.bench_gla --lengths 1024 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import interleaved_medians, parser, with_threads
from fcp.context import PackedContext
from fcp.ops.gla import gla

ROOT = Path(__file__).resolve().parents[1]
LIMIT = (0.0, float("inf"))  # Mamba2's default time_step_limit


def make(seq: int, heads: int, groups: int, head_dim: int, state: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    xs = dict(x=torch.randn(1, seq, heads, head_dim, generator=gen),
              dt=torch.randn(1, seq, heads, generator=gen),
              B=torch.randn(1, seq, groups, state, generator=gen),
              C=torch.randn(1, seq, groups, state, generator=gen),
              A_log=torch.log(torch.arange(1.0, heads + 1)), D=torch.ones(heads),
              dt_bias=torch.log(torch.expm1(torch.linspace(0.001, 0.1, heads))))  # fmt: skip
    return {n: t.requires_grad_() for n, t in xs.items()}


def fcp_ssd(t: dict, ctx: PackedContext) -> torch.Tensor:
    dt = F.softplus(t["dt"] + t["dt_bias"]).clamp(*LIMIT)
    y = gla(t["C"], t["B"], dt[..., None] * t["x"], dt * -torch.exp(t["A_log"]), ctx, scale=1.0)
    return y + t["D"][:, None] * t["x"]


def hf_ssd(t: dict, chunk: int) -> torch.Tensor:
    from transformers.models.mamba2 import modeling_mamba2

    ssd = inspect.unwrap(modeling_mamba2.mamba2_chunk_scan)
    return ssd(t["x"], t["dt"], -torch.exp(t["A_log"]), t["B"], t["C"], chunk_size=chunk, D=t["D"],
               dt_bias=t["dt_bias"], dt_softplus=True, dt_limit=LIMIT)  # fmt: skip


def step(fn, xs: dict) -> torch.Tensor:
    for x in xs.values():
        x.grad = None
    out = fn(xs)
    out.backward(torch.ones_like(out))
    return out.detach()


def main(argv=None) -> dict | None:
    p = parser(__doc__, lengths=[1024, 2048, 4096, 8192, 16384], repeats=5)
    p.add_argument("--compare-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--state", type=int, default=128)
    p.add_argument("--hf-chunk", type=int, default=256)
    p.add_argument("--sweep", choices=["default", "heap"], help=argparse.SUPPRESS)  # one sweep
    args = p.parse_args(argv)
    if args.sweep:
        return _sweep(args)
    return with_threads(args.threads, _run, args)


def _run(args) -> dict:
    shape = (args.heads, args.groups, args.head_dim, args.state)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), batch 1, heads "
          f"{args.heads}, groups {args.groups}, head_dim {args.head_dim}, d_state {args.state}, "
          f"fp32; forward + backward CPU seconds (median of {args.repeats})")
    seq = args.compare_len
    xs = make(seq, *shape)
    ctx = PackedContext(torch.ones(1, seq, dtype=torch.long))
    fns = {"fcp": lambda t: fcp_ssd(t, ctx), "hf": lambda t: hf_ssd(t, args.hf_chunk)}
    ours, theirs = step(fns["fcp"], xs), step(fns["hf"], xs)
    diff = (ours - theirs).abs().max() / theirs.abs().max()
    t = interleaved_medians({name: (lambda fn=fn: step(fn, xs)) for name, fn in fns.items()},
                            args.repeats)  # fmt: skip
    compare = dict(seq=seq, fcp_s=t["fcp"], hf_s=t["hf"], ratio=t["hf"] / t["fcp"],
                   rel_diff=float(diff), hf_chunk=args.hf_chunk)  # fmt: skip
    print(f"\n{seq} tokens: fcp.gla {t['fcp']:.3f} s, transformers mamba2_chunk_scan (chunk "
          f"{args.hf_chunk}) {t['hf']:.3f} s: fcp {compare['ratio']:.1f}x faster; outputs differ by "
          f"{compare['rel_diff']:.1e} (max |fcp - hf| / max |hf|)")
    sweeps = {kind: _sweep_process(args, kind) for kind in ("default", "heap")}
    print(f"\n{'seq':>6} {'us/token':>9} {'faults/token':>13} {'us/token heap':>14} "
          f"{'faults/token heap':>18}")
    for d, h in zip(sweeps["default"], sweeps["heap"]):
        print(f"{d['seq']:>6} {d['us_per_token']:9.1f} {d['faults_per_token']:13.1f} "
              f"{h['us_per_token']:14.1f} {h['faults_per_token']:18.1f}")
    flat = {kind: rows[-1]["us_per_token"] / rows[0]["us_per_token"] for kind, rows in sweeps.items()}
    first, last = sweeps["default"][0]["seq"], sweeps["default"][-1]["seq"]
    print(f"per-token cost at {last} / at {first} tokens (1.00 = linear in the length): "
          f"{flat['default']:.2f} with glibc's default allocator, {flat['heap']:.2f} heap only")
    return dict(compare=compare, lengths=sweeps, flat_ratio=flat)


def _sweep_process(args, kind: str) -> list[dict]:
    """One length sweep in a fresh process (the allocator's state is per process)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--sweep", kind, "--repeats",
           str(args.repeats), "--threads", str(args.threads), "--heads", str(args.heads),
           "--groups", str(args.groups), "--head-dim", str(args.head_dim), "--state",
           str(args.state), "--lengths", *map(str, args.lengths)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _sweep(args) -> None:
    if args.sweep == "heap":
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX: no block from mmap, every block from the heap
        libc.mallopt(-1, 2**40)  # M_TRIM_THRESHOLD: keep freed heap memory for reuse
    torch.set_num_threads(args.threads)
    rows = []
    for seq in args.lengths:
        xs = make(seq, args.heads, args.groups, args.head_dim, args.state)
        ctx = PackedContext(torch.ones(1, seq, dtype=torch.long))
        step(lambda t: fcp_ssd(t, ctx), xs)  # warm-up
        times, faults = [], []
        for _ in range(args.repeats):
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
            step(lambda t: fcp_ssd(t, ctx), xs)
            times.append(time.process_time() - t0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        rows.append(dict(seq=seq, fcp_s=statistics.median(times),
                         us_per_token=1e6 * statistics.median(times) / seq,
                         faults_per_token=statistics.median(faults) / seq))  # fmt: skip
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
