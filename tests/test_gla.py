"""Gated linear attention (scalar decay per head, Mamba2's SSD): the chunked operator against
per-document oracles, numerics, leakage, CP edge packings, compile.

Oracles, each run separately on every document (and on the pad tail) of every row:

* ``loop_gla_doc`` below: a plain per-token fp64 loop written from the definition, for tight
  checks;
* transformers' own pure-PyTorch Mamba2 SSD (``mamba2_chunk_scan``, what ``Mamba2Mixer``
  calls without mamba_ssm), with dt softplus + bias + clamp, ``A = -exp(A_log)`` and the ``D``
  skip on its side and fcp's documented mapping on ours (``q = C``, ``k = B``, ``v = dt x``,
  ``a = dt A``, ``scale = 1``, ``+ D x``).

Error metric everywhere: ``rel = max |x - ref| / max |ref|`` per tensor (output and every input
gradient). Tolerances: fp64 inputs 1e-10 (measured <= 5.4e-16); fp32 inputs 1e-5 against the
loop (measured <= 2.7e-7, also at per-token log decays 0, -8, a mix and -40); transformers' fp32
path 1e-5 (measured <= 3.2e-7, with moderate and with strong decays, median a < -5); bf16
inputs: bitwise the fp32 computation rounded once (accumulation is fp32), and 1e-2 against the
loop (measured <= 4.7e-3: bf16 rounding of the results).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.gla import gla
from fcp.ops.gla.reference import gla_reference
from tests import _gla_rank_fns as fns
from tests._gla_rank_fns import NAMES, make_inputs
from tests.support import operator_checks
from tests.support.inputs import rel_err
from tests.support.operator_checks import check_compiled_block_gradient, check_compiled_once
from tests.support.operator_checks import check_documents_independent, check_pad_inert
from tests.support.operator_checks import EXTREME_DECAYS, per_document, with_decay
from tests.support.packing import doc_ids_from_lengths, random_doc_ids, ref_segments


# ---------------------------------------------------------------------------------------------
# oracles
# ---------------------------------------------------------------------------------------------
def loop_gla_doc(q, k, v, a, scale):
    """One document, fp64, token by token from the definition. q, k ``[T, G, K]``; v ``[T, H,
    V]``; a ``[T, H]``."""
    q, k, v, a = (x.double() for x in (q, k, v, a))
    heads = v.shape[1]
    group = torch.arange(heads) // (heads // q.shape[1])  # head h reads group h // (H // G)
    state = q.new_zeros(heads, q.shape[2], v.shape[2])
    outs = []
    for t in range(q.shape[0]):
        state = a[t].exp()[:, None, None] * state + k[t, group][:, :, None] * v[t][:, None, :]
        outs.append(scale * (state * q[t, group][:, :, None]).sum(1))
    return torch.stack(outs)


def runs(ids: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of every run (document or pad tail) of one row."""
    bounds = ref_segments(ids.tolist())
    return list(zip(bounds[:-1], bounds[1:]))


def out_and_grads(fn, inputs: dict, grad_out: torch.Tensor, names=NAMES):
    return operator_checks.out_and_grads(fn, inputs, grad_out, names)


def check(fn_a, fn_b, inputs, grad_out, tol):
    return operator_checks.check(fn_a, fn_b, inputs, grad_out, tol, NAMES)


def ours(ctx, **kw):
    return lambda *xs: gla(*xs, ctx, **kw)


def loop(doc_ids, scale):
    """The fp64 loop on every document of ``doc_ids`` alone."""
    return lambda *xs: per_document(loop_gla_doc, xs, doc_ids, scale)


PACKING = [([7, 1, 30, 9], 5), ([52], 0)]  # two rows of 52 tokens: short/single/long docs + pad


# ---------------------------------------------------------------------------------------------
# correctness against the oracles
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk,groups,heads", [(16, 1, 2), (64, 2, 2), (8, 2, 6), (4, 1, 1),
                                                (1, 1, 3)])  # fmt: skip
