"""Kimi Delta Attention: chunked operator vs per-document oracles, numerics, leakage, compile.

Oracles, each run separately on every document (and on the pad tail) of every row:

* ``loop_kda_doc`` below: a plain per-token fp64 loop, for tight checks;
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
from tests._kda_rank_fns import NAMES, doc_ids_from_lengths, make_inputs, rel_err
from tests.support.compile_checks import HOST_SYNC_OPS, random_packings, recording_backend


# ---------------------------------------------------------------------------------------------
# oracles
# ---------------------------------------------------------------------------------------------
def loop_kda_doc(q, k, v, g, beta, scale):
    """One document, fp64 per-token recurrence. q, k ``[T, H, K]``; v ``[T, HV, V]``."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    state = q.new_zeros(v.shape[1], q.shape[2], v.shape[2])
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[..., None]
        resid = v[t] - torch.einsum("hk,hkv->hv", k[t], state)
        state = state + beta[t][:, None, None] * k[t][..., None] * resid[:, None, :]
        outs.append(scale * torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outs)


def fla_kda_doc(q, k, v, g, beta, scale):
    from fla.ops.kda.naive import naive_recurrent_kda

    return naive_recurrent_kda(q[None], k[None], v[None], g[None], beta[None], scale=scale)[0][0]


def per_document(doc_fn, xs: dict, doc_ids: torch.Tensor, scale: float) -> torch.Tensor:
    """Run ``doc_fn`` on every run (document or pad tail) of every row; differentiable."""
    rows = []
    for b in range(doc_ids.shape[0]):
        ids = doc_ids[b]
        cuts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + [len(ids)]
        pieces = [
            doc_fn(*(xs[n][b, s:e] for n in NAMES), scale).to(torch.float64)
            for s, e in zip(cuts[:-1], cuts[1:])
        ]
        rows.append(torch.cat(pieces))
    return torch.stack(rows)


def out_and_grads(fn, inputs: dict, grad_out: torch.Tensor):
    xs = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    out = fn(xs)
    grads = torch.autograd.grad(out, [xs[n] for n in NAMES], grad_out.to(out.dtype))
    return out.detach(), dict(zip(NAMES, grads))


def check(fn_a, fn_b, inputs, grad_out, tol):
    """Output and every input gradient of ``fn_a`` within ``tol`` (rel) of ``fn_b``'s."""
    out_a, grads_a = out_and_grads(fn_a, inputs, grad_out)
    out_b, grads_b = out_and_grads(fn_b, inputs, grad_out)
    errs = {"out": rel_err(out_a, out_b)}
    errs.update({n: rel_err(grads_a[n], grads_b[n]) for n in NAMES})
    assert all(torch.isfinite(x).all() for x in [out_a, *grads_a.values()])
    assert max(errs.values()) <= tol, errs
    return errs


PACKING = [([7, 1, 30, 9], 5), ([52], 0)]  # two rows of 52 tokens: short/single/long docs + pad


# ---------------------------------------------------------------------------------------------
# correctness against the oracles
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "chunk,heads,value_heads", [(16, 1, 2), (64, 2, 2), (8, 2, 4), (4, 1, 1), (1, 1, 1)]
)
def test_fp64_matches_loop_tightly(chunk, heads, value_heads):
    doc_ids = doc_ids_from_lengths(PACKING)
    inputs = make_inputs(2, 52, heads, value_heads, 8, 6, seed=chunk, dtype=torch.float64)
    grad_out = torch.randn(2, 52, value_heads, 6, dtype=torch.float64)
    ctx = PackedContext(doc_ids)
    scale = 8**-0.5
    check(
        lambda xs: kda(*(xs[n] for n in NAMES), ctx, chunk_size=chunk),
        lambda xs: per_document(loop_kda_doc, xs, doc_ids, scale),
        inputs,
        grad_out,
        tol=1e-10,
    )


def test_fp32_matches_loop_and_fla():
    doc_ids = doc_ids_from_lengths([([40, 1, 70, 17], 0), ([3, 100], 25)])
    inputs = make_inputs(2, 128, 2, 4, 16, 12, seed=1)
    grad_out = torch.randn(2, 128, 4, 12)
    ctx = PackedContext(doc_ids)
    scale = 0.3

    def ours(xs):
        return kda(*(xs[n] for n in NAMES), ctx, scale=scale)

    check(ours, lambda xs: per_document(loop_kda_doc, xs, doc_ids, scale), inputs, grad_out, 1e-5)
    check(ours, lambda xs: per_document(fla_kda_doc, xs, doc_ids, scale), inputs, grad_out, 1e-5)


