"""transformers' Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid and Bailing-Hybrid on fcp: what the standard
battery does not cover.

Their per-document parity, replacement contract, ``*ForCausalLM`` wrappers and compiled mixers are
in ``tests/test_hf_families.py``. Here: Qwen3.5's vision-language wrappers (text on fcp, images
refused), and the RoPE variants: Qwen3.5's mRoPE text positions are 1-D RoPE, Bailing-Hybrid's
interleaved rotation and OLMo-Hybrid's fp32 tables are transformers' own, and OLMo-Hybrid's
attention alone with RoPE and NoPE equals transformers' code on each document.
"""

from __future__ import annotations

import pytest
import torch

import fcp
from fcp.integrations.hf import enable_packed_cp
from tests import _hf_rank_fns as fns
from tests.support.hf_checks import assert_unmarked, check_attention_alone
from tests.support.hf_families import FAMILIES, documents
from tests.support.hf_reference import BAILING_HYBRID_TINY, OLMO_HYBRID_TINY, QWEN3_5_TINY, build


#: a tiny vision tower for Qwen3.5's vision-language wrappers (its special tokens in the vocab)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
              patch_size=4, num_position_embeddings=16, spatial_merge_size=2,
              temporal_patch_size=2)  # fmt: skip
SPECIAL = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122,
               vision_end_token_id=123)  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_vision_language_wrapper_runs_text_and_refuses_images(family):
    """``Qwen3_5(Moe)ForConditionalGeneration`` holds the same text model: text-only calls under a
    ``cp_context`` run on fcp (logits = the text backbone's packed outputs through ``lm_head``);
    image or video inputs raise a ``ValueError`` before the vision tower runs, by keyword or by
    position, and leave no mixer marked."""
    import transformers

    name = {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}[family]
    config = getattr(transformers, f"{name}Config")(text_config=FAMILIES[family].config,
                                                    vision_config=VISION, **SPECIAL)  # fmt: skip
    vlm = getattr(transformers, f"{name}ForConditionalGeneration")(config).eval()
    backbone = enable_packed_cp(build(family, FAMILIES[family].config))
    text = vlm.model.language_model
    text.load_state_dict(backbone.state_dict())
    enable_packed_cp(vlm)
    assert [type(m) for m in text.modules()] == [type(m) for m in backbone.modules()]
    batch, _ = fns.pack(documents(), [[5, 1, 3], [4, 2]], 30)
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
    assert_unmarked(vlm)


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

    def tables(doc, positions):
        return OlmoHybridRotaryEmbedding(model.config)(doc, positions) if rope == "rope" else None

    check_attention_alone(enable_packed_cp(model.layers[1].self_attn), tables)
