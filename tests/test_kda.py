"""Kimi Delta Attention: chunked operator vs per-document oracles, numerics, leakage, compile.

``fcp.kda`` takes two gate kinds: KDA's ``g [B, L, HV, K]`` (a decay per key channel) and Gated
DeltaNet's ``g [B, L, HV]`` (one per head). A property both must have is one test here,
parametrised by ``gate``; what only GDN has (transformers' oracle, its GVA convention, the
scalar gate against the broadcast one, NaN isolation) is in ``tests/test_gdn.py``.

Oracles, each run separately on every document (and on the pad tail) of every row:

* :func:`tests.support.kda_oracles.loop_doc`: a plain per-token fp64 loop, for tight checks;
* FLA's ``naive_recurrent_kda`` (computes in fp32 internally).

Error metric everywhere: ``rel = max |x - ref| / max |ref|`` per tensor (output and the gradients
of q, k, v, g, beta). Tolerances: fp64 inputs 1e-10 (measured ~5e-16); fp32 inputs 1e-5 against
both oracles (measured <= 5e-7, also with per-token log decays of -8, 0 and -40 over full 64-token
chunks); bf16 inputs 1e-2 for outputs and gradients (bf16 rounding of the results, measured
<= 4.4e-3).
"""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.kda import kda
from fcp.ops.kda.reference import kda_reference
from tests import _kda_rank_fns as fns
from tests.support.cp_jobs import cat_ranks
from tests.support.inputs import KDA_NAMES as NAMES, kda_inputs, rel_err
from tests.support.kda_oracles import check, loop_doc, out_and_grads, per_document
from tests.support.operator_checks import check_compiled_block_gradient, check_compiled_once
from tests.support.operator_checks import EXTREME_DECAYS, check_documents_independent
from tests.support.operator_checks import check_pad_inert, with_decay
from tests.support.packing import doc_ids_from_lengths, random_doc_ids


def fla_kda_doc(q, k, v, g, beta, scale):
    from fla.ops.kda.naive import naive_recurrent_kda

    return naive_recurrent_kda(q[None], k[None], v[None], g[None], beta[None], scale=scale)[0][0]


PACKING = [([7, 1, 30, 9], 5), ([52], 0)]  # two rows of 52 tokens: short/single/long docs + pad


# ---------------------------------------------------------------------------------------------
# correctness against the oracles
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "gate,chunk,heads,value_heads",
    [("kda", 16, 1, 2), ("kda", 64, 2, 2), ("kda", 8, 2, 4), ("kda", 4, 1, 1), ("kda", 1, 1, 1),
     ("gdn", 16, 1, 2), ("gdn", 64, 2, 2), ("gdn", 8, 2, 6), ("gdn", 1, 1, 1)],
)  # fmt: skip
def test_fp64_matches_loop_tightly(gate, chunk, heads, value_heads):
    doc_ids = doc_ids_from_lengths(PACKING)
    inputs = kda_inputs(2, 52, heads, value_heads, 8, 6, seed=chunk, dtype=torch.float64, gate=gate)
    grad_out = torch.randn(2, 52, value_heads, 6, dtype=torch.float64)
    ctx = PackedContext(doc_ids)

    def loop(*xs):
        return per_document(loop_doc, xs, doc_ids, 8**-0.5)

    check(lambda *xs: kda(*xs, ctx, chunk_size=chunk), loop, inputs, grad_out, tol=1e-10)
    # the reference's recurrence accepts both gate kinds
    check(lambda *xs: kda_reference(*xs, ctx), loop, inputs, grad_out, tol=1e-12)


def test_fp32_matches_loop_and_fla():
    doc_ids = doc_ids_from_lengths([([40, 1, 70, 17], 0), ([3, 100], 25)])
    inputs = kda_inputs(2, 128, 2, 4, 16, 12, seed=1)
    grad_out = torch.randn(2, 128, 4, 12)
    ctx = PackedContext(doc_ids)
    scale = 0.3

    def ours(*xs):
        return kda(*xs, ctx, scale=scale)

    for doc_fn in (loop_doc, fla_kda_doc):
        check(ours, lambda *xs: per_document(doc_fn, xs, doc_ids, scale), inputs, grad_out, 1e-5)


