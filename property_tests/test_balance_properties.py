"""Balanced queries for long documents (:mod:`fcp.ops.kit.balance`) over random packings.

On 2-4 real gloo ranks with 128-256 tokens per rank (the band is the row, so the plan moves
queries whatever the packing), every balanced operator equals the single-process operator
(outputs and q/k/v gradients within 2e-5 in fp32; the indexers' ids bitwise), and its outputs
and query gradients are bitwise those of the contiguous layout on the same ranks. Packings:
one document filling the row, random cuts (documents spanning ranks, tiny documents), pad
tails of 0-5 tokens, two rows.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from tests import _attention_rank_fns as attn
from tests import _balance_rank_fns as fns
from tests.support.inputs import attention_inputs, index_inputs
from tests.support.packing import cut_rows, packing

FP32 = dict(atol=2e-5, rtol=2e-5)
OPS = {"doc_causal": {}, "compressed": {"ratio": 4, "window": 5},
       "kpool": {"topk": 8, "kpool": 4}, "qsa": {"budget": 8, "ratio": 4}}  # fmt: skip


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(OPS)))
    world = draw(st.integers(2, 4))
    local = draw(st.sampled_from([128, 256] if world == 2 else [128]))
    batch = draw(st.integers(1, 2))
    seq = world * local
    one = draw(st.booleans())
    doc_ids = packing(seq, *[[seq]] * batch) if one else draw(cut_rows(batch, seq, max_cuts=5))
    seed = draw(st.integers(0, 2**16))
    if name in ("kpool", "qsa"):
        inputs = index_inputs(seed, batch, seq, index_heads=2)
    else:
        inputs = attention_inputs(seed, batch, seq, heads=2, kv_heads=1)
    grad_out = torch.randn(batch, seq, 2, 4, generator=torch.Generator().manual_seed(seed))
    return name, world, inputs, doc_ids, OPS[name], grad_out


@settings(max_examples=10, deadline=None)
@given(case=cases())
def test_balanced_equals_single_process_and_contiguous(rank_pool, case):
    name, world, inputs, doc_ids, kw, grad_out = case
    assert fns.plan_moves(doc_ids, world)
    want = attn.single_process(name, inputs, doc_ids, kw, grad_out)
    res = rank_pool.run(fns.balanced_and_contiguous, world, name, inputs, doc_ids, kw, grad_out)
    for key in want:
        on = torch.cat([r[0][key] for r in res], 1)
        off = torch.cat([r[1][key] for r in res], 1)
        if key in ("out", "q"):
            assert torch.equal(on, off), (name, key)
        if name in attn.INDEXER_OPS:
            assert torch.equal(on, want[key]), name
        else:
            torch.testing.assert_close(on, want[key], **FP32, msg=f"{name} {key}")
