"""RWKV-4's WKV (:func:`fcp.ops.wkv.wkv`): the fp64 per-token loop as oracle, transformers' own
``rwkv_linear_attention_cpu`` per document, the stabiliser at extreme keys and decays, CP on 2
and 4 ranks (documents across rank boundaries, single-token documents, pad-only ranks), exact
document independence, inert padding, one compilation over ten packings."""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.wkv import wkv
from fcp.ops.wkv.reference import wkv_reference
from tests import _wkv_rank_fns as fns
from tests._wkv_rank_fns import NAMES, make_inputs
from tests.support.cp_jobs import GraphRecorder
from tests.support.inputs import rel_err
from tests.support.operator_checks import check, check_documents_independent, check_pad_inert
from tests.support.operator_checks import out_and_grads
from tests.support.packing import doc_ids_from_lengths, random_doc_ids

PACKING = [([5, 1, 17, 2], 7), ([1, 30], 1)]


def ours(ctx):
    return lambda *xs: wkv(*xs, ctx)


def oracle(doc_ids):
    return lambda *xs: wkv_reference(*(x.double() for x in xs), doc_ids)


def test_fp64_matches_the_loop_tightly():
    doc_ids = doc_ids_from_lengths(PACKING)
    inputs = make_inputs(2, 32, 6, seed=1, dtype=torch.float64)
    grad = torch.randn(2, 32, 6, dtype=torch.float64)
    check(ours(PackedContext(doc_ids)), oracle(doc_ids), inputs, grad, 1e-12, NAMES)


@pytest.mark.parametrize("key_scale", [3.0, 60.0])
def test_fp32_matches_the_loop(key_scale):
    """Keys of scale 60: ``e^k`` overflows fp32 without the stabiliser."""
    doc_ids = doc_ids_from_lengths(PACKING)
    inputs = make_inputs(2, 32, 6, seed=2, key_scale=key_scale)
    grad = torch.randn(2, 32, 6)
    check(ours(PackedContext(doc_ids)), oracle(doc_ids), inputs, grad, 1e-5, NAMES)


@pytest.mark.parametrize("decay", [0.0, -8.0, -40.0])
def test_extreme_decays_stay_finite_and_exact(decay):
    doc_ids = doc_ids_from_lengths([([20, 1, 9], 2)])
    inputs = dict(make_inputs(1, 32, 4, seed=3), a=torch.full((4,), decay))
    grad = torch.randn(1, 32, 4)
    check(ours(PackedContext(doc_ids)), oracle(doc_ids), inputs, grad, 1e-5, NAMES)


def test_matches_transformers_rwkv_cpu_path_per_document():
    """transformers' ``rwkv_linear_attention_cpu`` run on each document alone (it casts the keys
    to fp32 whatever their dtype: fp32 rounding)."""
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    doc_ids = doc_ids_from_lengths([([7, 1, 12], 0)])
    inputs = make_inputs(1, 20, 5, seed=4, dtype=torch.float64)
    time_decay = torch.log(-inputs["a"])
    got = wkv(*(inputs[n] for n in NAMES), PackedContext(doc_ids))
    start = 0
    for n in (7, 1, 12):
        k, v = inputs["k"][:, start : start + n], inputs["v"][:, start : start + n]
        want, _ = rwkv_linear_attention_cpu(time_decay, inputs["u"], k, v)
        torch.testing.assert_close(got[:, start : start + n], want, atol=1e-6, rtol=1e-5)
        start += n


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
    """CP end to end against the fp64 loop: outputs and every input gradient (a and u summed
    over the ranks) within 1e-5, with keys of scale 30 (the references differ across ranks)."""
    doc_ids = doc_ids_from_lengths(rows)
    batch = doc_ids.shape[0]
    inputs = make_inputs(batch, 32, 4, seed=10, key_scale=30.0)
    grad = torch.randn(batch, 32, 4, generator=torch.Generator().manual_seed(0))
    results = rank_pool.run(fns.wkv_fwd_bwd, world, inputs, doc_ids, grad)
    out = torch.cat([r[0] for r in results], 1)
    ref_out, ref_grads = out_and_grads(oracle(doc_ids), inputs, grad, NAMES)
    assert rel_err(out, ref_out) <= 1e-5
    for n in ("k", "v"):
        assert rel_err(torch.cat([r[1][n] for r in results], 1), ref_grads[n]) <= 1e-5, n
    for n in ("a", "u"):
        assert rel_err(sum(r[1][n] for r in results), ref_grads[n]) <= 1e-5, n


