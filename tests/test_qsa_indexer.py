"""Unit tests for fcp.ops.qsa_indexer (Qwen3.8-Flash-Next's QSA selection) and QSA's attention.

The selection against NeMo AutoModel's own indexer module (``Qwen3_8_FlashNextQSAIndexer``, packed
per-document path: ``select_qsa_token_ids`` per document) in fp32 and bf16 with tie rows
counted and exempt, index attention against NeMo's ``gathered_qsa_gqa_attention`` per document
(forward and q/k/v gradients, GQA), the per-token pieces (RMSNorm, RoPE) bitwise against
NeMo's, the dense phase and the tie rule. Against its float64 reference, under CP (blocks
straddling ranks) and compiled: tests/test_indexers.py (both indexers).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.index_attention import index_attention
from fcp.ops.kit.norms import rope_tables, rotate_half_rope, zero_centered_rms_norm
from fcp.ops.qsa_indexer import qsa_indexer
from fcp.ops.qsa_indexer.reference import qsa_indexer_reference
from tests import _attention_rank_fns as fns
from tests._attention_rank_fns import one_thread  # noqa: F401 (autouse fixture)
from tests.support.inputs import QKV, index_inputs
from tests.support.packing import packing

FP32 = dict(atol=1e-5, rtol=1e-5)


def _args(inputs, doc_ids, rotary=fns.ROTARY):
    positions = PackedContext(doc_ids).position_ids
    cos, sin = rope_tables(positions, rotary, dtype=inputs["index_q"].dtype)
    return [inputs["index_q"], inputs["index_k"], inputs["q_norm"], inputs["k_norm"], cos, sin]


def test_dense_phase_is_causal_and_ties_go_to_the_earlier_block():
    """Rows with t < (K+1)c - 1 hold exactly the document's tokens 0..t in order; with all
    scores 0 (zero index queries), sparse rows take the K earliest blocks, ascending."""
    doc_ids = packing(40, [5, 35])
    inputs = index_inputs(0, 1, 40)
    inputs["index_q"].zero_()
    got = qsa_indexer(*_args(inputs, doc_ids), PackedContext(doc_ids), budget=8, ratio=4)
    for t in range(5, 5 + 11):  # document 2, positions 0..10 (first sparse position: 11)
        row = got[0, t].tolist()
        assert row == list(range(5, t + 1)) + [-1] * (11 - (t + 1 - 5)), t
    assert got[0, 16].tolist() == [5, 6, 7, 8, 9, 10, 11, 12, -1, -1, -1]  # t = 11, 3 blocks
    assert got[0, 17].tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 17, -1, -1]  # then the tail
    assert got[0, 39].tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 37, 38, 39]


def test_bad_arguments():
    doc_ids = packing(8, [8])
    args = _args(index_inputs(0, 1, 8), doc_ids)
    ctx = PackedContext(doc_ids)
    with pytest.raises(ValueError, match="multiple"):
        qsa_indexer(*args, ctx, budget=6, ratio=4)
    with pytest.raises(ValueError, match="rotary"):
        qsa_indexer(*args[:4], args[4].repeat(1, 1, 3), args[5].repeat(1, 1, 3), ctx, budget=8,
                    ratio=4)  # fmt: skip
    with pytest.raises(ValueError, match="index_k"):
        qsa_indexer(args[0], args[1][..., :3], *args[2:], ctx, budget=8, ratio=4)


# ============================================================================ NeMo AutoModel
@pytest.fixture(scope="module")
def nemo_qsa():
    return pytest.importorskip("nemo_automodel.components.models.qwen3_8_flash_next.qsa")


def _nemo_indexer(nq, dtype, hidden=32, heads=4, dim=16, budget=16, ratio=4):
    from nemo_automodel.components.models.common import BackendConfig

    cfg = SimpleNamespace(hidden_size=hidden, indexer_n_heads=heads, indexer_kv_heads=1,
                          indexer_head_dim=dim, indexer_budget=budget,
                          indexer_compress_ratio=ratio, torch_dtype=dtype, rms_norm_eps=1e-6)
    backend = BackendConfig(linear="torch", attn="sdpa", rms_norm="torch", rope_fusion=False,
                            experts="torch", dispatcher="torch")  # fmt: skip
    torch.manual_seed(0)
    ix = nq.Qwen3_8_FlashNextQSAIndexer(cfg, backend).to(dtype)
    with torch.no_grad():
        for n, p in ix.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in n else 0.2))
    return ix, cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selection_matches_nemo_per_document(nemo_qsa, dtype):
    """NeMo's indexer on a packed row (``cu_seqlens``: each document selected on its own) and
    fcp's on the same row give the same ids, in the same order, on every row without a tie at
    NeMo's ``torch.topk`` cutoff (counted and printed)."""
    ix, cfg = _nemo_indexer(nemo_qsa, dtype)
    lens = [37, 5, 64, 23, 2]
    seq = sum(lens)
    doc_ids = packing(seq, lens)
    ctx = PackedContext(doc_ids)
    x = torch.randn(1, seq, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    cos, sin = rope_tables(ctx.position_ids, 8, dtype=dtype)  # rotary 8 of index dim 16
    with torch.no_grad():
        nemo = ix(x, freqs_cis=torch.cat([cos, sin], -1),
                  cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])).long()
        proj = ix.index_qk_proj(x)
    hi, di = cfg.indexer_n_heads, cfg.indexer_head_dim
    args = [proj[..., : hi * di].view(1, seq, hi, di), proj[..., hi * di :],
            ix.q_layernorm.weight, ix.k_layernorm.weight, cos, sin]  # fmt: skip
    kw = dict(budget=cfg.indexer_budget, ratio=cfg.indexer_compress_ratio, eps=cfg.rms_norm_eps)
    got = qsa_indexer(*args, ctx, **kw)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    _, near, exact = qsa_indexer_reference(*args, doc_ids, **kw, tol=tol)
    tie = (near | exact)[0]
    same = (got == nemo).all(-1)[0]
    assert same[~tie].all(), (~same & ~tie).nonzero().flatten().tolist()
    print(f"\nQSA selection vs NeMo ({dtype}): {int(same.sum())}/{seq} rows identical, "
          f"{int(tie.sum())} tie rows exempt ({int((tie & ~same).sum())} of them differ)")
    assert tie.sum() < seq // 4


