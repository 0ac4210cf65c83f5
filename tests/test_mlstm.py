"""xLSTM's mLSTM: the stabiliser (:func:`fcp.ops.mlstm.mlstm_stabilizer`) against its fp64 loop,
and the whole mLSTM as xLSTM's mixer composes it (stabiliser + :func:`fcp.ops.gla.gla`) against
the fp64 per-token mLSTM and transformers' own per-step kernel; CP on 2 and 4 ranks (the running
max entering a rank from several ranks back), exact document independence, one compilation over
ten packings."""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.mlstm import mlstm_stabilizer
from fcp.ops.mlstm.reference import mlstm_reference, mlstm_stabilizer_reference
from tests import _mlstm_rank_fns as fns
from tests._mlstm_rank_fns import NAMES, make_inputs, mlstm_composed
from tests.support.cp_jobs import GraphRecorder
from tests.support.inputs import rel_err
from tests.support.operator_checks import check, check_documents_independent, out_and_grads
from tests.support.packing import doc_ids_from_lengths, random_doc_ids

PACKING = [([5, 1, 17, 2], 7), ([1, 30], 1)]
GATES = ("log_f", "log_i")


def stabilizer(ctx):
    return lambda f, i: torch.stack(mlstm_stabilizer(f, i, ctx), -1)


def stabilizer_oracle(doc_ids):
    return lambda f, i: torch.stack(mlstm_stabilizer_reference(f, i, doc_ids), -1)


def test_stabilizer_matches_the_loop():
    doc_ids = doc_ids_from_lengths(PACKING)
    inputs = {n: make_inputs(2, 32, 3, 4, 4, seed=1, dtype=torch.float64)[n] for n in GATES}
    grad = torch.randn(2, 32, 3, 2, dtype=torch.float64)
    check(stabilizer(PackedContext(doc_ids)), stabilizer_oracle(doc_ids), inputs, grad, 1e-12,
          GATES)  # fmt: skip


@pytest.mark.parametrize("gate_scale, tol", [(0.1, 1e-5), (4.0, 1e-5), (12.0, 1e-4)])
def test_mlstm_matches_the_loop(gate_scale, tol):
    """Small input gates (the initial state's 0 holds the max), large ones (they do). fp32: at
    gate scale 12 (input gates up to ~40) the problem itself is ill-conditioned in fp32:
    transformers' own per-step kernel in fp32 is 1.2e-5 from its fp64 run there (this path
    2e-5), so the bound is 1e-4; in fp64 the two agree to 1e-14
    (:func:`test_mlstm_is_exact_in_fp64`)."""
    doc_ids = doc_ids_from_lengths(PACKING)
    inputs = make_inputs(2, 32, 2, 8, 4, seed=2, gate_scale=gate_scale)
    grad = torch.randn(2, 32, 2, 4)
    check(lambda *xs: mlstm_composed(*xs, PackedContext(doc_ids)),
          lambda *xs: mlstm_reference(*(x.double() for x in xs), doc_ids), inputs, grad, tol,
          NAMES)  # fmt: skip


def test_mlstm_is_exact_in_fp64():
    doc_ids = doc_ids_from_lengths(PACKING)
    inputs = make_inputs(2, 32, 2, 8, 4, seed=2, gate_scale=12.0, dtype=torch.float64)
    grad = torch.randn(2, 32, 2, 4, dtype=torch.float64)
    check(lambda *xs: mlstm_composed(*xs, PackedContext(doc_ids)),
          lambda *xs: mlstm_reference(*xs, doc_ids), inputs, grad, 1e-12, NAMES)


