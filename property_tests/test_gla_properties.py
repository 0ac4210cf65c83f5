"""Gated linear attention (fcp.gla) properties over random packings, with and without CP (real
gloo groups, 1-4 ranks).

* CP == single process: every rank runs :func:`fcp.ops.gla.gla` on its shard (the state enters
  through :func:`fcp.comm.state_chain`); the concatenated outputs and input gradients equal a
  single-process run on the global tensors within 2e-5 relative (``max |err| / max |ref|`` per
  tensor, fp32; the two differ only in fp32 rounding).
* The ``"fla"`` backend's CP composition (on the ops' CPU test doubles) == the reference, 2e-5.
* Single process == the per-token reference (:func:`fcp.ops.gla.gla_reference`) in fp64, 1e-10.
* A decay per key dimension (``a [B, L, H, K]``, up to -12 per token): CP == single process and
  single process == the fp64 reference, as above.
* No leakage: replacing every token of one document (or of the pad tail) leaves every other
  output bitwise unchanged (``torch.equal``), with and without CP.

Layouts (:func:`tests.support.packing.length_rows`) mix documents shorter than a chunk (often
one token), documents spanning every rank, pad tails (ranks holding only padding), GQA (heads =
1-3 x groups) and chunks smaller and larger than a shard, so chunk and rank boundaries fall
inside documents, on them and in the padding.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from fcp.context import PackedContext
from fcp.ops.gla import gla
from fcp.ops.gla.reference import gla_reference
from tests import _gla_rank_fns as fns
from tests._gla_rank_fns import NAMES, make_inputs
from tests.support.inputs import rel_err
from tests.support.packing import length_rows, one_document


@st.composite
def problem(draw, max_world: int = 4):
    world = draw(st.integers(1, max_world))
    local = draw(st.integers(4, 40))
    batch = draw(st.integers(1, 2))
    groups = draw(st.integers(1, 2))
    heads = groups * draw(st.sampled_from([1, 2, 3]))
    dk, dv = draw(st.sampled_from([4, 8, 16])), draw(st.sampled_from([4, 8]))
    chunk = draw(st.sampled_from([4, 8, 16, 64]))
    doc_ids = draw(length_rows(batch, world * local))
    seed = draw(st.integers(0, 2**16))
    return world, chunk, doc_ids, make_inputs(batch, world * local, groups, heads, dk, dv, seed)


@st.composite
def keyed_problem(draw, max_world: int = 4):
    """:func:`problem` with a decay per key dimension (``a [B, L, H, K]``), strong or mild."""
    world, chunk, doc_ids, inputs = draw(problem(max_world))
    batch, seq, heads = inputs["a"].shape
    groups, dk = inputs["q"].shape[2:]
    dv = inputs["v"].shape[3]
    seed, strength = draw(st.integers(0, 2**16)), draw(st.sampled_from([1.0, 12.0]))
    return world, chunk, doc_ids, fns.make_keyed_inputs(batch, seq, groups, heads, dk, dv, seed,
                                                        strength=strength)  # fmt: skip


def _single(inputs, doc_ids, chunk, grad_out, fn=None):
    xs = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    out = (fn or gla)(*(xs[n] for n in NAMES), PackedContext(doc_ids), chunk_size=chunk)
    (out.double() * grad_out.double()).sum().backward()
    return out.detach(), {n: xs[n].grad for n in NAMES}


def _assert_cp_equals(results, ref_out, ref_grads):
    assert rel_err(torch.cat([r[0] for r in results], 1), ref_out) <= 2e-5
    for n in NAMES:
        grad = torch.cat([r[1][n] for r in results], 1)
        assert torch.isfinite(grad).all(), n
        assert rel_err(grad, ref_grads[n]) <= 2e-5, (n, rel_err(grad, ref_grads[n]))


@settings(max_examples=25, deadline=None)
@given(problem())
def test_cp_equals_single_process(rank_pool, prob):
    world, chunk, doc_ids, inputs = prob
    grad_out = torch.randn(*inputs["v"].shape, generator=torch.Generator().manual_seed(1))
    results = rank_pool.run(fns.gla_fwd_bwd, world, inputs, doc_ids, grad_out, chunk)
    _assert_cp_equals(results, *_single(inputs, doc_ids, chunk, grad_out))


@settings(max_examples=10, deadline=None)
@given(problem())
def test_fla_static_cp_equals_reference(rank_pool, prob):
    world, _, doc_ids, inputs = prob
    grad_out = torch.randn(*inputs["v"].shape, generator=torch.Generator().manual_seed(2))
    results = rank_pool.run(fns.gla_fwd_bwd, world, inputs, doc_ids, grad_out, 64, False, True)
    reference = lambda *xs, chunk_size: gla_reference(*xs)  # noqa: E731
    _assert_cp_equals(results, *_single(inputs, doc_ids, 64, grad_out, reference))


@settings(max_examples=15, deadline=None)
@given(problem(max_world=1))
def test_single_process_equals_reference_fp64(prob):
    _, chunk, doc_ids, inputs = prob
    inputs = {n: x.double() for n, x in inputs.items()}
    ctx = PackedContext(doc_ids)
    out = gla(*(inputs[n] for n in NAMES), ctx, chunk_size=chunk)
    assert rel_err(out, gla_reference(*(inputs[n] for n in NAMES), ctx)) <= 1e-10


@settings(max_examples=15, deadline=None)
@given(problem(), st.data())
def test_other_documents_bitwise_unchanged(rank_pool, prob, data):
    world, chunk, doc_ids, inputs = prob
    inside = one_document(data, doc_ids)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    # new values for every token of that run (a stays a decay)
    noise = {n: 3 * torch.randn(x.shape, generator=gen) for n, x in inputs.items()}
    noise["a"] = -noise["a"].abs()
    mask = {n: inside.view(*inside.shape, *([1] * (x.dim() - 2))) for n, x in inputs.items()}
    perturbed = {n: torch.where(mask[n], noise[n], x) for n, x in inputs.items()}
    clean, dirty = zip(*rank_pool.run(fns.gla_leak, world, inputs, perturbed, doc_ids, chunk))
    assert torch.equal(torch.cat(clean, 1)[~inside], torch.cat(dirty, 1)[~inside])


@settings(max_examples=15, deadline=None)
@given(keyed_problem())
def test_keyed_cp_equals_single_process(rank_pool, prob):
    """A decay per key dimension: CP == one process (2e-5), with decays up to -12 per token."""
    world, chunk, doc_ids, inputs = prob
    grad_out = torch.randn(*inputs["v"].shape, generator=torch.Generator().manual_seed(3))
    results = rank_pool.run(fns.gla_fwd_bwd, world, inputs, doc_ids, grad_out, chunk)
    _assert_cp_equals(results, *_single(inputs, doc_ids, chunk, grad_out))


@settings(max_examples=10, deadline=None)
@given(keyed_problem(max_world=1))
def test_keyed_single_process_equals_reference_fp64(prob):
    _, chunk, doc_ids, inputs = prob
    inputs = {n: x.double() for n, x in inputs.items()}
    ctx = PackedContext(doc_ids)
    out = gla(*(inputs[n] for n in NAMES), ctx, chunk_size=chunk)
    assert rel_err(out, gla_reference(*(inputs[n] for n in NAMES), ctx)) <= 1e-10
