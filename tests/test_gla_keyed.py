"""Gated linear attention with a decay per key dimension (``a [B, L, H, K]``: GLA proper,
Mamba1's selective scan): the chunked operator against a per-document fp64 loop, strong decays,
leakage, CP on 1, 2 and 4 ranks, compile.

Error metric: ``rel = max |x - ref| / max |ref|`` per tensor (output and every input gradient).
Tolerances: fp64 inputs 1e-10 (measured <= 1e-14); fp32 inputs 1e-5 (measured <= 4e-7, also at
per-token log decays 0, -8, a mix and -40, where a factorisation through ``exp(-cumsum)``
overflows fp32 within 12 tokens).
"""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.gla import gla
from fcp.ops.gla.reference import gla_reference
from tests import _gla_rank_fns as fns
from tests._gla_rank_fns import NAMES, make_keyed_inputs
from tests.support import operator_checks
from tests.support.inputs import rel_err
from tests.support.operator_checks import EXTREME_DECAYS, check_compiled_once
from tests.support.operator_checks import check_documents_independent, check_pad_inert
from tests.support.operator_checks import per_document, with_decay
from tests.support.packing import doc_ids_from_lengths, random_doc_ids


def loop_keyed_doc(q, k, v, a, scale):
    """One document, fp64, token by token from the definition: ``S = diag(exp(a_t)) S + k_t
    v_t^T``, ``o_t = scale S^T q_t``. q, k ``[T, G, K]``; v ``[T, H, V]``; a ``[T, H, K]``."""
    q, k, v, a = (x.double() for x in (q, k, v, a))
    heads = v.shape[1]
    group = torch.arange(heads) // (heads // q.shape[1])
    state = q.new_zeros(heads, q.shape[2], v.shape[2])
    outs = []
    for t in range(q.shape[0]):
        state = a[t].exp()[:, :, None] * state + k[t, group][:, :, None] * v[t][:, None, :]
        outs.append(scale * (state * q[t, group][:, :, None]).sum(1))
    return torch.stack(outs)


def check(fn_a, fn_b, inputs, grad_out, tol):
    return operator_checks.check(fn_a, fn_b, inputs, grad_out, tol, NAMES)


def ours(ctx, **kw):
    return lambda *xs: gla(*xs, ctx, **kw)


def loop(doc_ids, scale):
    return lambda *xs: per_document(loop_keyed_doc, xs, doc_ids, scale)


PACKING = [([7, 1, 30, 9], 5), ([52], 0)]  # two rows of 52 tokens: short/single/long docs + pad


@pytest.mark.parametrize("chunk,groups,heads", [(16, 1, 2), (8, 2, 6), (1, 1, 3), (64, 1, 1)])
def test_fp64_matches_loop_tightly(chunk, groups, heads):
    doc_ids = doc_ids_from_lengths(PACKING)
    inputs = make_keyed_inputs(2, 52, groups, heads, 4, 3, seed=chunk, dtype=torch.float64,
                               strength=12.0)  # fmt: skip
    grad_out = torch.randn(2, 52, heads, 3, dtype=torch.float64)
    check(ours(PackedContext(doc_ids), chunk_size=chunk), loop(doc_ids, 0.5), inputs, grad_out,
          1e-10)  # fmt: skip


@pytest.mark.parametrize("decay", EXTREME_DECAYS)
def test_extreme_decays_stay_finite_and_exact(decay):
    """Full 32-token chunks with per-token log decays 0, -8, a mix and -40 on every key."""
    inputs = with_decay(make_keyed_inputs(1, 64, 1, 2, 8, 4, seed=3), "a", decay)
    doc_ids = doc_ids_from_lengths([([50], 14)])
    check(ours(PackedContext(doc_ids), chunk_size=32), loop(doc_ids, 8**-0.5), inputs,
          torch.randn(1, 64, 2, 4), 1e-5)  # fmt: skip


def test_fp32_one_value_per_head_like_mamba1():
    """Mamba1's shape: many heads of one value, one shared key group, strong and weak decays."""
    doc_ids = doc_ids_from_lengths([([3, 40, 1, 17], 3)])
    inputs = make_keyed_inputs(1, 64, 1, 16, 8, 1, seed=4, strength=12.0)
    check(ours(PackedContext(doc_ids), scale=1.0, chunk_size=16), loop(doc_ids, 1.0), inputs,
          torch.randn(1, 64, 16, 1), 1e-5)  # fmt: skip


def test_reference_matches_loop():
    doc_ids = doc_ids_from_lengths(PACKING)
    inputs = make_keyed_inputs(2, 52, 1, 2, 4, 4, seed=5, dtype=torch.float64)
    check(lambda *xs: gla_reference(*xs, PackedContext(doc_ids)), loop(doc_ids, 0.5), inputs,
          torch.randn(2, 52, 2, 4, dtype=torch.float64), 1e-12)  # fmt: skip


