"""transformers' Qwen4-Exp (``qwen4_exp``: Gated DeltaNet, QSA attention, hashed n-gram PLE with a
dilated conv, hyper-connections, MoE) trained on packed documents with fcp: per-document parity.

:func:`fcp.integrations.hf.enable_packed_cp` replaces a tiny random ``Qwen4ExpTextModel``'s Gated
DeltaNet, QSA attention and PLE layers and its decoder layers (which hand the context to the PLE,
called by transformers without ``**kwargs``). Every packed document must then come out exactly
as transformers computes it alone, with the contract and tolerances of ``tests/test_hf_glm5.py``:
outputs to 1e-5; every parameter's gradient, summed over the CP ranks, to 1e-5 relative to the
larger of its own largest entry and a tenth of the model's largest gradient entry; on 1, 2 and 4
gloo ranks, for Hypothesis packings (documents shorter than the conv width and the n-gram size,
end-of-sequence tokens inside documents, a document spanning every rank, padding, two rows).

Gradient tolerance floor. The PLE gate takes a signed square root of a dot product
(``sqrt(|g|) * sign(g)``), whose derivative grows without bound near 0, so transformers' own
fp32 gradients of the PLE parameters carry rounding noise far above 1e-5 on some documents
(measured: up to 5.9e-5 from the same model run in float64, driven by one 13-token document).
Each parameter's tolerance is therefore the larger of 1e-5 and twice that measured noise: two
fp32 evaluations of the same sums, each that far from float64, may be twice that far apart
(measured: fcp's largest error 8.8e-5 = 1.5x the noise; its own distance from float64 at most
0.98x transformers'). The float64 run keeps transformers' Gated DeltaNet kernels, which compute
in fp32 whatever the dtype, and must decide every routing and selection as the fp32 run does
(outputs to 1e-5). The tests report how many parameters needed the floor.

The pieces are checked on their own too: the n-gram history and the whole PLE layer against
transformers' on each document alone (on 1, 2 and 4 ranks, shards shorter than the history and
the conv halo); the QSA selection against transformers' ``Qwen4ExpTextQSAIndexer`` with fcp's
tie rule (equal scores to the earlier block), reporting how many query rows transformers' own
``topk`` decided differently; mRoPE's text tables against transformers' rotary module.

The whole-model reference (transformers itself, FLA blocked) runs once in a subprocess over a
pool of documents; each example packs a subset of them.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fcp
from fcp.integrations.hf import FcpMixer, enable_packed_cp
from fcp.integrations.hf.mixers import GatedDeltaNetMixer, PleMixer, QsaGqaMixer
from tests import _hf_qwen4_rank_fns as qfns
from tests import _hf_rank_fns as fns
from tests.support.hf_checks import assert_unmarked, drop_context
from tests.support.hf_packings import document_packings
from tests.support.hf_reference import (
    QWEN4_EXP_TINY,
    build,
    indexer_selections,
    per_document,
    selection_rows,
)

FAMILY = "qwen4_exp"
CONFIG = QWEN4_EXP_TINY
HIDDEN = CONFIG["hidden_size"]
STREAMS = CONFIG["hc_count"] * HIDDEN
EOS = CONFIG["eos_token_id"]
# shorter than the n-gram size (1, 2) and the conv width (3), around a QSA block (5, 8), in the
# sparse phase (13: from position 11 on), up to 37 tokens
LENGTHS = [1, 2, 3, 5, 8, 13, 22, 37]
# end-of-sequence tokens inside documents: (document, position); two in a row, one first
EOS_AT = [(1, 1), (3, 2), (5, 4), (6, 0), (6, 10), (7, 20), (7, 21)]


def documents(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(EOS + 1, CONFIG["vocab_size"], (n,), generator=gen) for n in LENGTHS]
    for d, t in EOS_AT:
        docs[d][t] = EOS
    return docs


@pytest.fixture(scope="module")
def reference():
    gen = torch.Generator().manual_seed(9)
    docs = documents(7)
    cots = [torch.randn(n, HIDDEN, generator=gen) for n in LENGTHS]
    state = {k: v.clone() for k, v in build(FAMILY, CONFIG).state_dict().items()}
    ref = per_document(FAMILY, CONFIG, state, docs, cots, float64=True)
    # the float64 run must decide every routing and selection as the fp32 one does, or it does
    # not measure rounding noise
    for out, out64 in zip(ref["outputs"], ref["outputs_float64"]):
        torch.testing.assert_close(out, out64, rtol=1e-5, atol=1e-5)
    print(f"\n[hf-qwen4_exp] transformers' topk chose another tied set on {ref['tie_rows']} of "
          f"{ref['indexed_rows']} indexed query rows (fcp's rule: the earlier block)")
    return dict(state=state, docs=docs, cots=cots, **ref)


def run(rank_pool, fn, world, *args):
    if world == 1:
        return [fn(None, *args)]
    return rank_pool.run(fn, world, *args, timeout=fns.POOL_TIMEOUT_S)


def check(reference: dict, rows: list[list[int]], results: list) -> dict:
    """Per-document parity of the ranks' ``results`` (:func:`tests._hf_rank_fns.
    packed_forward_backward`): outputs to 1e-5; summed parameter gradients to the larger of 1e-5
    and twice the reference's measured fp32 noise (module doc), relative to the larger of the
    tensor's largest entry and a tenth of the model's largest gradient entry (as
    :func:`tests._hf_rank_fns.check`). Returns the largest errors: ``out`` (relative), ``grad``
    (every parameter), ``within`` (the parameters within 1e-5), ``floored`` (how many were not)
    and ``ratio`` (their distance from float64 over transformers', largest)."""
    out = torch.cat([r[0] for r in results], 1)
    grads = {n: sum(r[1][n] for r in results) for n in results[0][1]}
    want, want64, out_err = {}, {}, 0.0
    for b, row in enumerate(rows):
        start = 0
        for i in row:
            n, ref = LENGTHS[i], reference["outputs"][i]
            torch.testing.assert_close(out[b, start : start + n], ref, atol=1e-5, rtol=1e-5)
            err = (out[b, start : start + n] - ref).abs().max() / ref.abs().max()
            out_err = max(out_err, float(err))
            start += n
            for name, g in reference["grads"][i].items():
                want[name] = want.get(name, 0) + g
                want64[name] = want64.get(name, 0) + reference["grads_float64"][i][name]
    assert grads.keys() == want.keys()
    scale = max(float(w.abs().max()) for w in want.values())
    errs = dict(out=out_err, grad=0.0, within=0.0, floored=0, ratio=0.0)
    for name, g in grads.items():
        den = max(float(want[name].abs().max()), 0.1 * scale)
        err = float((g - want[name]).abs().max()) / den
        if err > 1e-5:  # beyond 1e-5 only as far as the reference's own rounding allows
            noise = float((want[name] - want64[name]).abs().max()) / den
            assert err <= 2 * noise, (name, err, noise)
            err64 = float((g - want64[name]).abs().max()) / den
            errs.update(floored=errs["floored"] + 1, ratio=max(errs["ratio"], err64 / noise))
        else:
            errs["within"] = max(errs["within"], err)
        errs["grad"] = max(errs["grad"], err)
    return errs


# ---------------------------------------------------------------------------------------------
# the whole model
# ---------------------------------------------------------------------------------------------
@settings(deadline=None, max_examples=6)
@given(case=document_packings(LENGTHS))
def test_packed_documents_equal_transformers_on_each_document(rank_pool, reference, case):
    world, rows, seq = case
    batch, cot = fns.pack(reference, rows, seq)
    check(reference, rows, run(rank_pool, fns.packed_forward_backward, world, FAMILY, CONFIG,
                               reference["state"], batch, cot))  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 4])
def test_one_document_spanning_every_rank_with_padding(rank_pool, reference, world):
    # 37 + 1 tokens across every rank, short docs, padding; document 5 (13 tokens) is the one
    # whose PLE gradients carry the reference's largest fp32 noise
    rows = [[7, 0], [6, 5, 1, 3]]
    batch, cot = fns.pack(reference, rows, 45)
    results = run(rank_pool, fns.packed_forward_backward, world, FAMILY, CONFIG,
                  reference["state"], batch, cot)  # fmt: skip
    e = check(reference, rows, results)
    print(f"\n[hf-qwen4_exp] {world} rank(s): max relative output error {e['out']:.1e}; "
          f"parameter gradients {e['within']:.1e}; the other {e['floored']} {e['grad']:.1e} "
          f"(within twice the reference's fp32 noise; from float64 at {e['ratio']:.2f}x "
          "transformers' fp32 distance)")


def test_without_a_context_the_original_code_runs(reference):
    assert reference["no_context_max_diff"] == 0.0


def test_replacement_keeps_parameters_keys_and_values():
    model = fns.check_replacement(FAMILY, CONFIG, {"Qwen4ExpTextDecoderLayer": FcpMixer,
                                                   "Qwen4ExpTextGatedDeltaNet": GatedDeltaNetMixer,
                                                   "Qwen4ExpTextAttention": QsaGqaMixer,
                                                   "Qwen4ExpTextPLELayer": PleMixer})  # fmt: skip
    # 4 decoder layers, 3 Gated DeltaNets, 1 QSA attention, 2 PLEs; one class per kind
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, FcpMixer)}
    assert len(kinds) == 10 and len(set(kinds.values())) == 4
    assert issubclass(kinds["layers.0.linear_attn"], GatedDeltaNetMixer)
    assert issubclass(kinds["layers.2.self_attn"], QsaGqaMixer)
    assert issubclass(kinds["layers.3.ple"], PleMixer) and model.layers[1].ple is None


# ---------------------------------------------------------------------------------------------
# the PLE layer: n-gram history (restarts at document starts and after EOS) and dilated conv
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ple_reference():
    """transformers' PLE layers on each document alone: n-gram embeddings and PLE outputs."""
    model = build(FAMILY, CONFIG, seed=1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    docs = documents(8)
    gen = torch.Generator().manual_seed(4)
    hidden = [torch.randn(n, STREAMS, generator=gen) for n in LENGTHS]
    out = {}
    with torch.no_grad():
        for layer in (0, 3):
            ple = model.layers[layer].ple
            out[layer] = [(ple.ple_embedding(d[None], None)[0], ple(h[None], d[None], None)[0])
                          for d, h in zip(docs, hidden)]  # fmt: skip
    return dict(state=state, docs=docs, hidden=hidden, out=out)


@settings(deadline=None, max_examples=10)
@given(case=document_packings(LENGTHS), layer=st.sampled_from([0, 3]), short=st.booleans())
def test_ple_equals_transformers_on_each_document(rank_pool, ple_reference, case, layer, short):
    """n-gram embeddings bitwise, PLE outputs to 1e-6; ``short``: only the short documents, so
    a shard (1-3 tokens) is shorter than the 2-id n-gram history and the 9-token conv halo."""
    world, rows, seq = case
    if short:
        rows = [[i for i in row if LENGTHS[i] <= 5] or [0] for row in rows]
        seq = max(sum(LENGTHS[i] for i in row) for row in rows)
    ref = dict(docs=ple_reference["docs"], cots=ple_reference["hidden"])
    batch, hidden = fns.pack(ref, rows, seq)
    results = run(rank_pool, qfns.ple_shard, world, CONFIG, ple_reference["state"], layer, batch,
                  hidden)  # fmt: skip
    emb = torch.cat([r[0] for r in results], 1)
    out = torch.cat([r[1] for r in results], 1)
    for b, row in enumerate(rows):
        start = 0
        for i in row:
            n = LENGTHS[i]
            want_emb, want_out = ple_reference["out"][layer][i]
            assert torch.equal(emb[b, start : start + n], want_emb), (layer, rows, i)
            torch.testing.assert_close(out[b, start : start + n], want_out, rtol=1e-6, atol=1e-6)
            start += n


def test_ngram_history_restarts_at_documents_and_after_eos():
    """PLE's n-gram history is ``token_history`` with the end-of-sequence id (2) as its fill and
    its reset: documents ``[5, 6, 2, 7]`` and ``[8]``."""
    ids = torch.tensor([[5, 6, 2, 7, 8]])
    ctx = fcp.PackedContext(torch.tensor([[1, 1, 1, 1, 2]]))
    got = fcp.token_history(ids, ctx, 3, fill=2, reset=2)
    assert got[0].tolist() == [[5, 2, 2], [6, 5, 2], [2, 6, 5], [7, 2, 2], [8, 2, 2]]


# ---------------------------------------------------------------------------------------------
# QSA attention: the selection is transformers' indexer's, ties by the earlier block
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("index_heads", [2, 1])
def test_qsa_attention_alone_equals_transformers_on_each_document(index_heads):
    """The QSA attention layer enabled on its own, on packed documents: its selection (per query,
    the set of document-local token ids) is transformers' ``Qwen4ExpTextQSAIndexer``'s on each
    document alone given fcp's tie rule, and its output transformers' attention's; RoPE comes
    from the layer's config at document-local positions. With one index head a block scores
    exactly 0 half the time, so ties at the cutoff (found by fcp's float64 oracle) are common and
    the rule decides them; the test counts those rows and the rows where transformers' own
    ``topk`` chose another tied set."""
    from fcp.ops.qsa_indexer.reference import qsa_indexer_reference

    config = dict(CONFIG, indexer_n_heads=index_heads)
    ruled, plain, ours = (build(FAMILY, config, seed=2) for _ in range(3))  # the same weights
    theirs = ruled.layers[2].self_attn
    rule_selections = indexer_selections(ruled, tie_rule=True)
    attn = enable_packed_cp(ours.layers[2].self_attn)
    rows = [[7, 3, 5], [6, 4]]  # 55 and 30 tokens
    seq = 55
    x = torch.randn(2, seq, HIDDEN, generator=torch.Generator().manual_seed(3))
    lens = torch.tensor([[LENGTHS[i] for i in rows[0]], [LENGTHS[i] for i in rows[1]] + [-1000]])
    ctx = fcp.PackedContext(fcp.doc_ids_from_seq_lens(lens, seq))
    ix = attn.indexer
    _, _, tied = qsa_indexer_reference(*attn.fcp_index_inputs(x, ctx), ctx.doc_ids,
                                       budget=ix.token_budget, ratio=ix.compress_ratio,
                                       eps=ix.k_layernorm.eps)  # fmt: skip
    decided = 0
    with torch.no_grad():
        ids = attn.fcp_qsa_select(x, ctx)
        got = attn(x, position_embeddings=None, attention_mask=None, cp_context=ctx)[0]
        for r, row in enumerate(rows):
            start = 0
            for i in row:
                n = LENGTHS[i]
                doc = x[r : r + 1, start : start + n]
                rope = ruled.rotary_emb(doc, torch.arange(n)[None])
                causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
                want = theirs(doc, position_embeddings=rope, attention_mask=causal)[0]
                rule = selection_rows(rule_selections[-1])
                own = selection_rows(plain.layers[2].self_attn.indexer(doc, rope, causal, None))
                mine = [set((ids[r, start + t] - start).tolist()) - {-1 - start}
                        for t in range(n)]  # fmt: skip
                assert mine == rule, (r, i)
                decided += sum(a != b for a, b in zip(own, rule))
                torch.testing.assert_close(got[r : r + 1, start : start + n], want,
                                           atol=1e-5, rtol=1e-5)  # fmt: skip
                start += n
    total = int(ctx.doc_ids.ne(0).sum())
    print(f"\n[hf-qwen4_exp] QSA alone, {index_heads} index head(s): {int(tied.sum())} of {total} "
          f"query rows tied at the cutoff (decided by fcp's rule, the earlier block); "
          f"transformers' own topk chose another tied set on {decided}")
    if index_heads == 1:
        assert int(tied.sum()) > 0  # the rule was exercised


def test_mrope_text_tables_are_rope_at_one_position():
    """For text tokens transformers' mRoPE gives every axis the same position; its tables then
    equal fcp's 1-D :func:`~fcp.integrations.hf.rope.rope_tables` of the config, bitwise (2-D
    positions, expanded by transformers, and explicit equal 3-D ones)."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRotaryEmbedding

    from fcp.integrations.hf.rope import rope_tables

    config = Qwen4ExpTextConfig(**CONFIG)
    rotary = Qwen4ExpTextRotaryEmbedding(config)
    positions = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    x = torch.zeros(2, 9, 4)
    got = rope_tables(config, positions, x.dtype)
    for pos in (positions, positions[None].expand(3, -1, -1)):
        want = rotary(x, pos)
        assert got[0].shape == want[0].shape == (2, 9, 8)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    # a genuinely 3-D position (an image token) would differ: mRoPE is not 1-D in general
    image = positions[None].repeat(3, 1, 1)
    image[1] += 7
    assert not torch.equal(rotary(x, image)[0], got[0])


# ---------------------------------------------------------------------------------------------
# the context reaches every mixer, or the forward raises
# ---------------------------------------------------------------------------------------------
def packed(seed: int, seq: int = 24):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor([[5, 11, seq - 16], [seq - 3, -1000, -1000]])
    ids = torch.randint(EOS + 1, CONFIG["vocab_size"], (2, seq), generator=gen)
    return fcp.shard_batch(None, {"input_ids": ids, "seq_lens": lens})


def test_transformers_decoder_layer_calling_its_ple_without_the_context_raises():
    """transformers' own decoder layer calls its PLE without ``cp_context``: with the adapter
    bypassed (the layer's forward drops the context), the PLE raises instead of running the
    non-CP history and conv on a packed batch."""
    model = enable_packed_cp(build(FAMILY, CONFIG))
    drop_context(model.layers[0])
    local, ctx = packed(0)
    with pytest.raises(ValueError, match=r"layers\.0\.ple .*decoder layer \(layers\.0\) did not"):
        model(input_ids=local["input_ids"], cp_context=ctx)
    assert_unmarked(model)
    del model.layers[0].forward
    with torch.no_grad():
        assert model(input_ids=local["input_ids"], cp_context=ctx).last_hidden_state.shape == (
            2, 24, HIDDEN)  # fmt: skip
    assert_unmarked(model)


@pytest.fixture(scope="module")
def wrappers():
    """A text model on fcp, and ``Qwen4ExpForCausalLM`` / ``Qwen4ExpForConditionalGeneration``
    (tiny vision tower) holding the same text weights, all enabled."""
    import transformers
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpConfig

    backbone = build(FAMILY, CONFIG)
    state = backbone.state_dict()
    causal = transformers.Qwen4ExpForCausalLM(backbone.config)
    causal.model.load_state_dict(state)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2,
                  temporal_patch_size=1, spatial_merge_size=1, out_hidden_size=HIDDEN,
                  num_position_embeddings=16)  # fmt: skip
    full_config = Qwen4ExpConfig(text_config=dict(CONFIG), vision_config=vision,
                                 image_token_id=125, video_token_id=126, vision_start_token_id=123,
                                 vision_end_token_id=124)  # fmt: skip
    full_config.text_config._attn_implementation = "eager"
    full = transformers.Qwen4ExpForConditionalGeneration(full_config).eval()
    full.model.language_model.load_state_dict(state)
    full.lm_head.load_state_dict(causal.lm_head.state_dict())
    return [enable_packed_cp(m) for m in (backbone, causal.eval(), full)]


def test_causal_lm_and_multimodal_wrappers_run_text(wrappers):
    """``Qwen4ExpForCausalLM`` and ``Qwen4ExpForConditionalGeneration`` (text-only inputs): their
    logits are the packed text model's outputs through ``lm_head``."""
    backbone, causal, full = wrappers
    local, ctx = packed(1)
    with torch.no_grad():
        hidden = backbone(input_ids=local["input_ids"], cp_context=ctx).last_hidden_state
        want = causal.lm_head(hidden)
        for lm in (causal, full):
            got = lm(input_ids=local["input_ids"], cp_context=ctx).logits
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert_unmarked(lm)


def test_image_or_video_inputs_with_a_context_raise(wrappers):
    _, _, full = wrappers
    local, ctx = packed(2)
    ids = local["input_ids"]
    pixels = torch.zeros(4, 3 * 2 * 2)
    grid = torch.tensor([[1, 2, 2]])
    for kwargs in ({"pixel_values": pixels, "image_grid_thw": grid},
                   {"pixel_values_videos": pixels, "video_grid_thw": grid}):  # fmt: skip
        with pytest.raises(ValueError, match="image and video inputs are not supported"):
            full(input_ids=ids, cp_context=ctx, **kwargs)
        with pytest.raises(ValueError, match="image and video inputs are not supported"):
            full.model(input_ids=ids, cp_context=ctx, **kwargs)
    with pytest.raises(ValueError, match="not supported .*pixel_values"):  # by position
        full(ids, None, None, None, None, None, pixels, cp_context=ctx)
    assert_unmarked(full)


# ---------------------------------------------------------------------------------------------
# compiled mixers
# ---------------------------------------------------------------------------------------------
def test_compiled_mixers_do_not_recompile_across_packings():
    """The model's token mixers (Gated DeltaNet, QSA attention, PLE) compiled as the demo does
    (``fullgraph=True``, aot_eager), the model run eagerly over 10 packings: one graph per mixer
    kind and table size (the two PLE layers' hashed tables differ: each layer hashes into its own
    primes), compiled at the first step, and the outputs of the uncompiled model."""
    import torch._dynamo.testing

    model = enable_packed_cp(build(FAMILY, CONFIG))
    eager = enable_packed_cp(build(FAMILY, CONFIG))
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    mixers = [m for m in model.modules() if isinstance(m, (GatedDeltaNetMixer, QsaGqaMixer,
                                                           PleMixer))]  # fmt: skip
    for mixer in mixers:
        mixer.compile(backend=counter, fullgraph=True, dynamic=False)
    counts = []
    for step in range(10):
        local, ctx = packed(20 + step, seq=40)
        got = model(input_ids=local["input_ids"], cp_context=ctx).last_hidden_state
        want = eager(input_ids=local["input_ids"], cp_context=ctx).last_hidden_state
        torch.testing.assert_close(got, want)
        counts.append(counter.frame_count)
    tables = {m.ple_embedding.ngram_embedding.weight.shape for m in mixers if isinstance(m, PleMixer)}
    assert len(tables) == 2 and counts == [2 + len(tables)] * 10, counts


def test_gradient_checkpointing_is_bitwise_the_same():
    """transformers' gradient checkpointing of the (adapted) decoder layers: the same outputs and
    gradients, bitwise."""
    model = enable_packed_cp(build(FAMILY, CONFIG)).train()
    local, ctx = packed(5, seq=40)
    runs = []
    for checkpointing in (True, False):
        if checkpointing:
            model.gradient_checkpointing_enable()
        else:
            model.gradient_checkpointing_disable()
        model.zero_grad(set_to_none=True)
        out = model(input_ids=local["input_ids"], cp_context=ctx).last_hidden_state
        out.square().sum().backward()
        runs.append((out.detach(), {n: p.grad for n, p in model.named_parameters()
                                    if p.grad is not None}))  # fmt: skip
    (out_a, grads_a), (out_b, grads_b) = runs
    assert torch.equal(out_a, out_b) and grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
