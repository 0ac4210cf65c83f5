"""WKV (:func:`fcp.ops.wkv.wkv`) and the mLSTM (its stabiliser :func:`fcp.ops.mlstm.
mlstm_stabilizer` composed with :func:`fcp.ops.gla.gla`, as xLSTM's mixer does) over random
packings, with and without CP (real gloo groups, 1-4 ranks).

* CP == the fp64 per-token loop: the concatenated outputs and input gradients (WKV's ``a``,
  ``u``: summed over the ranks) within 2e-5 relative (``max |err| / max |ref|`` per tensor,
  fp32) for WKV; within 1e-4 for the mLSTM, whose fp32 conditioning is worse (transformers' own
  fp32 per-step kernel is up to 3.1e-5 from its fp64 run on these layouts).
* Layouts (:func:`tests.support.packing.length_rows`) mix single-token documents, documents
  spanning every rank and pad tails; WKV's keys up to scale 10 (exponents up to ~40: the
  running maxima differ across ranks; at scale 40, |k| ~ 100, the fp32 rounding of ``u + k``
  alone moves the gradients by ~5e-5, for transformers' fp32 loop too), the mLSTM's input gates
  up to scale 4
  (beyond it the mLSTM itself is ill-conditioned in fp32: ``tests/test_mlstm.py``).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from fcp.ops.mlstm.reference import mlstm_reference
from fcp.ops.wkv.reference import wkv_reference
from tests import _mlstm_rank_fns as mlstm_fns
from tests import _wkv_rank_fns as wkv_fns
from tests.support.inputs import rel_err
from tests.support.operator_checks import out_and_grads
from tests.support.packing import length_rows


@st.composite
def layout(draw):
    world = draw(st.integers(1, 4))
    local = draw(st.integers(2, 12))
    batch = draw(st.integers(1, 2))
    return world, draw(length_rows(batch, world * local)), draw(st.integers(0, 2**16))


def _run(rank_pool, fn, world, *args):
    if world == 1:
        return [fn(_OneRank(), *args)]
    return rank_pool.run(fn, world, *args)


class _OneRank:
    group, world_size, rank = None, 1, 0


@settings(max_examples=15, deadline=None)
@given(layout(), st.sampled_from([1.0, 10.0]))
def test_wkv_cp_equals_the_loop(rank_pool, case, key_scale):
    world, doc_ids, seed = case
    batch, seq = doc_ids.shape
    inputs = wkv_fns.make_inputs(batch, seq, 3, seed, key_scale=key_scale)
    grad = torch.randn(batch, seq, 3, generator=torch.Generator().manual_seed(seed))
    results = _run(rank_pool, wkv_fns.wkv_fwd_bwd, world, inputs, doc_ids, grad)
    # + 0 * a: with only one-token documents the loop never uses the decay (autograd then has
    # no gradient for it; the true one is 0)
    want, grads = out_and_grads(lambda *xs: wkv_reference(*xs, doc_ids) + 0 * xs[2].sum(),
                                {n: x.double() for n, x in inputs.items()}, grad, wkv_fns.NAMES)
    assert rel_err(torch.cat([r[0] for r in results], 1), want) <= 2e-5
    got = {n: torch.cat([r[1][n] for r in results], 1) for n in ("k", "v")}
    got.update({n: sum(r[1][n] for r in results) for n in ("a", "u")})
    # gradients relative to the larger of their own largest entry and a tenth of the largest of
    # all (the parity battery's rule): with strong decays the decay's whole gradient can be
    # ~1e-7 of the others, a difference of nearly equal fp32 terms
    scale = max(float(g.abs().max()) for g in grads.values())
    for n, g in got.items():
        err = float((g.double() - grads[n]).abs().max())
        assert err <= 2e-5 * max(float(grads[n].abs().max()), 0.1 * scale), n


@settings(max_examples=15, deadline=None)
@given(layout(), st.sampled_from([0.5, 4.0]))
def test_mlstm_cp_equals_the_loop(rank_pool, case, gate_scale):
    world, doc_ids, seed = case
    batch, seq = doc_ids.shape
    inputs = mlstm_fns.make_inputs(batch, seq, 2, 4, 4, seed, gate_scale=gate_scale)
    grad = torch.randn(batch, seq, 2, 4, generator=torch.Generator().manual_seed(seed))
    results = _run(rank_pool, mlstm_fns.mlstm_fwd_bwd, world, inputs, doc_ids, grad)
    want, grads = out_and_grads(lambda *xs: mlstm_reference(*xs, doc_ids),
                                {n: x.double() for n, x in inputs.items()}, grad,
                                mlstm_fns.NAMES)  # fmt: skip
    assert rel_err(torch.cat([r[0] for r in results], 1), want) <= 1e-4
    for n in mlstm_fns.NAMES:
        assert rel_err(torch.cat([r[1][n] for r in results], 1), grads[n]) <= 1e-4, n
