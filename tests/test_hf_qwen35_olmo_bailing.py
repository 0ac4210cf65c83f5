"""transformers' Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid and Bailing-Hybrid trained on packed documents
with fcp: per-document parity, the replacement contract, compilation, and their RoPE variants.

:func:`fcp.integrations.hf.enable_packed_cp` replaces, in tiny random text backbones:

* Qwen3.5 / Qwen3.5-MoE: Gated DeltaNet with separate projections, and Qwen3-Next's gated GQA
  attention whose mRoPE text positions are 1-D RoPE at document-local positions;
* OLMo-Hybrid: Gated DeltaNet with ``beta = 2 sigmoid(b)`` and its own norm / output names, and
  attention with q/k norm over all heads and fp32 RoPE tables (or NoPE);
* Bailing-Hybrid: KDA with a full-width output gate, and MLA with interleaved RoPE on its rope
  channels and a per-head output gate.

Every packed document must then come out exactly as transformers computes it alone, with the
contract of ``tests/test_hf_kimi_qwen3next.py`` (its packings and documents): outputs to 1e-5;
every parameter's gradient summed over the CP ranks to 1e-5 relative to the larger of its own
largest entry and a tenth of the model's largest; on 1, 2 and 4 gloo ranks. The reference
(transformers itself, FLA blocked) runs once per module, for the four families in one subprocess.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import fcp
from fcp.integrations.hf import FcpMixer, enable_packed_cp
from tests import _hf_rank_fns as fns
from tests.support.hf_reference import (
    BAILING_HYBRID_TINY,
    OLMO_HYBRID_TINY,
    QWEN3_5_MOE_TINY,
    QWEN3_5_TINY,
    build,
)
from tests.test_hf_kimi_qwen3next import HIDDEN, LENGTHS, POOL_TIMEOUT_S, packing

CONFIGS = {"qwen3_5": QWEN3_5_TINY, "qwen3_5_moe": QWEN3_5_MOE_TINY,
           "olmo_hybrid": OLMO_HYBRID_TINY, "bailing_hybrid": BAILING_HYBRID_TINY}  # fmt: skip
FAMILIES = sorted(CONFIGS)
#: the transformers mixer classes of each family (attention layer, linear-attention layer)
MIXERS = {"qwen3_5": ("Qwen3_5Attention", "Qwen3_5GatedDeltaNet"),
          "qwen3_5_moe": ("Qwen3_5MoeAttention", "Qwen3_5MoeGatedDeltaNet"),
          "olmo_hybrid": ("OlmoHybridAttention", "OlmoHybridGatedDeltaNet"),
          "bailing_hybrid": ("BailingHybridAttention", "BailingHybridDeltaAttention")}  # fmt: skip


@pytest.fixture(scope="module")
def references():
    return fns.references(CONFIGS, LENGTHS, HIDDEN, seed=7)


@pytest.mark.parametrize("family", FAMILIES)
@settings(deadline=None, max_examples=3)
@given(case=packing())
def test_packed_documents_equal_transformers_on_each_document(rank_pool, references, family,
                                                              case):  # fmt: skip
    world, rows, seq = case
    results = fns.run(rank_pool, references[family], family, CONFIGS[family], world, rows, seq,
                      POOL_TIMEOUT_S)  # fmt: skip
    fns.check(references[family], rows, results)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_document_spanning_every_rank_with_padding(rank_pool, references, family, world):
    fns.check_spanning_every_rank(rank_pool, references[family], family, CONFIGS[family], world,
                                  POOL_TIMEOUT_S)  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_without_a_context_the_original_code_runs(references, family):
    assert references[family]["no_context_max_diff"] == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_replacement_keeps_the_state_dict_and_loads_it_strictly(family):
    fns.check_replacement(family, CONFIGS[family], MIXERS[family])


def test_an_unknown_model_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match=r"Sequential has no supported token mixer .*"
                                         r"BailingHybridAttention.*OlmoHybridGatedDeltaNet.*"
                                         r"Qwen3_5GatedDeltaNet.*Qwen3_5MoeAttention"):  # fmt: skip
        enable_packed_cp(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def _causal_lm(family):
    import transformers

    return {"qwen3_5": transformers.Qwen3_5ForCausalLM,
            "qwen3_5_moe": transformers.Qwen3_5MoeForCausalLM,
            "olmo_hybrid": transformers.OlmoHybridForCausalLM,
            "bailing_hybrid": transformers.BailingHybridForCausalLM}[family]  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_lm_wrapper(references, family):
    """``*ForCausalLM``: its mixers are replaced, and its logits are the backbone's packed outputs
    through ``lm_head``."""
    backbone = fns.packed_model(family, CONFIGS[family], references[family]["state"])
    lm = _causal_lm(family)(backbone.config)
    lm.model.load_state_dict(references[family]["state"])
    enable_packed_cp(lm)
    assert [type(m) for m in lm.model.modules()] == [type(m) for m in backbone.modules()]
    batch, _ = fns.pack(references[family], [[5, 1, 3]], 30)
    local, ctx = fcp.shard_batch(None, batch)
    with torch.no_grad():
        logits = lm(input_ids=local["input_ids"], cp_context=ctx).logits
        hidden = backbone(input_ids=local["input_ids"], cp_context=ctx).last_hidden_state
    torch.testing.assert_close(logits, lm.lm_head(hidden))


#: a tiny vision tower for Qwen3.5's vision-language wrappers (its special tokens in the vocab)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
              patch_size=4, num_position_embeddings=16, spatial_merge_size=2,
              temporal_patch_size=2)  # fmt: skip
SPECIAL = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122,
               vision_end_token_id=123)  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_vision_language_wrapper_runs_text_and_refuses_images(references, family):
    """``Qwen3_5(Moe)ForConditionalGeneration`` holds the same text model: text-only calls under a
    ``cp_context`` run on fcp (logits = the text backbone's packed outputs through ``lm_head``);
    image or video inputs raise a ``ValueError`` before the vision tower runs, by keyword or by
    position, and leave no mixer marked."""
    import transformers

    name = {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}[family]
    config = getattr(transformers, f"{name}Config")(text_config=CONFIGS[family],
                                                    vision_config=VISION, **SPECIAL)  # fmt: skip
    vlm = getattr(transformers, f"{name}ForConditionalGeneration")(config).eval()
    text = vlm.model.language_model
    text.load_state_dict(references[family]["state"])
    enable_packed_cp(vlm)
    backbone = fns.packed_model(family, CONFIGS[family], references[family]["state"])
    assert [type(m) for m in text.modules()] == [type(m) for m in backbone.modules()]
    batch, _ = fns.pack(references[family], [[5, 1, 3], [4, 2]], 30)
    local, ctx = fcp.shard_batch(None, batch)
    ids = local["input_ids"]
    with torch.no_grad():
        logits = vlm(input_ids=ids, cp_context=ctx).logits
        hidden = backbone(input_ids=ids, cp_context=ctx).last_hidden_state
    torch.testing.assert_close(logits, vlm.lm_head(hidden))
    pixels = torch.randn(16, 3 * 2 * 4 * 4)  # one 4 x 4 grid of patches
    grid = torch.tensor([[1, 4, 4]])
    calls = [dict(pixel_values=pixels, image_grid_thw=grid), dict(image_grid_thw=grid),
             dict(pixel_values_videos=pixels, video_grid_thw=grid)]  # fmt: skip
    vision = [0]
    vlm.model.visual.register_forward_pre_hook(lambda *_: vision.__setitem__(0, vision[0] + 1))
    for kwargs in calls:
        with pytest.raises(ValueError, match=f"ForConditionalGeneration.forward: image and video "
                                             f"inputs are not supported with cp_context yet "
                                             f"\\(got {next(iter(kwargs))}\\)"):  # fmt: skip
            vlm(input_ids=ids, cp_context=ctx, **kwargs)
    with pytest.raises(ValueError, match=r"not supported with cp_context yet \(got pixel_values\)"):
        vlm(ids, None, None, None, None, None, pixels, cp_context=ctx)  # positional pixel_values
    with pytest.raises(ValueError, match=r"Model.forward: image .*\(got pixel_values\)"):
        vlm.model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, cp_context=ctx)
    assert vision == [0]  # raised before the vision tower ran
    assert all(m.fcp_expected_by == () for m in vlm.modules() if isinstance(m, FcpMixer))


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_mixers_do_not_recompile_across_packings(references, family):
    """Every mixer compiled as the demo does (``mixer.compile``, fullgraph, aot_eager), the model
    run over 10 packings of the same shape: one graph per mixer kind, made at the first step, and
    the compiled model's outputs equal eager's."""
    counts, kinds = fns.compile_counts(family, CONFIGS[family], references[family]["state"], 10)
    assert counts == [kinds] * 10, counts


# ---------------------------------------------------------------------------------------------
# RoPE: the tables and rotations transformers' own modules compute
# ---------------------------------------------------------------------------------------------
POSITIONS = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", ["tiny", "default"])
def test_text_mrope_is_1d_rope_at_the_text_position(dtype, size):
    """Qwen3.5's mRoPE given three equal position axes (text tokens) is bitwise the 1-D table of
    :func:`~fcp.integrations.hf.rope.rope_tables` at that position; unequal axes differ."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from fcp.integrations.hf.rope import rope_tables

    config = Qwen3_5TextConfig(**(QWEN3_5_TINY if size == "tiny" else {}))
    rotary = Qwen3_5TextRotaryEmbedding(config)
    x = torch.zeros(2, 9, 4, dtype=dtype)
    got = rope_tables(config, POSITIONS, dtype)
    want = rotary(x, POSITIONS[None].expand(3, -1, -1))
    assert got[0].shape == want[0].shape and all(map(torch.equal, got, want))
    image = rotary(x, torch.stack([POSITIONS, POSITIONS + 1, POSITIONS + 2]))
    assert not torch.equal(image[0], got[0])


def test_interleaved_rope_and_olmo_tables_are_transformers_own():
    """Bailing-Hybrid: its rotary module's tables (dim ``qk_rope_head_dim``) and DeepSeek's
    interleaved rotation equal fcp's bitwise (eager and compiled); OLMo-Hybrid: its fp32 tables
    for a bf16 input equal ``rope_tables(..., torch.float32)``."""
    from transformers.models.bailing_hybrid.configuration_bailing_hybrid import BailingHybridConfig
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import (
        BailingHybridRotaryEmbedding,
        apply_rotary_pos_emb_interleave,
    )
    from transformers.models.olmo_hybrid.configuration_olmo_hybrid import OlmoHybridConfig
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridRotaryEmbedding

    from fcp.integrations.hf.rope import apply_rope_interleaved, rope_tables

    config = BailingHybridConfig(**BAILING_HYBRID_TINY)
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 9, 2, 4, generator=gen), torch.randn(2, 9, 1, 4, generator=gen)
    cos, sin = rope_tables(config, POSITIONS, q.dtype)
    want_tables = BailingHybridRotaryEmbedding(config)(q, POSITIONS)
    assert cos.shape == (2, 9, 4) and all(map(torch.equal, (cos, sin), want_tables))
    want = apply_rotary_pos_emb_interleave(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    torch._dynamo.reset()
    compiled = torch.compile(apply_rope_interleaved, fullgraph=True, backend="aot_eager")
    for fn in (apply_rope_interleaved, compiled):
        got = fn(q, cos, sin).transpose(1, 2), fn(k, cos, sin).transpose(1, 2)
        assert all(map(torch.equal, got, want))
    olmo = OlmoHybridConfig(**OLMO_HYBRID_TINY)
    want = OlmoHybridRotaryEmbedding(olmo)(torch.zeros(1, dtype=torch.bfloat16), POSITIONS)
    got = rope_tables(olmo, POSITIONS, torch.float32)
    assert want[0].dtype == torch.float32 and all(map(torch.equal, got, want))


@pytest.mark.parametrize("rope", ["rope", "nope"])
def test_olmo_attention_alone_with_and_without_rope(rope):
    """OLMo-Hybrid's attention enabled on its own, on packed documents, equals transformers' code
    on each document alone: with RoPE (its rotary tables at ``0 .. n-1``) and NoPE (a config
    without ``rope_theta``: transformers passes ``position_embeddings=None``)."""
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridRotaryEmbedding

    config = dict(OLMO_HYBRID_TINY)
    if rope == "nope":
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": None}
    model = build("olmo_hybrid", config)
    assert (model.rotary_emb is None) == (rope == "nope")
    attn = enable_packed_cp(model.layers[1].self_attn)
    x = torch.randn(2, 30, HIDDEN, generator=torch.Generator().manual_seed(1))
    seq_lens = torch.tensor([[13, 5, 8], [22, -1000, -1000]])
    ctx = fcp.PackedContext(fcp.doc_ids_from_seq_lens(seq_lens, 30))
    with torch.no_grad():
        got = attn(x, position_embeddings=None, attention_mask=None, cp_context=ctx)[0]
        for r, row in enumerate([[13, 5, 8], [22]]):
            start = 0
            for n in row:
                doc = x[r : r + 1, start : start + n]
                tables = None
                if rope == "rope":
                    tables = OlmoHybridRotaryEmbedding(model.config)(doc, torch.arange(n)[None])
                causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
                want = attn(doc, position_embeddings=tables, attention_mask=causal)[0]
                torch.testing.assert_close(got[r : r + 1, start : start + n], want,
                                           atol=1e-5, rtol=1e-5)  # fmt: skip
                start += n