def test_bf16_inputs():
    doc_ids = doc_ids_from_lengths([([20, 44], 0)])
    inputs = make_inputs(1, 64, 1, 2, 16, 16, seed=2, dtype=torch.bfloat16)
    grad_out = torch.randn(1, 64, 2, 16)
    ctx = PackedContext(doc_ids)
    out = kda(*(inputs[n] for n in NAMES), ctx, chunk_size=32)
    assert out.dtype == torch.bfloat16
    check(
        lambda xs: kda(*(xs[n] for n in NAMES), ctx, chunk_size=32),
        lambda xs: per_document(loop_kda_doc, xs, doc_ids, 16**-0.5),
        inputs,
        grad_out,
        tol=1e-2,
    )


@pytest.mark.parametrize("decay", ["-8", "0", "mixed", "-40"])
def test_extreme_decays_stay_finite_and_exact(decay):
    """Full 64-token chunks with per-token log decay -8 (cumulative -512: naive exp(-cumsum)
    would overflow fp32), 0, a mix of both, and an extreme -40."""
    inputs = make_inputs(1, 128, 1, 1, 16, 8, seed=3)
    if decay == "mixed":
        pick = torch.rand(inputs["g"].shape, generator=torch.Generator().manual_seed(0)) < 0.5
        inputs["g"] = torch.where(pick, -8.0, 0.0)
    else:
        inputs["g"] = torch.full_like(inputs["g"], float(decay))
    doc_ids = doc_ids_from_lengths([([100], 28)])
    ctx = PackedContext(doc_ids)
    check(
        lambda xs: kda(*(xs[n] for n in NAMES), ctx),
        lambda xs: per_document(loop_kda_doc, xs, doc_ids, 16**-0.5),
        inputs,
        torch.randn(1, 128, 1, 8),
        tol=1e-5,
    )


def test_reference_matches_loop():
    doc_ids = doc_ids_from_lengths(PACKING)
    inputs = make_inputs(2, 52, 1, 2, 4, 4, seed=4, dtype=torch.float64)
    check(
        lambda xs: kda_reference(*(xs[n] for n in NAMES), PackedContext(doc_ids)),
        lambda xs: per_document(loop_kda_doc, xs, doc_ids, 0.5),
        inputs,
        torch.randn(2, 52, 2, 4, dtype=torch.float64),
        tol=1e-12,
    )


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
    results = rank_pool.run(fns.kda_fwd_bwd, 4, inputs, doc_ids, grad_out, 4)
    out = torch.cat([r[0] for r in results], 1)
    ref_out, ref_grads = out_and_grads(
        lambda xs: per_document(loop_kda_doc, xs, doc_ids, 8**-0.5), inputs, grad_out
    )
    assert rel_err(out, ref_out) <= 1e-5
    for n in NAMES:
        assert rel_err(torch.cat([r[1][n] for r in results], 1), ref_grads[n]) <= 1e-5, n


# ---------------------------------------------------------------------------------------------
# documents are exactly independent; padding is inert
# ---------------------------------------------------------------------------------------------
def test_other_documents_bitwise_unchanged():
    doc_ids = doc_ids_from_lengths([([5, 1, 20, 1, 30, 3], 4)])
    inputs = make_inputs(1, 64, 1, 2, 8, 8, seed=5)
    ctx = PackedContext(doc_ids)
    base = kda(*(inputs[n] for n in NAMES), ctx, chunk_size=16)
    noise = make_inputs(1, 64, 1, 2, 8, 8, seed=6)
    for d in doc_ids.unique().tolist():
        inside = doc_ids[0] == d
        pert = {}
        for n in NAMES:
            m = inside.view(1, -1, *([1] * (inputs[n].dim() - 2)))
            pert[n] = torch.where(m, noise[n] * 3, inputs[n])
        out = kda(*(pert[n] for n in NAMES), ctx, chunk_size=16)
        assert torch.equal(out[:, ~inside], base[:, ~inside]), d
        assert not torch.equal(out[:, inside], base[:, inside]), d


def test_pad_tokens_finite_and_inert():
    doc_ids = doc_ids_from_lengths([([10, 13], 9)])
    inputs = make_inputs(1, 32, 1, 1, 8, 8, seed=7)
    inputs["v"][:, 23:] = 1e4  # garbage in the pad tail
    ctx = PackedContext(doc_ids)
    xs = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    out = kda(*(xs[n] for n in NAMES), ctx, chunk_size=16)
    assert torch.isfinite(out).all()
    out[:, 23:].sum().backward()
    for n in NAMES:
        assert torch.equal(xs[n].grad[:, :23], torch.zeros_like(xs[n].grad[:, :23])), n


