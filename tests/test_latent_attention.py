"""Unit tests of the latent-attention operator (GLM-5.3-Flash's DSA indexed MLA)."""

from __future__ import annotations

import pytest
import torch

from fcp.checks import ArgumentTypeError
from fcp.context import PackedContext
from fcp.ops.index_attention import index_attention
from fcp.ops.latent_attention import latent_attention
from fcp.ops.latent_attention.reference import latent_attention_reference
from tests import _latent_attention_rank_fns as fns
from tests.support.packing import packing, random_packings

HEADS, DK, DV, RANK = 3, 4, 2, 5


def inputs(seed: int, batch: int, seq: int, width: int = 5, bias: bool = True,
           dtype=torch.float32) -> dict:  # fmt: skip
    """q, latent, kv_weight (+ kv_bias) and indices with -1, future, other-document and
    out-of-range ids (the operator must drop them)."""
    g = torch.Generator().manual_seed(seed)
    t = {"q": torch.randn(batch, seq, HEADS, DK, generator=g),
         "latent": torch.randn(batch, seq, RANK, generator=g),
         "kv_weight": torch.randn(HEADS * (DK + DV), RANK, generator=g) / RANK**0.5}  # fmt: skip
    if bias:
        t["kv_bias"] = torch.randn(HEADS * (DK + DV), generator=g)
    t = {n: x.to(dtype) for n, x in t.items()}
    t["indices"] = torch.randint(-2, seq + 2, (batch, seq, width), generator=g)
    return t


