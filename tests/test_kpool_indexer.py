"""Unit tests for fcp.ops.kpool_indexer (GLM-5.3-Flash's DSA k-pool indexer).

The operator against transformers' ``Glm5NextTextIndexer`` run on each document alone (tie
rows counted and exempt), the tie rule, the doc_pools slot table, no gradient, argument errors.
Against its float64 reference, under CP and compiled: tests/test_indexers.py (both indexers).
Properties: property_tests/test_index_properties.py.
"""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.kit.pools import pool_slots
from fcp.ops.kpool_indexer import kpool_indexer
from fcp.ops.kpool_indexer.reference import kpool_indexer_reference
from tests import _attention_rank_fns as fns
from tests._attention_rank_fns import one_thread  # noqa: F401 (autouse fixture)
from tests.support.inputs import index_inputs
from tests.support.packing import packing

def _args(inputs):
    return [inputs[n] for n in fns.KPOOL_INPUTS]


def test_pool_slots_worked_example():
    doc_ids = torch.tensor([[1] * 6 + [2] * 9 + [0]])
    assert pool_slots(doc_ids, 4, 2).tolist() == [[3, -1, 9, 13]]
    # slots are position-aligned (slot c of a rank: its local positions [4c, 4c + 4))
    assert pool_slots(doc_ids, 4, 1).tolist() == [[3, -1, 9, 13]]


def test_ties_go_to_the_earlier_pool():
    """Zero index keys: every score is exactly 0, so the earliest visible pools win (in
    ascending order), and the tail follows."""
    doc_ids = packing(20, [3, 17])
    inputs = index_inputs(0, 1, 20, kpool=2)
    inputs["index_k"].zero_()
    got = kpool_indexer(*_args(inputs), PackedContext(doc_ids), topk=4, kpool=2)
    # doc 1 (3 tokens) has one complete pool: the tail follows one pool slot (transformers)
    assert got[0, 0].tolist() == [-1, -1, 0, -1, -1]  # no complete pool yet: the tail
    assert got[0, 2].tolist() == [0, 1, 2, -1, -1]  # doc 1's only pool, then the tail
    assert got[0, 4].tolist() == [3, 4, -1, -1, -1]  # doc 2's first pool (tokens 3, 4)
    assert got[0, 10].tolist() == [3, 4, 5, 6, -1]  # the two earliest of 4 pools
    assert got[0, 19].tolist() == [3, 4, 5, 6, 19]
    want, near, exact = kpool_indexer_reference(*_args(inputs), doc_ids, topk=4, kpool=2)
    assert torch.equal(got, want) and exact.any()


def test_no_gradient_and_pad_rows():
    doc_ids = packing(12, [4, 5])
    inputs = index_inputs(1, 1, 12)
    for n in fns.KPOOL_INPUTS:
        inputs[n].requires_grad_()
    got = kpool_indexer(*_args(inputs), PackedContext(doc_ids), topk=4, kpool=4)
    assert not got.requires_grad and got.dtype == torch.int64
    assert (got[0, 9:] == -1).all()  # pad queries


@pytest.mark.parametrize("bad", ["topk_multiple", "kpool", "index_k", "ape", "weights", "dtype"])
def test_bad_arguments(bad):
    doc_ids = packing(8, [8])
    t = index_inputs(0, 1, 8)
    args = _args(t)
    kw = dict(topk=8, kpool=4)
    if bad == "topk_multiple":
        kw["topk"] = 6
    elif bad == "kpool":
        kw["kpool"] = 0
    elif bad == "index_k":
        args[1] = args[1][..., None]
    elif bad == "ape":
        args[3] = args[3][:3]
    elif bad == "weights":
        args[4] = args[4][..., :1]
    else:
        args[0] = args[0].long()
    with pytest.raises(ValueError):
        kpool_indexer(*args, PackedContext(doc_ids), **kw)


# ============================================================================ transformers
@pytest.fixture(scope="module")
def hf_indexer():
    """A tiny ``Glm5NextTextIndexer`` with random weights (its pool gate and position embedding
    start at zero in transformers: perturbed so every term matters). Only the indexer module is
    used: it needs neither FLA nor the model's KDA kernels."""
    glm = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    cfg = Glm5NextTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, index_topk=8, index_head_dim=8,
        index_n_heads=4, index_kpool=4, linear_head_dim=8, linear_num_heads=2,
        linear_conv_kernel_dim=4, hc_mult=2, hc_sinkhorn_iters=3, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    ix = glm.Glm5NextTextIndexer(cfg, 3).eval()
    with torch.no_grad():
        for p in ix.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return ix, cfg


def test_matches_transformers_per_document(hf_indexer):
    """fcp on a packed row (and on two ranks' worth of layout, via the property tests) equals
    transformers' indexer run on each document alone (ids offset by the document start), on
    every row without a tie that transformers' ``torch.topk`` may break either way."""
    ix, cfg = hf_indexer
    lens = [37, 5, 64, 3, 23]
    seq = sum(lens) + 4
    doc_ids = packing(seq, lens)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, seq, cfg.hidden_size, generator=g)
    q_resid = torch.randn(1, seq, cfg.q_lora_rank, generator=g)
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    with torch.no_grad():
        args = (
            ix.wq_b(q_resid).view(1, seq, hi, di),
            ix.k_norm(ix.wk(x)),
            torch.nn.functional.linear(x, ix.index_kpool_compress_gate),
            ix.index_kpool_compress_ape,
            ix.weights_proj(x).float() * hi**-0.5,
        )
    kw = dict(topk=cfg.index_topk, kpool=cfg.index_kpool)
    got = kpool_indexer(*args, PackedContext(doc_ids), **kw)
    _, near, exact = kpool_indexer_reference(*args, doc_ids, **kw)
    rows = tie_rows = 0
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        with torch.no_grad():
            hf = ix(x[:, sl], q_resid[:, sl], torch.ones(1, n, dtype=torch.bool), None).long()
        hf = torch.where(hf >= 0, hf + start, -1)[0]
        for t in range(n):
            rows += 1
            if near[0, start + t] or exact[0, start + t]:
                tie_rows += 1  # transformers may break it either way
                continue
            assert torch.equal(got[0, start + t], hf[t]), (start + t, got[0, start + t], hf[t])
        start += n
    print(f"\nk-pool indexer vs transformers: {rows - tie_rows}/{rows} rows equal, "
          f"{tie_rows} tie rows exempt")  # fmt: skip
    assert tie_rows < rows // 4


# ============================================================================ CP
@pytest.mark.gpu
def test_cuda_matches_cpu():
    doc_ids = packing(256, [1, 60, 3, 100, 17, 50])
    inputs = index_inputs(0, 1, 256, index_heads=4, index_dim=32)
    kw = dict(topk=32, kpool=4)
    want = kpool_indexer(*_args(inputs), PackedContext(doc_ids), **kw)
    cuda = [t.cuda() for t in _args(inputs)]
    got = kpool_indexer(*cuda, PackedContext(doc_ids.cuda()), **kw)
    _, near, _ = kpool_indexer_reference(*_args(inputs), doc_ids, **kw)
    assert not ((got.cpu() != want).any(-1) & ~near).any()