def test_fp64_matches_loop_tightly(chunk, groups, heads):
    doc_ids = doc_ids_from_lengths(PACKING)
    inputs = make_inputs(2, 52, groups, heads, 8, 6, seed=chunk, dtype=torch.float64)
    grad_out = torch.randn(2, 52, heads, 6, dtype=torch.float64)
    check(ours(PackedContext(doc_ids), chunk_size=chunk),
          loop(doc_ids, 8**-0.5), inputs, grad_out, 1e-10)


def test_fp32_matches_loop():
    doc_ids = doc_ids_from_lengths([([40, 1, 70, 17], 0), ([3, 100], 25)])
    inputs = make_inputs(2, 128, 2, 4, 16, 12, seed=1)
    check(ours(PackedContext(doc_ids), scale=0.3), loop(doc_ids, 0.3), inputs,
          torch.randn(2, 128, 4, 12), 1e-5)


def test_bf16_inputs_accumulate_in_fp32():
    """bf16 in, bf16 out, fp32 inside: bitwise the fp32 computation on the same (bf16-valued)
    inputs, rounded once; and within bf16 rounding of the fp64 loop."""
    doc_ids = doc_ids_from_lengths([([20, 44], 0)])
    ctx = PackedContext(doc_ids)
    inputs = make_inputs(1, 64, 1, 2, 16, 16, seed=2, dtype=torch.bfloat16)
    out = gla(*(inputs[n] for n in NAMES), ctx, chunk_size=32)
    assert out.dtype == torch.bfloat16
    widened = gla(*(inputs[n].float() for n in NAMES), ctx, chunk_size=32)
    assert torch.equal(out, widened.to(torch.bfloat16))
    check(ours(ctx, chunk_size=32), loop(doc_ids, 0.25), inputs, torch.randn(1, 64, 2, 16), 1e-2)


@pytest.mark.parametrize("decay", EXTREME_DECAYS)
def test_extreme_decays_stay_finite_and_exact(decay):
    """Full 64-token chunks with the per-token log decays of :data:`~tests.support.
    operator_checks.EXTREME_DECAYS`."""
    inputs = with_decay(make_inputs(1, 128, 1, 2, 16, 8, seed=3), "a", decay)
    doc_ids = doc_ids_from_lengths([([100], 28)])
    check(ours(PackedContext(doc_ids)), loop(doc_ids, 0.25), inputs, torch.randn(1, 128, 2, 8),
          1e-5)


def test_reference_matches_loop():
    doc_ids = doc_ids_from_lengths(PACKING)
    inputs = make_inputs(2, 52, 1, 2, 4, 4, seed=4, dtype=torch.float64)
    check(lambda *xs: gla_reference(*xs, PackedContext(doc_ids)), loop(doc_ids, 0.5), inputs,
          torch.randn(2, 52, 2, 4, dtype=torch.float64), 1e-12)


