"""The ``"fla"`` backend of fcp.gla on CPU: the ``fcp::fla_gla_*`` custom ops (schemas, fake
kernels, autograd), static mode (decay resets, the CP state chain around the op), compile.

The ops are CUDA-only; :mod:`tests.support.fla_cpu_kernels` registers CPU kernels built from
fcp's reference recurrence (and autograd of it) implementing exactly the contract of FLA's
``chunk_simple_gla_fwd`` / ``_bwd``, so everything around FLA's kernels is checked here against
fcp's references (that importing the backend imports no FLA and registers CUDA kernels only is
checked with the other FLA ops in ``tests/test_fla.py``). FLA's own kernels run here under the
Triton CPU interpreter (:mod:`tests._gla_interpret_check`, a subprocess), and on CUDA in
``tests/test_gla_gpu.py``.

Tolerance with the CPU doubles (max |x - ref| / max |ref|): 1e-5 (fp32 doubles against fp32
references; measured 0 single-process: a reset of -105 underflows to the reference's exact
zero).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.gla.fla import RESET_LOG_DECAY, fla_gla_bwd, fla_gla_fwd, gla_fla_static, reset_decay
from fcp.ops.gla.reference import gla_reference
from tests import _gla_rank_fns as fns
from tests._gla_rank_fns import NAMES, make_inputs
from tests.support.inputs import rel_err
from tests.support.packing import doc_ids_from_lengths
from tests.support.fla_cpu_kernels import RCP_LN2

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


# ---------------------------------------------------------------------------------------------
# custom ops: opcheck (schemas, fake kernels, autograd registration, AOT dispatch)
# ---------------------------------------------------------------------------------------------
def op_args(dtype, b=2, t=9, h=3, dk=4, dv=5, seed=0):
    xs = make_inputs(b, t, h, h, dk, dv, seed, dtype)
    return [xs[n].requires_grad_() for n in NAMES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    xs = op_args(dtype)
    torch.library.opcheck(fla_gla_fwd, (*xs, 0.5, 64))
    with torch.no_grad():
        o, ht = fla_gla_fwd(*xs, 0.5, 64)
    assert o.dtype == dtype and ht.dtype == torch.float32
    plain = [x.detach() for x in xs]  # the backward op has no double backward
    for dht in (torch.randn_like(ht), None):
        torch.library.opcheck(fla_gla_bwd, (*plain, torch.randn_like(o), dht, 0.5, 64))


def test_op_gradients_match_the_recurrence():
    """The autograd formula wires (do, dht) to (dq, dk, dv, dg) as the recurrence's own."""
    from fcp.ops.gla.reference import gla_recurrence

    xs = op_args(torch.float64)
    gen = torch.Generator().manual_seed(3)
    do, dht = torch.randn(2, 9, 3, 5, generator=gen, dtype=torch.float64), torch.randn(2, 3, 4, 5, generator=gen)
    grads = []
    for fn in (lambda *a: fla_gla_fwd(*a, 0.5, 64), lambda *a: gla_recurrence(*a, 0.5)):
        o, ht = fn(*xs)
        grads.append(torch.autograd.grad((o * do).sum() + (ht * dht.to(ht.dtype)).sum(), xs))
    for got, want in zip(*grads):
        assert rel_err(got, want) <= TOL


# ---------------------------------------------------------------------------------------------
# static mode, single process
# ---------------------------------------------------------------------------------------------
def out_and_grads(fn, inputs: dict, grad_out):
    xs = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    out = fn(*(xs[n] for n in NAMES))
    grads = torch.autograd.grad(out, [xs[n] for n in NAMES], grad_out.to(out.dtype))
    return out.detach(), dict(zip(NAMES, grads))


def errors(got, ref) -> dict:
    (out, grads), (r_out, r_grads) = got, ref
    return {"out": rel_err(out, r_out)} | {n: rel_err(grads[n], r_grads[n]) for n in NAMES}


@pytest.mark.parametrize("rows", [[([1, 1, 3, 20, 5], 2), ([32], 0)], [([16, 16], 0), ([7], 25)]])
def test_static_mode_matches_reference(rows):
    doc = doc_ids_from_lengths(rows)
    ctx = PackedContext(doc)
    inputs = make_inputs(2, 32, 1, 2, 8, 4, seed=3)
    grad_out = torch.randn(2, 32, 2, 4, generator=torch.Generator().manual_seed(4))
    got = out_and_grads(lambda *xs: gla_fla_static(*xs, ctx), inputs, grad_out)
    ref = out_and_grads(lambda *xs: gla_reference(*xs, ctx), inputs, grad_out)
    errs = errors(got, ref)
    assert max(errs.values()) <= TOL, errs