def test_equals_index_attention_of_the_expanded_latent():
    """What the GLM-5.3-Flash mixer computed before the operator existed (expand with
    ``kv_b_proj``, then ``index_attention(kv="global")``), bitwise, forward and backward."""
    t = inputs(0, 2, 12)
    ctx = PackedContext(packing(12, [5, 1, 6], [3, 4]))
    grad_out = torch.randn(2, 12, HEADS, DV, generator=torch.Generator().manual_seed(1))

    def old(q, latent, w, b):
        kv = torch.nn.functional.linear(latent, w, b).view(2, 12, HEADS, DK + DV)
        k, v = kv.split([DK, DV], -1)
        return index_attention(q, k, v, t["indices"], ctx, scale=0.3, kv="global")

    def new(q, latent, w, b):
        return latent_attention(q, latent, w, t["indices"], ctx, kv_bias=b, scale=0.3)

    results = []
    for fn in (old, new):
        leaves = [t[n].clone().requires_grad_() for n in ("q", "latent", "kv_weight", "kv_bias")]
        out = fn(*leaves)
        (out * grad_out).sum().backward()
        results.append([out.detach()] + [x.grad for x in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_single_process_equals_the_reference_and_pads_get_zeros():
    t = inputs(2, 2, 10, bias=False)
    doc_ids = packing(10, [4, 3], [10])
    ctx = PackedContext(doc_ids)
    out = latent_attention(t["q"], t["latent"], t["kv_weight"], t["indices"], ctx, query_chunk=3)
    want = latent_attention_reference(t["q"], t["latent"], t["kv_weight"], t["indices"], ctx)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert not out[doc_ids == 0].any()  # the pad tail of row 0


def test_a_rotary_key_is_each_heads_last_channels():
    """``k_rope`` equals expanding the latent per head and appending the shared rotary key to
    every head's key (index_attention over that), forward and every gradient."""
    rope, nope = 2, DK - 2
    t = inputs(3, 2, 12, bias=True)
    g = torch.Generator().manual_seed(4)
    t["kv_weight"] = torch.randn(HEADS * (nope + DV), RANK, generator=g)
    t["kv_bias"] = torch.randn(HEADS * (nope + DV), generator=g)
    t["k_rope"] = torch.randn(2, 12, rope, generator=g)
    ctx = PackedContext(packing(12, [5, 1, 6], [3, 4]))
    grad_out = torch.randn(2, 12, HEADS, DV, generator=g)

    def expanded(q, latent, w, b, kr):
        kv = torch.nn.functional.linear(latent, w, b).view(2, 12, HEADS, nope + DV)
        k, v = kv.split([nope, DV], -1)
        k = torch.cat([k, kr[:, :, None].expand(-1, -1, HEADS, -1)], -1)
        return index_attention(q, k, v, t["indices"], ctx, scale=0.3, kv="global")

    def operator(q, latent, w, b, kr):
        return latent_attention(q, latent, w, t["indices"], ctx, kv_bias=b, k_rope=kr, scale=0.3)

    results = []
    for fn in (expanded, operator):
        names = ("q", "latent", "kv_weight", "kv_bias", "k_rope")
        leaves = [t[n].clone().requires_grad_() for n in names]
        out = fn(*leaves)
        (out * grad_out).sum().backward()
        results.append([out.detach()] + [x.grad for x in leaves])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="k_rope"):
        latent_attention(t["q"], t["latent"], t["kv_weight"], t["indices"], ctx,
                         k_rope=torch.zeros(2, 12, DK))  # fmt: skip


def test_rejects_bad_arguments():
    t = inputs(0, 1, 4)
    ctx = PackedContext(torch.ones(1, 4, dtype=torch.long))
    q, c, w, ids = t["q"], t["latent"], t["kv_weight"], t["indices"]
    with pytest.raises(ArgumentTypeError, match="latent_attention: q must be"):
        latent_attention(q.long(), c, w, ids, ctx)
    with pytest.raises(ValueError, match=r"latent must have shape \[batch, local_seq, rank\]"):
        latent_attention(q, c[:, :3], w, ids, ctx)
    with pytest.raises(ValueError, match="kv_weight must have shape"):
        latent_attention(q, c, w[:, :2], ids, ctx)
    with pytest.raises(ValueError, match=r"kv_weight \(16, 5\) must have heads \* \(Dk - R \+ Dv\)"):
        latent_attention(q, c, w[:16], ids, ctx)
    with pytest.raises(ValueError, match="kv_bias"):
        latent_attention(q, c, w, ids, ctx, kv_bias=t["kv_bias"][:3])
    with pytest.raises(ArgumentTypeError, match="indices"):
        latent_attention(q, c, w, ids.float(), ctx)
    with pytest.raises(ValueError, match="width >= 1"):
        latent_attention(q, c, w, ids[..., :0], ctx)
    with pytest.raises(ValueError, match="query_chunk"):
        latent_attention(q, c, w, ids, ctx, query_chunk=0)
    with pytest.raises(ValueError, match="backend"):
        latent_attention(q, c, w, ids, ctx, backend="flex")
    with pytest.raises(ArgumentTypeError, match="ctx must be a PackedContext"):
        latent_attention(q, c, w, ids, None)


def test_compiled_on_ranks_is_one_graph_across_packings(rank_pool):
    """2 ranks, ``fullgraph=True``, forward and backward: four packings compile once, equal
    eager and synchronise nothing."""
    t = inputs(3, 1, 8)
    grad_out = torch.randn(1, 8, HEADS, DV, generator=torch.Generator().manual_seed(4))
    doc_ids_list = random_packings(4, 1, 8, seed=2)
    for frames, syncs, worst, _ in rank_pool.run(fns.cp_compile_rank, 2, t, doc_ids_list,
                                                 grad_out):  # fmt: skip
        assert (frames, syncs) == (1, []) and worst < 1e-5


def test_nan_in_one_document_changes_no_other_document():
    """NaN in document 2's latent and queries: every other token's output and q / latent
    gradients are bitwise those of a clean run."""
    t = inputs(5, 1, 12)
    doc_ids = packing(12, [4, 5, 3])
    ctx, poisoned = PackedContext(doc_ids), doc_ids == 2
    grad_out = torch.randn(1, 12, HEADS, DV, generator=torch.Generator().manual_seed(6))
    runs = []
    for bad in (False, True):
        q, c = t["q"].clone(), t["latent"].clone()
        if bad:
            q[poisoned], c[poisoned] = float("nan"), float("nan")
        q.requires_grad_(), c.requires_grad_()
        out = latent_attention(q, c, t["kv_weight"], t["indices"], ctx, kv_bias=t["kv_bias"])
        (out * grad_out).sum().backward()
        runs.append((out.detach()[~poisoned], q.grad[~poisoned], c.grad[~poisoned]))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bias, rope", [(True, 0), (False, 2)])
def test_custom_ops_pass_opcheck(bias, rope):
    """``fcp::latent_attention_fwd`` / ``_bwd`` and the kernel they call
    (``fcp::index_attention_fwd`` / ``_bwd``): schemas, fake kernels, autograd registration."""
    from fcp.ops.kit.gather import index_attention_bwd, index_attention_fwd, selected_slots
    from fcp.ops.latent_attention.gather import latent_attention_bwd, latent_attention_fwd

    g = torch.Generator().manual_seed(7)
    doc_ids = packing(8, [3, 5])
    scale = torch.tensor(0.3, dtype=torch.float64)
    q = torch.randn(1, 6, HEADS, DK, generator=g, requires_grad=True)  # tokens 2..7
    full = torch.randn(1, 8, RANK + rope, generator=g, requires_grad=True)
    w = torch.randn(HEADS * (DK - rope + DV), RANK, generator=g, requires_grad=True)
    b = torch.randn(HEADS * (DK - rope + DV), generator=g, requires_grad=True) if bias else None
    ids = torch.randint(-1, 8, (1, 6, 3), generator=g)
    args = (q, full, w, b, ids, doc_ids, 2, 8, scale, rope, 0)
    torch.library.opcheck(latent_attention_fwd, args)
    out, lse = latent_attention_fwd(*args)
    plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    grad = torch.randn(out.shape, generator=g)
    torch.library.opcheck(latent_attention_bwd, (grad, *plain[:6], out.detach(), lse.detach(),
                                                 *plain[6:]))  # fmt: skip
    kvh = torch.randn(1, HEADS, 8, DK + DV, generator=g, requires_grad=True)
    slots, valid = selected_slots(ids, doc_ids, 2)
    torch.library.opcheck(index_attention_fwd, (q, kvh, slots, valid, scale, DK, 4))
    out, lse = (t.detach() for t in index_attention_fwd(q, kvh, slots, valid, scale, DK, 4))
    torch.library.opcheck(index_attention_bwd, (grad, q.detach(), kvh.detach(), slots, valid,
                                                out, lse, scale, DK, 4))  # fmt: skip


def test_a_dynamic_compile_keeps_a_module_scale_symbolic():
    """Under ``torch.compile(dynamic=True)`` a module's float attribute (``self.scaling``) is a
    symbolic float. It reaches the kernels as a tensor (a custom op's ``float`` argument
    would specialise it and restart Dynamo's trace of the whole frame), so the layer compiles
    in one attempt, a new scale neither recompiles nor is lost, and the results equal eager."""
    import torch._dynamo.testing

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scaling = 0.3

        def forward(self, q, latent, w, ids, ctx):
            return latent_attention(q, latent, w, ids, ctx, scale=self.scaling)

    t = inputs(8, 1, 10)
    ctx = PackedContext(packing(10, [4, 6]))
    args = (t["q"], t["latent"], t["kv_weight"], t["indices"], ctx)
    layer = Layer()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for scaling in (0.3, 0.7):
        layer.scaling = scaling
        assert torch.equal(compiled(*args), layer(*args))
    assert counter.frame_count == 1
    assert torch._dynamo.utils.counters["aot_autograd"]["total"] == 1  # no restarted attempt
