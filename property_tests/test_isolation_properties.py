"""Nothing crosses a document boundary, not even NaN or inf (1-4 real gloo ranks).

For every operator and a random packing, one document of one row is poisoned: one of its tokens
gets NaN, +inf or -inf in one token input, or in the upstream gradient. Every other document's
outputs and input gradients must stay finite and bitwise equal (``torch.equal``) to the clean
run, on every rank and in every batch row. (Parameter gradients are shared, hence exempt; what
the poisoned document itself gets is unspecified.)
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from fcp.context import PackedContext
from tests import _isolation_rank_fns as fns
from tests.support.cp_jobs import cat_ranks

POISONS = (float("nan"), float("inf"), float("-inf"))


@st.composite
def case(draw):
    op = draw(st.sampled_from(sorted(fns.TOKEN_INPUTS)))
    world = draw(st.integers(1, 4))
    local = draw(st.sampled_from([2, 4, 6]))  # multiples of the compressed ratio (2)
    batch = draw(st.integers(1, 2))
    seq = world * local
    rows = []
    for _ in range(batch):
        ids, doc = [], 0
        while len(ids) < seq:
            if draw(st.integers(0, 5)) == 0 and ids:  # a pad tail
                ids += [0] * (seq - len(ids))
                break
            doc += 1
            ids += [doc] * draw(st.integers(1, seq))
        rows.append(ids[:seq])
    doc_ids = torch.tensor(rows)
    real = (doc_ids > 0).nonzero().tolist()
    b, t = draw(st.sampled_from(real))
    where = draw(st.sampled_from(fns.TOKEN_INPUTS[op] + ("grad",)))
    value = draw(st.sampled_from(POISONS))
    seed = draw(st.integers(0, 2**16))
    return op, world, doc_ids, (b, t), where, value, seed


@settings(deadline=None, max_examples=80)
@given(case())
def test_non_finite_values_stay_in_their_document(rank_pool, problem):
    op, world, doc_ids, (b, t), where, value, seed = problem
    inputs = fns.make_inputs(op, doc_ids.shape[0], doc_ids.shape[1], seed)
    probe = fns.call(op, inputs, PackedContext(doc_ids))
    grad = torch.randn(probe.shape, generator=torch.Generator().manual_seed(seed + 1))
    poisoned, poisoned_grad = dict(inputs), grad.clone()
    if where == "grad":
        poisoned_grad[b, t] = value
    else:
        x = inputs[where].clone()
        x[b, t] = value
        poisoned[where] = x
    res = rank_pool.run(fns.clean_and_poisoned, world, op, inputs, poisoned, doc_ids, grad,
                        poisoned_grad)  # fmt: skip
    keep = torch.ones_like(doc_ids, dtype=torch.bool)  # other rows: everything, padding included
    keep[b] = doc_ids[b] != doc_ids[b, t]  # this row: every other document and the padding
    for name in res[0][0]:
        c = cat_ranks([r[0] for r in res], name)[keep]
        d = cat_ranks([r[1] for r in res], name)[keep]
        assert bool(torch.isfinite(d).all()), (op, world, name, where, value)
        assert torch.equal(c, d), (op, world, name, where, value, (c - d).abs().max())
