"""Gated DeltaNet (one gate per head) through :func:`fcp.ops.kda.kda`: oracles, isolation, compile.

``kda(q, k, v, g, beta, ctx)`` with ``g [B, L, HV]`` is GDN's recurrence ``S <- exp(g_t) S``,
then the delta rule (:mod:`fcp.ops.kda.reference`). Oracles, each run on every document (and on
the pad tail) of every row separately:

* ``loop_gdn_doc`` below: a plain per-token fp64 loop with a scalar decay per head;
* transformers' ``torch_chunk_gated_delta_rule`` (Qwen3-Next's PyTorch path, fp32 inside), the
  function its ``Qwen3NextGatedDeltaNet`` runs without FLA;
* the per-key-dimension path of the same operator fed the gate broadcast to ``[.., K]``.

Error metric: ``rel = max |x - ref| / max |ref|`` per tensor (output and the gradients of q, k,
v, g, beta). Tolerances: fp64 1e-10 (measured ~5e-16); fp32 1e-5 (measured <= 5e-7); scalar
versus broadcast gate in fp32 1e-6 (two orders of the same sums).
"""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.kda import kda
from fcp.ops.kda.reference import kda_reference
from tests import _kda_rank_fns as fns
from tests._kda_rank_fns import NAMES, doc_ids_from_lengths, rel_err
from tests.support.compile_checks import HOST_SYNC_OPS, random_packings, recording_backend


def make_gdn_inputs(batch, seq, heads, value_heads, dk, dv, seed, dtype=torch.float32) -> dict:
    """KDA's test inputs (L2-normalised keys, beta in (0, 1)) with one log decay per head in
    ``[-8, 0]``: ``g [batch, seq, value_heads]``."""
    xs = fns.make_inputs(batch, seq, heads, value_heads, dk, dv, seed, dtype)
    xs["g"] = xs["g"][..., 0].contiguous()
    return xs


def loop_gdn_doc(q, k, v, g, beta, scale):
    """One document, fp64 per-token recurrence: q, k ``[T, H, K]``, v ``[T, HV, V]``, g ``[T, HV]``
    (one log decay per value head)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)  # value head j: key j // rep
    state = q.new_zeros(v.shape[1], q.shape[2], v.shape[2])
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        resid = v[t] - torch.einsum("hk,hkv->hv", k[t], state)
        state = state + beta[t][:, None, None] * k[t][..., None] * resid[:, None, :]
        outs.append(scale * torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outs)


def transformers_gdn_doc(q, k, v, g, beta, scale):
    """transformers' Qwen3-Next ``torch_chunk_gated_delta_rule`` on one document (its PyTorch
    fallback: ``__wrapped__`` under the kernel-hub wrapper, which binds FLA when importable).
    It scales q by ``K ** -0.5`` itself."""
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    fn = getattr(qwen3_next.torch_chunk_gated_delta_rule, "__wrapped__",
                 qwen3_next.torch_chunk_gated_delta_rule)  # fmt: skip
    assert scale == q.shape[-1] ** -0.5
    out, _ = fn(q[None], k[None], v[None], g[None], beta[None], use_qk_l2norm_in_kernel=False)
    return out[0]


def per_document(doc_fn, xs: dict, doc_ids: torch.Tensor, scale: float) -> torch.Tensor:
    rows = []
    for b in range(doc_ids.shape[0]):
        ids = doc_ids[b]
        cuts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + [len(ids)]
        rows.append(torch.cat([doc_fn(*(xs[n][b, s:e] for n in NAMES), scale).double()
                               for s, e in zip(cuts[:-1], cuts[1:])]))  # fmt: skip
    return torch.stack(rows)


def out_and_grads(fn, inputs: dict, grad_out: torch.Tensor):
    xs = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    out = fn(xs)
    grads = torch.autograd.grad(out, [xs[n] for n in NAMES], grad_out.to(out.dtype))
    return out.detach(), dict(zip(NAMES, grads))


def check(fn_a, fn_b, inputs, grad_out, tol):
    out_a, grads_a = out_and_grads(fn_a, inputs, grad_out)
    out_b, grads_b = out_and_grads(fn_b, inputs, grad_out)
    errs = {"out": rel_err(out_a, out_b), **{n: rel_err(grads_a[n], grads_b[n]) for n in NAMES}}
    assert all(torch.isfinite(x).all() for x in [out_a, *grads_a.values()])
    assert max(errs.values()) <= tol, errs
    return errs


def gdn(xs, ctx, **kw):
    return kda(*(xs[n] for n in NAMES), ctx, **kw)


PACKING = [([7, 1, 30, 9], 5), ([52], 0)]  # two rows of 52 tokens: short/single/long docs + pad


# ---------------------------------------------------------------------------------------------
# correctness against the oracles
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk,heads,value_heads", [(16, 1, 2), (64, 2, 2), (8, 2, 6), (1, 1, 1)])
def test_fp64_matches_loop_tightly(chunk, heads, value_heads):
    doc_ids = doc_ids_from_lengths(PACKING)
    inputs = make_gdn_inputs(2, 52, heads, value_heads, 8, 6, seed=chunk, dtype=torch.float64)
    grad_out = torch.randn(2, 52, value_heads, 6, dtype=torch.float64)
    ctx = PackedContext(doc_ids)
    check(lambda xs: gdn(xs, ctx, chunk_size=chunk),
          lambda xs: per_document(loop_gdn_doc, xs, doc_ids, 8**-0.5), inputs, grad_out, 1e-10)
    # the reference's recurrence accepts the scalar gate too
    check(lambda xs: kda_reference(*(xs[n] for n in NAMES), ctx),
          lambda xs: per_document(loop_gdn_doc, xs, doc_ids, 8**-0.5), inputs, grad_out, 1e-12)


def test_fp32_matches_transformers_qwen3_next_per_document():
    """transformers' own GDN kernel (Qwen3-Next's PyTorch path), GVA 3 value heads per key head:
    its ``repeat_interleave`` is fcp's convention (value head ``j`` reads key head ``j // 3``)."""
    doc_ids = doc_ids_from_lengths([([40, 1, 70, 17], 0), ([3, 100], 25)])
    inputs = make_gdn_inputs(2, 128, 2, 6, 16, 12, seed=1)
    grad_out = torch.randn(2, 128, 6, 12)
    ctx = PackedContext(doc_ids)
    errs = check(lambda xs: gdn(xs, ctx), lambda xs: per_document(transformers_gdn_doc, xs,
                                                                  doc_ids, 16**-0.5),
                 inputs, grad_out, 1e-5)  # fmt: skip
    print(f"\n[gdn] fcp vs transformers' torch_chunk_gated_delta_rule: {errs}")
    check(lambda xs: gdn(xs, ctx), lambda xs: per_document(loop_gdn_doc, xs, doc_ids, 16**-0.5),
          inputs, grad_out, 1e-5)  # fmt: skip