def test_bf16_inputs():
    doc_ids = doc_ids_from_lengths([([20, 44], 0)])
    inputs = kda_inputs(1, 64, 1, 2, 16, 16, seed=2, dtype=torch.bfloat16)
    grad_out = torch.randn(1, 64, 2, 16)
    ctx = PackedContext(doc_ids)
    out = kda(*(inputs[n] for n in NAMES), ctx, chunk_size=32)
    assert out.dtype == torch.bfloat16
    check(
        lambda *xs: kda(*xs, ctx, chunk_size=32),
        lambda *xs: per_document(loop_doc, xs, doc_ids, 16**-0.5),
        inputs,
        grad_out,
        tol=1e-2,
    )


@pytest.mark.parametrize("decay", EXTREME_DECAYS)
@pytest.mark.parametrize("gate,value_heads", [("kda", 1), ("gdn", 2)])
def test_extreme_decays_stay_finite_and_exact(gate, value_heads, decay):
    """Full 64-token chunks with the per-token log decays of :data:`~tests.support.
    operator_checks.EXTREME_DECAYS`."""
    inputs = with_decay(kda_inputs(1, 128, 1, value_heads, 16, 8, seed=3, gate=gate), "g", decay)
    doc_ids = doc_ids_from_lengths([([100], 28)])
    ctx = PackedContext(doc_ids)
    check(
        lambda *xs: kda(*xs, ctx),
        lambda *xs: per_document(loop_doc, xs, doc_ids, 16**-0.5),
        inputs,
        torch.randn(1, 128, value_heads, 8),
        tol=1e-5,
    )


def test_reference_matches_loop():
    doc_ids = doc_ids_from_lengths(PACKING)
    inputs = kda_inputs(2, 52, 1, 2, 4, 4, seed=4, dtype=torch.float64)
    check(
        lambda *xs: kda_reference(*xs, PackedContext(doc_ids)),
        lambda *xs: per_document(loop_doc, xs, doc_ids, 0.5),
        inputs,
        torch.randn(2, 52, 2, 4, dtype=torch.float64),
        tol=1e-12,
    )


@pytest.mark.parametrize(
    "gate,world,rows",
    [
        ("kda", 4, [([32], 0)]),  # one document spanning all four ranks
        ("kda", 4, [([8, 8, 1, 7, 8], 0)]),  # documents start exactly at rank starts; 1-token doc
        ("kda", 4, [([7, 2, 1, 1, 1], 20)]),  # 1-token docs across a rank boundary; pad-only ranks
        ("kda", 4, [([3, 10], 19), ([1, 30], 1)]),  # batch 2, different packings per row
        ("gdn", 4, [([32], 0)]),
        ("gdn", 4, [([7, 2, 1, 1, 1], 20)]),
        ("gdn", 2, [([3, 10], 19), ([1, 30], 1)]),
    ],
)
def test_cp_matches_loop(rank_pool, gate, world, rows):
    """Deterministic CP edge packings (32 tokens, chunk 4 < shard: the state chained across
    ranks), end to end against the per-document fp64 loop: output and all input gradients
    within 1e-5."""
    doc_ids = doc_ids_from_lengths(rows)
    batch = doc_ids.shape[0]
    inputs = kda_inputs(batch, 32, 1, 2, 8, 4, seed=10, gate=gate)
    grad_out = torch.randn(batch, 32, 2, 4, generator=torch.Generator().manual_seed(0))
    results = rank_pool.run(fns.kda_fwd_bwd, world, inputs, doc_ids, grad_out, 4)
    ref_out, ref_grads = out_and_grads(
        lambda *xs: per_document(loop_doc, xs, doc_ids, 8**-0.5), inputs, grad_out
    )
    assert rel_err(cat_ranks(results, "out"), ref_out) <= 1e-5
    for n in NAMES:
        assert rel_err(cat_ranks(results, n), ref_grads[n]) <= 1e-5, n


# ---------------------------------------------------------------------------------------------
# documents are exactly independent; padding is inert
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_other_documents_bitwise_unchanged(gate):
    def inputs(seq, seed):
        return kda_inputs(1, seq, 1, 2, 8, 8, seed=seed, gate=gate)

    check_documents_independent(kda, inputs, NAMES, chunk_size=16)


def test_pad_tokens_finite_and_inert():
    check_pad_inert(kda, kda_inputs(1, 32, 1, 1, 8, 8, seed=7), NAMES, chunk_size=16)


