"""transformers' gpt-oss, LFM3 and Lara-Mini on fcp: what the standard battery does not cover.

Their per-document parity (sliding and full attention, gpt-oss's sinks, LFM3's short conv and
output gate, Lara-Mini's Gated DeltaNet and NoPE full attention), replacement contract,
``*ForCausalLM`` wrappers and compiled mixers are in ``tests/test_hf_families.py``; LFM3 without
its output gate is a configuration variant (``tests/test_hf_mamba2_lfm2.py``). Here the rotary
tables: gpt-oss's YaRN and LFM3's per-layer-type RoPE (plain on sliding layers, proportional on
full ones) are transformers' own, bitwise, rotation included; and a layer type whose RoPE rescales
with the sequence is refused.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fcp.integrations.hf import enable_packed_cp
from fcp.integrations.hf.rope import apply_rope
from tests.support.hf_reference import GPT_OSS_TINY, LFM3_TINY

POSITIONS = torch.tensor([[0, 1, 2, 3, 0, 1, 5, 40, 4095, 4096, 70000]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", ["tiny", "default"])
def test_gpt_oss_yarn_rotation_is_transformers(dtype, size):
    """gpt-oss's YaRN tables (``[head_dim / 2]``, scaled by its ``attention_scaling``) and its
    half-split rotation equal fcp's ``rotate_half`` rotation of :func:`rope_tables`, bitwise."""
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import (
        GptOssRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from fcp.integrations.hf.rope import rope_tables

    config = GptOssConfig(**(GPT_OSS_TINY if size == "tiny" else {}))
    assert config.rope_parameters["rope_type"] == "yarn"
    x = torch.randn(1, POSITIONS.shape[1], 4, config.head_dim).to(dtype)
    cos, sin = GptOssRotaryEmbedding(config)(x, POSITIONS)
    want, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    got = apply_rope(x, *rope_tables(config, POSITIONS, dtype))
    assert torch.equal(got, want.transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", ["tiny", "default"])
def test_lfm3_rotation_per_layer_type_is_transformers(dtype, size):
    """LFM3's attention rotates q and k with its layer type's fp32 tables (proportional RoPE on
    full layers: zero frequencies past ``partial_rotary_factor``) and casts back: the adapter's
    ``fcp_rotate_qk`` on each layer type equals transformers' rotation, bitwise."""
    import transformers
    from transformers.models.lfm3.modeling_lfm3 import Lfm3RotaryEmbedding, apply_rotary_pos_emb

    config = transformers.Lfm3Config(**(LFM3_TINY if size == "tiny" else
                                        dict(hidden_size=64, num_attention_heads=4,
                                             num_key_value_heads=2, num_hidden_layers=5,
                                             vocab_size=128, intermediate_size=64,
                                             pad_token_id=0, bos_token_id=1,
                                             eos_token_id=2)))  # fmt: skip
    model = enable_packed_cp(transformers.Lfm3Model(config))
    rotary = Lfm3RotaryEmbedding(config)
    ctx = SimpleNamespace(local_position_ids=POSITIONS)  # all fcp_rotate_qk reads of a context
    seen = set()
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or attn.layer_type in seen:
            continue
        seen.add(attn.layer_type)
        q = torch.randn(1, POSITIONS.shape[1], 4, config.head_dim).to(dtype)
        cos, sin = rotary(q, POSITIONS, attn.layer_type)
        want, _ = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos, sin)
        got, _ = attn.fcp_rotate_qk(q, q, ctx)
        assert got.dtype == dtype and torch.equal(got, want.transpose(1, 2)), attn.layer_type
    assert seen == {"sliding_attention", "full_attention"}


def test_lfm3_refuses_a_sequence_dependent_rope_on_one_layer_type():
    import transformers

    config = dict(LFM3_TINY, rope_parameters={
        "sliding_attention": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
        "full_attention": dict(LFM3_TINY["rope_parameters"]["full_attention"])})  # fmt: skip
    model = transformers.Lfm3Model(transformers.Lfm3Config(**config))
    with pytest.raises(NotImplementedError, match="rope_type='dynamic'"):
        enable_packed_cp(model)