def test_reset_decay_values():
    doc = torch.tensor([[1, 1, 2, 2, 2, 0]])
    a = -torch.rand(1, 6, 3)
    got = reset_decay(a, PackedContext(doc))
    interior = torch.tensor([False, False, True, False, False, True])  # position 0: zero state
    assert torch.equal(got[0, interior], torch.full((2, 3), RESET_LOG_DECAY))
    assert torch.equal(got[0, ~interior], a[0, ~interior])
    # the reset underflows to an exact zero decay in FLA's log2 domain, with margin
    assert torch.exp2(torch.tensor(RESET_LOG_DECAY) * RCP_LN2) == 0.0
    assert RESET_LOG_DECAY * RCP_LN2 < -150


# ---------------------------------------------------------------------------------------------
# static mode under CP (rank pool, the ops' CPU test doubles)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "world, rows, compiled",
    [
        (2, [([5, 9, 2], 0)], False),  # a document across the rank boundary
        (2, [([3, 7, 6], 0)], True),  # the same, compiled (fullgraph, aot_eager) on every rank
        (3, [([4, 8, 1, 3], 2), ([18], 0)], False),  # starts exactly at a rank boundary, pad tail
        (4, [([1, 1, 1, 1, 1, 3], 4)], False),  # one-token shards of documents
    ],
)
def test_static_cp_matches_reference(rank_pool, world, rows, compiled):
    doc = doc_ids_from_lengths(rows)
    b, t = doc.shape
    inputs = make_inputs(b, t, 1, 2, 4, 3, seed=world)
    grad_out = torch.randn(b, t, 2, 3, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    res = rank_pool.run(fns.gla_fwd_bwd, world, inputs, doc, grad_out, 64, compiled, True)
    got = torch.cat([r[0] for r in res], 1), {n: torch.cat([r[1][n] for r in res], 1) for n in NAMES}
    ref = out_and_grads(lambda *xs: gla_reference(*xs, PackedContext(doc)), inputs, grad_out)
    errs = errors(got, ref)
    assert max(errs.values()) <= TOL, errs


def test_static_mode_compiles_once_across_packings():
    torch._dynamo.reset()
    frames = []

    def counting(gm, example_inputs):
        frames.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(gla_fla_static, fullgraph=True, backend=counting)
    inputs = make_inputs(2, 16, 1, 2, 4, 4, seed=2)
    grad_out = torch.randn(2, 16, 2, 4)
    for rows in ([([3, 9, 4], 0), ([16], 0)], [([1, 1, 14], 0), ([5], 11)], [([16], 0)] * 2):
        ctx = PackedContext(doc_ids_from_lengths(rows))
        got = out_and_grads(lambda *xs: compiled(*xs, ctx), inputs, grad_out)
        ref = out_and_grads(lambda *xs: gla_reference(*xs, ctx), inputs, grad_out)
        assert max(errors(got, ref).values()) <= TOL
    assert len(frames) == 1, "a new packing recompiled"
    targets = {str(n.target) for n in frames[0].graph.nodes if n.op == "call_function"}
    assert any("fla_gla_fwd" in t for t in targets)


# ---------------------------------------------------------------------------------------------
# FLA's real Triton kernels on CPU (interpreter, subprocess)
# ---------------------------------------------------------------------------------------------
def test_fla_kernels_under_triton_interpreter():
    """FLA's own simple_gla kernels through fcp's ops and static mode (~10 s, a subprocess).

    Tolerances: 1e-4 with several resets in one chunk (measured 2.1e-5: the documented reset
    rounding, ~6e-6 per reset), 2e-5 without interior resets (measured 3.2e-6, FLA's own
    cumulative-gate rounding) and for the final state and its gradients (measured 2.5e-6).
    """
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-m", "tests._gla_interpret_check"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report) == {"static", "plain", "final_state"}
    for check, metrics in report.items():
        errs = {k: v for k, v in metrics.items() if k != "seconds"}
        assert max(errs.values()) <= (1e-4 if check == "static" else 2e-5), (check, errs)
