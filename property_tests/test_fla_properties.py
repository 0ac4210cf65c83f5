"""Properties of the FLA interop: planning agrees with FLA, static mode agrees with the reference.

* :func:`build_fla_cp_context` equals FLA's own ``build_cp_context`` (given the row's global
  boundaries, the world size and the rank, no process group) on every field, for random packings
  (documents of any length, pad tails, multi-row batches), worlds 1-4 and conv widths; and a repeated
  call returns the cached object.
* Static mode under CP (rank pool; the op's PyTorch fallback on CPU) equals the single-process
  reference, output and all five gradients, to 1e-5 relative (fp32).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from fcp.context import PackedContext
from fcp.ops.kit.fla import build_fla_cp_context
from fcp.ops.kda.reference import kda_reference
from tests import _fla_rank_fns as fns
from tests._fla_rank_fns import fla_context_dict
from tests.support.cp_jobs import cat_ranks
from tests.support.inputs import KDA_NAMES as NAMES, kda_inputs, rel_err
from tests.support.packing import doc_ids_from_lengths


@st.composite
def packings(draw, max_world=4):
    world = draw(st.integers(1, max_world))
    local = draw(st.integers(1, 12))
    total = world * local
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        lens, used = [], 0
        pad = draw(st.integers(0, total - 1)) if draw(st.booleans()) else 0
        while used < total - pad:
            n = draw(st.integers(1, total - pad - used))
            lens.append(n)
            used += n
        rows.append((lens, pad))
    return world, doc_ids_from_lengths(rows)


@settings(max_examples=30, deadline=None)
@given(packing=packings(), conv=st.sampled_from([None, 1, 2, 3, 4, 5]))
def test_build_fla_cp_context_equals_fla(packing, conv):
    from fla.ops.cp import build_cp_context

    world, doc = packing
    for rank in range(world):
        ctx = PackedContext(doc, group="no-group" if world > 1 else None, cp_size=world, cp_rank=rank)
        for row in range(doc.shape[0]):
            ours = build_fla_cp_context(ctx, row, None, conv)
            dev, cpu = ctx.row_cu_seqlens(row)
            theirs = build_cp_context(dev.clone(), None, conv, cu_seqlens_cpu=cpu.clone(),
                                      world_size=world, rank=rank)  # fmt: skip
            assert fla_context_dict(ours) == fla_context_dict(theirs), (rank, row, doc[row].tolist())
            assert build_fla_cp_context(ctx, row, None, conv) is ours


@settings(max_examples=10, deadline=None)
@given(packing=packings(), seed=st.integers(0, 2**16))
def test_static_mode_cp_equals_reference(rank_pool, packing, seed):
    world, doc = packing
    b, t = doc.shape
    inputs = kda_inputs(b, t, 1, 2, 4, 3, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(b, t, 2, 3, generator=gen, dtype=torch.float64)
    res = rank_pool.run(fns.static_kda_fwd_bwd, world, inputs, doc, grad_out, 32, False)
    out, grads = cat_ranks(res, "out"), {n: cat_ranks(res, n) for n in NAMES}
    xs = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    ref = kda_reference(*(xs[n] for n in NAMES), PackedContext(doc))
    ref_grads = torch.autograd.grad(ref, [xs[n] for n in NAMES], grad_out.to(ref.dtype))
    errs = {"out": rel_err(out, ref)} | {n: rel_err(grads[n], g) for n, g in zip(NAMES, ref_grads)}
    assert max(errs.values()) <= 1e-5, errs
