"""Elementwise scan (fcp.elementwise_scan) properties over random packings, with and without CP
(real gloo groups, 1-4 ranks).

* CP == the fp64 reference: every rank runs
  :func:`fcp.ops.elementwise_scan.elementwise_scan` on its shard (the state enters through
  :func:`fcp.comm.state_chain`); the concatenated outputs and input gradients equal
  :func:`~fcp.ops.elementwise_scan.reference.elementwise_scan_reference` (float64 per-token
  loop) on the global tensors within 1e-5 relative (``max |err| / max |ref|`` per tensor, fp32
  inputs), with decays from none (1) to strong (``exp(-40)``) and exact zeros.
* Single process in fp64 == the reference, 1e-12.
* No leakage: replacing every token of one document (or of the pad tail) leaves every other
  output bitwise unchanged (``torch.equal``), with and without CP.

Layouts (:func:`tests.support.packing.length_rows`) mix single-token documents, documents
spanning every rank and pad tails (ranks holding only padding).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from fcp.context import PackedContext
from fcp.ops.elementwise_scan import elementwise_scan
from fcp.ops.elementwise_scan.reference import elementwise_scan_reference
from tests import _elementwise_scan_rank_fns as fns
from tests._elementwise_scan_rank_fns import NAMES, make_inputs
from tests.support.inputs import rel_err
from tests.support.packing import length_rows, one_document


@st.composite
def problem(draw, max_world: int = 4):
    world = draw(st.integers(1, max_world))
    local = draw(st.integers(1, 24))
    batch = draw(st.integers(1, 2))
    channels = draw(st.sampled_from([1, 5, (2, 3)]))
    doc_ids = draw(length_rows(batch, world * local))
    seed = draw(st.integers(0, 2**16))
    # log decays in [log_low, 0]: none to strong
    log_low = draw(st.sampled_from([-0.1, -4.0, -40.0]))
    inputs = make_inputs(batch, world * local, channels, seed, log_low=log_low)
    if draw(st.booleans()):  # some decays exactly 0
        gen = torch.Generator().manual_seed(seed)
        inputs["a"] = torch.where(torch.rand(inputs["a"].shape, generator=gen) < 0.2, 0.0,
                                  inputs["a"])  # fmt: skip
    return world, doc_ids, inputs


@settings(max_examples=25, deadline=None)
@given(problem())
def test_cp_equals_reference(rank_pool, prob):
    world, doc_ids, inputs = prob
    grad_out = torch.randn(*inputs["x"].shape, generator=torch.Generator().manual_seed(1))
    results = rank_pool.run(fns.scan_fwd_bwd, world, inputs, doc_ids, grad_out)
    xs = {n: x.double().requires_grad_() for n, x in inputs.items()}
    ref = elementwise_scan_reference(*(xs[n] for n in NAMES), doc_ids)
    (ref * grad_out.double()).sum().backward()
    assert rel_err(torch.cat([r[0] for r in results], 1), ref.detach()) <= 1e-5
    for n in NAMES:
        grad = torch.cat([r[1][n] for r in results], 1)
        assert torch.isfinite(grad).all(), n
        assert rel_err(grad, xs[n].grad) <= 1e-5, (n, rel_err(grad, xs[n].grad))


@settings(max_examples=15, deadline=None)
@given(problem(max_world=1))
def test_single_process_equals_reference_fp64(prob):
    _, doc_ids, inputs = prob
    inputs = {n: x.double() for n, x in inputs.items()}
    ctx = PackedContext(doc_ids)
    out = elementwise_scan(*(inputs[n] for n in NAMES), ctx)
    assert rel_err(out, elementwise_scan_reference(*(inputs[n] for n in NAMES), ctx)) <= 1e-12


@settings(max_examples=15, deadline=None)
@given(problem(), st.data())
def test_other_documents_bitwise_unchanged(rank_pool, prob, data):
    world, doc_ids, inputs = prob
    inside = one_document(data, doc_ids)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    noise = {n: 3 * torch.randn(x.shape, generator=gen) for n, x in inputs.items()}
    noise["a"] = torch.rand(inputs["a"].shape, generator=gen)  # a stays a decay
    mask = {n: inside.view(*inside.shape, *([1] * (x.dim() - 2))) for n, x in inputs.items()}
    perturbed = {n: torch.where(mask[n], noise[n], x) for n, x in inputs.items()}
    clean, dirty = zip(*rank_pool.run(fns.scan_leak, world, inputs, perturbed, doc_ids))
    assert torch.equal(torch.cat(clean, 1)[~inside], torch.cat(dirty, 1)[~inside])
