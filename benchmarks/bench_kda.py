"""CPU benchmark: chunked ``fcp.ops.kda.kda`` vs FLA's naive KDA implementations.

Forward + backward time (median of ``--repeats`` runs after one warm-up; process CPU time with
one thread by default, ``--wall`` for wall clock) for batch 1, ``--heads`` heads, K = V = 64, one
document per row, at each sequence length. Prints, per length, the times, the time per token
(flat = linear cost) and the speed-ups over FLA's ``naive_chunk_kda`` (chunked, per-token loops
inside each chunk; run once) and ``naive_recurrent_kda`` (per-token loop; run once, only up to
``--recurrent-max`` tokens because its backward is very slow), then an inductor-compiled vs eager
ratio at ``--compile-len``.

    .venv/bin/python -m benchmarks.bench_kda                   # full table (several minutes)
    .venv/bin/python -m benchmarks.bench_kda --lengths 1024 2048 --recurrent-max 1024 \
        --no-compile
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import parser
from fcp.context import PackedContext
from fcp.ops.kda import kda


def make(seq: int, heads: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq, heads, dim, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, seq, heads, dim, generator=gen), dim=-1)
    v = torch.randn(1, seq, heads, dim, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, seq, heads, dim, generator=gen))
    beta = torch.rand(1, seq, heads, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def fwd_bwd_time(fn, xs, repeats: int, warmup: int = 1, clock=time.process_time) -> float:
    """Median seconds of forward + backward. ``clock``: process CPU time by default, which on a
    machine shared with other jobs is far steadier than wall time (with one thread the two agree
    on an idle machine)."""

    def once():
        for x in xs:
            x.grad = None
        t0 = clock()
        out = fn(*xs)
        out.backward(torch.ones_like(out))
        return clock() - t0

    for _ in range(warmup):
        once()
    return statistics.median(once() for _ in range(repeats))


def main() -> None:
    p = parser(__doc__, lengths=[1024, 2048, 4096, 8192, 16384], repeats=3, wall=True)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--recurrent-max", type=int, default=4096)
    p.add_argument("--chunk-max", type=int, default=16384)
    p.add_argument("--compile-len", type=int, default=2048)
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.process_time

    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda  # slow import (~15 s)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch 1, "
          f"heads {args.heads}, K = V = {args.dim}; forward+backward "
          f"{'wall' if args.wall else 'CPU'} seconds (median)")
    header = f"{'seq':>6} {'kda':>8} {'us/token':>9} {'naive_chunk':>12} {'x':>6} " \
             f"{'naive_rec':>10} {'x':>7}"
    print(header)
    for seq in args.lengths:
        xs = make(seq, args.heads, args.dim)
        ctx = PackedContext(torch.ones(1, seq, dtype=torch.long))
        t_kda = fwd_bwd_time(lambda *a: kda(*a, ctx), xs, args.repeats, clock=clock)
        row = f"{seq:>6} {t_kda:8.3f} {1e6 * t_kda / seq:9.1f}"
        if seq <= args.chunk_max:
            t_chunk = fwd_bwd_time(lambda *a: naive_chunk_kda(*a)[0], xs, 1, 0, clock)
            row += f" {t_chunk:12.3f} {t_chunk / t_kda:6.1f}"
        else:
            row += f" {'skipped':>12} {'':>6}"
        if seq <= args.recurrent_max:
            t_rec = fwd_bwd_time(lambda *a: naive_recurrent_kda(*a)[0], xs, 1, 0, clock)
            row += f" {t_rec:10.2f} {t_rec / t_kda:7.1f}"
        else:
            row += f" {'skipped':>10} {'':>7}"
        print(row, flush=True)

    if not args.no_compile:
        seq = args.compile_len
        xs = make(seq, args.heads, args.dim)
        ctx = PackedContext(torch.ones(1, seq, dtype=torch.long))
        compiled = torch.compile(kda, fullgraph=True)
        t0 = time.perf_counter()
        fwd_bwd_time(lambda *a: compiled(*a, ctx), xs, 1, 0)
        t_first = time.perf_counter() - t0
        t_c = fwd_bwd_time(lambda *a: compiled(*a, ctx), xs, args.repeats, clock=clock)
        t_e = fwd_bwd_time(lambda *a: kda(*a, ctx), xs, args.repeats, clock=clock)
        print(f"inductor at seq {seq}: compiled {t_c:.3f} s vs eager {t_e:.3f} s "
              f"(eager/compiled = {t_e / t_c:.2f}x; first call incl. compile {t_first:.1f} s)")


if __name__ == "__main__":
    main()
