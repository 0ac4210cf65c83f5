"""Unit tests for fcp.ops.doc_causal and fcp.ops.compressed.

Each operator is checked against its float64 reference (``<op>/reference.py``: the definition,
one query at a time, Python loops over keys/blocks), forward and q/k/v gradients;
then isolation between documents and causality (bitwise), pad handling, argument errors, CP on
real gloo groups, and torch.compile. (Indexer-selected attention: tests/test_index_attention.py.)
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.compressed.reference import compressed_attention_reference as ref_compressed
from fcp.ops.doc_causal.reference import doc_causal_attention_reference as ref_doc_causal
from fcp.ops.sliding_window.reference import sliding_window_attention_reference as ref_sliding
from tests import _attention_rank_fns as fns
from tests._attention_rank_fns import SOFTMAX_OPS as OPS
from tests.support.inputs import QKV, attention_inputs
from tests.support.packing import EDGE_PACKINGS, packing, random_packings

FP32 = dict(atol=1e-5, rtol=1e-5)


# ============================================================================ helpers
def run_ref(name, inputs, doc_ids, kwargs):
    t = {n: x.clone().double().requires_grad_() for n, x in inputs.items()}
    kwargs = {n: x for n, x in kwargs.items() if n != "backend"}
    if name == "doc_causal":
        out = ref_doc_causal(t["q"], t["k"], t["v"], doc_ids, sinks=t.get("sinks"), **kwargs)
    elif name == "sliding":
        kwargs = {"window": fns.WINDOW, **kwargs}
        out = ref_sliding(t["q"], t["k"], t["v"], doc_ids, sinks=t.get("sinks"), **kwargs)
    else:
        out = ref_compressed(t["q"], t["k"], t["v"], doc_ids, **kwargs)
    return out, t


def check_against_reference(name, inputs, doc_ids, kwargs, tol=FP32):
    grad_out = torch.randn(inputs["q"].shape[:3] + inputs["v"].shape[3:], dtype=torch.float64)
    out_ref, t = run_ref(name, inputs, doc_ids, kwargs)
    (out_ref * grad_out).sum().backward()
    got = fns.single_process(name, inputs, doc_ids, kwargs, grad_out.float())
    assert got["out"].dtype == inputs["q"].dtype
    torch.testing.assert_close(got["out"].double(), out_ref, **tol)
    for n in QKV + tuple(n for n in ("sinks",) if n in inputs):
        torch.testing.assert_close(got[n].double(), ref_grad(t[n]), **tol, msg=f"grad {n}")
    return got


def ref_grad(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x) if x.grad is None else x.grad


# ============================================================================ reference equality
PACKINGS = {**EDGE_PACKINGS, "straddling_blocks": (24, [2, 11, 1, 9])}
CASES = [
    ("doc_causal", {}),
    ("doc_causal", {"scale": 0.3}),
    ("compressed", {}),
    ("compressed", {"ratio": 2, "window": 5}),
    ("compressed", {"ratio": 3, "window": 1}),
    ("compressed", {"ratio": 1, "window": 2}),
    ("sliding", {}),
    ("sliding", {"window": 1}),
    ("sliding", {"window": 3, "softcap": 0.5}),
    ("sliding", {"window": 100}),  # longer than every document: doc-causal attention
    ("doc_causal", {"softcap": 2.0}),
]


@pytest.mark.parametrize("name,kwargs", CASES, ids=lambda x: str(x) if isinstance(x, dict) else x)
@pytest.mark.parametrize("pack", list(PACKINGS))
def test_matches_reference(name, kwargs, pack):
    doc_ids = packing(*PACKINGS[pack])
    inputs = attention_inputs(0, *doc_ids.shape, heads=4, kv_heads=2, dim=4)
    check_against_reference(name, inputs, doc_ids, kwargs)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("seq", [7, 11])
def test_length_not_a_multiple_of_the_block(name, seq):
    """Without CP any length works (a trailing partial block)."""
    doc_ids = packing(seq, [3, seq - 4])
    kwargs = {
        "doc_causal": {},
        "compressed": {"ratio": 4, "window": 3},
        "sliding": {"window": 4},
    }
    inputs = attention_inputs(1, 1, seq, heads=2, kv_heads=2, dim=8)
    check_against_reference(name, inputs, doc_ids, kwargs[name])


BF16 = dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", OPS)
def test_bf16(name):
    """bf16 in, bf16 out and grads; fp32 softmax keeps them within bf16 rounding of the float64
    reference (run on the same bf16-rounded inputs)."""
    doc_ids = packing(16, [6, 1, 7])
    inputs = attention_inputs(3, 1, 16, heads=4, kv_heads=1, dim=8, dtype=torch.bfloat16)
    got = check_against_reference(name, inputs, doc_ids, {}, tol=BF16)
    assert all(got[n].dtype == torch.bfloat16 for n in ("out",) + QKV)


# ============================================================================ masks and pads
def _call(name, inputs, doc_ids, kwargs=None):
    return fns.call_op(name, inputs, PackedContext(doc_ids), kwargs or {})


@pytest.mark.parametrize("name", OPS)
def test_pad_queries_zero_and_no_gradient_into_real_tokens(name):
    doc_ids = packing(12, [4, 3])
    inputs = attention_inputs(0, 1, 12)
    for n in QKV:
        inputs[n].requires_grad_()
    out = _call(name, inputs, doc_ids)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, 7:], torch.zeros_like(out[:, 7:]))
    out[:, 7:].sum().backward()  # a loss on pad outputs only
    for n in QKV:
        assert torch.isfinite(inputs[n].grad).all()
        assert torch.equal(inputs[n].grad, torch.zeros_like(inputs[n].grad)), n


@pytest.mark.parametrize("name", OPS)
def test_first_token_of_a_document_sees_only_itself(name):
    """Everything masked but the query itself: the output is exactly v at that token."""
    doc_ids = packing(8, [3, 5])
    inputs = attention_inputs(0, 1, 8, heads=2, kv_heads=1)
    out = _call(name, inputs, doc_ids)
    for t in (0, 3):
        torch.testing.assert_close(out[0, t], inputs["v"][0, t].expand(2, -1), atol=1e-6, rtol=0)


def _perturb(inputs, positions):
    new = {n: x.clone() for n, x in inputs.items()}
    g = torch.Generator().manual_seed(123)
    for n, x in new.items():
        x[:, positions] = torch.randn(x[:, positions].shape, generator=g) * 3
    return new


ISOLATION_KWARGS = {
    "doc_causal": {},
    "compressed": {"ratio": 2, "window": 3},
    "sliding": {"window": 4},
}


@pytest.mark.parametrize("name", OPS)
def test_isolation_bitwise(name):
    """Perturbing every input of one document changes no other output."""
    doc_ids = packing(24, [5, 7, 1, 6, 3])  # blocks straddle documents
    for seed, d in itertools.product(range(3), range(1, 6)):
        inputs = attention_inputs(seed, 1, 24, heads=2, kv_heads=1)
        base = _call(name, inputs, doc_ids, ISOLATION_KWARGS[name])
        mine = (doc_ids[0] == d).nonzero().flatten()
        out = _call(name, _perturb(inputs, mine), doc_ids, ISOLATION_KWARGS[name])
        others = doc_ids[0] != d
        assert torch.equal(out[:, others], base[:, others]), f"doc {d} leaked (seed {seed})"
        assert not torch.equal(out[:, mine], base[:, mine])


@pytest.mark.parametrize("name", OPS)
def test_causality_bitwise(name):
    """Perturbing tokens after t (all inputs) changes no output at or before t."""
    doc_ids = packing(24, [20, 3])
    inputs = attention_inputs(5, 1, 24, heads=2, kv_heads=1)
    base = _call(name, inputs, doc_ids, ISOLATION_KWARGS[name])
    for t in (0, 3, 8, 13, 19):
        new = _perturb(inputs, torch.arange(t + 1, 24))
        out = _call(name, new, doc_ids, ISOLATION_KWARGS[name])
        assert torch.equal(out[:, : t + 1], base[:, : t + 1]), t


# ============================================================================ errors
class _FakeGroup:
    """Stands in for a ProcessGroup: the length checks run before any collective."""


@pytest.mark.parametrize("name,kw,word", [("compressed", {"ratio": 4}, "ratio=4")])
def test_cp_local_length_must_be_a_multiple(name, kw, word):
    doc_ids = packing(12, [12])
    ctx = PackedContext(doc_ids, group=_FakeGroup(), cp_size=2, cp_rank=0)  # local 6
    inputs = {n: x[:, :6] for n, x in attention_inputs(0, 1, 12).items()}
    with pytest.raises(ValueError, match=word):
        fns.call_op(name, inputs, ctx, kw)


@pytest.mark.parametrize("bad", ["heads", "dim", "length", "ratio"])
def test_bad_arguments(bad):
    doc_ids = packing(8, [8])
    t = attention_inputs(0, 1, 8, heads=3, kv_heads=1)
    ctx = PackedContext(doc_ids)
    from fcp.ops.compressed import compressed_attention
    from fcp.ops.doc_causal import doc_causal_attention

    with pytest.raises(ValueError):
        if bad == "heads":
            k2, v2 = t["k"].expand(-1, -1, 2, -1), t["v"].expand(-1, -1, 2, -1)
            doc_causal_attention(t["q"], k2, v2, ctx)  # 3 heads, 2 kv heads
        elif bad == "dim":
            doc_causal_attention(t["q"], t["k"][..., :2], t["v"], ctx)
        elif bad == "length":
            doc_causal_attention(t["q"][:, :4], t["k"][:, :4], t["v"][:, :4], ctx)
        else:
            compressed_attention(t["q"], t["k"], t["v"], ctx, ratio=0)


# ============================================================================ CP (real gloo groups)
CP_KWARGS = {
    "doc_causal": {},
    "compressed": {"ratio": 4, "window": 6},
    "sliding": {"window": 11},  # longer than a 4-rank shard (8): a halo from two ranks
}


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_matches_single_process(rank_pool, name, world_size):
    seq = 8 * world_size
    doc_ids = packing(seq, [3, seq - 9, 2], [seq])  # documents spanning every rank; pad tail
    inputs = attention_inputs(7, 2, seq, heads=4, kv_heads=2)
    grad_out = torch.randn(2, seq, 4, 4)
    fns.check_cp(rank_pool, name, world_size, inputs, doc_ids, CP_KWARGS[name], grad_out, FP32)


@pytest.mark.parametrize("name", OPS)
def test_cp_rank_holding_only_padding(rank_pool, name):
    """Rank 1 holds only pad tokens and its loss ignores them: it still joins every backward
    collective (RankPool fails on a hang or on unequal collective counts) and rank 0's
    gradients are exact."""
    doc_ids = packing(16, [3, 5])  # rank 1 (tokens 8..15) is all padding
    inputs = attention_inputs(8, 1, 16, heads=2, kv_heads=1)
    grad_out = torch.randn(1, 16, 2, 4) * (doc_ids != 0)[..., None, None]
    res = fns.check_cp(rank_pool, name, 2, inputs, doc_ids, CP_KWARGS[name], grad_out, FP32)
    assert torch.equal(res[1]["out"], torch.zeros_like(res[1]["out"]))


@pytest.mark.parametrize("name", ["compressed"])
def test_cp_error_is_raised_on_every_rank(rank_pool, name):
    doc_ids = packing(12, [12])
    msgs = rank_pool.run(fns.cp_error, 2, name, attention_inputs(0, 1, 12), doc_ids, {})
    assert all(m is not None and "local sequence length 6" in m for m in msgs)


# ============================================================================ torch.compile
@pytest.mark.parametrize("name", OPS)
def test_compile_single_process_no_recompile(name):
    packings = random_packings(21, 2, 16)
    inputs = attention_inputs(2, 2, 16, heads=2, kv_heads=1)
    grad_out = torch.randn(2, 16, 2, 4)
    frames, forbidden, worst, graphs = fns.compile_packings(
        name, inputs, packings, CP_KWARGS[name], grad_out, PackedContext
    )
    assert frames == 1, f"recompiled: {frames} frames over {len(packings)} packings"
    assert graphs >= 2 and forbidden == [], forbidden
    assert worst <= 1e-5


def test_compile_cp_two_ranks(rank_pool):
    packings = random_packings(20, 1, 16, seed=1)
    inputs = attention_inputs(3, 1, 16, heads=2, kv_heads=1)
    grad_out = torch.randn(1, 16, 2, 4)
    for name in OPS:
        kw = CP_KWARGS[name]
        res = rank_pool.run(fns.cp_compile_rank, 2, name, inputs, packings, kw, grad_out)
        for frames, forbidden, worst, graphs in res:
            assert frames == 1, (name, frames)
            assert graphs >= 2 and forbidden == [], (name, forbidden)
            assert worst <= 1e-5, (name, worst)


# ============================================================================ FlexAttention backend
FLEX_WARNINGS = pytest.mark.filterwarnings("ignore::UserWarning")


@FLEX_WARNINGS
@pytest.mark.parametrize("name,kwargs", CASES, ids=lambda x: str(x) if isinstance(x, dict) else x)
def test_flex_masks_equal_dense_masks_cpu(name, kwargs):
    """The Flex mask_mod and the dense masks agree (Flex forward runs on CPU without grad)."""
    for i, pack in enumerate(["straddling_blocks", "two_rows"]):
        doc_ids = packing(*PACKINGS[pack])
        inputs = attention_inputs(i, *doc_ids.shape, heads=4, kv_heads=2)
        want = _call(name, inputs, doc_ids, {**kwargs, "backend": "dense"})
        got = _call(name, inputs, doc_ids, {**kwargs, "backend": "flex"})
        torch.testing.assert_close(got, want, **FP32)


@FLEX_WARNINGS
@pytest.mark.slow  # ~30 s: tracing the FlexAttention higher-order op
def test_flex_compiles_without_recompiles_cpu():
    import torch._dynamo.testing

    inputs = attention_inputs(0, 2, 16)
    for name in ["compressed"]:  # the richest mask_mod; doc_causal traces the same helper
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        fn = torch.compile(fns.call_op, backend=counter, fullgraph=True)
        for doc_ids in random_packings(2, 2, 16, seed=4):
            got = fn(name, inputs, PackedContext(doc_ids), {**CP_KWARGS[name], "backend": "flex"})
            want = _call(name, inputs, doc_ids, {**CP_KWARGS[name], "backend": "dense"})
            torch.testing.assert_close(got, want, **FP32)
        assert counter.frame_count == 1, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", OPS)
def test_flex_cuda_matches_dense(name, dtype):
    """On CUDA the Flex backend (forward and q/k/v grads) equals the dense backend."""
    seq = 256
    doc_ids = packing(seq, [1, 60, 3, 100, 17, 50]).cuda()
    inputs = {n: x.cuda() for n, x in attention_inputs(0, 1, seq, 4, 2, 16, dtype).items()}
    grad_out = torch.randn(1, seq, 4, 16, device="cuda")
    kwargs = {"doc_causal": {}, "compressed": {"ratio": 4, "window": 8},
              "sliding": {"window": 40, "softcap": 3.0}}[name]  # fmt: skip
    want = fns.single_process(name, inputs, doc_ids, {**kwargs, "backend": "dense"}, grad_out)
    got = fns.single_process(name, inputs, doc_ids, kwargs, grad_out)  # auto: flex on CUDA
    tol = FP32 if dtype == torch.float32 else BF16
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else tol  # TF32-free, reordered sums
    for key in ("out",) + QKV:
        torch.testing.assert_close(got[key].float(), want[key].float(), **tol, msg=key)


@pytest.mark.gpu
@pytest.mark.parametrize("name", OPS)
def test_flex_cuda_compiled_no_recompile(name):
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    fn = torch.compile(fns.call_op, backend=counter, fullgraph=True)
    inputs = {n: x.cuda() for n, x in attention_inputs(0, 2, 128, 4, 2, 16).items()}
    for doc_ids in random_packings(20, 2, 128, seed=5):
        fn(name, inputs, PackedContext(doc_ids.cuda()), CP_KWARGS[name])
    assert counter.frame_count == 1


# ============================================================================ sliding window: sinks
def _with_sinks(inputs, doc_ids, seed=11):
    gen = torch.Generator().manual_seed(seed)
    heads = inputs["q"].shape[2]
    return {**inputs, "sinks": torch.randn(*doc_ids.shape, heads, generator=gen)}


@pytest.mark.parametrize("name,kwargs", [("sliding", {}), ("sliding", {"window": 2}),
                                         ("sliding", {"softcap": 1.0}), ("doc_causal", {})])
def test_sinks_match_reference(name, kwargs):
    """Per-query sinks (Inkling-style ``[B, L, H]``): outputs and the gradients of q/k/v and of
    the sinks equal the float64 definition."""
    doc_ids = packing(*PACKINGS["straddling_blocks"])
    inputs = _with_sinks(attention_inputs(2, *doc_ids.shape, heads=4, kv_heads=2), doc_ids)
    check_against_reference(name, inputs, doc_ids, kwargs)


def test_head_sinks_gradient_sums_over_queries():
    """A ``[heads]`` sink parameter (gpt-oss) is the per-query sink broadcast: same output, and
    its gradient is the per-query gradients summed over batch and sequence."""
    from fcp.ops.sliding_window import sliding_window_attention

    doc_ids = packing(20, [7, 9], [20])
    inputs = attention_inputs(4, 2, 20, heads=4, kv_heads=2)
    ctx = PackedContext(doc_ids)
    head = torch.randn(4, requires_grad=True)
    per_query = head.detach().expand(2, 20, 4).clone().requires_grad_()
    grad_out = torch.randn(2, 20, 4, 4)
    outs = [sliding_window_attention(inputs["q"], inputs["k"], inputs["v"], ctx, 5, sinks=s)
            for s in (head, per_query)]
    assert torch.equal(outs[0], outs[1])
    for out in outs:
        (out * grad_out).sum().backward()
    torch.testing.assert_close(head.grad, per_query.grad.sum((0, 1)), **FP32)
    assert head.grad.abs().min() > 0  # every head's sink matters


@pytest.mark.parametrize("world_size", [2, 4])
def test_sinks_cp_matches_single_process(rank_pool, world_size):
    """Under CP, per-query sinks' gradients stay on their query's rank."""
    seq = 8 * world_size
    doc_ids = packing(seq, [3, seq - 9, 2], [seq])
    inputs = _with_sinks(attention_inputs(7, 2, seq, heads=4, kv_heads=2), doc_ids)
    grad_out = torch.randn(2, seq, 4, 4)
    fns.check_cp(rank_pool, "sliding", world_size, inputs, doc_ids,
                 {"window": 11, "softcap": 2.0}, grad_out, FP32)  # fmt: skip


def test_halo_is_the_window_or_the_band():
    """``min(window, band) - 1`` tokens under CP (a key further back is outside the window or
    in an earlier document), none without CP."""
    from fcp.ops.sliding_window import halo_tokens

    doc_ids = packing(8192, [1000, 300, 2000])  # longest document 2000: band 2048
    cp = dict(group=_FakeGroup(), cp_size=2, cp_rank=1)
    assert halo_tokens(PackedContext(doc_ids, **cp), 6) == 5
    assert halo_tokens(PackedContext(doc_ids, **cp), 4096) == 2047
    assert halo_tokens(PackedContext(doc_ids, band=8192, **cp), 4096) == 4095
    assert halo_tokens(PackedContext(doc_ids), 4096) == 0


@pytest.mark.parametrize("window,halo", [(6, 5), (4096, 32)])
def test_each_rank_receives_only_the_halo(rank_pool, window, halo):
    """Measured bytes: rank 1 receives the halo's k and v (fp32, one kv head of dim 4 each)
    and nothing else (a window longer than the row: rank 0's 32 tokens); rank 0 receives
    nothing."""
    doc_ids = packing(64, [20, 12, 30])
    inputs = attention_inputs(0, 1, 64, heads=2, kv_heads=1, dim=4)
    got = rank_pool.run(fns.cp_bytes_rank, 2, "sliding", inputs, doc_ids, {"window": window})
    assert got == [0, halo * (4 + 4) * 4], got


@FLEX_WARNINGS
@pytest.mark.parametrize("name,kwargs", [("sliding", {"window": 3, "softcap": 2.0}),
                                         ("sliding", {"window": 100}), ("doc_causal", {})])
def test_flex_sinks_equal_dense_cpu(name, kwargs):
    """FlexAttention applies the sinks from its log-sum-exp (``out * sigmoid(lse - sink)``) and
    the soft-cap as a score_mod: the dense backend's result (forward; no CPU backward)."""
    doc_ids = packing(*PACKINGS["straddling_blocks"])
    inputs = _with_sinks(attention_inputs(5, *doc_ids.shape, heads=4, kv_heads=2), doc_ids)
    want = _call(name, inputs, doc_ids, {**kwargs, "backend": "dense"})
    got = _call(name, inputs, doc_ids, {**kwargs, "backend": "flex"})
    torch.testing.assert_close(got, want, **FP32)
