"""FLA's real ``simple_gla`` Triton kernels on CPU (``TRITON_INTERPRET=1``) through fcp's ops,
against fcp's references.

Run as a subprocess by ``tests/test_gla_fla.py::test_fla_kernels_under_triton_interpreter``:
``python -m tests._gla_interpret_check`` prints one JSON object ``{check: {metric: value}}`` on
its last line. Nothing here may run in the pytest process (the interpreter patches are global),
and nothing imports the ops' CPU test doubles (they would replace FLA's kernels).

Checks (fp32, tiny shapes; each value is max |a - ref| / max |ref|):

* ``static``: :func:`gla_fla_static` (decay resets; several documents inside one 64-token chunk,
  one-token documents, a pad tail; 2 groups, 4 heads) vs :func:`gla_reference`, output and the
  gradients of q, k, v, a;
* ``plain``: the same on rows without an interior document start (FLA's dense numerics alone);
* ``final_state``: ``fcp::fla_gla_fwd``'s final state and the gradients through it (what CP
  uses) vs :func:`gla_recurrence`.
"""

from __future__ import annotations

import json
import time

from tests.support import fla_interpret

fla_interpret.enable()

import torch  # noqa: E402

from fcp.context import PackedContext  # noqa: E402
from fcp.ops.gla.fla import fla_gla_fwd, gla_fla_static  # noqa: E402
from fcp.ops.gla.reference import gla_recurrence, gla_reference  # noqa: E402
from tests.support.inputs import rel_err  # noqa: E402
from tests.support.packing import doc_ids_from_lengths  # noqa: E402

NAMES = ("q", "k", "v", "a")


def _inputs(b, t, groups, heads, dk, dv, seed) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(b, t, groups, dk, generator=gen),
                k=torch.randn(b, t, groups, dk, generator=gen),
                v=torch.randn(b, t, heads, dv, generator=gen),
                a=-4.0 * torch.rand(b, t, heads, generator=gen) ** 3)  # fmt: skip


def _grads(fn, inputs: dict, grad_out):
    xs = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    out = fn(*(xs[n] for n in NAMES))
    (out.double() * grad_out).sum().backward()
    return out.detach(), {n: xs[n].grad for n in NAMES}


def _compare(rows, seed) -> dict:
    ctx = PackedContext(doc_ids_from_lengths(rows))
    b, t = ctx.doc_ids.shape
    inputs = _inputs(b, t, 2, 4, 16, 16, seed)
    grad_out = torch.randn(b, t, 4, 16, generator=torch.Generator().manual_seed(seed + 1),
                           dtype=torch.float64)  # fmt: skip
    out, grads = _grads(lambda *xs: gla_fla_static(*xs, ctx), inputs, grad_out)
    ref, ref_grads = _grads(lambda *xs: gla_reference(*xs, ctx), inputs, grad_out)
    return {"out": rel_err(out, ref)} | {f"d{n}": rel_err(grads[n], ref_grads[n]) for n in NAMES}


def check_final_state() -> dict:
    inputs = _inputs(1, 80, 2, 2, 16, 8, seed=5)  # groups = heads: the op takes repeated q, k
    xs = [inputs[n].requires_grad_() for n in NAMES]
    gen = torch.Generator().manual_seed(6)
    do, dht = torch.randn(1, 80, 2, 8, generator=gen), torch.randn(1, 2, 16, 8, generator=gen)
    res = {}
    for name, fn in (("fla", lambda *a: fla_gla_fwd(*a, 0.25, 64)),
                     ("ref", lambda *a: gla_recurrence(*a, 0.25))):  # fmt: skip
        o, ht = fn(*xs)
        res[name] = [o.detach(), ht.detach(), *torch.autograd.grad((o * do).sum() + (ht * dht).sum(), xs)]
    keys = ["out", "final", *(f"d{n}" for n in NAMES)]
    return {k: rel_err(a, r) for k, a, r in zip(keys, res["fla"], res["ref"])}


if __name__ == "__main__":
    report = {}
    for name, run in (
        ("static", lambda: _compare([([1, 1, 3, 20, 30, 1], 8), ([2, 60, 2], 0)], seed=1)),
        ("plain", lambda: _compare([([64], 0), ([64], 0)], seed=3)),
        ("final_state", check_final_state),
    ):
        t0 = time.perf_counter()
        report[name] = run() | {"seconds": time.perf_counter() - t0}
    print(json.dumps(report))