def test_input_validation():
    inputs = make_inputs(1, 8, 2, 2, 4, 4, seed=0)
    ctx = PackedContext(torch.ones(1, 8, dtype=torch.long))
    args = [inputs[n] for n in NAMES]
    with pytest.raises(ValueError, match="multiple of heads"):
        kda(*args[:2], make_inputs(1, 8, 3, 3, 4, 4, 0)["v"], *args[3:], ctx)
    with pytest.raises(ValueError, match="local_seq_len"):
        kda(*args, PackedContext(torch.ones(1, 9, dtype=torch.long)))
    with pytest.raises(ValueError, match="beta"):
        kda(*args[:4], args[4][..., :1], ctx)
    with pytest.raises(ValueError, match="power of two"):
        kda(*args, ctx, chunk_size=12)
    with pytest.raises(TypeError, match="PackedContext"):
        kda(*args, ctx.doc_ids)


@pytest.mark.parametrize("per_head", [False, True])
def test_a_positive_log_decay_is_rejected_in_eager_mode_only(per_head):
    """It used to return NaN without a word; compiled code reads no values (no host sync)."""
    inputs = make_inputs(1, 8, 1, 2, 4, 4, seed=0)
    if per_head:
        inputs["g"] = inputs["g"][..., 0].clone()
    inputs["g"][0, 5, 1] = 0.25  # a token of the first document grows the state
    inputs["g"][0, 6, 0] = float("inf")  # non-finite values follow the isolation rule instead
    ctx = PackedContext(torch.ones(1, 8, dtype=torch.long))
    args = [inputs[n] for n in NAMES]
    where = r"g\[0, 5, 1\]" if per_head else r"g\[0, 5, 1, 0\]"
    with pytest.raises(ValueError, match=rf"must be <= 0, got {where} = 0.25"):
        kda(*args, ctx, chunk_size=4)
    torch._dynamo.reset()
    out = torch.compile(kda, fullgraph=True, backend="aot_eager")(*args, ctx, chunk_size=4)
    assert out.shape == (1, 8, 2, 4)


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------
def test_compiled_equals_eager_without_recompiles():
    torch._dynamo.reset()
    backend, seen = recording_backend()
    compiled = torch.compile(kda, fullgraph=True, backend=backend)
    gen = torch.Generator().manual_seed(8)
    batch, seq = 2, 40
    for i, doc_ids in enumerate(random_packings(21, batch, seq, seed=8)):
        ctx = PackedContext(doc_ids)
        inputs = make_inputs(batch, seq, 1, 2, 8, 4, seed=100 + i)
        grad_out = torch.randn(batch, seq, 2, 4, generator=gen)

        def run(fn):
            return out_and_grads(
                lambda xs: fn(*(xs[n] for n in NAMES), ctx, chunk_size=16),
                inputs,
                grad_out,
            )

        out_c, grads_c = run(compiled)
        out_e, grads_e = run(kda)
        assert rel_err(out_c, out_e) <= 1e-6
        assert all(rel_err(grads_c[n], grads_e[n]) <= 1e-6 for n in NAMES)
    assert seen["frames"] == 1, seen["frames"]
    assert not HOST_SYNC_OPS & seen["ops"], HOST_SYNC_OPS & seen["ops"]
    assert "aten.bmm.default" in seen["ops"]  # the recorder saw the real aten graphs


def test_compiled_cp_two_ranks_equals_eager(rank_pool):
    doc_ids = doc_ids_from_lengths([([5, 20, 3], 4)])
    inputs = make_inputs(1, 32, 1, 1, 4, 4, seed=9)
    grad_out = torch.randn(1, 32, 1, 4)
    eager = rank_pool.run(fns.kda_fwd_bwd, 2, inputs, doc_ids, grad_out, 8, False)
    compiled = rank_pool.run(fns.kda_fwd_bwd, 2, inputs, doc_ids, grad_out, 8, True)
    for (out_e, grads_e), (out_c, grads_c) in zip(eager, compiled):
        assert rel_err(out_c, out_e) <= 1e-6
        assert all(rel_err(grads_c[n], grads_e[n]) <= 1e-6 for n in NAMES)


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

    grads = []
    for fn in (block, torch.compile(block, backend="aot_eager", fullgraph=True)):
        w.grad = None
        fn(x, w).pow(2).sum().backward()
        grads.append(w.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