def test_compiled_cp_two_ranks_equals_eager(rank_pool):
    doc_ids = doc_ids_from_lengths([([5, 20, 3], 4)])
    inputs = make_inputs(1, 32, 4, seed=9)
    grad = torch.randn(1, 32, 4)
    eager = rank_pool.run(fns.wkv_fwd_bwd, 2, inputs, doc_ids, grad, False)
    compiled = rank_pool.run(fns.wkv_fwd_bwd, 2, inputs, doc_ids, grad, True)
    for (out_e, grads_e), (out_c, grads_c) in zip(eager, compiled):
        assert rel_err(out_c, out_e) <= 1e-6
        assert all(rel_err(grads_c[n], grads_e[n]) <= 1e-6 for n in NAMES)


def test_other_documents_bitwise_unchanged():
    def inputs_of(seq, seed):
        x = make_inputs(1, seq, 4, seed)
        return {"k": x["k"], "v": x["v"]}

    fixed = make_inputs(1, 1, 4, seed=0)
    check_documents_independent(lambda k, v, ctx: wkv(k, v, fixed["a"], fixed["u"], ctx),
                                inputs_of, ("k", "v"))  # fmt: skip


def test_pad_tokens_finite_and_inert():
    fixed = make_inputs(1, 1, 4, seed=0)
    inputs = {n: make_inputs(1, 32, 4, seed=7)[n] for n in ("k", "v")}
    check_pad_inert(lambda k, v, ctx: wkv(k, v, fixed["a"], fixed["u"], ctx), inputs, ("k", "v"))


def test_input_validation():
    x = make_inputs(1, 8, 4, seed=0)
    k, v, a, u = (x[n] for n in NAMES)
    ctx = PackedContext(torch.ones(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="local_seq"):
        wkv(k, v, a, u, PackedContext(torch.ones(1, 9, dtype=torch.long)))
    with pytest.raises(ValueError, match="v"):
        wkv(k, v[..., :2], a, u, ctx)
    with pytest.raises(ValueError, match="channels"):
        wkv(k, v, a[:2], u, ctx)
    with pytest.raises(ValueError, match="backend must be"):
        wkv(k, v, a, u, ctx, backend="cuda")
    with pytest.raises(TypeError, match="PackedContext"):
        wkv(k, v, a, u, ctx.doc_ids)


def test_compiled_equals_eager_once_across_ten_packings_without_host_sync():
    gen = torch.Generator().manual_seed(8)
    torch._dynamo.reset()
    recorder = GraphRecorder()
    compiled = torch.compile(wkv, fullgraph=True, backend=recorder)
    for i in range(10):
        doc_ids = random_doc_ids(gen, 2, 40)
        ctx = PackedContext(doc_ids)
        inputs = make_inputs(2, 40, 4, seed=100 + i)
        grad = torch.randn(2, 40, 4, generator=gen)
        out_c, grads_c = out_and_grads(lambda *xs: compiled(*xs, ctx), inputs, grad, NAMES)
        out_e, grads_e = out_and_grads(lambda *xs: wkv(*xs, ctx), inputs, grad, NAMES)
        assert rel_err(out_c, out_e) <= 1e-6
        assert all(rel_err(grads_c[n], grads_e[n]) <= 1e-6 for n in NAMES)
    assert recorder.frames == 1, recorder.frames
    assert recorder.host_syncs() == [], recorder.host_syncs()