def test_per_token_pieces_equal_nemo_bitwise(nemo_qsa):
    from nemo_automodel.components.models.qwen3_next.layers import Qwen3NextRMSNorm

    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 5, 3, 16, generator=g).to(dtype)
        norm = Qwen3NextRMSNorm(16, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(16, generator=g))
            assert torch.equal(zero_centered_rms_norm(x, norm.weight, 1e-6), norm(x))
        cos, sin = rope_tables(torch.arange(5).expand(2, 5), 8, dtype=dtype)
        want = nemo_qsa.apply_qsa_rope(x, torch.cat([cos, sin], -1))
        assert torch.equal(rotate_half_rope(x, cos[:, :, None], sin[:, :, None]), want)


def test_attention_matches_nemo_per_document(nemo_qsa):
    """QSA's attention: fcp's index_attention on the packed row (GQA, global ids from the QSA
    indexer) equals NeMo's gathered_qsa_gqa_attention on each document alone (document-local
    ids), forward and q/k/v gradients."""
    lens = [29, 3, 40]
    seq = sum(lens) + 2
    doc_ids = packing(seq, lens)
    inputs = index_inputs(5, 1, seq, heads=6, kv_heads=2, dim=8, dv=8)
    ctx = PackedContext(doc_ids)
    ids = qsa_indexer(*_args(inputs, doc_ids), ctx, budget=8, ratio=4)
    grad_out = torch.randn(1, seq, 6, 8)
    t = {n: inputs[n].clone().requires_grad_() for n in QKV}
    out = index_attention(t["q"], t["k"], t["v"], ids, ctx)
    (out * grad_out).sum().backward()
    n = {n_: inputs[n_].clone().requires_grad_() for n_ in QKV}
    start, parts = 0, []
    for length in lens:
        sl = slice(start, start + length)
        local = torch.where(ids[:, sl] >= 0, ids[:, sl] - start, -1)
        parts.append(nemo_qsa.gathered_qsa_gqa_attention(n["q"][:, sl], n["k"][:, sl],
                                                         n["v"][:, sl], local))  # fmt: skip
        start += length
    nemo = torch.cat(parts, 1)
    (nemo * grad_out[:, :start]).sum().backward()
    torch.testing.assert_close(out[:, :start], nemo, **FP32)
    assert torch.equal(out[:, start:], torch.zeros_like(out[:, start:]))  # pad queries
    for key in QKV:
        torch.testing.assert_close(t[key].grad, n[key].grad, **FP32, msg=key)


# ============================================================================ CP, compile, CUDA
@pytest.mark.gpu
def test_cuda_matches_cpu():
    doc_ids = packing(256, [1, 60, 3, 100, 17, 50])
    inputs = index_inputs(0, 1, 256, index_heads=4, index_dim=32)
    args = _args(inputs, doc_ids, rotary=16)
    kw = dict(budget=32, ratio=4)
    want = qsa_indexer(*args, PackedContext(doc_ids), **kw)
    got = qsa_indexer(*[a.cuda() for a in args], PackedContext(doc_ids.cuda()), **kw)
    _, near, _ = qsa_indexer_reference(*args, doc_ids, **kw)
    assert not ((got.cpu() != want).any(-1) & ~near).any()
