"""transformers' Kimi-Linear and Qwen3-Next trained on packed documents with fcp: per-document
parity.

:func:`fcp.integrations.hf.enable_packed_cp` replaces the linear-attention mixers (Kimi: KDA with
a per-channel gate; Qwen3-Next: Gated DeltaNet with one gate per value head, interleaved
projections, its conv and SiLU-gated norm) and the full-attention mixers (Kimi: NoPE MLA;
Qwen3-Next: gated GQA attention with q/k norm and partial RoPE at document-local positions) of
tiny random ``KimiLinearModel`` / ``Qwen3NextModel``. Every packed document must then come out
exactly as transformers computes it alone, with the contract and tolerances of
``tests/test_hf_glm5.py``: outputs to 1e-5; every parameter's gradient, summed over the CP ranks,
to 1e-5 relative to the larger of its own largest entry and a tenth of the model's largest
gradient entry; on 1, 2 and 4 gloo ranks, for Hypothesis packings (documents shorter than the
conv width, a document spanning every rank, padding, two rows).

The reference (transformers itself, FLA blocked, in one subprocess for both families) runs once
per module over a pool of documents; each example packs a subset of them.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fcp
from fcp.integrations.hf import KdaMixer, MlaMixer, SUPPORTED, enable_packed_cp
from tests import _hf_rank_fns as fns
from tests.support.hf_reference import KIMI_TINY, QWEN3_NEXT_TINY, build

CONFIGS = {"kimi_linear": KIMI_TINY, "qwen3_next": QWEN3_NEXT_TINY}
FAMILIES = sorted(CONFIGS)
HIDDEN = 32
# documents shorter than the conv width (1, 2, 3), around a chunk of a rank's shard, up to 37
LENGTHS = [1, 2, 3, 5, 8, 13, 22, 37]
POOL_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def references():
    return fns.references(CONFIGS, LENGTHS, HIDDEN, seed=5)


def run(rank_pool, reference, family, world, rows, seq):
    return fns.run(rank_pool, reference, family, CONFIGS[family], world, rows, seq,
                   POOL_TIMEOUT_S)  # fmt: skip


@st.composite
def packing(draw):
    world = draw(st.sampled_from([1, 2, 4]))
    n_rows = draw(st.integers(1, 2))
    order = draw(st.permutations(range(len(LENGTHS))))
    rows, used = [], 0
    for _ in range(n_rows):
        k = draw(st.integers(1, 4))
        rows.append(list(order[used : used + k]))
        used += k
    longest = max(sum(LENGTHS[i] for i in row) for row in rows)
    return world, rows, longest + draw(st.integers(0, 7))


@pytest.mark.parametrize("family", FAMILIES)
@settings(deadline=None, max_examples=6)
@given(case=packing())
def test_packed_documents_equal_transformers_on_each_document(rank_pool, references, family,
                                                              case):  # fmt: skip
    world, rows, seq = case
    reference = references[family]
    results = rank_pool.run(fns.packed_forward_backward, world, family, CONFIGS[family],
                            reference["state"], *fns.pack(reference, rows, seq),
                            timeout=POOL_TIMEOUT_S)  # fmt: skip
    fns.check(reference, rows, results)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_document_spanning_every_rank_with_padding(rank_pool, references, family, world):
    rows = [[7, 0], [6, 1, 3]]  # 37 + 1 tokens across every rank, short docs, padding
    err = fns.check(references[family], rows, run(rank_pool, references[family], family, world, rows,
                                              41))  # fmt: skip
    print(f"\n[hf-{family}] {world} rank(s): max relative parameter-gradient error {err:.1e}")


@pytest.mark.parametrize("family", FAMILIES)
def test_without_a_context_the_original_code_runs(references, family):
    assert references[family]["no_context_max_diff"] == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_replacement_keeps_parameters_and_keys(family):
    model = build(family, CONFIGS[family])
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    buffers = [n for n, _ in model.named_buffers()]

    def mixers():
        return [getattr(layer, "linear_attn", None) or layer.self_attn for layer in model.layers]

    originals = [type(m) for m in mixers()]
    assert enable_packed_cp(model) is model
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_buffers()] == buffers  # RoPE adds no buffer
    assert all(p is params[n] for n, p in model.named_parameters())  # optimizers stay valid
    kinds = [type(m) for m in mixers()]
    assert [k.__name__ for k in kinds] == [f"Packed{c.__name__}" for c in originals]
    assert [k.__bases__ for k in kinds] == [(SUPPORTED[c.__name__], c) for c in originals]
    if family == "kimi_linear":
        assert [k.__bases__[0] for k in kinds] == [KdaMixer, MlaMixer, KdaMixer]
    assert kinds[0] is kinds[2]  # one class per kind
    assert enable_packed_cp(model) is model  # idempotent
    assert [type(m) for m in mixers()] == kinds


def test_attention_alone_takes_its_positions_from_the_context(references):
    """Qwen3-Next's attention enabled on its own (no enclosing model, no rotary module): on packed
    documents it equals transformers' code on each document alone, given the model's rotary
    tables at positions ``0 .. n-1``: RoPE comes from the layer's config at document-local
    positions."""
    model = build("qwen3_next", QWEN3_NEXT_TINY)
    model.load_state_dict(references["qwen3_next"]["state"])
    attn = enable_packed_cp(model.layers[1].self_attn)
    rows = [[13, 5, 8], [22]]
    x = torch.randn(2, 30, HIDDEN, generator=torch.Generator().manual_seed(1))
    seq_lens = torch.tensor([[13, 5, 8], [22, -1000, -1000]])
    ctx = fcp.PackedContext(fcp.doc_ids_from_seq_lens(seq_lens, 30))
    with torch.no_grad():
        got = attn(x, position_embeddings=None, attention_mask=None, cp_context=ctx)[0]
        for r, row in enumerate(rows):
            start = 0
            for n in row:
                doc = x[r : r + 1, start : start + n]
                rope = model.rotary_emb(doc, torch.arange(n)[None])
                causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
                want = attn(doc, position_embeddings=rope, attention_mask=causal)[0]
                torch.testing.assert_close(got[r : r + 1, start : start + n], want,
                                           atol=1e-5, rtol=1e-5)  # fmt: skip
                start += n


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_lm_wrapper(references, family):
    """``*ForCausalLM`` (a model wrapping the backbone): its mixers are replaced and its logits are
    the backbone's packed outputs through ``lm_head``."""
    import transformers

    cls = {"kimi_linear": transformers.KimiLinearForCausalLM,
           "qwen3_next": transformers.Qwen3NextForCausalLM}[family]  # fmt: skip
    backbone = fns.packed_model(family, CONFIGS[family], references[family]["state"])
    lm = cls(backbone.config)
    lm.model = build(family, CONFIGS[family])
    lm.model.load_state_dict(references[family]["state"])
    enable_packed_cp(lm)
    assert all(isinstance(m, type(b)) for m, b in zip(lm.model.modules(), backbone.modules()))
    batch, _ = fns.pack(references[family], [[5, 1, 3]], 30)
    local, ctx = fcp.shard_batch(None, batch)
    with torch.no_grad():
        logits = lm(input_ids=local["input_ids"], cp_context=ctx, use_cache=False).logits
        hidden = backbone(input_ids=local["input_ids"], cp_context=ctx, use_cache=False)
    torch.testing.assert_close(logits, lm.lm_head(hidden.last_hidden_state))


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_model_does_not_recompile_across_packings(references, family):
    """The whole integrated model (its two mixer kinds: a 2-layer variant of the tiny config)
    compiles with ``fullgraph=True`` (aot_eager, forward and backward graphs) once, and the
    compiled model equals eager over 4 packings without recompiling."""
    import torch._dynamo.testing

    two = {"layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2}
    if family == "kimi_linear":
        two["mlp_layer_types"] = ["dense", "sparse"]
    model = enable_packed_cp(build(family, dict(CONFIGS[family], **two)))
    gen = torch.Generator().manual_seed(3)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=False)
    for _ in range(4):
        perm = torch.randperm(len(LENGTHS), generator=gen).tolist()
        batch, _ = fns.pack(references[family], [perm[:3], perm[3:5]], 80)
        local, ctx = fcp.shard_batch(None, batch)
        got = compiled(input_ids=local["input_ids"], cp_context=ctx, use_cache=False)
        want = model(input_ids=local["input_ids"], cp_context=ctx, use_cache=False)
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state)
    assert counter.frame_count == 1, counter.frame_count
