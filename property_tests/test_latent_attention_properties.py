"""Latent attention under CP (1, 2 and 4 gloo ranks) equals its float64 reference, forward and
backward (q, latent, kv_weight, kv_bias and the shared rotary key k_rope; the parameters'
per-rank partial sums added up).

Packings: random cuts with pad tails of 0-5 tokens (a rank may hold only padding), tiny
documents, documents spanning ranks; selections with -1, future, other-document, repeated and
out-of-range ids; query chunks smaller than a shard. Tolerance: fp32 inputs 1e-5 relative to
each tensor's scale (fp32 softmax over at most 8 keys against float64).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from fcp.ops.latent_attention.reference import latent_attention_reference
from tests import _latent_attention_rank_fns as fns
from tests.support.packing import cut_rows


@st.composite
def cases(draw):
    world = draw(st.sampled_from([1, 2, 4]))
    local = draw(st.sampled_from([2, 3, 5]))
    batch = draw(st.integers(1, 2))
    seq = world * local
    doc_ids = draw(cut_rows(batch, seq, max_cuts=4))
    heads, dk, dv, rank = (draw(st.integers(1, n)) for n in (3, 4, 3, 5))
    rope = draw(st.integers(0, dk - 1))  # a shared rotary key on the last channels, or none
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    rows = heads * (dk - rope + dv)
    inputs = {"q": torch.randn(batch, seq, heads, dk, generator=g),
              "latent": torch.randn(batch, seq, rank, generator=g),
              "kv_weight": torch.randn(rows, rank, generator=g)}  # fmt: skip
    if rope:
        inputs["k_rope"] = torch.randn(batch, seq, rope, generator=g)
    if draw(st.booleans()):
        inputs["kv_bias"] = torch.randn(rows, generator=g)
    width = draw(st.integers(1, 8))
    inputs["indices"] = torch.randint(-2, seq + 2, (batch, seq, width), generator=g)
    grad_out = torch.randn(batch, seq, heads, dv, generator=g)
    scale = draw(st.sampled_from([None, 0.3]))
    chunk = draw(st.sampled_from([None, 1, 2]))
    return world, inputs, doc_ids, grad_out, scale, chunk


@settings(max_examples=20, deadline=None)
@given(case=cases())
def test_cp_equals_the_reference(rank_pool, case):
    world, inputs, doc_ids, grad_out, scale, chunk = case
    ref = {n: x.double().requires_grad_() if n in fns.GRADS else x for n, x in inputs.items()}
    want = latent_attention_reference(ref["q"], ref["latent"], ref["kv_weight"], ref["indices"],
                                      doc_ids, kv_bias=ref.get("kv_bias"),
                                      k_rope=ref.get("k_rope"), scale=scale)  # fmt: skip
    (want * grad_out.double()).sum().backward()
    res = rank_pool.run(fns.cp_rank, world, inputs, doc_ids, grad_out, scale, chunk)
    got = {"out": torch.cat([r["out"] for r in res], 1)}
    for n in ("q", "latent", "k_rope"):
        if n in inputs:
            got[n] = torch.cat([r[n] for r in res], 1)
    for n in fns.PARAMS:
        if n in inputs:
            got[n] = sum(r[n].double() for r in res)  # the data-parallel reduction sums them
    # an input no selected key reaches has no gradient in the reference: zeros
    expected = {"out": want.detach(), **{n: torch.zeros_like(ref[n]) if ref[n].grad is None
                                         else ref[n].grad for n in got if n != "out"}}
    for n, w in expected.items():
        scale_n = max(1.0, float(w.abs().max()))
        torch.testing.assert_close(got[n].double(), w, rtol=0, atol=1e-5 * scale_n, msg=n)