def test_key_head_of_each_value_head_is_repeat_interleave():
    """GVA by ``repeat_interleave`` (transformers' Qwen3-Next, NeMo's GDN): passing q/k once per
    key head equals passing them repeated for every value head, bitwise; ``repeat`` differs."""
    doc_ids = doc_ids_from_lengths([([9, 15], 0)])
    xs = make_gdn_inputs(1, 24, 2, 6, 8, 4, seed=3)
    ctx = PackedContext(doc_ids)
    out = gdn(xs, ctx, chunk_size=8)
    rep = dict(xs, q=xs["q"].repeat_interleave(3, 2), k=xs["k"].repeat_interleave(3, 2))
    assert torch.equal(out, gdn(rep, ctx, chunk_size=8))
    tiled = dict(xs, q=xs["q"].repeat(1, 1, 3, 1), k=xs["k"].repeat(1, 1, 3, 1))
    assert not torch.allclose(out, gdn(tiled, ctx, chunk_size=8))


@pytest.mark.parametrize("chunk", [8, 64])
def test_scalar_gate_equals_broadcast_gate(chunk):
    """The scalar path computes the per-key path's recurrence for the gate broadcast over K; the
    broadcast gate's gradient, summed over K, is the scalar gate's."""
    doc_ids = doc_ids_from_lengths([([40, 1, 30, 17], 40)])
    inputs = make_gdn_inputs(1, 128, 2, 4, 16, 8, seed=2)
    grad_out = torch.randn(1, 128, 4, 8)
    ctx = PackedContext(doc_ids)

    def broadcast(xs):
        return gdn(dict(xs, g=xs["g"][..., None].expand(*xs["g"].shape, 16)), ctx, chunk_size=chunk)

    check(lambda xs: gdn(xs, ctx, chunk_size=chunk), broadcast, inputs, grad_out, 1e-6)


