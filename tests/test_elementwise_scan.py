"""The elementwise scan (``h_t = a_t h_{t-1} + x_t`` per channel, RecurrentGemma's RG-LRU
recurrence): the log-depth operator against a per-document fp64 loop, numerics, leakage, CP on
1, 2 and 4 ranks, compile.

Oracle: ``loop_doc`` below, a plain per-token fp64 loop written from the definition, run on
every document (and on the pad tail) of every row alone. Error metric: ``rel = max |x - ref| /
max |ref|`` per tensor (output and both input gradients). Tolerances: fp64 inputs 1e-12; fp32
inputs 1e-5 (also with decays exactly 0, ``exp(-40)``, ``exp(-8)``, a mix and none: 1); bf16
inputs bitwise the fp32 computation rounded once, 1e-2 against the loop.
"""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.elementwise_scan import elementwise_scan
from fcp.ops.elementwise_scan.reference import elementwise_scan_reference
from tests import _elementwise_scan_rank_fns as fns
from tests._elementwise_scan_rank_fns import NAMES, make_inputs
from tests.support.cp_jobs import GraphRecorder
from tests.support.inputs import rel_err
from tests.support.operator_checks import EXTREME_DECAYS, check, check_documents_independent
from tests.support.operator_checks import out_and_grads, per_document, with_decay
from tests.support.packing import doc_ids_from_lengths, random_doc_ids


def loop_doc(x, a, _scale=None):
    """One document ``x``, ``a`` ``[T, *channels]``, fp64, token by token from the definition
    (the first token's decay unread: the state starts at zero)."""
    h = torch.zeros_like(x[0], dtype=torch.float64)
    out = []
    for t in range(x.shape[0]):
        h = a[t].double() * h + x[t].double()
        out.append(h)
    return torch.stack(out)


def ours(ctx):
    return lambda *xs: elementwise_scan(*xs, ctx)


def loop(doc_ids):
    return lambda *xs: per_document(loop_doc, xs, doc_ids, 1.0)


PACKING = [([7, 1, 30, 9], 5), ([52], 0)]  # two rows of 52 tokens: short/single/long docs + pad


@pytest.mark.parametrize("channels", [3, (2, 4)])
def test_fp64_matches_loop_tightly(channels):
    doc_ids = doc_ids_from_lengths(PACKING)
    inputs = make_inputs(2, 52, channels, seed=1, dtype=torch.float64)
    grad_out = torch.randn(inputs["x"].shape, dtype=torch.float64)
    check(ours(PackedContext(doc_ids)), loop(doc_ids), inputs, grad_out, 1e-12, NAMES)
    check(lambda *xs: elementwise_scan_reference(*xs, PackedContext(doc_ids)), loop(doc_ids),
          inputs, grad_out, 1e-12, NAMES)  # fmt: skip


@pytest.mark.parametrize("decay", ("zero", *EXTREME_DECAYS))
def test_fp32_matches_loop_from_no_decay_to_strong(decay):
    """Log decays 0 (a = 1), -8, -40, a mix of -8 and 0, and decays exactly 0."""
    doc_ids = doc_ids_from_lengths([([40, 1, 70, 17], 0), ([3, 100], 25)])
    inputs = make_inputs(2, 128, 6, seed=2)
    if decay == "zero":
        inputs["a"] = torch.zeros_like(inputs["a"])
    else:
        inputs = with_decay(inputs, "a", decay)
        inputs["a"] = inputs["a"].exp()
    check(ours(PackedContext(doc_ids)), loop(doc_ids), inputs,
          torch.randn(2, 128, 6, generator=torch.Generator().manual_seed(0)), 1e-5, NAMES)


def test_bf16_inputs_accumulate_in_fp32():
    """bf16 in, bf16 out, fp32 inside: bitwise the fp32 computation on the same (bf16-valued)
    inputs, rounded once; and within bf16 rounding of the fp64 loop."""
    doc_ids = doc_ids_from_lengths([([20, 44], 0)])
    ctx = PackedContext(doc_ids)
    inputs = make_inputs(1, 64, 8, seed=3, dtype=torch.bfloat16)
    out = elementwise_scan(*(inputs[n] for n in NAMES), ctx)
    assert out.dtype == torch.bfloat16
    widened = elementwise_scan(*(inputs[n].float() for n in NAMES), ctx)
    assert torch.equal(out, widened.to(torch.bfloat16))
    check(ours(ctx), loop(doc_ids), inputs, torch.randn(1, 64, 8), 1e-2, NAMES)


