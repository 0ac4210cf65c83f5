"""Static mode vs FLA's varlen ``chunk_kda`` (and fcp's pure-PyTorch KDA) on one CUDA device.

For each total length (default 8k, 16k, 32k, 64k tokens, one packed row of documents with
log-normal lengths around 1.5k tokens, some very short, plus a pad tail) it times one forward +
backward of

* ``static``  - :func:`fcp.ops.kda.fla.kda_fla_static` (FLA's dense kernel through the ``fcp::`` op,
  gate resets from the doc-id map; what a compiled / CUDA-graphed model runs),
* ``varlen``  - FLA's own ``chunk_kda(..., cu_seqlens=...)`` (the baseline),
* ``fcp-varlen`` - :func:`fcp.ops.kda.fla.kda_fla_varlen` (FLA's varlen path through the ``fcp::`` op),
* ``pure``    - :func:`fcp.ops.kda.kda` eager (only up to ``--pure-max`` tokens),

and prints the ratio static / varlen (target <= 1.10). At the first length it also prints the
agreement of static, varlen and pure (bf16 inputs) with pure PyTorch on fp32 inputs:
``max |x - ref| / max |ref|`` of the output and of the q/k/v/g/beta gradients.

Usage: ``python benchmarks/bench_fla_gpu.py [--lengths 8192 65536] [--heads 16] [--dim 128]
[--autotune-max N]`` (``N`` bounds Triton autotuning per kernel, :mod:`tests.support.triton_tuning`; the
bound applies to FLA's dense and varlen kernels alike).
Prints ``skipped`` and exits 0 without CUDA. The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fcp.context import PackedContext  # noqa: E402
from fcp.ops.kda.fla import kda_fla_static, kda_fla_varlen  # noqa: E402
from fcp.ops.kda import kda  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")


def packing(total: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pad = int(torch.randint(0, 64, (1,), generator=gen))
    lens, used = [], 0
    while used < total - pad:
        n = int(math.exp(torch.randn((), generator=gen).item() * 1.2 + math.log(1500)))
        n = max(1, min(n, total - pad - used))
        lens.append(n)
        used += n
    ids = torch.repeat_interleave(torch.arange(1, len(lens) + 1), torch.tensor(lens))
    return torch.cat([ids, torch.zeros(pad, dtype=torch.long)])[None]


DEVICE = "cuda"


def make_inputs(t: int, heads: int, dim: int, seed: int) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, device=DEVICE, generator=gen)

    return dict(
        q=rand(1, t, heads, dim),
        k=torch.nn.functional.normalize(rand(1, t, heads, dim), dim=-1),
        v=rand(1, t, heads, dim),
        g=-torch.nn.functional.softplus(rand(1, t, heads, dim) - 2.0),
        beta=torch.sigmoid(rand(1, t, heads)),
    )


def runners(doc: torch.Tensor):
    from fla.ops.kda import chunk_kda
    from fcp.layout import segment_cu_seqlens

    ctx = PackedContext(doc.to(DEVICE))
    cu_cpu = segment_cu_seqlens(doc[0])
    cu = cu_cpu.to(DEVICE)
    return {
        "static": lambda *xs: kda_fla_static(*xs, ctx),
        "varlen": lambda *xs: chunk_kda(*xs, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)[0],
        "fcp-varlen": lambda *xs: kda_fla_varlen(*xs, ctx),
        "pure": lambda *xs: kda(*xs, ctx),
    }


def fwd_bwd(fn, inputs: dict, dtype, grad_out):
    xs = [inputs[n].to(dtype).detach().requires_grad_() for n in NAMES]
    out = fn(*xs)
    grads = torch.autograd.grad(out, xs, grad_out.to(out.dtype))
    return out, grads


def time_ms(fn, inputs, dtype, grad_out, warmup: int, iters: int) -> float:
    xs = [inputs[n].to(dtype).detach().requires_grad_() for n in NAMES]
    go = grad_out.to(dtype)

    def once():
        out = fn(*xs)
        torch.autograd.grad(out, xs, go)

    for _ in range(warmup):
        once()
    times = []
    for _ in range(iters):
        if DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            once()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    den = ref.abs().max().item()
    return (a - ref).abs().max().item() / den if den else (a - ref).abs().max().item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--pure-max", type=int, default=16384, help="longest length timed for pure")
    p.add_argument("--autotune-max", type=int, default=None,
                   help="autotune at most this many configs per kernel (default: $FCP_FLA_AUTOTUNE_MAX, "
                        "else all)")  # fmt: skip
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": interpreter dry run
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":  # dry run of this script on FLA's kernels under TRITON_INTERPRET=1
        from tests.support import fla_interpret as interpret

        interpret.enable()
    elif not torch.cuda.is_available():
        print("skipped: bench_fla_gpu needs a CUDA device")
        return 0
    from tests.support.triton_tuning import limit_from_env, limit_triton_autotune

    if args.autotune_max is None:
        args.autotune_max = limit_from_env()
    else:
        limit_triton_autotune(args.autotune_max)
    dtype = getattr(torch, args.dtype)
    summary = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "dtype": args.dtype, "heads": args.heads,
               "dim": args.dim, "autotune_max": args.autotune_max, "rows": []}  # fmt: skip
    tuning = f"autotune <= {args.autotune_max} configs/kernel" if args.autotune_max > 0 else "full autotune"
    print(f"device: {summary['device']}, {args.dtype}, H=HV={args.heads}, K=V={args.dim}, {tuning}, "
          "fwd+bwd ms (median)")
    print(f"{'tokens':>7} {'docs':>5} {'static':>9} {'varlen':>9} {'fcp-varl':>9} {'pure':>9} {'static/varlen':>14}")
    for i, t in enumerate(args.lengths):
        doc = packing(t, seed=t)
        inputs = make_inputs(t, args.heads, args.dim, seed=i)
        grad_out = torch.randn(1, t, args.heads, args.dim, device=DEVICE)
        fns = runners(doc)
        if i == 0:
            ref_out, ref_grads = fwd_bwd(fns["pure"], inputs, torch.float32, grad_out)
            agree = {}
            for name in ("static", "varlen", "pure"):
                out, grads = fwd_bwd(fns[name], inputs, dtype, grad_out)
                agree[name] = {"out": rel(out, ref_out)} | {
                    f"d{n}": rel(g, r) for n, g, r in zip(NAMES, grads, ref_grads)
                }
            summary["agreement_vs_pure_fp32"] = {"tokens": t, **agree}
            del ref_out, ref_grads
            for name, errs in agree.items():
                worst = max(errs, key=errs.get)
                print(f"agreement {name:6s} ({args.dtype}) vs pure fp32 at {t} tokens: out "
                      f"{errs['out']:.2e}, worst {worst} {errs[worst]:.2e}")  # fmt: skip
        row = {"tokens": t, "docs": int(doc.max())}
        for name in ("static", "varlen", "fcp-varlen", "pure"):
            if name == "pure" and t > args.pure_max:
                row[name] = None
                continue
            row[name] = time_ms(fns[name], inputs, dtype, grad_out, args.warmup, args.iters)
        row["ratio"] = row["static"] / row["varlen"]
        summary["rows"].append(row)

        def fmt(x):
            return f"{x:9.2f}" if x is not None else f"{'-':>9}"

        print(f"{t:7d} {row['docs']:5d} {fmt(row['static'])} {fmt(row['varlen'])} "
              f"{fmt(row['fcp-varlen'])} {fmt(row['pure'])} {row['ratio']:14.3f}")  # fmt: skip
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    worst = max(r["ratio"] for r in summary["rows"])
    summary["worst_ratio"] = worst
    summary["within_10pct"] = worst <= 1.10
    print(f"static/varlen worst ratio {worst:.3f} ({'OK' if worst <= 1.10 else 'ABOVE'} target 1.10)")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
