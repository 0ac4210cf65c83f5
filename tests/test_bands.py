"""The context's band and the banded kernels (issue 20).

* ``PackedContext.band``: planned from the map (power-of-two buckets, a logarithmic number of
  them per row length), validated when given, carried through pytree flatten/unflatten and
  re-planned by ``replace(doc_ids=...)``.
* The band and the query chunk change no result bitwise: dense document-causal and compressed
  attention (outputs and q/k/v gradients) and both indexers (selected ids), on Hypothesis
  layouts over 1-4 gloo ranks.
* Compiled (fullgraph, aot_eager) operators do not recompile across packings in one band
  bucket; a new bucket compiles once more.
* The custom ops pass ``torch.library.opcheck``; the indexer scores about half the full matrix
  for one document filling the row, and a bounded number of slots per query otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings, strategies as st

from fcp.context import MIN_BAND, PackedContext, band_bucket
from fcp.layout import longest_document
from fcp.ops.kit import pools, softmax
from tests import _attention_rank_fns as attention_fns
from tests import _band_rank_fns as band_fns
from tests._attention_rank_fns import one_thread  # noqa: F401 (autouse fixture)
from tests.support.inputs import attention_inputs, index_inputs
from tests.test_index_attention import packing


# ============================================================================ the field
def test_band_is_planned_validated_and_survives_pytree():
    doc_ids = packing(3000, [1100, 900, 1000])
    ctx = PackedContext(doc_ids)
    assert ctx.band == 2048 and ctx.key_band == 2048  # longest 1100 -> the next power of two
    leaves, spec = pytree.tree_flatten(ctx)
    again = pytree.tree_unflatten(leaves, spec)
    assert again.band == 2048 and again.cp_size == ctx.cp_size
    explicit = PackedContext(doc_ids, band=1500)
    assert pytree.tree_unflatten(*pytree.tree_flatten(explicit)).band == 1500
    with pytest.raises(ValueError, match="band=1000 is shorter than the longest document"):
        PackedContext(doc_ids, band=1000)
    with pytest.raises(TypeError):
        PackedContext(doc_ids, band=2048.0)
    assert ctx.replace(doc_ids=packing(3000, [3000])).band == 3000  # re-planned, capped at seq
    assert ctx.replace(cp_size=1).band == 2048


def test_band_survives_fake_unflatten():
    """Under FakeTensorMode (what AOT tracing does) the map has no data: the static band of the
    spec is kept as it is, not planned or checked."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ctx = PackedContext(packing(2048, [10, 2038]))
    leaves, spec = pytree.tree_flatten(ctx)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(leaves[0])
        assert pytree.tree_unflatten([fake], spec).band == 2048
        assert PackedContext(fake).band is None and PackedContext(fake).key_band == 2048


def test_band_buckets_are_few():
    """Over every longest-document length of a 64k row: at most log2(seq / MIN_BAND) + 2
    distinct bands, each covering its longest document."""
    seq = 1 << 16
    seen = set()
    for longest in range(0, seq + 1, 7):
        band = band_bucket(longest, seq)
        assert longest <= band <= seq
        seen.add(band)
    assert len(seen) <= math.log2(seq / MIN_BAND) + 2, sorted(seen)
    assert longest_document(packing(10, [3, 4], [2])) == 4


# ============================================================================ bitwise invariance
@st.composite
def band_cases(draw):
    name = draw(st.sampled_from(band_fns.ATTENTION + band_fns.INDEXERS))
    world = draw(st.integers(1, 4))
    local = draw(st.sampled_from([32, 72, 100] if world < 4 else [32, 72]))
    batch = draw(st.integers(1, 2))
    seq = world * local
    rows = []
    for _ in range(batch):
        real = seq - draw(st.integers(0, 5))
        cuts = sorted(draw(st.sets(st.integers(1, real - 1), max_size=8)))
        bounds = [0, *cuts, real]
        rows.append([b - a for a, b in zip(bounds, bounds[1:])])
    doc_ids = packing(seq, *rows)
    seed = draw(st.integers(0, 2**16))
    longest = longest_document(doc_ids)
    bands = [seq, longest, draw(st.integers(longest, seq))]
    if name in band_fns.ATTENTION:
        kw = ({"ratio": 4, "window": draw(st.integers(1, 6))} if name == "compressed" else {})
        inputs = attention_inputs(seed, batch, seq, heads=2, kv_heads=1, dim=4)
        grad_out = torch.randn(batch, seq, 2, 4, generator=torch.Generator().manual_seed(seed))
        chunks = [None, 64, draw(st.sampled_from([1, 128, 192]))]
    else:
        kw = ({"kpool": 4, "topk": 8, "select_tail": draw(st.booleans())} if name == "kpool"
              else {"ratio": 2, "budget": 4})  # fmt: skip
        inputs = index_inputs(seed, batch, seq, index_heads=2, index_dim=4)
        grad_out = None
        chunks = [None, 1, draw(st.integers(2, local))]
    return name, world, inputs, doc_ids, kw, grad_out, list(zip(bands, chunks))


