"""Gated DeltaNet (one gate per head) through :func:`fcp.ops.kda.kda`: what only GDN has.

``kda(q, k, v, g, beta, ctx)`` with ``g [B, L, HV]`` is GDN's recurrence ``S <- exp(g_t) S``,
then the delta rule (:mod:`fcp.ops.kda.reference`). The properties both gate kinds share (fp64
loop, extreme decays, CP, document isolation, compile) are tests of ``tests/test_kda.py``
parametrised by ``gate``. Oracles, each run on every document (and on the pad tail) of every row
separately:

* :func:`tests.support.kda_oracles.loop_doc`: a plain per-token fp64 loop;
* transformers' ``torch_chunk_gated_delta_rule`` (Qwen3-Next's PyTorch path, fp32 inside), the
  function its ``Qwen3NextGatedDeltaNet`` runs without FLA;
* the per-key-dimension path of the same operator fed the gate broadcast to ``[.., K]``.

Error metric: ``rel = max |x - ref| / max |ref|`` per tensor (output and the gradients of q, k,
v, g, beta). Tolerances: fp32 1e-5 (measured <= 5e-7); scalar versus broadcast gate in fp32
1e-6 (two orders of the same sums).
"""

from __future__ import annotations

import functools

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.kda import kda
from tests import _kda_rank_fns as fns
from tests.support.cp_jobs import cat_ranks
from tests.support.inputs import KDA_NAMES as NAMES, kda_inputs
from tests.support.kda_oracles import check, loop_doc, per_document
from tests.support.packing import doc_ids_from_lengths

#: KDA's test inputs with one log decay per head: ``g [batch, seq, value_heads]``
gdn_inputs = functools.partial(kda_inputs, gate="gdn")


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


def gdn(xs: dict, ctx, **kw):
    return kda(*(xs[n] for n in NAMES), ctx, **kw)


def broadcast_gate(q, k, v, g, beta):
    """The per-head gate ``[B, L, HV]`` repeated over the key channels: ``[B, L, HV, K]``."""
    return q, k, v, g[..., None].expand(*g.shape, q.shape[-1]), beta


# ---------------------------------------------------------------------------------------------
# correctness against the oracles
# ---------------------------------------------------------------------------------------------
def test_fp32_matches_transformers_qwen3_next_per_document():
    """transformers' own GDN kernel (Qwen3-Next's PyTorch path), GVA 3 value heads per key head:
    its ``repeat_interleave`` is fcp's convention (value head ``j`` reads key head ``j // 3``)."""
    doc_ids = doc_ids_from_lengths([([40, 1, 70, 17], 0), ([3, 100], 25)])
    inputs = gdn_inputs(2, 128, 2, 6, 16, 12, seed=1)
    grad_out = torch.randn(2, 128, 6, 12)
    ctx = PackedContext(doc_ids)
    for doc_fn in (transformers_gdn_doc, loop_doc):
        errs = check(lambda *xs: kda(*xs, ctx),
                     lambda *xs: per_document(doc_fn, xs, doc_ids, 16**-0.5), inputs, grad_out,
                     1e-5)  # fmt: skip
        print(f"\n[gdn] fcp vs {doc_fn.__name__}: {errs}")


def test_key_head_of_each_value_head_is_repeat_interleave():
    """GVA by ``repeat_interleave`` (transformers' Qwen3-Next, NeMo's GDN): passing q/k once per
    key head equals passing them repeated for every value head, bitwise; ``repeat`` differs."""
    doc_ids = doc_ids_from_lengths([([9, 15], 0)])
    xs = gdn_inputs(1, 24, 2, 6, 8, 4, seed=3)
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
    inputs = gdn_inputs(1, 128, 2, 4, 16, 8, seed=2)
    grad_out = torch.randn(1, 128, 4, 8)
    ctx = PackedContext(doc_ids)

    check(lambda *xs: kda(*xs, ctx, chunk_size=chunk),
          lambda *xs: kda(*broadcast_gate(*xs), ctx, chunk_size=chunk), inputs, grad_out, 1e-6)


# ---------------------------------------------------------------------------------------------
# documents are exactly independent, NaN included
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["g", "q", "grad"])
@pytest.mark.parametrize("world", [1, 2])
def test_non_finite_gate_or_input_stays_in_its_document(rank_pool, where, world):
    """NaN / inf in one document's gate (or q, or output gradient): every other document's
    outputs and input gradients are bitwise those of the clean run, with and without CP."""
    doc_ids = doc_ids_from_lengths([([5, 9, 2, 11], 5)])
    inputs = gdn_inputs(1, 32, 1, 2, 8, 4, seed=7)
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
        for key in ("out",) + NAMES:
            c, d = cat_ranks(clean, key), cat_ranks(dirty, key)
            assert torch.isfinite(d[:, keep]).all(), (where, value, key)
            assert torch.equal(c[:, keep], d[:, keep]), (where, value, key)


def test_input_validation():
    xs = gdn_inputs(1, 8, 2, 2, 4, 4, seed=0)
    ctx = PackedContext(torch.ones(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"g must be \[1, 8, 2\] .* or \[1, 8, 2, 4\]"):
        gdn(dict(xs, g=xs["g"][..., :1]), ctx)
    with pytest.raises(ValueError, match="g must be"):
        gdn(dict(xs, g=xs["g"][..., None].expand(1, 8, 2, 3)), ctx)


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
    inputs = gdn_inputs(2, 32, 1, 2, 8, 4, seed=11)
    ctx = PackedContext(doc_ids)

    check(lambda *xs: kda_fla_static(*broadcast_gate(*xs), ctx, None, 32),
          lambda *xs: kda(*xs, ctx), inputs, torch.randn(2, 32, 2, 4), 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fla", "fla_varlen"])
def test_fla_backends_take_the_scalar_gate(backend):
    doc_ids = doc_ids_from_lengths([([40, 1, 70, 17], 0)]).cuda()
    inputs = {n: x.cuda() for n, x in gdn_inputs(1, 128, 2, 4, 64, 64, seed=4).items()}
    grad_out = torch.randn(1, 128, 4, 64, device="cuda")
    ctx = PackedContext(doc_ids)
    check(lambda *xs: kda(*xs, ctx, backend=backend), lambda *xs: kda(*xs, ctx), inputs,
          grad_out, 1e-4)  # fmt: skip
