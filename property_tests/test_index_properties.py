"""Properties of index attention and the two indexers over random packings, on real gloo ranks.

* CP (1-4 ranks) equals the single-process operator: index attention's outputs and q/k/v
  gradients within 1e-5 (fp32) / 3e-2 (bf16), the indexers' ids bitwise, and the indexer ->
  index attention pipelines (GLM-5.3-Flash's MLA route with ``kv="global"``, QSA's GQA route).
* The single-process operators equal their float64 references (``reference.py`` of each
  folder): index attention forward and gradients; the indexers' rows exactly, except rows
  whose order depends on a near tie in float rounding (assumed away).
* Isolation on CP ranks, bitwise: new values, NaN or inf in one document's inputs, and NaN in
  its output gradient, change no other document's outputs, gradients or selected ids.

Packings: random document cuts (documents shorter than a pool, one document spanning every
rank), pad tails of 0-5 tokens (a rank may hold only padding), one or two rows, local lengths
that are not multiples of the pool size (pools straddle ranks; a shard may be shorter than a
pool). Shapes are tiny so the file runs in well under a minute.
"""

from __future__ import annotations

import torch
from hypothesis import assume, given, settings, strategies as st

from fcp.ops.index_attention.reference import index_attention_reference
from tests import _attention_rank_fns as fns
from tests._attention_rank_fns import one_thread  # noqa: F401 (autouse fixture)
from tests.support.inputs import QKV, index_inputs
from tests.support.packing import cut_rows

HEADS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)]
FP32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=3e-2, rtol=3e-2)


def op_kwargs(draw, name: str) -> dict:
    if name in ("kpool", "glm"):
        kpool = draw(st.sampled_from([1, 2, 3, 4]))
        return {"kpool": kpool, "topk": kpool * draw(st.integers(1, 3)),
                "select_tail": draw(st.booleans())}  # fmt: skip
    if name in ("qsa", "qsa_attn"):
        ratio = draw(st.sampled_from([1, 2, 4]))
        return {"ratio": ratio, "budget": ratio * draw(st.integers(1, 3))}
    return {"scale": draw(st.sampled_from([0.3, 1.0]))}


@st.composite
def cases(draw, ops=fns.INDEX_OPS + fns.INDEXER_OPS, dtype=torch.float32, max_world=4):
    name = draw(st.sampled_from(ops))
    world = draw(st.integers(1, max_world))
    local = draw(st.sampled_from([3, 5, 8, 12] if world < 4 else [3, 5, 8]))
    batch = draw(st.integers(1, 2))
    heads, kv_heads = draw(st.sampled_from(HEADS))
    kw = op_kwargs(draw, name)
    doc_ids = draw(cut_rows(batch, world * local, max_cuts=5))
    seed = draw(st.integers(0, 2**16))
    inputs = index_inputs(seed, batch, world * local, heads, kv_heads,
                             dim=draw(st.sampled_from([4, 8])), dv=6,
                             width=draw(st.integers(1, 8)), kpool=kw.get("kpool", 4),
                             dtype=dtype)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(batch, world * local, heads, 6, generator=gen)
    return name, world, inputs, doc_ids, kw, grad_out


def _check_cp(rank_pool, case, tol):
    name, world, inputs, doc_ids, kw, grad_out = case
    fns.check_cp(rank_pool, name, world, inputs, doc_ids, kw, grad_out, tol)


@settings(max_examples=150, deadline=None)
@given(case=cases())
def test_cp_equals_single_process_fp32(rank_pool, case):
    _check_cp(rank_pool, case, FP32)


@settings(max_examples=40, deadline=None)
@given(case=cases(dtype=torch.bfloat16))
def test_cp_equals_single_process_bf16(rank_pool, case):
    _check_cp(rank_pool, case, BF16)


@settings(max_examples=100, deadline=None)
@given(case=cases(ops=("attn", "kpool", "qsa"), max_world=1))
def test_single_process_equals_reference(case):
    name, _, inputs, doc_ids, kw, grad_out = case
    got = fns.single_process(name, inputs, doc_ids, kw, grad_out)
    if name == "attn":
        t = {n: inputs[n].double().requires_grad_() for n in QKV}
        out = index_attention_reference(t["q"], t["k"], t["v"], inputs["indices"], doc_ids,
                                        kw["scale"])  # fmt: skip
        (out * grad_out.double()).sum().backward()
        torch.testing.assert_close(got["out"].double(), out, **FP32)
        for n in QKV:
            want = torch.zeros_like(t[n]) if t[n].grad is None else t[n].grad  # nothing read
            torch.testing.assert_close(got[n].double(), want, **FP32, msg=n)
        return
    want, near, _ = fns.reference_ids(name, inputs, doc_ids, kw)
    differs = (got["out"] != want).any(-1)
    assume(not (differs & near).any())  # an order decided by float rounding of a near tie
    assert torch.equal(got["out"], want)


@st.composite
def isolation_cases(draw):
    name, world, inputs, doc_ids, kw, grad_out = draw(cases())
    row = draw(st.integers(0, doc_ids.shape[0] - 1))
    docs = sorted(set(doc_ids[row].tolist()) - {0})
    assume(docs)
    d = draw(st.sampled_from(docs))
    how = draw(st.sampled_from(["values", "nan", "inf"]))
    return name, world, inputs, doc_ids, kw, grad_out, row, d, how


@settings(max_examples=80, deadline=None)
@given(case=isolation_cases())
def test_documents_are_isolated_bitwise(rank_pool, case):
    name, world, inputs, doc_ids, kw, grad_out, row, d, how = case
    mine = torch.zeros_like(doc_ids, dtype=torch.bool)
    mine[row] = doc_ids[row] == d
    new = {n: x.clone() for n, x in inputs.items()}
    gen = torch.Generator().manual_seed(7)
    for n, x in new.items():
        if n in fns.PARAMS:
            continue
        if n == "indices":  # the document's own selections change too
            x[mine] = torch.randint(-2, x.shape[1] + 2, x[mine].shape, generator=gen)
            continue
        fill = torch.randn(x[mine].shape, generator=gen).to(x.dtype) * 3
        x[mine] = fill if how == "values" else float(how)
    new_grad = grad_out.clone()
    if how != "values":
        new_grad[mine] = float("nan")
    res = rank_pool.run(fns.cp_rank_pair, world, name, inputs, new, doc_ids, kw, grad_out,
                        new_grad)  # fmt: skip
    base = {key: torch.cat([r[0][key] for r in res], 1) for key in res[0][0]}
    other = {key: torch.cat([r[1][key] for r in res], 1) for key in res[0][1]}
    for key in base:
        assert torch.equal(base[key][~mine], other[key][~mine]), (name, key, how)

