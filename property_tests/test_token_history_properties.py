"""Token history under CP (1, 2 and 4 gloo ranks) equals its single-process reference, bitwise.

Packings: random cuts with pad tails of 0-5 tokens (a rank may hold only padding), documents
shorter than the history, documents spanning ranks, shards shorter than the history (the halo
then comes from several earlier ranks). Ids 0-3 so the reset id is frequent.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from fcp.ops.token_history.reference import token_history_reference
from tests import _token_history_rank_fns as fns
from tests.support.packing import cut_rows


@st.composite
def cases(draw):
    world = draw(st.sampled_from([1, 2, 4]))
    local = draw(st.integers(1, 4))
    batch = draw(st.integers(1, 2))
    doc_ids = draw(cut_rows(batch, world * local, max_cuts=4))
    seed = draw(st.integers(0, 2**16))
    tokens = torch.randint(0, 4, doc_ids.shape, generator=torch.Generator().manual_seed(seed))
    size = draw(st.integers(1, 6))
    fill, reset = draw(st.sampled_from([(2, 2), (-1, None), (7, 3)]))
    return world, tokens, doc_ids, size, fill, reset


@settings(max_examples=25, deadline=None)
@given(case=cases())
def test_cp_equals_the_reference(rank_pool, case):
    world, tokens, doc_ids, size, fill, reset = case
    want = token_history_reference(tokens, doc_ids, size, fill=fill, reset=reset)
    got = torch.cat(rank_pool.run(fns.cp_rank, world, tokens, doc_ids, size, fill, reset), 1)
    assert torch.equal(got, want), (doc_ids.tolist(), size, reset)
