"""transformers' Gemma 3, Granite-SWA and Granite-MoE-SWA on fcp (sliding-window and global
attention layers): what the standard battery does not cover.

Their per-document parity on 1, 2 and 4 ranks, replacement contract and ``*ForCausalLM`` wrappers
are in ``tests/test_hf_families.py``. Here:

* compiled mixers: one graph per distinct layer (a sliding and a global layer differ in their
  window, Granite-SWA's layers in their RoPE base), made at the first packing, none after;
* each layer's RoPE tables (Gemma 3's per layer type, with linear scaling on the global layers;
  Granite-SWA's per-layer base and NoPE) are transformers' own, bitwise, and reading them leaves
  the model's config as it was;
* Gemma 3's ``attn_logit_softcapping`` is inert in transformers (its attention never receives
  it), so fcp applies none either; bidirectional Gemma 3 and sequence-dependent rope types are
  refused before any change;
* ``Gemma3ForConditionalGeneration``: text on fcp, images refused.
"""

from __future__ import annotations

import pytest
import torch

import fcp
from fcp.integrations.hf import FcpMixer, enable_packed_cp
from tests import _hf_rank_fns as fns
from tests.support.hf_families import FAMILIES, documents
from tests.support.hf_reference import build

SWA = ("gemma3", "granite_swa", "granitemoe_swa")


@pytest.mark.parametrize(("family", "graphs"), [("gemma3", 2), ("granitemoe_swa", 3)])
def test_compiled_mixers_compile_once_per_distinct_layer(family, graphs):
    """Every mixer compiled as the demo does (``mixer.compile``, fullgraph, aot_eager) over 3
    packings of one shape: Gemma 3's sliding layers share a graph and its global layer has one
    (2), Granite-MoE-SWA's three layers differ in window or base (3: linear-scaled RoPE at two
    bases, NoPE); no recompile after the first packing, outputs equal eager's. Granite-SWA has the
    same adapter with default RoPE."""
    counts, layer_kinds = fns.compile_counts(family, FAMILIES[family].config, 3)
    assert layer_kinds == 2 and counts == [graphs] * 3, counts  # (class, layer type) pairs


def _transformers_rotation(model, i: int, q: torch.Tensor, k: torch.Tensor):
    """``(q, k)`` ``[1, L, heads, D]`` rotated as transformers' model rotates them in layer ``i``
    at positions ``0 .. L-1`` (unchanged under NoPE)."""
    import importlib

    positions = torch.arange(q.shape[1])[None]
    if type(model).__name__ == "Gemma3TextModel":
        tables = model.rotary_emb(q, positions, model.config.layer_types[i])
    elif not model.config.layer_rope_theta[i]:
        return q, k
    else:
        theta = model.config.layer_rope_theta[i]
        emb = next(e for e in model.rotary_embs if e.config.rope_parameters["rope_theta"] == theta)
        tables = emb(q, positions)
    modeling = importlib.import_module(type(model).__module__)
    q, k = modeling.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *tables)
    return q.transpose(1, 2), k.transpose(1, 2)


@pytest.mark.parametrize("family", SWA)
def test_each_layers_rotation_is_transformers(family):
    """``fcp_rotate_qk`` of every layer equals transformers' rotation of that layer, bitwise
    (on one document, whose local positions are its row positions); the tiny configs rotate at
    two different bases (Gemma 3: its sliding layers at one, its global layer at the other;
    Granite-SWA: its sliding layers at two, its full layer not at all), and reading a layer's
    rotary parameters leaves the model's config as it was."""
    model = build(family, FAMILIES[family].config)
    rope_before = repr(model.config.rope_parameters)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 40, 4, 8, generator=gen), torch.randn(1, 40, 2, 8, generator=gen)
    reference = [_transformers_rotation(model, i, q, k) for i in range(len(model.layers))]
    enable_packed_cp(model)
    _, ctx = fcp.shard_batch(None, {"input_ids": torch.ones(1, 40, dtype=torch.long),
                                    "seq_lens": torch.tensor([[40]])})  # fmt: skip
    rotated = []
    for i, layer in enumerate(model.layers):
        got = layer.self_attn.fcp_rotate_qk(q, k, ctx)
        assert all(torch.equal(g, w) for g, w in zip(got, reference[i])), (family, i)
        if not torch.equal(got[0], q):
            rotated.append(got[0])
    distinct = [r for i, r in enumerate(rotated) if not any(torch.equal(r, o) for o in rotated[:i])]
    assert len(rotated) == (3 if family == "gemma3" else 2) and len(distinct) == 2
    assert repr(model.config.rope_parameters) == rope_before


def test_gemma3_softcapping_is_inert_in_transformers_and_in_fcp():
    """transformers' Gemma 3 stores ``attn_logit_softcapping`` but never passes it to its
    attention: the model with the tiny config's cap (2.0, small enough to change the scores)
    equals the model without one. fcp follows the oracle: no cap."""
    config = FAMILIES["gemma3"].config
    assert config["attn_logit_softcapping"] == 2.0
    capped = build("gemma3", config)
    plain = build("gemma3", dict(config, attn_logit_softcapping=None))
    ids = documents()["docs"][7][None]
    with torch.no_grad():
        assert torch.equal(capped(input_ids=ids).last_hidden_state,
                           plain(input_ids=ids).last_hidden_state)
    enable_packed_cp(capped)
    mixers = [m for m in capped.modules() if isinstance(m, FcpMixer)]
    assert mixers and all(m.attn_logit_softcapping == 2.0 and m.fcp_softcap() is None
                          for m in mixers)  # fmt: skip


@pytest.mark.parametrize(("family", "change", "match"), [
    ("gemma3", dict(use_bidirectional_attention=True), "bidirectional"),
    ("gemma3", dict(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0}}),
     "dynamic"),
    ("granite_swa", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                          "rope_theta": 10000.0}), "dynamic"),
])  # fmt: skip
def test_what_fcp_cannot_compute_is_refused_before_any_change(family, change, match):
    model = build(family, dict(FAMILIES[family].config, **change))
    with pytest.raises(NotImplementedError, match=match):
        enable_packed_cp(model)
    assert not any(isinstance(m, FcpMixer) for m in model.modules())


def test_gemma3_vision_language_wrapper_runs_text_and_refuses_images():
    """``Gemma3ForConditionalGeneration`` holds the same text model: text-only calls under a
    ``cp_context`` run on fcp (logits = the text backbone's packed outputs through ``lm_head``);
    ``pixel_values`` raise before the vision tower runs."""
    import transformers

    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=8, patch_size=4)  # fmt: skip
    config = transformers.Gemma3Config(text_config=FAMILIES["gemma3"].config,
                                       vision_config=vision, mm_tokens_per_image=4,
                                       boi_token_index=120, eoi_token_index=121,
                                       image_token_index=122)  # fmt: skip
    vlm = transformers.Gemma3ForConditionalGeneration(config).eval()
    backbone = enable_packed_cp(build("gemma3", FAMILIES["gemma3"].config))
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
        with pytest.raises(ValueError, match="pixel_values"):
            vlm(input_ids=ids, pixel_values=torch.randn(1, 3, 8, 8), cp_context=ctx)