@settings(max_examples=30, deadline=None)
@given(case=band_cases())
def test_band_and_chunk_change_no_result_bitwise(rank_pool, case):
    name, world, inputs, doc_ids, kw, grad_out, variants = case
    res = rank_pool.run(band_fns.band_variants, world, name, inputs, doc_ids, kw, grad_out,
                        variants)  # fmt: skip
    for rank in res:
        first = rank[0]
        for other, setting in zip(rank[1:], variants[1:]):
            for key in first:
                assert torch.equal(first[key], other[key]), (name, key, setting)


# ============================================================================ compile
def _attention_compiles(ctx_fn, packings):
    inputs = attention_inputs(4, 1, packings[0].shape[1], heads=2, kv_heads=1)
    grad_out = torch.randn(1, packings[0].shape[1], 2, 4)
    frames, forbidden, worst, _ = attention_fns.compile_packings(
        "doc_causal", inputs, packings, {}, grad_out, ctx_fn)
    assert forbidden == [] and worst <= 1e-5
    return frames


def _indexer_compiles(ctx_fn, packings):
    inputs = index_inputs(5, 1, packings[0].shape[1], index_heads=2, index_dim=4)
    frames, forbidden, worst, _ = attention_fns.compile_packings(
        "kpool", inputs, packings, {"topk": 8, "kpool": 4}, None, ctx_fn)
    assert forbidden == [] and worst == 0.0
    return frames


@pytest.mark.parametrize("compiles", [_attention_compiles, _indexer_compiles])
def test_compiled_operators_recompile_only_for_a_new_band(compiles):
    """Planned bands: three packings of documents up to 1024 tokens share the bucket 1024 (one
    graph); a 1500-token document moves to the bucket 2048 (one more)."""
    seq = 2560
    same_bucket = [packing(seq, [1000, 1000, 560]), packing(seq, [7, 1024, 900, 629]),
                   packing(seq, [64] * 40)]  # fmt: skip
    assert {PackedContext(d).band for d in same_bucket} == {1024}
    assert compiles(PackedContext, same_bucket) == 1
    assert compiles(PackedContext, same_bucket + [packing(seq, [1500, 1060])]) == 2


# ============================================================================ ops and cost
def test_custom_ops_pass_opcheck():
    g = torch.Generator().manual_seed(0)
    doc_ids = packing(70, [30, 36])
    b, hkv, nkb, e, dk, n = 1, 1, 2, 6, 4, 2 * softmax.BLOCK
    q = torch.randn(b, n, 2, dk, generator=g, requires_grad=True)
    kvh = torch.randn(b, hkv, nkb, softmax.BLOCK, e, generator=g, requires_grad=True)
    doc_q = torch.nn.functional.pad(doc_ids, (0, n - 70), value=-1)
    key_doc = doc_q.view(b, nkb, softmax.BLOCK)
    key_lo = torch.arange(nkb * softmax.BLOCK).view(nkb, softmax.BLOCK)
    wkv = torch.randn(b, n, hkv, 3, e, generator=g, requires_grad=True)
    wm = torch.rand(b, n, 3, generator=g) > 0.3
    key_hi = key_lo + 5  # a sliding window of 6
    half = torch.tensor(0.5, dtype=torch.float64)  # the scale, as scalar_tensor makes it
    sinks = torch.randn(b, n, 2, generator=g, requires_grad=True)
    for win, extra, softcap in (((None, None), (None, None), 0.0), ((wkv, wm), (None, None), 0.0),
                                ((None, None), (key_hi, sinks), 2.0)):  # fmt: skip
        args = (q, kvh, key_doc, key_lo, doc_q, *win, *extra, 0, 40, 1, half, softcap, dk, 1)
        torch.library.opcheck(softmax.banded_attention_fwd, args)
        out, lse = (t.detach() for t in softmax.banded_attention_fwd(*args))
        plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        torch.library.opcheck(softmax.banded_attention_bwd,  # no double backward: no grads
                              (torch.randn_like(out), *plain[:9], out, lse, *plain[9:]))
    plan = pools.plan_pools(PackedContext(doc_ids), 4)
    keys = torch.randn(1, plan.slots.shape[1], dk, generator=g)
    torch.library.opcheck(pools.pool_top, (torch.randn(1, 70, 2, dk, generator=g), keys,
                                           torch.randn(1, 70, 2, generator=g), plan.slots,
                                           doc_ids, 0, 70, 4, 40, 2, half, None, 16))  # fmt: skip


def test_indexer_scores_half_the_matrix_for_one_document_and_the_band_otherwise():
    seq, kpool = 8192, 4
    one = PackedContext(torch.ones(1, seq, dtype=torch.long))
    full = seq * pools.slot_capacity(seq, kpool)
    assert pools.scored_pairs(one, kpool) <= 0.55 * full
    bounded = PackedContext(packing(seq, [1000] * 8))  # band 1024
    per_query = pools.scored_pairs(bounded, kpool) / seq
    chunk = pools.score_chunk_rows(1, seq, bounded.band, kpool)
    assert per_query <= (bounded.band + chunk) / kpool + 2