def test_input_validation():
    inputs = kda_inputs(1, 8, 2, 2, 4, 4, seed=0)
    ctx = PackedContext(torch.ones(1, 8, dtype=torch.long))
    args = [inputs[n] for n in NAMES]
    with pytest.raises(ValueError, match="multiple of heads"):
        kda(*args[:2], kda_inputs(1, 8, 3, 3, 4, 4, 0)["v"], *args[3:], ctx)
    with pytest.raises(ValueError, match="local_seq_len"):
        kda(*args, PackedContext(torch.ones(1, 9, dtype=torch.long)))
    with pytest.raises(ValueError, match="beta"):
        kda(*args[:4], args[4][..., :1], ctx)
    with pytest.raises(ValueError, match="power of two"):
        kda(*args, ctx, chunk_size=12)
    with pytest.raises(TypeError, match="PackedContext"):
        kda(*args, ctx.doc_ids)


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_a_positive_log_decay_is_rejected_in_eager_mode_only(gate):
    """It used to return NaN without a word; compiled code reads no values (no host sync)."""
    inputs = kda_inputs(1, 8, 1, 2, 4, 4, seed=0, gate=gate)
    if gate == "gdn":
        inputs["g"][0, 5, 1] = 0.25  # a token of the first document grows the state
        inputs["g"][0, 6, 0] = float("inf")  # non-finite values follow the isolation rule instead
    else:
        inputs["g"][0, 5, 1, 0] = 0.25
        inputs["g"][0, 6, 0, 0] = float("inf")
    ctx = PackedContext(torch.ones(1, 8, dtype=torch.long))
    args = [inputs[n] for n in NAMES]
    where = r"g\[0, 5, 1\]" if gate == "gdn" else r"g\[0, 5, 1, 0\]"
    with pytest.raises(ValueError, match=rf"must be <= 0, got {where} = 0.25"):
        kda(*args, ctx, chunk_size=4)
    torch._dynamo.reset()
    out = torch.compile(kda, fullgraph=True, backend="aot_eager")(*args, ctx, chunk_size=4)
    assert out.shape == (1, 8, 2, 4)


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gate,packings", [("kda", 21), ("gdn", 8)])
def test_compiled_equals_eager_without_recompiles(gate, packings):
    """fullgraph aot_eager over many packings: one compilation; no host sync in the graphs."""
    gen = torch.Generator().manual_seed(8)
    batch, seq = 2, 40
    cases = [(random_doc_ids(gen, batch, seq),
              kda_inputs(batch, seq, 1, 2, 8, 4, seed=100 + i, gate=gate),
              torch.randn(batch, seq, 2, 4, generator=gen)) for i in range(packings)]  # fmt: skip
    check_compiled_once(kda, cases, NAMES, chunk_size=16)


@pytest.mark.parametrize("gate,value_heads", [("kda", 1), ("gdn", 2)])
def test_compiled_cp_two_ranks_equals_eager(rank_pool, gate, value_heads):
    doc_ids = doc_ids_from_lengths([([5, 20, 3], 4)])
    inputs = kda_inputs(1, 32, 1, value_heads, 4, 4, seed=9, gate=gate)
    grad_out = torch.randn(1, 32, value_heads, 4)
    eager = rank_pool.run(fns.kda_fwd_bwd, 2, inputs, doc_ids, grad_out, 8, False)
    compiled = rank_pool.run(fns.kda_fwd_bwd, 2, inputs, doc_ids, grad_out, 8, True)
    for rank_e, rank_c in zip(eager, compiled):
        assert all(rel_err(rank_c[key], rank_e[key]) <= 1e-6 for key in rank_e)


def test_compiled_backward_through_caller_views_of_the_inputs():
    """Input gradients are contiguous, so a caller's ``view`` in a compiled backward works.

    Regression: with strided input gradients, aot_eager traced ``view(softplus_backward)`` with
    fake strides that the eager kernels did not reproduce ("view size is not compatible").
    """
    torch.manual_seed(0)
    b, t, h, d = 1, 24, 2, 8
    x = torch.randn(b, t, 16)
    w = torch.randn(16, 5 * h * d, requires_grad=True)
    ctx = PackedContext(torch.tensor([[1] * 10 + [2] * 9 + [0] * 5]))

    def block(x, w):
        q, k, v, g, bt = (x @ w).split(h * d, -1)
        view = lambda z: z.view(b, t, h, d)  # noqa: E731
        q, k = (torch.nn.functional.normalize(view(z), dim=-1) for z in (q, k))
        g = -torch.nn.functional.softplus(view(g))
        beta = torch.sigmoid(view(bt).mean(-1))
        return kda(q, k, view(v), g, beta, ctx, chunk_size=8)

    check_compiled_block_gradient(block, x, w)
