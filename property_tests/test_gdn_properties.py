"""Gated DeltaNet (one gate per head) properties over random packings, 1-4 real gloo ranks.

The properties of ``property_tests/test_kda_properties.py`` for ``g [B, L, HV]``:

* CP == single process within 2e-5 relative (outputs and every input gradient, fp32);
* single process == the per-token reference (:func:`fcp.ops.kda.kda_reference`) in fp64, 1e-10;
* no leakage: replacing every token of one document (or of the pad tail) leaves every other
  output bitwise unchanged, with and without CP.

Packings include documents spanning every rank, single-token documents, pad-only ranks, GVA
(value_heads = 1-3 x heads) and chunks smaller than a shard.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from fcp.context import PackedContext
from fcp.ops.kda import kda
from fcp.ops.kda.reference import kda_reference
from tests import _kda_rank_fns as fns
from tests._kda_rank_fns import NAMES, make_inputs, rel_err
from tests.support.strategies import one_document, packing


@st.composite
def problem(draw, max_world: int = 4):
    world = draw(st.integers(1, max_world))
    local = draw(st.integers(8, 40))
    batch = draw(st.integers(1, 2))
    heads = draw(st.integers(1, 2))
    gva = draw(st.sampled_from([1, 2, 3]))
    dk, dv = draw(st.sampled_from([4, 8, 16])), draw(st.sampled_from([4, 8]))
    chunk = draw(st.sampled_from([4, 8, 16]))
    doc_ids = draw(packing(batch, world * local))
    seed = draw(st.integers(0, 2**16))
    inputs = make_inputs(batch, world * local, heads, heads * gva, dk, dv, seed)
    inputs["g"] = inputs["g"][..., 0].contiguous()  # one gate per value head
    return world, chunk, doc_ids, inputs


@settings(max_examples=20, deadline=None)
@given(problem())
def test_cp_equals_single_process(rank_pool, prob):
    world, chunk, doc_ids, inputs = prob
    grad_out = torch.randn(*inputs["v"].shape, generator=torch.Generator().manual_seed(1))
    results = rank_pool.run(fns.kda_fwd_bwd, world, inputs, doc_ids, grad_out, chunk)
    xs = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    ref = kda(*(xs[n] for n in NAMES), PackedContext(doc_ids), chunk_size=chunk)
    (ref * grad_out).sum().backward()
    assert rel_err(torch.cat([r[0] for r in results], 1), ref.detach()) <= 2e-5
    for n in NAMES:
        grad = torch.cat([r[1][n] for r in results], 1)
        assert torch.isfinite(grad).all(), n
        assert rel_err(grad, xs[n].grad) <= 2e-5, (n, rel_err(grad, xs[n].grad))


@settings(max_examples=15, deadline=None)
@given(problem(max_world=1))
def test_single_process_equals_reference_fp64(prob):
    _, chunk, doc_ids, inputs = prob
    inputs = {n: x.double() for n, x in inputs.items()}
    ctx = PackedContext(doc_ids)
    out = kda(*(inputs[n] for n in NAMES), ctx, chunk_size=chunk)
    assert rel_err(out, kda_reference(*(inputs[n] for n in NAMES), ctx)) <= 1e-10


@settings(max_examples=15, deadline=None)
@given(problem(), st.data())
def test_other_documents_bitwise_unchanged(rank_pool, prob, data):
    world, chunk, doc_ids, inputs = prob
    inside = one_document(data, doc_ids)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    perturbed = {}
    for n in NAMES:
        noise = torch.randn(inputs[n].shape, generator=gen)
        if n in ("g", "beta"):  # keep the gate a decay and beta a step size
            noise = -noise.abs() if n == "g" else noise.sigmoid()
        m = inside.view(*inside.shape, *([1] * (inputs[n].dim() - 2)))
        perturbed[n] = torch.where(m, noise, inputs[n])
    results = rank_pool.run(fns.kda_leak, world, inputs, perturbed, doc_ids, chunk)
    a = torch.cat([r[0] for r in results], 1)
    b = torch.cat([r[1] for r in results], 1)
    assert torch.equal(a[~inside], b[~inside])
