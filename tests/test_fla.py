"""FLA interop on CPU: FLA CP planning, the ``fcp::`` custom ops, both FLA backends, compile,
dispatch.

What runs here (no GPU): the ops are CUDA-only; :mod:`tests.support.fla_cpu_kernels` registers
CPU kernels built from fcp's references (the recurrence and ``torch.func.vjp`` of it) that
implement exactly the contract of FLA's kernels, so the op plumbing (schemas, fake kernels,
autograd formulas), the static-mode composition (gate resets, CP state chain around the op) and
compile behaviour are all checked against fcp's references. FLA's real Triton kernels run here only
under the Triton CPU interpreter (``test_fla_kernels_under_triton_interpreter``, marked ``slow``).

Tolerances (max |x - ref| / max |ref|): fp32 fallbacks 1e-5 (they are fp32 recurrences against
fcp's fp32 chunked/recurrent references; measured ~1e-7); the interpreter run 2e-4 for static mode
(the documented rounding of gate resets, measured ~2e-5 with three resets in one chunk) and 2e-5
for the varlen/h0/conv checks (measured <= 4e-6).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.conv import short_conv
from fcp.ops.conv.reference import short_conv_reference
from fcp.ops.conv.fla import fla_conv_varlen_bwd, fla_conv_varlen_fwd, short_conv_fla_varlen
from fcp.ops.kit.fla import build_fla_cp_context, fla_cp_fields
from fcp.ops.kda import kda
from fcp.ops.kda.reference import kda_reference
from fcp.ops.kda.fla import (
    RESET_LOG_DECAY,
    fla_kda_bwd,
    fla_kda_fwd,
    fla_kda_varlen_bwd,
    fla_kda_varlen_fwd,
    kda_fla_static,
    kda_fla_varlen,
    reset_gate,
)
from tests import _fla_rank_fns as ffns
from tests._fla_rank_fns import Block, fla_context_dict
from tests.support.cp_jobs import cat_ranks
from tests.support.fla_cpu_kernels import RCP_LN2
from tests.support.inputs import KDA_NAMES as NAMES, kda_inputs, rel_err
from tests.support.kda_oracles import check, out_and_grads
from tests.support.packing import doc_ids_from_lengths
from tests.support.python_subprocess import run_python

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


def fla_oracle(cu_cpu: torch.Tensor, world: int, rank: int, conv):
    from fla.ops.cp import build_cp_context

    return build_cp_context(cu_cpu.clone(), None, conv, cu_seqlens_cpu=cu_cpu.clone(),
                            world_size=world, rank=rank)  # fmt: skip


def rank_context(doc_ids: torch.Tensor, world: int, rank: int) -> PackedContext:
    # a placeholder group: planning never communicates
    group = "no-group" if world > 1 else None
    return PackedContext(doc_ids, group=group, cp_size=world, cp_rank=rank)


# ---------------------------------------------------------------------------------------------
# import hygiene
# ---------------------------------------------------------------------------------------------
def test_import_fcp_does_not_import_fla_and_ops_are_cuda_only():
    """Importing fcp's FLA backends does not import FLA (seconds), and fcp registers only CUDA
    kernels for its ops (the CPU kernels used in this file are test doubles)."""
    code = (
        "import sys, fcp, fcp.ops.kda.fla as k, fcp.ops.conv.fla as c, fcp.ops.kit.fla\n"
        "import fcp.ops.gla.fla as g, fcp.models.glm5_next.cp, fcp.models.qwen3_8_flash_next.cp\n"
        "ops = [k.fla_kda_fwd, k.fla_kda_bwd, k.fla_kda_varlen_fwd, k.fla_kda_varlen_bwd,\n"
        "       c.fla_conv_varlen_fwd, c.fla_conv_varlen_bwd, g.fla_gla_fwd, g.fla_gla_bwd]\n"
        "print('fla' in sys.modules, sorted({d for op in ops for d in op._backend_fns}))"
    )
    assert run_python(code).strip() == "False ['cuda']"


def test_fcp_works_without_fla_and_triton_installed():
    """FLA and triton are an extra: with both unimportable, fcp imports and its default
    backends run."""
    code = (
        "import sys; sys.modules['fla'] = None; sys.modules['triton'] = None\n"
        "import torch, fcp, fcp.models.glm5_next.cp, fcp.models.qwen3_8_flash_next.cp\n"
        "ctx = fcp.PackedContext(torch.tensor([[1, 1, 2, 0]]))\n"
        "x = torch.randn(1, 4, 1, 4)\n"
        "o = fcp.kda(x, x, x, -torch.rand(1, 4, 1, 4), torch.rand(1, 4, 1), ctx)\n"
        "y = fcp.short_conv(x[:, :, 0], torch.randn(4, 3), None, ctx)\n"
        "print(tuple(o.shape), tuple(y.shape))"
    )
    assert run_python(code).strip() == "(1, 4, 1, 4) (1, 4, 4)"


# ---------------------------------------------------------------------------------------------
# planning: build_fla_cp_context
# ---------------------------------------------------------------------------------------------
def test_context_worked_example_matches_fla():
    """The plan module's docstring table, and FLA's builder on the same boundaries."""
    doc = torch.tensor([[1, 1, 1, 1, 2, 3, 3, 3, 3, 3, 0, 0]])
    expected = [
        ([0, 3], 0, 1, True, False, 0),
        ([0, 1, 2, 3], 1, 2, False, False, 3),
        ([0, 3], 1, 1, False, False, 1),
        ([0, 1, 3], 2, 0, False, True, 4),
    ]
    for rank, exp in enumerate(expected):
        ctx = rank_context(doc, 4, rank)
        ours = build_fla_cp_context(ctx, 0, None, 4)
        got = (ours.cu_seqlens_cpu.tolist(), ours.pre_num_ranks, ours.post_num_ranks,
               ours.is_first_rank, ours.is_last_rank, ours.pre_num_conv_tokens)  # fmt: skip
        assert got == exp
        oracle = fla_oracle(ctx.row_cu_seqlens(0)[1], 4, rank, 4)
        assert fla_context_dict(ours) == fla_context_dict(oracle)


def test_context_is_cached_per_row_and_kernel_size():
    doc = doc_ids_from_lengths([([3, 5], 4), ([12], 0)])
    ctx = rank_context(doc, 2, 1)
    a = build_fla_cp_context(ctx, 0, None, 4)
    assert build_fla_cp_context(ctx, 0, None, 4) is a
    assert build_fla_cp_context(ctx, 0, None, 3) is not a
    b = build_fla_cp_context(ctx, 1, None, 4)
    assert b is not a and b.cu_seqlens_cpu.tolist() == [0, 6]
    assert a.cu_seqlens_cpu.tolist() == [0, 2, 6]  # doc 2 ends at 8, then the pad tail
    assert build_fla_cp_context(ctx.replace(), 0, None, 4) is not a  # a new context, a new memo
    with pytest.raises(ValueError):
        build_fla_cp_context(ctx, 2, None, 4)


def test_fla_cp_fields_rejects_bad_lengths():
    with pytest.raises(ValueError, match="multiple of cp_size"):
        fla_cp_fields(torch.tensor([0, 3, 7]), 2, 0)


@pytest.mark.slow  # ~30 s: every rank imports FLA
def test_context_with_real_group_matches_fla(rank_pool):
    doc = doc_ids_from_lengths([([2, 7, 1, 1], 1), ([5, 7], 0)])
    for ours, theirs, cached in rank_pool.run(ffns.fla_context_fields, 3, doc, 1, 4):
        assert ours == theirs
        assert ours["group"] is True and cached


# ---------------------------------------------------------------------------------------------
# custom ops: opcheck (schemas, fake kernels, autograd registration, AOT dispatch)
# ---------------------------------------------------------------------------------------------
def kda_args(b=2, t=9, h=1, hv=2, dk=4, dv=3, dtype=torch.float32, seed=0):
    xs = kda_inputs(b, t, h, hv, dk, dv, seed, dtype)
    return [xs[n].requires_grad_() for n in NAMES]


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_kda(with_h0, dtype):
    xs = kda_args(dtype=dtype)
    b, hv, dk, dv = 2, 2, 4, 3
    h0 = torch.randn(b, hv, dk, dv, requires_grad=True) if with_h0 else None
    torch.library.opcheck(fla_kda_fwd, (*xs, h0, 0.5, 32))
    with torch.no_grad():
        o, ht, gc, aqk, akk = fla_kda_fwd(*xs, h0, 0.5, 32)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    h0 = None if h0 is None else h0.detach()  # the backward ops have no double backward
    plain = [x.detach() for x in xs]
    torch.library.opcheck(fla_kda_bwd, (*plain, h0, gc, aqk, akk, do, dht, 0.5, 32))
    torch.library.opcheck(fla_kda_bwd, (*plain, h0, gc, aqk, akk, do, None, 0.5, 32))


def test_opcheck_kda_varlen():
    xs = kda_args(b=1, t=11)
    cu = torch.tensor([0, 3, 4, 11], dtype=torch.int32)
    meta = (cu, cu, 0.5, 64, "", 0, 0, True, True)
    torch.library.opcheck(fla_kda_varlen_fwd, (*xs, *meta))
    with torch.no_grad():
        o, gc, aqk, akk, h0 = fla_kda_varlen_fwd(*xs, *meta)
    torch.library.opcheck(
        fla_kda_varlen_bwd, (*[x.detach() for x in xs], gc, aqk, akk, h0, torch.randn_like(o), *meta)
    )


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["", "silu"])
def test_opcheck_conv_varlen(bias, activation):
    x = torch.randn(1, 10, 5, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    b = torch.randn(5, requires_grad=True) if bias else None
    cu = torch.tensor([0, 1, 6, 10], dtype=torch.int32)
    meta = (cu, cu, activation, "", 0, True)
    torch.library.opcheck(fla_conv_varlen_fwd, (x, w, b, *meta))
    with torch.no_grad():
        y, state = fla_conv_varlen_fwd(x, w, b, *meta)
    dargs = (x.detach(), w.detach(), None if b is None else b.detach(), state, torch.randn_like(y))
    torch.library.opcheck(fla_conv_varlen_bwd, (*dargs, *meta))


def test_dispatcher_refuses_fla_backends_off_cuda():
    ctx = PackedContext(doc_ids_from_lengths([([8], 0)]))
    xs = [kda_inputs(1, 8, 1, 1, 4, 3, seed=0)[n].float() for n in NAMES]
    for backend in ("fla", "fla_varlen"):
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            kda(*xs, ctx, backend=backend)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        short_conv(torch.randn(1, 8, 3), torch.randn(3, 4), None, ctx, backend="fla_varlen")
    with pytest.raises(ValueError, match="backend must be"):
        kda(*xs, ctx, backend="fast")


# ---------------------------------------------------------------------------------------------
# both modes against the references (single process)
# ---------------------------------------------------------------------------------------------
PACKINGS = [
    [([1, 1, 3, 20, 5], 2), ([32], 0)],
    [([16, 16], 0), ([7], 25)],
]


@pytest.mark.parametrize("rows", PACKINGS)
@pytest.mark.parametrize("mode", ["static", "varlen"])
def test_modes_match_reference(rows, mode):
    doc = doc_ids_from_lengths(rows)
    ctx = PackedContext(doc)
    inputs = kda_inputs(2, 32, 1, 2, 8, 4, seed=3)
    grad_out = torch.randn(2, 32, 2, 4, generator=torch.Generator().manual_seed(4))
    fn = kda_fla_static if mode == "static" else kda_fla_varlen
    check(lambda *xs: fn(*xs, ctx), lambda *xs: kda_reference(*xs, ctx), inputs, grad_out, TOL)


def test_static_reset_gate_values():
    doc = torch.tensor([[1, 1, 2, 2, 2, 0]])
    g = -torch.rand(1, 6, 1, 2)
    got = reset_gate(g, PackedContext(doc))
    interior = torch.tensor([False, False, True, False, False, True])  # position 0: initial state
    assert torch.equal(got[0, interior], torch.full((2, 1, 2), RESET_LOG_DECAY))
    assert torch.equal(got[0, ~interior], g[0, ~interior])
    # the reset underflows to an exact zero decay in FLA's log2 domain, with margin
    assert torch.exp2(torch.tensor(RESET_LOG_DECAY) * RCP_LN2) == 0.0
    assert RESET_LOG_DECAY * RCP_LN2 < -150


def test_conv_varlen_matches_reference():
    doc = doc_ids_from_lengths([([1, 2, 9], 4), ([16], 0)])
    ctx = PackedContext(doc)
    gen = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(2, 16, 6, generator=gen), torch.randn(6, 3, generator=gen), torch.randn(6, generator=gen)
    dy = torch.randn(2, 16, 6, generator=gen)
    grads = {}
    for name, fn in (("fla", short_conv_fla_varlen), ("ref", None)):
        xs = [t.clone().requires_grad_() for t in (x, w, b)]
        y = fn(*xs, ctx, "silu") if fn else short_conv_reference(*xs, doc, "silu")
        grads[name] = [y.detach(), *torch.autograd.grad(y, xs, dy)]
    for a, r in zip(grads["fla"], grads["ref"]):
        assert rel_err(a, r) <= TOL


# ---------------------------------------------------------------------------------------------
# static mode under CP (rank pool, the ops' CPU test doubles)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "world, rows",
    [
        (2, [([5, 9, 2], 0)]),  # a document across the rank boundary
        (3, [([4, 8, 1, 3], 2), ([18], 0)]),  # starts exactly at a rank boundary, pad tail
        (4, [([1, 1, 1, 1, 1, 3], 4)]),  # one-token shards of documents
    ],
)
def test_static_cp_matches_reference(rank_pool, world, rows):
    doc = doc_ids_from_lengths(rows)
    b, t = doc.shape
    inputs = kda_inputs(b, t, 1, 2, 4, 3, seed=world)
    grad_out = torch.randn(b, t, 2, 3, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    res = rank_pool.run(ffns.static_kda_fwd_bwd, world, inputs, doc, grad_out, 32, False)
    out, grads = cat_ranks(res, "out"), {n: cat_ranks(res, n) for n in NAMES}
    ref, ref_grads = out_and_grads(lambda *xs: kda_reference(*xs, PackedContext(doc)), inputs, grad_out)
    errs = {"out": rel_err(out, ref)} | {n: rel_err(grads[n], ref_grads[n]) for n in NAMES}
    assert max(errs.values()) <= TOL, errs


def test_static_cp_compiles_fullgraph(rank_pool):
    doc = doc_ids_from_lengths([([3, 7, 2], 0)])
    inputs = kda_inputs(1, 12, 1, 1, 4, 3, seed=1)
    grad_out = torch.randn(1, 12, 1, 3, dtype=torch.float64)
    eager = rank_pool.run(ffns.static_kda_fwd_bwd, 2, inputs, doc, grad_out, 32, False)
    compiled = rank_pool.run(ffns.static_kda_fwd_bwd, 2, inputs, doc, grad_out, 32, True)
    for rank_e, rank_c in zip(eager, compiled):
        assert all(torch.allclose(rank_e[key], rank_c[key], atol=1e-6) for key in rank_e)


# ---------------------------------------------------------------------------------------------
# compile: a small KDA + short-conv block calling the custom ops
# ---------------------------------------------------------------------------------------------
def _step(model, x, context):
    model.zero_grad(set_to_none=True)
    y = model(x, context)
    (y * y).mean().backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()]


def _compile_and_compare(backend):
    torch.manual_seed(0)
    model = Block()
    frames = []

    def counting_backend(gm, example_inputs):
        frames.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=counting_backend)
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(1))
    for rows in ([([3, 9, 4], 0), ([16], 0)], [([1, 1, 14], 0), ([5], 11)]):
        ctx = PackedContext(doc_ids_from_lengths(rows))
        y_e, g_e = _step(model, x, ctx)
        y_c, g_c = _step(compiled, x, ctx)
        assert torch.allclose(y_e, y_c, atol=1e-5, rtol=1e-5)
        assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(g_e, g_c))
    assert len(frames) == 1, "a new packing recompiled"
    return frames[0]


def test_block_compiles_fullgraph_aot_eager():
    gm = _compile_and_compare("aot_eager")
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any("fla_kda_fwd" in t for t in targets)


@pytest.mark.slow
def test_block_compiles_fullgraph_inductor():
    t0 = time.perf_counter()
    _compile_and_compare("inductor")
    assert time.perf_counter() - t0 < 300


def test_varlen_op_compiles_fullgraph():
    """The varlen ops also trace (metadata as graph inputs), though the mode plans on the host."""
    doc = doc_ids_from_lengths([([2, 5, 3], 2)])
    inputs = kda_inputs(1, 12, 1, 1, 4, 3, seed=2)
    ctx = build_fla_cp_context(PackedContext(doc), 0, None, None)

    def f(q, k, v, g, beta, cu, cu_cpu):
        return fla_kda_varlen_fwd(q, k, v, g, beta, cu, cu_cpu, 0.5, 64, "", 0, 0, True, True)[0]

    torch._dynamo.reset()
    xs = [inputs[n] for n in NAMES]
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*xs, ctx.cu_seqlens, ctx.cu_seqlens_cpu)
    assert torch.allclose(got, kda_reference(*xs, PackedContext(doc), scale=0.5), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------------------------
def test_fla_conv_needs_a_full_halo_under_cp():
    with pytest.raises(ValueError, match="single-hop"):
        short_conv_fla_varlen(torch.randn(1, 2, 3), torch.randn(3, 4), None,
                              PackedContext(torch.ones(1, 4, dtype=torch.long), group=_FakeGroup(),
                                            cp_size=2, cp_rank=1))  # fmt: skip


class _FakeGroup:
    group_name = "fake"


# ---------------------------------------------------------------------------------------------
# FLA's real Triton kernels on CPU (interpreter, subprocess)
# ---------------------------------------------------------------------------------------------
def interpreted_report(module: str) -> dict:
    """The JSON report (last stdout line) of ``python -m module`` run with FLA's Triton kernels
    interpreted on CPU (``TRITON_INTERPRET=1``, inherited by any ranks it starts)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_fla_kernels_under_triton_interpreter():
    """Static and varlen modes, the CP-augmented initial state and the conv through FLA's kernels.

    ~80 s on 2 shared cores (FLA's token-parallel intra-chunk kernel dominates).
    """
    for name, metrics in interpreted_report("tests._fla_interpret_check").items():
        tol = 2e-4 if name == "static" else 2e-5
        errs = {k: v for k, v in metrics.items() if k != "seconds"}
        assert max(errs.values()) <= tol, (name, errs)


@pytest.mark.slow
def test_fla_cp_path_under_triton_interpreter():
    """FLA-varlen mode *with CP* (FLA's own state exchange and conv halo, fed by
    build_fla_cp_context through the fcp:: ops) on 2 gloo ranks, FLA kernels interpreted on CPU.

    ~1 min. KDA forward and backward, conv forward (the interpreter cannot run FLA's conv
    backward-with-halo kernel). Tolerance 2e-5 (measured <= 1.5e-6).
    """
    report = interpreted_report("tests._fla_interpret_cp")
    for name in ("kda", "conv"):
        assert max(report[name].values()) <= 2e-5, (name, report[name])