ROWS = [
    [([32], 0)],  # one document spanning all four ranks
    [([8, 8, 1, 7, 8], 0)],  # documents start exactly at rank starts; single-token doc
    [([7, 2, 1, 1, 1], 20)],  # single-token docs across a rank boundary; pad-only ranks
    [([3, 10], 19), ([1, 30], 1)],  # batch 2, different packings per row
]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_cp_matches_loop(rank_pool, world):
    """CP edge packings (32 tokens over 1, 2 and 4 ranks; channels with heads), end to end
    against the per-document fp64 loop: output and both input gradients within 1e-5."""
    for rows in ROWS:
        doc_ids = doc_ids_from_lengths(rows)
        inputs = make_inputs(doc_ids.shape[0], 32, (2, 3), seed=10, log_low=-10.0)
        grad_out = torch.randn(inputs["x"].shape, generator=torch.Generator().manual_seed(0))
        results = rank_pool.run(fns.scan_fwd_bwd, world, inputs, doc_ids, grad_out)
        ref_out, ref_grads = out_and_grads(loop(doc_ids), inputs, grad_out, NAMES)
        assert rel_err(torch.cat([r[0] for r in results], 1), ref_out) <= 1e-5, rows
        for n in NAMES:
            grad = torch.cat([r[1][n] for r in results], 1)
            assert rel_err(grad, ref_grads[n]) <= 1e-5, (rows, n)


def test_other_documents_bitwise_unchanged():
    check_documents_independent(elementwise_scan, lambda seq, seed: make_inputs(1, seq, 4, seed),
                                NAMES)  # fmt: skip


def test_pad_and_non_finite_values_stay_in_their_run():
    """Garbage (1e4, inf, NaN) in the pad tail and NaN in one document: every other document's
    output is finite and bitwise the clean one, and the pad tail's outputs send no gradient to
    a real token."""
    doc_ids = doc_ids_from_lengths([([10, 13], 9)])
    ctx = PackedContext(doc_ids)
    inputs = make_inputs(1, 32, 4, seed=7)
    clean = elementwise_scan(*(inputs[n] for n in NAMES), ctx)
    dirty = {n: x.clone() for n, x in inputs.items()}
    dirty["x"][:, 23:] = 1e4
    dirty["x"][:, 30] = float("inf")
    dirty["a"][:, 25] = float("nan")
    dirty["x"][:, 12] = float("nan")  # inside the second document
    xs = {n: x.requires_grad_() for n, x in dirty.items()}
    out = elementwise_scan(*(xs[n] for n in NAMES), ctx)
    assert torch.equal(out[:, :10], clean[:, :10])
    out[:, 23:].sum().backward()
    for n in NAMES:
        assert torch.equal(xs[n].grad[:, :23], torch.zeros_like(xs[n].grad[:, :23])), n


def test_input_validation():
    inputs = make_inputs(1, 8, 4, seed=0)
    ctx = PackedContext(torch.ones(1, 8, dtype=torch.long))
    x, a = inputs["x"], inputs["a"]
    with pytest.raises(ValueError, match="a must have x's shape"):
        elementwise_scan(x, a[..., :1], ctx)
    with pytest.raises(ValueError, match="3-D or more"):
        elementwise_scan(x[..., 0], a[..., 0], ctx)
    with pytest.raises(ValueError, match="local_seq_len"):
        elementwise_scan(x, a, PackedContext(torch.ones(1, 9, dtype=torch.long)))
    with pytest.raises(ValueError, match="backend must be"):
        elementwise_scan(x, a, ctx, backend="fast")
    with pytest.raises(TypeError, match="PackedContext"):
        elementwise_scan(x, a, ctx.doc_ids)
    with pytest.raises(TypeError, match="a must be floating point"):
        elementwise_scan(x, a.long(), ctx)


def test_compiled_equals_eager_once_across_ten_packings_without_host_sync():
    """``torch.compile(fullgraph=True)``: one frame for ten packings, forward and backward equal
    to eager (1e-6), no host synchronisation in the aten graphs."""
    gen = torch.Generator().manual_seed(8)
    torch._dynamo.reset()
    recorder = GraphRecorder()
    compiled = torch.compile(elementwise_scan, fullgraph=True, backend=recorder)
    for i in range(10):
        ctx = PackedContext(random_doc_ids(gen, 2, 40))
        inputs = make_inputs(2, 40, 4, seed=100 + i)
        grad_out = torch.randn(2, 40, 4, generator=gen)
        out_c, grads_c = out_and_grads(lambda *xs: compiled(*xs, ctx), inputs, grad_out, NAMES)
        out_e, grads_e = out_and_grads(ours(ctx), inputs, grad_out, NAMES)
        assert rel_err(out_c, out_e) <= 1e-6
        assert all(rel_err(grads_c[n], grads_e[n]) <= 1e-6 for n in NAMES)
    assert recorder.frames == 1, recorder.frames
    assert recorder.host_syncs() == [], recorder.host_syncs()
    assert "fcp.decay_scan_fwd.default" in recorder.ops, recorder.ops


def test_compiled_cp_two_ranks_equals_eager(rank_pool):
    doc_ids = doc_ids_from_lengths([([5, 20, 3], 4)])
    inputs = make_inputs(1, 32, 4, seed=9)
    grad_out = torch.randn(1, 32, 4)
    eager = rank_pool.run(fns.scan_fwd_bwd, 2, inputs, doc_ids, grad_out, False)
    compiled = rank_pool.run(fns.scan_fwd_bwd, 2, inputs, doc_ids, grad_out, True)
    for (out_e, grads_e), (out_c, grads_c) in zip(eager, compiled):
        assert rel_err(out_c, out_e) <= 1e-6
        assert all(rel_err(grads_c[n], grads_e[n]) <= 1e-6 for n in NAMES)