def test_reference_is_transformers_step_kernel():
    """transformers' ``mlstm_recurrent_sequence_native`` (the per-step kernel) on one document."""
    from transformers.models.xlstm.modeling_xlstm import mlstm_recurrent_sequence_native

    x = make_inputs(1, 12, 2, 8, 4, seed=3, dtype=torch.float64)
    f_pre = torch.log(torch.expm1(-x["log_f"]).reciprocal())  # logsigmoid(f_pre) = log_f
    want = mlstm_recurrent_sequence_native(
        *(x[n].transpose(1, 2) for n in ("q", "k", "v")), igate=x["log_i"].transpose(1, 2),
        fgate=f_pre.transpose(1, 2), dtype_state=torch.float64).transpose(1, 2)
    got = mlstm_reference(*(x[n] for n in NAMES), torch.ones(1, 12, dtype=torch.long))
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    "world, rows",
    [
        (4, [([32], 0)]),  # one document spanning all four ranks
        (4, [([8, 8, 1, 7, 8], 0)]),  # documents start exactly at rank starts
        (4, [([7, 2, 1, 1, 1], 20)]),  # single-token docs across a boundary; pad-only ranks
        (2, [([3, 10], 19), ([1, 30], 1)]),  # two rows, different packings
    ],
)
def test_cp_matches_the_loop(rank_pool, world, rows):
    doc_ids = doc_ids_from_lengths(rows)
    batch = doc_ids.shape[0]
    inputs = make_inputs(batch, 32, 2, 8, 4, seed=10)
    grad = torch.randn(batch, 32, 2, 4, generator=torch.Generator().manual_seed(0))
    results = rank_pool.run(fns.mlstm_fwd_bwd, world, inputs, doc_ids, grad)
    ref_out, ref_grads = out_and_grads(lambda *xs: mlstm_reference(*xs, doc_ids),
                                       {n: x.double() for n, x in inputs.items()}, grad, NAMES)
    assert rel_err(torch.cat([r[0] for r in results], 1), ref_out) <= 1e-5
    for n in NAMES:
        assert rel_err(torch.cat([r[1][n] for r in results], 1), ref_grads[n]) <= 1e-5, n


def test_cp_stabilizer_matches_the_loop(rank_pool):
    """The running max crossing three ranks: strong input gates early, none later."""
    doc_ids = doc_ids_from_lengths([([30], 2)])
    inputs = {n: make_inputs(1, 32, 3, 4, 4, seed=4)[n] for n in GATES}
    inputs["log_i"][:, 8:] -= 20.0
    grads = [torch.randn(1, 32, 3, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    results = rank_pool.run(fns.stabilizer_fwd_bwd, 4, inputs, doc_ids, grads)
    want = mlstm_stabilizer_reference(inputs["log_f"], inputs["log_i"], doc_ids)
    for j in range(2):
        assert rel_err(torch.cat([r[0][j] for r in results], 1), want[j]) <= 1e-6
    ref_out, ref_grads = out_and_grads(lambda f, i: torch.stack(
        mlstm_stabilizer_reference(f, i, doc_ids), -1), inputs, torch.stack(grads, -1), GATES)
    for n in GATES:
        assert rel_err(torch.cat([r[1][n] for r in results], 1), ref_grads[n]) <= 1e-6, n


def test_other_documents_bitwise_unchanged():
    def inputs_of(seq, seed):
        return make_inputs(1, seq, 2, 4, 4, seed)

    check_documents_independent(mlstm_composed, inputs_of, NAMES)


def test_input_validation():
    x = make_inputs(1, 8, 2, 4, 4, seed=0)
    ctx = PackedContext(torch.ones(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="local_seq"):
        mlstm_stabilizer(x["log_f"], x["log_i"], PackedContext(torch.ones(1, 9, dtype=torch.long)))
    with pytest.raises(ValueError, match="log_i"):
        mlstm_stabilizer(x["log_f"], x["log_i"][..., :1], ctx)
    with pytest.raises(ValueError, match="backend must be"):
        mlstm_stabilizer(x["log_f"], x["log_i"], ctx, backend="cuda")


def test_compiled_equals_eager_once_across_ten_packings_without_host_sync():
    gen = torch.Generator().manual_seed(8)
    torch._dynamo.reset()
    recorder = GraphRecorder()
    compiled = torch.compile(mlstm_stabilizer, fullgraph=True, backend=recorder)
    for i in range(10):
        ctx = PackedContext(random_doc_ids(gen, 2, 40))
        inputs = {n: make_inputs(2, 40, 3, 4, 4, seed=100 + i)[n] for n in GATES}
        grad = torch.randn(2, 40, 3, 2, generator=gen)
        out_c, grads_c = out_and_grads(lambda f, i: torch.stack(compiled(f, i, ctx), -1), inputs,
                                       grad, GATES)  # fmt: skip
        out_e, grads_e = out_and_grads(stabilizer(ctx), inputs, grad, GATES)
        assert rel_err(out_c, out_e) <= 1e-6
        assert all(rel_err(grads_c[n], grads_e[n]) <= 1e-6 for n in GATES)
    assert recorder.frames == 1, recorder.frames
    assert recorder.host_syncs() == [], recorder.host_syncs()