@pytest.mark.parametrize("decay", ["-8", "0", "mixed", "-40"])
def test_extreme_decays_stay_finite_and_exact(decay):
    """Full 64-token chunks with per-token log decay -8 (cumulative -512), 0, a mix, and -40."""
    inputs = make_gdn_inputs(1, 128, 1, 2, 16, 8, seed=3)
    if decay == "mixed":
        pick = torch.rand(inputs["g"].shape, generator=torch.Generator().manual_seed(0)) < 0.5
        inputs["g"] = torch.where(pick, -8.0, 0.0)
    else:
        inputs["g"] = torch.full_like(inputs["g"], float(decay))
    doc_ids = doc_ids_from_lengths([([100], 28)])
    ctx = PackedContext(doc_ids)
    check(lambda xs: gdn(xs, ctx), lambda xs: per_document(loop_gdn_doc, xs, doc_ids, 16**-0.5),
          inputs, torch.randn(1, 128, 2, 8), 1e-5)  # fmt: skip


@pytest.mark.parametrize(
    "world,rows",
    [
        (4, [([32], 0)]),  # one document spanning all four ranks
        (4, [([7, 2, 1, 1, 1], 20)]),  # single-token docs across a rank boundary; pad-only ranks
        (2, [([3, 10], 19), ([1, 30], 1)]),  # batch 2, different packings per row
    ],
)
def test_cp_matches_loop(rank_pool, world, rows):
    """CP (state chained across ranks), chunk 4 < shard, end to end against the fp64 loop."""
    doc_ids = doc_ids_from_lengths(rows)
    batch = doc_ids.shape[0]
    inputs = make_gdn_inputs(batch, 32, 1, 2, 8, 4, seed=10)
    grad_out = torch.randn(batch, 32, 2, 4, generator=torch.Generator().manual_seed(0))
    results = rank_pool.run(fns.kda_fwd_bwd, world, inputs, doc_ids, grad_out, 4)
    ref_out, ref_grads = out_and_grads(
        lambda xs: per_document(loop_gdn_doc, xs, doc_ids, 8**-0.5), inputs, grad_out
    )
    assert rel_err(torch.cat([r[0] for r in results], 1), ref_out) <= 1e-5
    for n in NAMES:
        assert rel_err(torch.cat([r[1][n] for r in results], 1), ref_grads[n]) <= 1e-5, n


# ---------------------------------------------------------------------------------------------
# documents are exactly independent, NaN included
# ---------------------------------------------------------------------------------------------
def test_other_documents_bitwise_unchanged():
    doc_ids = doc_ids_from_lengths([([5, 1, 20, 1, 30, 3], 4)])
    inputs = make_gdn_inputs(1, 64, 1, 2, 8, 8, seed=5)
    ctx = PackedContext(doc_ids)
    base = gdn(inputs, ctx, chunk_size=16)
    noise = make_gdn_inputs(1, 64, 1, 2, 8, 8, seed=6)
    for d in doc_ids.unique().tolist():
        inside = doc_ids[0] == d
        pert = {n: torch.where(inside.view(1, -1, *([1] * (inputs[n].dim() - 2))), 3 * noise[n],
                               inputs[n]) for n in NAMES}  # fmt: skip
        out = gdn(pert, ctx, chunk_size=16)
        assert torch.equal(out[:, ~inside], base[:, ~inside]), d
        assert not torch.equal(out[:, inside], base[:, inside]), d


@pytest.mark.parametrize("where", ["g", "q", "grad"])
@pytest.mark.parametrize("world", [1, 2])
def test_non_finite_gate_or_input_stays_in_its_document(rank_pool, where, world):
    """NaN / inf in one document's gate (or q, or output gradient): every other document's
    outputs and input gradients are bitwise those of the clean run, with and without CP."""
    doc_ids = doc_ids_from_lengths([([5, 9, 2, 11], 5)])
    inputs = make_gdn_inputs(1, 32, 1, 2, 8, 4, seed=7)
    grad = torch.randn(1, 32, 2, 4, generator=torch.Generator().manual_seed(1))
    keep = doc_ids[0] != 2  # document 2 (tokens 5..13) is poisoned
    for value in (float("nan"), float("inf"), float("-inf")):
        poisoned, poisoned_grad = dict(inputs), grad.clone()
        if where == "grad":
            poisoned_grad[0, 7] = value
        else:
            x = inputs[where].clone()
            x[0, 7] = value
            poisoned[where] = x
        clean = rank_pool.run(fns.kda_fwd_bwd, world, inputs, doc_ids, grad, 4)
        dirty = rank_pool.run(fns.kda_fwd_bwd, world, poisoned, doc_ids, poisoned_grad, 4)
        pairs = [(torch.cat([r[0] for r in clean], 1), torch.cat([r[0] for r in dirty], 1))]
        pairs += [(torch.cat([r[1][n] for r in clean], 1), torch.cat([r[1][n] for r in dirty], 1))
                  for n in NAMES]  # fmt: skip
        for c, d in pairs:
            assert torch.isfinite(d[:, keep]).all(), (where, value)
            assert torch.equal(c[:, keep], d[:, keep]), (where, value)