@pytest.mark.parametrize("strong", [False, True])
def test_matches_transformers_mamba2_ssd(strong):
    """fcp's documented Mamba2 mapping against transformers' pure-PyTorch SSD run per document:
    outputs and the gradients of x, dt, B, C and of the parameters A_log, D, dt_bias."""
    from transformers.models.mamba2 import modeling_mamba2

    # the PyTorch function itself, even where mamba_ssm or hub kernels would replace it
    ssd = inspect.unwrap(modeling_mamba2.mamba2_chunk_scan)
    groups, heads, p, n_state, chunk = 2, 4, 8, 16, 16
    doc_ids = doc_ids_from_lengths([([5, 40, 1, 17], 1)])
    length = doc_ids.shape[1]
    gen = torch.Generator().manual_seed(5)
    xs = dict(x=torch.randn(1, length, heads, p, generator=gen),
              dt=torch.randn(1, length, heads, generator=gen),
              B=torch.randn(1, length, groups, n_state, generator=gen),
              C=torch.randn(1, length, groups, n_state, generator=gen),
              A_log=torch.log(torch.arange(1.0, heads + 1)) + (2.0 if strong else 0.0),
              D=torch.randn(heads, generator=gen),
              dt_bias=torch.full((heads,), 1.0 if strong else -3.0))  # fmt: skip
    limit = (0.0, 3.0)
    ctx = PackedContext(doc_ids)

    def fcp_mamba2(*values):
        t = dict(zip(xs, values))
        dt = torch.nn.functional.softplus(t["dt"] + t["dt_bias"]).clamp(*limit)
        y = gla(t["C"], t["B"], dt[..., None] * t["x"], dt * -torch.exp(t["A_log"]), ctx,
                scale=1.0)  # fmt: skip
        return y + t["D"][:, None] * t["x"]

    def transformers_per_document(*values):
        t = dict(zip(xs, values))
        pieces = [ssd(t["x"][:, s:e], t["dt"][:, s:e], -torch.exp(t["A_log"]), t["B"][:, s:e],
                      t["C"][:, s:e], chunk_size=chunk, D=t["D"], dt_bias=t["dt_bias"],
                      dt_softplus=True, dt_limit=limit)
                  for s, e in runs(doc_ids[0])]  # fmt: skip
        return torch.cat(pieces, 1)

    grad_out = torch.randn(1, length, heads, p, generator=gen)
    out, grads = out_and_grads(fcp_mamba2, xs, grad_out, tuple(xs))
    ref, ref_grads = out_and_grads(transformers_per_document, xs, grad_out, tuple(xs))
    errs = {"out": rel_err(out, ref)} | {n: rel_err(grads[n], ref_grads[n]) for n in xs}
    assert max(errs.values()) <= 1e-5, errs
    if strong:  # the decays really are strong: most of a chunk's state is forgotten per token
        a = torch.nn.functional.softplus(xs["dt"] + xs["dt_bias"]).clamp(*limit) * -torch.exp(xs["A_log"])
        assert a.median() < -5


@pytest.mark.parametrize(
    "rows",
    [
        [([32], 0)],  # one document spanning all four ranks
        [([8, 8, 1, 7, 8], 0)],  # documents start exactly at rank starts; single-token doc
        [([7, 2, 1, 1, 1], 20)],  # single-token docs across a rank boundary; pad-only ranks
        [([3, 10], 19), ([1, 30], 1)],  # batch 2, different packings per row
    ],
)
def test_cp_four_ranks_matches_loop(rank_pool, rows):
    """Deterministic CP edge packings (4 ranks x 8 tokens, chunk 4), end to end against the
    per-document fp64 loop: output and all input gradients within 1e-5."""
    doc_ids = doc_ids_from_lengths(rows)
    batch = doc_ids.shape[0]
    inputs = make_inputs(batch, 32, 1, 2, 8, 4, seed=10)
    grad_out = torch.randn(batch, 32, 2, 4, generator=torch.Generator().manual_seed(0))
    results = rank_pool.run(fns.gla_fwd_bwd, 4, inputs, doc_ids, grad_out, 4)
    out = torch.cat([r[0] for r in results], 1)
    ref_out, ref_grads = out_and_grads(loop(doc_ids, 8**-0.5), inputs, grad_out)
    assert rel_err(out, ref_out) <= 1e-5
    for n in NAMES:
        assert rel_err(torch.cat([r[1][n] for r in results], 1), ref_grads[n]) <= 1e-5, n


# ---------------------------------------------------------------------------------------------
# documents are exactly independent; padding is inert
# ---------------------------------------------------------------------------------------------
def test_other_documents_bitwise_unchanged():
    check_documents_independent(gla, lambda seq, seed: make_inputs(1, seq, 2, 4, 8, 8, seed),
                                NAMES, chunk_size=16)  # fmt: skip


