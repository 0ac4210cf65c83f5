"""KDA and Gated DeltaNet properties over random packings, with and without CP (1-4 gloo ranks).

Every property holds for both gate kinds of :func:`fcp.ops.kda.kda` (``gate``: KDA's
``g [B, L, HV, K]``, a decay per key channel; GDN's ``g [B, L, HV]``, one per head):

* CP == single process: every rank runs :func:`fcp.ops.kda.kda` on its shard (the state enters
  through :func:`fcp.comm.state_chain`); the concatenated outputs and input gradients equal a
  single-process run on the global tensors within 2e-5 relative (``max |err| / max |ref|`` per
  tensor, fp32; measured ~5e-7: the two differ only in fp32 rounding).
* Single process == per-token reference (:func:`fcp.ops.kda.kda_reference`) in fp64, 1e-10.
* No leakage: replacing every token of one document (or of the pad tail) leaves every other
  output bitwise unchanged (``torch.equal``), with and without CP.

Packings include documents spanning every rank, single-token documents, long pad tails (ranks
holding only padding), GVA (value_heads = 1-3 x heads) and chunks smaller than a shard, so chunk
and rank boundaries fall inside documents, on them, and in the padding.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fcp.context import PackedContext
from fcp.ops.kda import kda
from fcp.ops.kda.reference import kda_reference
from tests import _kda_rank_fns as fns
from tests.support.cp_jobs import cat_ranks
from tests.support.inputs import KDA_NAMES as NAMES, kda_inputs, rel_err
from tests.support.packing import length_rows

GATES = pytest.mark.parametrize("gate", ["kda", "gdn"])


#: per gate: the longest shard, the GVA factors (value heads per key head), the value dims
SHAPES = {"kda": (48, [1, 2], [4, 8, 16]), "gdn": (40, [1, 2, 3], [4, 8])}


@st.composite
def problem(draw, gate: str, max_world: int = 4):
    max_local, gvas, dvs = SHAPES[gate]
    world = draw(st.integers(1, max_world))
    local = draw(st.integers(8, max_local))
    batch = draw(st.integers(1, 2))
    heads = draw(st.integers(1, 2))
    gva = draw(st.sampled_from(gvas))
    dk, dv = draw(st.sampled_from([4, 8, 16])), draw(st.sampled_from(dvs))
    chunk = draw(st.sampled_from([4, 8, 16]))
    doc_ids = draw(length_rows(batch, world * local))
    seed = draw(st.integers(0, 2**16))
    inputs = kda_inputs(batch, world * local, heads, heads * gva, dk, dv, seed, gate=gate)
    return world, chunk, doc_ids, inputs


def _single(inputs, doc_ids, chunk, grad_out):
    xs = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    out = kda(*(xs[n] for n in NAMES), PackedContext(doc_ids), chunk_size=chunk)
    (out * grad_out).sum().backward()
    return out.detach(), {n: xs[n].grad for n in NAMES}


@GATES
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_cp_equals_single_process(rank_pool, gate, data):
    world, chunk, doc_ids, inputs = data.draw(problem(gate))
    grad_out = torch.randn(*inputs["v"].shape, generator=torch.Generator().manual_seed(1))
    results = rank_pool.run(fns.kda_fwd_bwd, world, inputs, doc_ids, grad_out, chunk)
    out = cat_ranks(results, "out")
    ref_out, ref_grads = _single(inputs, doc_ids, chunk, grad_out)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref_out) <= 2e-5
    for n in NAMES:
        grad = cat_ranks(results, n)
        assert torch.isfinite(grad).all(), n
        assert rel_err(grad, ref_grads[n]) <= 2e-5, (n, rel_err(grad, ref_grads[n]))


@GATES
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_single_process_equals_reference_fp64(gate, data):
    _, chunk, doc_ids, inputs = data.draw(problem(gate, max_world=1))
    inputs = {n: x.double() for n, x in inputs.items()}
    ctx = PackedContext(doc_ids)
    out = kda(*(inputs[n] for n in NAMES), ctx, chunk_size=chunk)
    ref = kda_reference(*(inputs[n] for n in NAMES), ctx)
    assert rel_err(out, ref) <= 1e-10


@GATES
@settings(max_examples=17, deadline=None)
@given(data=st.data())
def test_other_documents_bitwise_unchanged(rank_pool, gate, data):
    world, chunk, doc_ids, inputs = data.draw(problem(gate))
    row = data.draw(st.integers(0, doc_ids.shape[0] - 1))
    victim = data.draw(st.sampled_from(sorted(set(doc_ids[row].tolist()))))
    inside = torch.zeros_like(doc_ids, dtype=torch.bool)
    inside[row] = doc_ids[row] == victim
    noise = kda_inputs(*inputs["q"].shape[:3], inputs["v"].shape[2], inputs["q"].shape[3],
                       inputs["v"].shape[3], seed=data.draw(st.integers(0, 2**16)), gate=gate)
    perturbed = {}
    for n in NAMES:
        m = inside.view(*inside.shape, *([1] * (inputs[n].dim() - 2)))
        perturbed[n] = torch.where(m, 3 * noise[n], inputs[n])  # the gate stays a decay
    results = rank_pool.run(fns.kda_leak, world, inputs, perturbed, doc_ids, chunk)
    a = torch.cat([r[0] for r in results], 1)
    b = torch.cat([r[1] for r in results], 1)
    assert torch.equal(a[~inside], b[~inside])
    if world > 1:  # the single-process path must be leak-free too
        ctx = PackedContext(doc_ids)
        with torch.no_grad():
            a = kda(*(inputs[n] for n in NAMES), ctx, chunk_size=chunk)
            b = kda(*(perturbed[n] for n in NAMES), ctx, chunk_size=chunk)
        assert torch.equal(a[~inside], b[~inside])