def test_input_validation():
    xs = make_gdn_inputs(1, 8, 2, 2, 4, 4, seed=0)
    ctx = PackedContext(torch.ones(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"g must be \[1, 8, 2\] .* or \[1, 8, 2, 4\]"):
        gdn(dict(xs, g=xs["g"][..., :1]), ctx)
    with pytest.raises(ValueError, match="g must be"):
        gdn(dict(xs, g=xs["g"][..., None].expand(1, 8, 2, 3)), ctx)


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------
def test_compiled_equals_eager_without_recompiles():
    """fullgraph aot_eager over 8 packings: one compilation; no host sync in the graphs."""
    torch._dynamo.reset()
    backend, seen = recording_backend()
    compiled = torch.compile(kda, fullgraph=True, backend=backend)
    gen = torch.Generator().manual_seed(8)
    for i, doc_ids in enumerate(random_packings(8, batch=2, seq=40, seed=8)):
        ctx = PackedContext(doc_ids)
        inputs = make_gdn_inputs(2, 40, 1, 2, 8, 4, seed=100 + i)
        grad_out = torch.randn(2, 40, 2, 4, generator=gen)
        out_c, grads_c = out_and_grads(
            lambda xs: compiled(*(xs[n] for n in NAMES), ctx, chunk_size=16), inputs, grad_out
        )
        out_e, grads_e = out_and_grads(lambda xs: gdn(xs, ctx, chunk_size=16), inputs, grad_out)
        assert rel_err(out_c, out_e) <= 1e-6
        assert all(rel_err(grads_c[n], grads_e[n]) <= 1e-6 for n in NAMES)
    assert seen["frames"] == 1, seen["frames"]
    assert not HOST_SYNC_OPS & seen["ops"], HOST_SYNC_OPS & seen["ops"]


def test_compiled_cp_two_ranks_equals_eager(rank_pool):
    doc_ids = doc_ids_from_lengths([([5, 20, 3], 4)])
    inputs = make_gdn_inputs(1, 32, 1, 2, 4, 4, seed=9)
    grad_out = torch.randn(1, 32, 2, 4)
    eager = rank_pool.run(fns.kda_fwd_bwd, 2, inputs, doc_ids, grad_out, 8, False)
    compiled = rank_pool.run(fns.kda_fwd_bwd, 2, inputs, doc_ids, grad_out, 8, True)
    for (out_e, grads_e), (out_c, grads_c) in zip(eager, compiled):
        assert rel_err(out_c, out_e) <= 1e-6
        assert all(rel_err(grads_c[n], grads_e[n]) <= 1e-6 for n in NAMES)


# ---------------------------------------------------------------------------------------------
# FLA backends (CUDA): the scalar gate is broadcast to FLA's KDA kernels
# ---------------------------------------------------------------------------------------------
def test_fla_static_composition_takes_the_broadcast_gate():
    """On CPU with fcp's FLA test doubles (:mod:`tests.support.fla_cpu_kernels`): static mode's
    composition (gate resets, op, autograd) fed the per-head gate broadcast over K, as the
    dispatcher feeds the FLA backends, equals the scalar-gate chunked path."""
    import tests.support.fla_cpu_kernels  # noqa: F401  (CPU kernels for fcp's FLA ops)
    from fcp.ops.kda.fla import kda_fla_static

    doc_ids = doc_ids_from_lengths([([9, 1, 14], 8), ([32], 0)])
    inputs = make_gdn_inputs(2, 32, 1, 2, 8, 4, seed=11)
    ctx = PackedContext(doc_ids)

    def static(xs):
        g = xs["g"][..., None].expand(*xs["g"].shape, 8)
        return kda_fla_static(xs["q"], xs["k"], xs["v"], g, xs["beta"], ctx, None, 32)

    check(static, lambda xs: gdn(xs, ctx), inputs, torch.randn(2, 32, 2, 4), 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fla", "fla_varlen"])
def test_fla_backends_take_the_scalar_gate(backend):
    doc_ids = doc_ids_from_lengths([([40, 1, 70, 17], 0)]).cuda()
    inputs = {n: x.cuda() for n, x in make_gdn_inputs(1, 128, 2, 4, 64, 64, seed=4).items()}
    grad_out = torch.randn(1, 128, 4, 64, device="cuda")
    ctx = PackedContext(doc_ids)
    check(lambda xs: gdn(xs, ctx, backend=backend), lambda xs: gdn(xs, ctx), inputs, grad_out,
          1e-4)  # fmt: skip