@pytest.mark.parametrize("world,rows", [
    (1, [([3, 10], 19), ([1, 30], 1)]),
    (2, [([32], 0)]),  # one document across both ranks
    (4, [([8, 8, 1, 7, 8], 0)]),  # documents start exactly at rank starts; a one-token doc
    (4, [([7, 2, 1, 1, 1], 20), ([32], 0)]),  # one-token docs at a rank boundary; pad-only ranks
])  # fmt: skip
def test_cp_matches_loop(rank_pool, world, rows):
    """CP on 1, 2 and 4 ranks (32 tokens, chunks of 4), strong decays (many below -8), against
    the per-document fp64 loop: output and all input gradients within 1e-5."""
    doc_ids = doc_ids_from_lengths(rows)
    batch = doc_ids.shape[0]
    inputs = make_keyed_inputs(batch, 32, 1, 2, 4, 3, seed=10, strength=12.0)
    grad_out = torch.randn(batch, 32, 2, 3, generator=torch.Generator().manual_seed(0))
    results = rank_pool.run(fns.gla_fwd_bwd, world, inputs, doc_ids, grad_out, 4)
    out = torch.cat([r[0] for r in results], 1)
    ref_out, ref_grads = operator_checks.out_and_grads(loop(doc_ids, 0.5), inputs, grad_out,
                                                       NAMES)  # fmt: skip
    assert rel_err(out, ref_out) <= 1e-5
    for n in NAMES:
        assert rel_err(torch.cat([r[1][n] for r in results], 1), ref_grads[n]) <= 1e-5, n


def test_other_documents_bitwise_unchanged():
    check_documents_independent(gla, lambda seq, seed: make_keyed_inputs(1, seq, 1, 2, 4, 4, seed),
                                NAMES, chunk_size=16)  # fmt: skip


def test_pad_tokens_finite_and_inert():
    check_pad_inert(gla, make_keyed_inputs(1, 32, 1, 2, 4, 4, seed=7), NAMES, chunk_size=16)


def test_input_validation():
    inputs = make_keyed_inputs(1, 8, 1, 2, 4, 4, seed=0)
    ctx = PackedContext(torch.ones(1, 8, dtype=torch.long))
    q, k, v, a = (inputs[n] for n in NAMES)
    with pytest.raises(ValueError, match="one per key dimension"):
        gla(q, k, v, a[..., :3], ctx)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        gla(q, k, v, a, ctx, backend="fla")


def test_compiled_equals_eager_once_across_ten_packings_without_host_sync():
    gen = torch.Generator().manual_seed(8)
    cases = [(random_doc_ids(gen, 1, 24), make_keyed_inputs(1, 24, 1, 2, 4, 2, seed=100 + i),
              torch.randn(1, 24, 2, 2, generator=gen)) for i in range(10)]  # fmt: skip
    check_compiled_once(gla, cases, NAMES, chunk_size=8)


# ---------------------------------------------------------------------------------------------
# the "fla" backend's composition on CPU (the fcp::fla_gla_keyed_* ops' CPU test doubles; FLA's
# kernels themselves: tests/test_gla_gpu.py)
# ---------------------------------------------------------------------------------------------
def test_fla_keyed_ops_schemas_and_fakes():
    from fcp.ops.gla.fla_keyed import fla_gla_keyed_bwd, fla_gla_keyed_fwd

    xs = [make_keyed_inputs(1, 12, 2, 2, 4, 3, seed=11)[n] for n in NAMES]  # q, k per head
    torch.library.opcheck(fla_gla_keyed_fwd, (*xs, 0.5, 64))
    with torch.no_grad():
        o, ht = fla_gla_keyed_fwd(*xs, 0.5, 64)
    torch.library.opcheck(fla_gla_keyed_bwd, (*xs, torch.randn_like(o), torch.randn_like(ht),
                                              0.5, 64))  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fla_static_cp_composition_matches_loop(rank_pool, world):
    """Decay resets at document starts and the per-key CP response around the op (its CPU
    double: the reference recurrence), on 1, 2 and 4 ranks: output and gradients within 1e-5."""
    doc_ids = doc_ids_from_lengths([([5, 20, 1, 3], 3)])
    inputs = make_keyed_inputs(1, 32, 1, 2, 4, 3, seed=12, strength=12.0)
    grad_out = torch.randn(1, 32, 2, 3, generator=torch.Generator().manual_seed(1))
    results = rank_pool.run(fns.gla_fwd_bwd, world, inputs, doc_ids, grad_out, 64, False, True)
    out = torch.cat([r[0] for r in results], 1)
    ref_out, ref_grads = operator_checks.out_and_grads(loop(doc_ids, 0.5), inputs, grad_out,
                                                       NAMES)  # fmt: skip
    assert rel_err(out, ref_out) <= 1e-5
    for n in NAMES:
        assert rel_err(torch.cat([r[1][n] for r in results], 1), ref_grads[n]) <= 1e-5, n
