"""GLM-5 (transformers' ``glm_moe_dsa``) on fcp: what only its token-level DSA indexer has.

Its per-document parity with transformers (outputs and gradients, 1, 2, 4 ranks) is the standard
battery's (``tests/test_hf_families.py``, row ``glm_moe_dsa``). Here:

* :func:`fcp.ops.token_indexer.token_indexer` equals its float64 reference
  (``reference.py``) on every row but those a near tie in fp32 rounding decides (counted,
  exempt, under 5%), exact ties (every head's ``relu`` clamped) going to the earlier token; it
  is bitwise :func:`fcp.ops.kpool_indexer.kpool_indexer` with one-token pools, whatever the
  pool gate and positional term;
* under CP on 2 and 4 gloo ranks (local shards shorter than ``topk``, documents straddling
  ranks) it selects the same ids as one process, bitwise;
* the adapter's selection for a document packed after another equals transformers'
  ``GlmMoeDsaIndexer`` on the document alone (RoPE at document-local positions; transformers'
  ``topk`` with fcp's tie rule), with exact ties present;
* the model's full and shared DSA layers compile to two graphs (one per layer structure), made
  at the first packing and reused for the next;
* a RoPE type that rescales with the sequence length, and attention dropout, are refused before
  any change.
"""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from fcp.integrations.hf import FcpMixer, enable_packed_cp
from fcp.integrations.hf.families import glm_moe_dsa
from fcp.ops.kpool_indexer import kpool_indexer
from fcp.ops.token_indexer import token_indexer
from fcp.ops.token_indexer.reference import token_indexer_reference
from tests import _hf_rank_fns as fns
from tests.support.cp_jobs import cp_context
from tests.support.hf_reference import GLM_MOE_DSA_TINY, _stable_topk, build
from tests.support.packing import packing

FAMILY = "glm_moe_dsa"
#: ``(seq, *rows of document lengths)``: one long document, a pad tail, tiny documents, two rows
PACKINGS = {"one_doc": (40, [40]), "pad_tail": (40, [13, 3, 19]),
            "tiny_docs": (24, [1, 2, 1, 3, 1, 5, 4, 6]), "two_rows": (32, [17, 15], [2, 9, 21])}


def inputs(seed: int, batch: int, seq: int, heads: int = 3, di: int = 8, clamp: bool = False):
    """``(index_q [B, L, heads, Di], index_k [B, L, Di], head_weights [B, L, heads])``; with
    ``clamp``, keys are non-negative and half the queries non-positive, so many rows tie
    exactly (every head's ``relu`` clamped to 0)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, di, generator=g)
    k = torch.randn(batch, seq, di, generator=g)
    w = torch.randn(batch, seq, heads, generator=g)
    if clamp:
        k = k.abs()
        q = torch.where(torch.rand(batch, seq, 1, 1, generator=g) < 0.5, -q.abs(), q)
    return q, k, w


@pytest.mark.parametrize("topk", [1, 4, 8])
@pytest.mark.parametrize("layout", list(PACKINGS), ids=list(PACKINGS))
@pytest.mark.parametrize("clamp", [False, True], ids=["random", "ties"])
def test_token_indexer_matches_reference_and_is_the_one_token_kpool_indexer(layout, topk, clamp):
    doc_ids = packing(*PACKINGS[layout])
    q, k, w = inputs(3, *doc_ids.shape, clamp=clamp)
    ctx = PackedContext(doc_ids)
    got = token_indexer(q, k, w, ctx, topk=topk)
    want, near, exact = token_indexer_reference(q, k, w, doc_ids, topk=topk)
    assert got.shape == want.shape == (*doc_ids.shape, topk) and got.dtype == torch.int64
    differs = (got != want).any(-1)
    assert not (differs & ~near).any(), (differs & ~near).nonzero().tolist()
    assert near.float().mean() < 0.05, "too many near-tie rows for a meaningful test"
    if clamp and topk > 1:
        assert exact.any()  # the tie rule decided rows, and they matched
    gen = torch.Generator().manual_seed(4)  # any gate and positional term: a 1-token softmax is 1
    gate, ape = torch.randn(*k.shape, generator=gen), torch.randn(1, k.shape[-1], generator=gen)
    pooled = kpool_indexer(q, k, gate, ape, w, ctx, topk=topk, kpool=1, select_tail=False)
    assert torch.equal(got, pooled)


def token_indexer_rank(env, q, k, w, doc_ids, topk):
    """One rank's :func:`token_indexer` ids on its shard of the global inputs."""
    ctx = cp_context(env, doc_ids)
    sl = slice(*ctx.interval)
    return token_indexer(q[:, sl], k[:, sl], w[:, sl], ctx, topk=topk)