def test_pad_tokens_finite_and_inert():
    check_pad_inert(gla, make_inputs(1, 32, 1, 1, 8, 8, seed=7), NAMES, chunk_size=16)


def test_input_validation():
    inputs = make_inputs(1, 8, 2, 2, 4, 4, seed=0)
    ctx = PackedContext(torch.ones(1, 8, dtype=torch.long))
    q, k, v, a = (inputs[n] for n in NAMES)
    with pytest.raises(ValueError, match="multiple of groups"):
        gla(q, k, make_inputs(1, 8, 3, 3, 4, 4, 0)["v"], a, ctx)
    with pytest.raises(ValueError, match="local_seq_len"):
        gla(q, k, v, a, PackedContext(torch.ones(1, 9, dtype=torch.long)))
    with pytest.raises(ValueError, match="one decay per head"):
        gla(q, k, v, a[..., None].expand(-1, -1, -1, 3), ctx)  # K is 4
    with pytest.raises(ValueError, match="equal shapes"):
        gla(q, k[..., :2], v, a, ctx)
    with pytest.raises(ValueError, match="power of two"):
        gla(q, k, v, a, ctx, chunk_size=12)
    with pytest.raises(ValueError, match="backend must be"):
        gla(q, k, v, a, ctx, backend="fast")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        gla(q, k, v, a, ctx, backend="fla")
    with pytest.raises(TypeError, match="PackedContext"):
        gla(q, k, v, a, ctx.doc_ids)
    with pytest.raises(TypeError, match="a must be floating point"):
        gla(q, k, v, a.long(), ctx)


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------
def test_compiled_equals_eager_once_across_packings_without_host_sync():
    gen = torch.Generator().manual_seed(8)
    doc_ids = [random_doc_ids(gen, 2, 40) for _ in range(5)]
    cases = [(d, make_inputs(2, 40, 1, 2, 8, 4, seed=100 + i),
              torch.randn(2, 40, 2, 4, generator=gen)) for i, d in enumerate(doc_ids)]  # fmt: skip
    check_compiled_once(gla, cases, NAMES, chunk_size=16)


def test_compiled_cp_two_ranks_equals_eager(rank_pool):
    doc_ids = doc_ids_from_lengths([([5, 20, 3], 4)])
    inputs = make_inputs(1, 32, 1, 2, 4, 4, seed=9)
    grad_out = torch.randn(1, 32, 2, 4)
    eager = rank_pool.run(fns.gla_fwd_bwd, 2, inputs, doc_ids, grad_out, 8, False)
    compiled = rank_pool.run(fns.gla_fwd_bwd, 2, inputs, doc_ids, grad_out, 8, True)
    for (out_e, grads_e), (out_c, grads_c) in zip(eager, compiled):
        assert rel_err(out_c, out_e) <= 1e-6
        assert all(rel_err(grads_c[n], grads_e[n]) <= 1e-6 for n in NAMES)


def test_compiled_backward_through_caller_views_of_the_inputs():
    """A Mamba2-like block (one projection split and viewed into C, B, x, dt) compiles with
    aot_eager, and its gradient equals eager's."""
    torch.manual_seed(0)
    b, t, g, h, n, p = 1, 24, 1, 2, 8, 4
    x = torch.randn(b, t, 16)
    w = torch.randn(16, 2 * g * n + h * p + h, requires_grad=True)
    ctx = PackedContext(torch.tensor([[1] * 10 + [2] * 9 + [0] * 5]))

    def block(x, w):
        c_, b_, v_, dt = (x @ w).split([g * n, g * n, h * p, h], -1)
        dt = torch.nn.functional.softplus(dt)
        v_ = v_.view(b, t, h, p) * dt[..., None]
        return gla(c_.view(b, t, g, n), b_.view(b, t, g, n), v_, -dt, ctx, scale=1.0, chunk_size=8)

    check_compiled_block_gradient(block, x, w)
