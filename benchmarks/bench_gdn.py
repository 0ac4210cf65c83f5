"""CPU benchmark: Gated DeltaNet's scalar gate versus the same gate broadcast to ``[.., K]``.

``fcp.ops.kda.kda`` takes GDN's one-per-head gate ``g [B, L, HV]`` directly (its chunks form a
``[C, C]`` decay matrix per head, :func:`fcp.ops.kit.recurrence.wy_forms_scalar`); the
alternative is to broadcast it to KDA's per-key-dimension gate ``g[..., None].expand(.., K)``,
which the per-key path then materialises. Both compute the same recurrence (equal to fp32
rounding). Measured side by side in one process, batch 1, one document per row, Qwen3-Next's
head shapes scaled down (``--key-heads`` 2, ``--value-heads`` 4, K = V = 128), fp32, forward +
backward:

* time: median of ``--repeats`` runs after one warm-up each, the two variants interleaved
  (process CPU time with ``--threads`` 1 by default: steadier than wall time on a shared machine);
* memory: the peak of bytes allocated by PyTorch's CPU allocator during one forward + backward
  (from the profiler's memory events), and the bytes saved for the backward (unique storages).

    .venv/bin/python -m benchmarks.bench_gdn                    # 1k-8k tokens
    .venv/bin/python -m benchmarks.bench_gdn --lengths 1024 --repeats 3
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import interleaved_medians, parser, with_threads
from fcp.context import PackedContext
from fcp.ops.kda import kda


def make(seq: int, key_heads: int, value_heads: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq, key_heads, dim, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, seq, key_heads, dim, generator=gen), dim=-1)
    v = torch.randn(1, seq, value_heads, dim, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, seq, value_heads, generator=gen))
    beta = torch.rand(1, seq, value_heads, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def step(xs, ctx, broadcast: bool):
    """Forward + backward of one GDN call; ``broadcast``: the gate expanded to ``[.., K]``."""
    q, k, v, g, beta = xs
    for x in xs:
        x.grad = None
    gate = g[..., None].expand(*g.shape, q.shape[-1]) if broadcast else g
    out = kda(q, k, v, gate, beta, ctx)
    out.backward(torch.ones_like(out))


def peak_bytes(xs, ctx, broadcast: bool) -> int:
    """Peak of bytes held by PyTorch's CPU allocator during :func:`step` (profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(xs, ctx, broadcast)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())  # fmt: skip
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return peak


def saved_bytes(xs, ctx, broadcast: bool) -> int:
    """Bytes of the distinct storages autograd saves for the backward of one call."""
    seen, total = set(), [0]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes()
        return t

    q, k, v, g, beta = xs
    gate = g[..., None].expand(*g.shape, q.shape[-1]) if broadcast else g
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kda(q, k, v, gate, beta, ctx)
    return total[0]


def main(argv=None) -> list[dict]:
    p = parser(__doc__, lengths=[1024, 2048, 4096, 8192], repeats=5, wall=True)
    p.add_argument("--key-heads", type=int, default=2)
    p.add_argument("--value-heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    args = p.parse_args(argv)
    return with_threads(args.threads, _run, args)


def _run(args) -> list[dict]:
    clock = time.perf_counter if args.wall else time.process_time

    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), batch 1, key heads "
          f"{args.key_heads}, value heads {args.value_heads}, K = V = {args.dim}, fp32; forward + "
          f"backward {'wall' if args.wall else 'CPU'} seconds (median of {args.repeats})")
    print(f"{'seq':>6} {'scalar s':>9} {'bcast s':>9} {'time x':>7} {'peak MB':>8} "
          f"{'bcast MB':>9} {'peak x':>7} {'saved MB':>9} {'bcast MB':>9} {'saved x':>8}")
    rows = []
    for seq in args.lengths:
        xs = make(seq, args.key_heads, args.value_heads, args.dim)
        ctx = PackedContext(torch.ones(1, seq, dtype=torch.long))
        steps = {b: (lambda b=b: step(xs, ctx, b)) for b in (False, True)}
        times = interleaved_medians(steps, args.repeats, clock)
        t_s, t_b = times[False], times[True]
        p_s, p_b = (peak_bytes(xs, ctx, b) for b in (False, True))
        s_s, s_b = (saved_bytes(xs, ctx, b) for b in (False, True))
        row = dict(seq=seq, scalar_s=t_s, broadcast_s=t_b, time_ratio=t_b / t_s,
                   scalar_peak_mb=p_s / 2**20, broadcast_peak_mb=p_b / 2**20, peak_ratio=p_b / p_s,
                   scalar_saved_mb=s_s / 2**20, broadcast_saved_mb=s_b / 2**20,
                   saved_ratio=s_b / s_s)  # fmt: skip
        rows.append(row)
        print(f"{seq:>6} {t_s:9.3f} {t_b:9.3f} {row['time_ratio']:6.2f}x "
              f"{row['scalar_peak_mb']:8.1f} {row['broadcast_peak_mb']:9.1f} "
              f"{row['peak_ratio']:6.2f}x {row['scalar_saved_mb']:9.1f} "
              f"{row['broadcast_saved_mb']:9.1f} {row['saved_ratio']:7.2f}x", flush=True)
    print("x = broadcast / scalar (> 1: the scalar gate is cheaper)")
    return rows


if __name__ == "__main__":
    main()