@pytest.mark.parametrize("world,local", [(2, 10), (4, 3)])
def test_token_indexer_under_cp_equals_one_process_bitwise(rank_pool, world, local):
    seq = world * local
    doc_ids = packing(seq, [2, seq - 5], [seq])  # documents straddle every rank boundary
    q, k, w = inputs(9, 2, seq, clamp=True)
    want = token_indexer(q, k, w, PackedContext(doc_ids), topk=4)
    got = rank_pool.run(token_indexer_rank, world, q, k, w, doc_ids, 4)
    assert torch.equal(torch.cat(got, 1), want)


def test_selection_equals_transformers_indexer_on_the_document_alone(monkeypatch):
    """Layer 0's indexer: its input is per token (embedding, norm), so the document's rows are
    the same packed (after an 11-token document) and alone."""
    model = build(FAMILY, GLM_MOE_DSA_TINY)
    attn, gen = model.layers[0].self_attn, torch.Generator().manual_seed(2)
    first, doc = (torch.randint(1, 128, (n,), generator=gen) for n in (11, 29))
    n = len(doc)

    def prepare(ids):
        x = model.layers[0].input_layernorm(model.embed_tokens(ids[None]))
        return x, attn.q_a_layernorm(attn.q_a_proj(x))

    with torch.no_grad():
        x, q_resid = prepare(doc)
        positions = torch.arange(n)[None]
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
        monkeypatch.setattr(torch.Tensor, "topk", _stable_topk)  # fcp's tie rule, transformers'
        theirs = attn.indexer(x, q_resid, model.rotary_emb(x, positions), causal, positions)
        monkeypatch.undo()
        seen = []  # the operator's inputs, to find the rows an exact tie decides

        def recording(*args, **kwargs):
            seen.append((args, kwargs))
            return token_indexer(*args, **kwargs)

        monkeypatch.setattr(glm_moe_dsa, "token_indexer", recording)
        enable_packed_cp(model)
        ctx = PackedContext(packing(48, [11, n]))
        xs, rs = prepare(torch.cat([first, doc, torch.zeros(8, dtype=torch.long)]))
        ours = attn.fcp_select(xs, rs, ctx)[0, 11 : 11 + n]
    want = [{s for s in row.tolist() if s <= t} for t, row in enumerate(theirs[0])]
    got = [{s - 11 for s in row.tolist() if s >= 0} for row in ours]
    assert got == want
    (q, k, w, _), kwargs = seen[0]
    _, _, exact = token_indexer_reference(q, k, w, ctx.doc_ids, topk=kwargs["topk"],
                                          scale=kwargs["scale"])  # fmt: skip
    assert exact[0, 11 : 11 + n].any()  # ties every head clamps occurred: the rule decided them


def test_full_and_shared_layers_compile_to_two_graphs():
    counts, kinds = fns.compile_counts(FAMILY, GLM_MOE_DSA_TINY, 2)
    assert kinds == 1 and counts == [2, 2], counts


@pytest.mark.parametrize("change,match", [
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
     "'dynamic'"),
    (dict(attention_dropout=0.1), "attention dropout"),
], ids=["dynamic_rope", "dropout"])  # fmt: skip
def test_what_fcp_cannot_compute_is_refused_before_any_change(change, match):
    model = build(FAMILY, dict(GLM_MOE_DSA_TINY, **change))
    with pytest.raises(NotImplementedError, match=match):
        enable_packed_cp(model)
    assert not any(isinstance(m, FcpMixer) for m in model.modules())
