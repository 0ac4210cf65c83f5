"""Unit tests for fcp.ops.index_attention.

The operator against its float64 reference (forward, q/k/v gradients; GQA and MLA head layouts,
``kv="local"`` and ``kv="global"``, bf16), set semantics (order and repeats of the indices do not
matter, bitwise), empty selections, query chunking, document and NaN isolation, argument
errors, CP on real gloo groups, torch.compile without recompiles or host syncs, and (gpu) CUDA
against CPU. Hypothesis properties: property_tests/test_index_properties.py.
"""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.index_attention import index_attention
from fcp.ops.kit import gather
from fcp.ops.index_attention.reference import index_attention_reference
from tests import _attention_rank_fns as fns
from tests._attention_rank_fns import one_thread  # noqa: F401 (autouse fixture)
from tests.support.inputs import QKV, index_inputs
from tests.support.packing import EDGE_PACKINGS, packing, random_packings

FP32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=2e-2, rtol=2e-2)


def run_reference(inputs, doc_ids, grad_out, scale=None):
    t = {n: inputs[n].detach().double().requires_grad_() for n in QKV}
    out = index_attention_reference(t["q"], t["k"], t["v"], inputs["indices"], doc_ids, scale)
    (out * grad_out.double()).sum().backward()
    return {"out": out.detach(), **{n: t[n].grad for n in QKV}}


