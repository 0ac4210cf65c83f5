"""Document-masked short conv under CP equals ``F.conv1d`` run per document, forward and
backward, on real gloo groups; perturbing one document never changes another's output.

Tolerances: fp32 inputs 1e-5 relative to the output scale (the fp32 accumulation of 4 taps
versus an fp64 reference); bf16 inputs 2e-2 (one bf16 rounding of the output).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from fcp.context import PackedContext
from fcp.layout import doc_ids_from_seq_lens
from fcp.ops.conv import short_conv
from fcp.ops.conv.reference import short_conv_reference
from tests import _conv_rank_fns as fns


@st.composite
def conv_cases(draw):
    world = draw(st.integers(1, 4))
    local = draw(st.integers(1, 6))  # often shorter than width - 1: multi-hop halos
    rows = draw(st.integers(1, 2))
    total = world * local
    lens = []
    for _ in range(rows):
        row, used = [], 0
        while used < total and draw(st.booleans()) or not row:
            n = draw(st.integers(1, max(1, total - used))) if used < total else 0
            row.append(n)
            used += n
        lens.append(row)
    width = max(len(r) for r in lens)
    seq_lens = torch.full((rows, width), -1000)
    for i, r in enumerate(lens):
        seq_lens[i, : len(r)] = torch.tensor(r)
        if sum(r) > total:
            seq_lens[i, : len(r)] = torch.tensor(r[:-1] + [r[-1] - (sum(r) - total)])
    doc_ids = doc_ids_from_seq_lens(seq_lens, total)
    return world, doc_ids, draw(st.integers(1, 4)), draw(st.integers(2, 5))


@settings(max_examples=30, deadline=None)
@given(case=conv_cases(), activation=st.sampled_from([None, "silu"]),
       dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16]),
       with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_cp_short_conv_matches_per_document_conv1d(rank_pool, case, activation, dtype, with_bias,
                                                   seed):
    world, doc_ids, channels, width = case
    gen = torch.Generator().manual_seed(seed)
    rows, total = doc_ids.shape
    x = torch.randn(rows, total, channels, generator=gen).to(dtype)
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    bias = torch.randn(channels, generator=gen).to(dtype) if with_bias else None
    out_w = torch.randn(rows, total, channels, generator=gen)

    xr = x.double().requires_grad_()
    wr = weight.double().requires_grad_()
    br = bias.double().requires_grad_() if with_bias else None
    ref = short_conv_reference(xr, wr, br, doc_ids, activation)
    (ref * out_w.double()).sum().backward()

    results = rank_pool.run(fns.conv_fwd_bwd, world, x, weight, bias, doc_ids, activation, out_w)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = lambda t: max(1.0, float(t.detach().abs().max()))  # noqa: E731
    y = torch.cat([r[0] for r in results], 1)
    gx = torch.cat([r[1] for r in results], 1)
    gw = sum(r[2].double() for r in results)  # per-rank partial sums; DP reduction sums them
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), ref.detach(), rtol=0, atol=tol * scale(ref))
    torch.testing.assert_close(gx.double(), xr.grad, rtol=0, atol=tol * scale(xr.grad) * 2)
    torch.testing.assert_close(gw, wr.grad, rtol=0, atol=tol * scale(wr.grad) * 4)
    if with_bias:
        gb = sum(r[3].double() for r in results)
        torch.testing.assert_close(gb, br.grad, rtol=0, atol=tol * scale(br.grad) * 4)


@settings(max_examples=30, deadline=None)
@given(case=conv_cases(), seed=st.integers(0, 2**16), data=st.data())
def test_perturbing_one_document_changes_no_other_document(rank_pool, case, seed, data):
    world, doc_ids, channels, width = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*doc_ids.shape, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    bias = torch.randn(channels, generator=gen)
    docs = sorted(set(doc_ids.flatten().tolist()))
    d = data.draw(st.sampled_from(docs))
    x2 = torch.where((doc_ids == d).unsqueeze(-1), x * 3 + 1, x)
    others = (doc_ids != d).unsqueeze(-1).expand_as(x)
    zeros = torch.zeros(*doc_ids.shape, channels)
    for runner in ("single", "cp"):
        if runner == "single":
            ctx = PackedContext(doc_ids)
            y1, y2 = (short_conv(t, weight, bias, ctx, "silu") for t in (x, x2))
        else:
            y1, y2 = (torch.cat([r[0] for r in rank_pool.run(
                fns.conv_fwd_bwd, world, t, weight, bias, doc_ids, "silu", zeros)], 1)
                for t in (x, x2))
        assert torch.equal(y1[others], y2[others]), runner
