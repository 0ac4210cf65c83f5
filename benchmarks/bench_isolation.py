"""What keeping NaN/inf inside its document costs: the hybrid layer with its isolation, and with it
twice.

    .venv/bin/python benchmarks/bench_isolation.py [--lengths 1024 4096] [--repeats 7]

fcp's mixing operators replace non-finite inputs by zero and non-finite output gradients by zero
(:mod:`fcp.ops.kit.common`). The benchmark's hybrid layer (``bench_scaling.layer``: short conv ->
KDA -> k-pool indexer -> index attention) runs forward + backward as shipped and with that
isolation applied a second time around every operator; the difference is the isolation's cost,
reported as a fraction of the layer (CPU time, 1 thread, median of interleaved repeats).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fcp
from benchmarks.bench_scaling import D, _packing, _params, layer
from fcp.ops.kit.common import finite_or_zero, zero_nonfinite_grad


class _Twice:
    """fcp's mixing operators with their isolation applied once more (inputs and outputs)."""

    def __init__(self):
        self.short_conv = self._wrap(fcp.short_conv, 1)
        self.kda = self._wrap(fcp.kda, 5)
        self.kpool_indexer = self._wrap(fcp.kpool_indexer, 3)
        self.index_attention = self._wrap(fcp.index_attention, 3)

    @staticmethod
    def _wrap(op, n_tensors):
        def run(*args, **kwargs):
            args = [finite_or_zero(a) if i < n_tensors else a for i, a in enumerate(args)]
            return zero_nonfinite_grad(op(*args, **kwargs))

        return run


def _time(fn):
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def measure(seq: int, repeats: int) -> dict:
    p = _params()
    ctx = fcp.PackedContext(_packing(seq, 0))
    x = torch.randn(1, seq, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    twice = _Twice()

    def run(ops):
        return lambda: layer(x, p, ctx, ops).sum().backward()

    run(fcp)(), run(twice)()  # warm-up
    a, b = [], []
    for _ in range(repeats):  # interleaved: the machine's load hits both alike
        a.append(_time(run(fcp)))
        b.append(_time(run(twice)))
    t1, t2 = statistics.median(a), statistics.median(b)
    return dict(seq=seq, layer_s=t1, twice_s=t2, isolation_fraction=(t2 - t1) / t1)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print("# hybrid layer fwd+bwd, CPU s (median): as shipped vs isolation applied twice")
    for seq in args.lengths:
        r = measure(seq, args.repeats)
        rows.append(r)
        print(f"{seq:6d} tokens: layer {r['layer_s']:.3f} s, with isolation twice "
              f"{r['twice_s']:.3f} s -> isolation costs {100 * r['isolation_fraction']:.1f}% "
              "of the layer", flush=True)
    return rows


if __name__ == "__main__":
    main()