LAYOUTS = {
    "gqa": dict(heads=4, kv_heads=2, dim=8, dv=8),
    "mla": dict(heads=2, kv_heads=2, dim=8, dv=6),  # per-head keys and values, Dv != D
    "mqa": dict(heads=3, kv_heads=1, dim=4, dv=5),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("pack", list(EDGE_PACKINGS))
def test_matches_reference(pack, layout):
    doc_ids = packing(*EDGE_PACKINGS[pack])
    inputs = index_inputs(1, *doc_ids.shape, width=7, **LAYOUTS[layout])
    grad_out = torch.randn(*inputs["q"].shape[:3], inputs["v"].shape[3])
    want = run_reference(inputs, doc_ids, grad_out, scale=0.4)
    for name in ("attn", "attn_global"):
        got = fns.single_process(name, inputs, doc_ids, {"scale": 0.4}, grad_out)
        for key in ("out",) + QKV:
            torch.testing.assert_close(got[key].double(), want[key], **FP32, msg=f"{name} {key}")


def test_bf16():
    doc_ids = packing(16, [6, 1, 7])
    inputs = index_inputs(3, 1, 16, dtype=torch.bfloat16)
    grad_out = torch.randn(1, 16, 4, 6)
    want = run_reference(inputs, doc_ids, grad_out)
    got = fns.single_process("attn", inputs, doc_ids, {}, grad_out)
    for key in ("out",) + QKV:
        assert got[key].dtype == torch.bfloat16
        torch.testing.assert_close(got[key].double(), want[key], **BF16, msg=key)


def _call(inputs, doc_ids, **kw):
    return index_attention(inputs["q"], inputs["k"], inputs["v"], inputs["indices"],
                           PackedContext(doc_ids), **kw)  # fmt: skip


def test_order_and_repeats_do_not_matter_bitwise():
    doc_ids = packing(24, [10, 14])
    inputs = index_inputs(4, 1, 24, width=5)
    base = _call(inputs, doc_ids)
    g = torch.Generator().manual_seed(0)
    perm = torch.argsort(torch.rand(1, 24, 5, generator=g), -1)
    shuffled = dict(inputs, indices=inputs["indices"].gather(-1, perm))
    assert torch.equal(_call(shuffled, doc_ids), base)
    repeated = dict(inputs, indices=torch.cat([inputs["indices"], inputs["indices"].flip(-1)], -1))
    assert torch.equal(_call(repeated, doc_ids), base)
    as_int32 = dict(inputs, indices=inputs["indices"].int())
    assert torch.equal(_call(as_int32, doc_ids), base)


def test_empty_selection_gives_zeros_and_no_gradient():
    doc_ids = packing(12, [4, 5])  # tokens 9..11 are padding
    inputs = index_inputs(0, 1, 12)
    inputs["indices"][:, :6] = -1  # real queries that select nothing
    inputs["indices"][:, 6, :] = 2  # another document only: dropped
    for n in QKV:
        inputs[n].requires_grad_()
    out = _call(inputs, doc_ids)
    empty = [0, 1, 2, 3, 4, 5, 6, 9, 10, 11]
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    out[:, empty].sum().backward()
    for n in QKV:
        assert torch.equal(inputs[n].grad, torch.zeros_like(inputs[n].grad)), n


def test_query_chunks_change_nothing_bitwise():
    doc_ids = packing(32, [9, 20, 3], [32])
    inputs = index_inputs(5, 2, 32, width=9)
    grad_out = torch.randn(2, 32, 4, 6)
    whole = fns.single_process("attn", inputs, doc_ids, {}, grad_out)
    assert gather.chunk_rows(9, 4, 2, 8, 6, 32) == 32  # one chunk by default here
    chunked = fns.single_process("attn", inputs, doc_ids, {"query_chunk": 5}, grad_out)
    for key in ("out",) + QKV:
        assert torch.equal(whole[key], chunked[key]), key


def test_isolation_and_nonfinite_values_bitwise():
    """Another document's inputs (perturbed, NaN, inf) and output gradients (NaN) change no
    output or gradient outside it."""
    doc_ids = packing(24, [5, 7, 1, 6, 3])
    inputs = index_inputs(6, 1, 24, width=8)
    inputs["indices"] = torch.randint(0, 24, (1, 24, 8), generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(1, 24, 4, 6)
    base = fns.single_process("attn", inputs, doc_ids, {}, grad_out)
    for d, value in [(2, None), (4, float("nan")), (1, float("inf"))]:
        mine = doc_ids[0] == d
        new = {n: x.clone() for n, x in inputs.items()}
        for n in QKV:
            new[n][:, mine] = torch.randn(new[n][:, mine].shape) if value is None else value
        g = grad_out.clone()
        g[:, mine] = float("nan")
        got = fns.single_process("attn", new, doc_ids, {}, g)
        for key in ("out",) + QKV:
            assert torch.equal(got[key][:, ~mine], base[key][:, ~mine]), (d, key)


@pytest.mark.parametrize("bad", ["kv_heads", "dim", "length", "indices_dtype", "indices_shape",
                                 "global_length", "kv_mode", "backend"])  # fmt: skip
def test_bad_arguments(bad):
    doc_ids = packing(8, [8])
    t = index_inputs(0, 1, 8, heads=3, kv_heads=1)
    q, k, v, idx = t["q"], t["k"], t["v"], t["indices"]
    ctx = PackedContext(doc_ids)
    cases = {
        "kv_heads": lambda: index_attention(q, k.expand(-1, -1, 2, -1), v.expand(-1, -1, 2, -1),
                                            idx, ctx),
        "dim": lambda: index_attention(q, k[..., :2], v, idx, ctx),
        "length": lambda: index_attention(q[:, :4], k[:, :4], v[:, :4], idx[:, :4], ctx),
        "indices_dtype": lambda: index_attention(q, k, v, idx.float(), ctx),
        "indices_shape": lambda: index_attention(q, k, v, idx[..., 0], ctx),
        "global_length": lambda: index_attention(q, k[:, :4], v[:, :4], idx, ctx, kv="global"),
        "kv_mode": lambda: index_attention(q, k, v, idx, ctx, kv="remote"),
        "backend": lambda: index_attention(q, k, v, idx, ctx, backend="flex"),
    }  # fmt: skip
    with pytest.raises(ValueError):
        cases[bad]()


# ============================================================================ CP (real gloo groups)
@pytest.mark.parametrize("name", ["attn", "attn_global"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_matches_single_process(rank_pool, name, world_size):
    seq = 8 * world_size
    doc_ids = packing(seq, [3, seq - 9, 2], [seq])  # documents spanning every rank; pad tail
    inputs = index_inputs(7, 2, seq, width=6)
    gen = torch.Generator().manual_seed(2)
    inputs["indices"] = torch.randint(0, seq, (2, seq, 6), generator=gen)
    grad_out = torch.randn(2, seq, 4, 6)
    fns.check_cp(rank_pool, name, world_size, inputs, doc_ids, {}, grad_out, FP32)


def test_cp_rank_holding_only_padding(rank_pool):
    """Rank 1 holds only pad tokens: it still joins the K/V backward collective (RankPool fails
    on a hang or unequal collective counts), its outputs are zeros, rank 0's grads exact."""
    doc_ids = packing(16, [3, 5])
    inputs = index_inputs(8, 1, 16)
    grad_out = torch.randn(1, 16, 4, 6) * (doc_ids != 0)[..., None, None]
    res = fns.check_cp(rank_pool, "attn", 2, inputs, doc_ids, {}, grad_out, FP32)
    assert torch.equal(res[1]["out"], torch.zeros_like(res[1]["out"]))


@pytest.mark.parametrize("name", ["attn", "attn_global"])
def test_cp_bytes(rank_pool, name):
    """``kv="local"``: one all-gather of K and V (fp32 here); ``kv="global"``: none by the
    operator (the job's own all-gathers of k and v: the same bytes, the caller's choice)."""
    doc_ids = packing(24, [5, 19])
    inputs = index_inputs(1, 1, 24)  # kv_heads 2, D 8, Dv 6
    got = rank_pool.run(fns.cp_bytes_rank, 3, name, inputs, doc_ids, {})
    assert got == [2 * 8 * 2 * (8 + 6) * 4] * 3


# ============================================================================ torch.compile
def test_compile_single_process_no_recompile():
    packings = random_packings(6, 2, 16)
    inputs = index_inputs(2, 2, 16)
    grad_out = torch.randn(2, 16, 4, 6)
    for name in ("attn", "glm", "qsa_attn"):
        frames, forbidden, worst, graphs = fns.compile_packings(
            name, inputs, packings, {}, grad_out, PackedContext
        )
        assert frames == 1, f"{name} recompiled: {frames} frames over {len(packings)} packings"
        assert graphs >= 2 and forbidden == [], (name, forbidden)
        assert worst <= 1e-5, (name, worst)


def test_compile_cp_two_ranks(rank_pool):
    packings = random_packings(4, 1, 16, seed=1)
    inputs = index_inputs(3, 1, 16)
    grad_out = torch.randn(1, 16, 4, 6)
    for name in ("attn", "glm"):
        res = rank_pool.run(fns.cp_compile_rank, 2, name, inputs, packings, {}, grad_out)
        for frames, forbidden, worst, graphs in res:
            assert frames == 1 and graphs >= 2 and forbidden == [], (name, frames, forbidden)
            assert worst <= 1e-5, (name, worst)


# ============================================================================ CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["attn", "glm", "qsa_attn"])
def test_cuda_matches_cpu(name, dtype):
    """The gather backend on CUDA (forward, q/k/v grads) equals the same code on CPU."""
    seq = 256
    doc_ids = packing(seq, [1, 60, 3, 100, 17, 50])
    inputs = index_inputs(0, 1, seq, 4, 2, 32, 32, 24, dtype=dtype)
    grad_out = torch.randn(1, seq, 4, 32)
    kw = {"topk": 16, "kpool": 4, "budget": 16, "ratio": 4}
    want = fns.single_process(name, inputs, doc_ids, kw, grad_out)
    cuda = {n: x.cuda() for n, x in inputs.items()}
    got = fns.single_process(name, cuda, doc_ids.cuda(), kw, grad_out.cuda())
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else BF16
    for key in ("out",) + QKV:
        torch.testing.assert_close(got[key].cpu().float(), want[key].float(), **tol, msg=key)


@pytest.mark.gpu
def test_cuda_compiled_inductor_no_recompile():
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    fn = torch.compile(fns.call_op, backend=counter, fullgraph=True)
    inputs = {n: x.cuda() for n, x in index_inputs(0, 2, 128, 4, 2, 16, 16, 24).items()}
    for doc_ids in random_packings(6, 2, 128, seed=5):
        ctx = PackedContext(doc_ids.cuda())
        for name in ("attn", "glm", "qsa_attn"):
            got = fn(name, inputs, ctx, {"topk": 16, "budget": 16})
            want = fns.call_op(name, inputs, ctx, {"topk": 16, "budget": 16})
            torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    assert counter.frame_count == 3  # one graph per operator, none per packing
