"""Properties of the attention operators over random packings.

* CP on real gloo groups (1-4 ranks) equals the single-process operator: outputs and q/k/v
  gradients within 1e-5 in fp32; in bf16 within 3e-2 (outputs are rounded once to bf16 from
  fp32; the K/V gradients are summed across ranks in fp32, then rounded once).
* The single-process operator equals the float64 definition-by-loops reference of
  ``tests/test_attention.py`` (fp32, 1e-5).

Packings: random document cuts (tiny documents, documents spanning every rank), pad tails of
0-5 tokens (a rank may hold only padding), GQA head ratios, ratio/window settings (sliding
windows from 1 token to longer than two shards, soft-capping), per-query attention sinks.
Shapes are tiny so the file runs in well under 90 s.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from tests import _attention_rank_fns as fns
from tests._attention_rank_fns import SOFTMAX_OPS as OPS
from tests.support.inputs import QKV, attention_inputs
from tests.support.packing import cut_rows
from tests.test_attention import ref_grad, run_ref

HEADS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)]
FP32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=3e-2, rtol=3e-2)


def op_kwargs(draw, name: str) -> dict:
    if name == "compressed":
        ratio = draw(st.sampled_from([1, 2, 4]))
        return {"ratio": ratio, "window": draw(st.integers(1, 9))}
    if name == "sliding":  # windows from one token to longer than two shards
        return {"window": draw(st.integers(1, 40)),
                "softcap": draw(st.sampled_from([None, None, 0.5, 4.0]))}  # fmt: skip
    return {}


def with_sinks(draw, name: str, inputs: dict, seed: int) -> dict:
    """Per-query attention sinks (``[batch, seq, heads]``) for the operators that take them,
    half of the time."""
    if name not in ("doc_causal", "sliding") or not draw(st.booleans()):
        return inputs
    q = inputs["q"]
    gen = torch.Generator().manual_seed(seed + 1)
    return {**inputs, "sinks": torch.randn(q.shape[:3], generator=gen).to(q.dtype)}


@st.composite
def cp_cases(draw, dtype=torch.float32):
    name = draw(st.sampled_from(OPS))
    world = draw(st.integers(1, 4))
    local = draw(st.sampled_from([4, 8, 12, 16] if world < 4 else [4, 8]))
    batch = draw(st.integers(1, 2))
    heads, kv_heads = draw(st.sampled_from(HEADS))
    dim = draw(st.sampled_from([4, 8]))
    doc_ids = draw(cut_rows(batch, world * local, max_cuts=6))
    seed = draw(st.integers(0, 2**16))
    inputs = attention_inputs(seed, batch, world * local, heads, kv_heads, dim, dtype=dtype)
    inputs = with_sinks(draw, name, inputs, seed)
    gen = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(batch, world * local, heads, dim, generator=gen)
    return name, world, inputs, doc_ids, op_kwargs(draw, name), grad_out


def _check_cp(rank_pool, case, tol):
    name, world, inputs, doc_ids, kwargs, grad_out = case
    fns.check_cp(rank_pool, name, world, inputs, doc_ids, kwargs, grad_out, tol)


@settings(max_examples=120, deadline=None)
@given(case=cp_cases())
def test_cp_equals_single_process_fp32(rank_pool, case):
    _check_cp(rank_pool, case, FP32)


@settings(max_examples=30, deadline=None)
@given(case=cp_cases(dtype=torch.bfloat16))
def test_cp_equals_single_process_bf16(rank_pool, case):
    _check_cp(rank_pool, case, BF16)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_single_process_equals_reference(data):
    name = data.draw(st.sampled_from(OPS))
    seq = data.draw(st.integers(1, 14))
    batch = data.draw(st.integers(1, 2))
    heads, kv_heads = data.draw(st.sampled_from(HEADS))
    doc_ids = data.draw(cut_rows(batch, seq, max_cuts=6))
    kwargs = op_kwargs(data.draw, name)
    seed = data.draw(st.integers(0, 2**16))
    inputs = with_sinks(data.draw, name, attention_inputs(seed, batch, seq, heads, kv_heads), seed)
    out_ref, t = run_ref(name, inputs, doc_ids, kwargs)
    grad_out = torch.randn(out_ref.shape, dtype=torch.float64)
    (out_ref * grad_out).sum().backward()
    got = fns.single_process(name, inputs, doc_ids, kwargs, grad_out.float())
    torch.testing.assert_close(got["out"].double(), out_ref, **FP32)
    for n in QKV + (("sinks",) if "sinks" in inputs else ()):
        torch.testing.assert_close(got[n].double(), ref_grad(t[n]), **FP32, msg=n)
