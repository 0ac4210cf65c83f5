"""Nothing mixes tokens outside fcp under a context (:mod:`fcp.integrations.hf.coverage`).

* ``enable_packed_cp`` refuses a model holding a token mixer it does not replace (a foreign
  transformers attention, an ``nn.Conv1d``, a recurrence), naming each one, and leaves the model
  unchanged; ``allow_unreplaced=True`` enables it, and the mixer then raises when called inside a
  forward given a ``cp_context`` (naming itself, leaving nothing marked) and runs as it is
  outside one;
* the rule flags nothing in the 14 supported families (nor in a vision-language wrapper's
  vision tower, which fcp never runs under a context), and would flag every supported mixer were
  it not supported;
* ``packed_mixers`` lists what was replaced, and ``enable_packed_cp`` logs it.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import fcp
from fcp.integrations.hf import SUPPORTED, UnreplacedGuard, enable_packed_cp, packed_mixers
from fcp.integrations.hf import unreplaced_mixers
from fcp.integrations.hf.core import fcp_class
from fcp.integrations.hf.families import FAMILIES
from fcp.integrations.hf.coverage import mixes_tokens, unreplaced
from tests.support import hf_reference as ref
from tests.support.hf_checks import assert_unmarked

#: the 14 supported families' tiny backbones
#: every family of the registry, with its tiny test configuration
CONFIGS = {row.name: ref._tiny(row.name) for row in FAMILIES}
HIDDEN, SEQ = 32, 16
#: Qwen3.5 rotating whole heads (head_dim 16: mRoPE sections of 8 frequencies), so that a
#: Qwen3 / Llama / Mistral attention takes its position embeddings as they are
QWEN3_5_FULL_ROPE = dict(ref.QWEN3_5_TINY, rope_parameters=dict(
    ref.QWEN3_5_TINY["rope_parameters"], partial_rotary_factor=1.0, mrope_section=[4, 2, 2]))


class ConvBlock(nn.Module):
    """A causal depthwise conv over the sequence, in a decoder layer's ``linear_attn`` slot."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(HIDDEN, HIDDEN, 3, groups=HIDDEN, padding=2)

    def forward(self, hidden_states, **kwargs):
        out = self.conv(hidden_states.transpose(1, 2))[..., : hidden_states.shape[1]]
        return out.transpose(1, 2)


class RnnWrapper(nn.Module):  # not named like a mixer: the rule finds its nn.GRU / nn.LSTM
    def __init__(self, kind: type[nn.RNNBase]):
        super().__init__()
        self.rnn = kind(HIDDEN, HIDDEN, batch_first=True)

    def forward(self, hidden_states, **kwargs):
        return self.rnn(hidden_states)[0]


def foreign_attention(name: str) -> nn.Module:
    """transformers' ``<name>Attention`` (layer 1) at the tiny Qwen3.5's attention shapes."""
    import importlib

    import transformers

    config = getattr(transformers, f"{name}Config")(
        hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=3, vocab_size=128)
    config._attn_implementation = "eager"
    modeling = importlib.import_module(f"transformers.models.{name.lower()}.modeling_"
                                       f"{name.lower()}")  # fmt: skip
    return getattr(modeling, f"{name}Attention")(config, layer_idx=1)


#: the foreign module -> (where it goes in the tiny Qwen3.5, the path and class reported)
FOREIGN = {
    "Qwen3Attention": (lambda: foreign_attention("Qwen3"), "layers.1.self_attn",
                       "layers.1.self_attn", "Qwen3Attention"),
    "LlamaAttention": (lambda: foreign_attention("Llama"), "layers.1.self_attn",
                       "layers.1.self_attn", "LlamaAttention"),
    "MistralAttention": (lambda: foreign_attention("Mistral"), "layers.1.self_attn",
                         "layers.1.self_attn", "MistralAttention"),
    "Conv1d": (ConvBlock, "layers.0.linear_attn", "layers.0.linear_attn.conv", "Conv1d"),
    "GRU": (lambda: RnnWrapper(nn.GRU), "layers.2.linear_attn", "layers.2.linear_attn.rnn",
            "GRU"),
    "LSTM": (lambda: RnnWrapper(nn.LSTM), "layers.0.linear_attn", "layers.0.linear_attn.rnn",
             "LSTM"),
}  # fmt: skip


def with_foreign(kind: str) -> tuple[nn.Module, str, str]:
    """A tiny Qwen3.5 text model with one mixer swapped for ``FOREIGN[kind]``: (model, reported
    path, reported class)."""
    make, slot, path, cls = FOREIGN[kind]
    model = ref.build("qwen3_5", QWEN3_5_FULL_ROPE)
    layer, _, attr = slot.rpartition(".")
    torch.manual_seed(1)
    setattr(model.get_submodule(layer), attr, make())
    return model, path, cls


def packed_batch():
    """Two rows of packed documents, for one process."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (2, SEQ), generator=gen)
    seq_lens = torch.tensor([[5, 11], [SEQ - 3, -1000]])
    return fcp.shard_batch(None, {"input_ids": ids, "seq_lens": seq_lens})


def guards(model: nn.Module) -> list[UnreplacedGuard]:
    return [g for m in model.modules() if (g := UnreplacedGuard.of(m)) is not None]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_no_supported_family_has_an_unreplaced_mixer(family, caplog):
    """Nothing is flagged in any supported family, and every supported mixer would be (by
    itself, for Qwen4-Exp's PLE its conv, for a mixer nested in another the outer one) were it
    not supported: the rule sees them all."""
    model = ref.build(family, CONFIGS[family])
    supported = {n: m for n, m in model.named_modules() if type(m).__name__ in SUPPORTED}
    flagged = unreplaced(model, lambda m: False)
    leaves = [n for n, m in supported.items()
              if not any(type(s).__name__ in SUPPORTED for s in m.modules() if s is not m)]
    # a flagged module at the leaf, inside it, or around it (Inkling-2's short convs also sit
    # inside its attention's k/v projections: the attention is the one flagged)
    assert leaves and all(any(f == n or f.startswith(n + ".") or n.startswith(f + ".")
                              for f in flagged) for n in leaves)  # fmt: skip
    assert unreplaced_mixers(model) == {}
    with caplog.at_level(logging.INFO, logger="fcp"):
        assert enable_packed_cp(model) is model
    assert packed_mixers(model) == {n: SUPPORTED[type(m).__bases__[1].__name__].__name__
                                    for n, m in supported.items()}  # fmt: skip
    assert not guards(model)
    (record,) = [r for r in caplog.records if r.name == "fcp"]
    assert record.levelno == logging.INFO
    assert f"enable_packed_cp({type(model).__name__}): {len(supported)} modules on fcp" in (
        record.getMessage())


def test_packed_mixers_and_the_log_name_what_was_replaced(caplog):
    model = ref.build("qwen3_5", ref.QWEN3_5_TINY)
    assert packed_mixers(model) == {}
    with caplog.at_level(logging.INFO, logger="fcp"):
        enable_packed_cp(model)
    assert packed_mixers(model) == {"layers.0.linear_attn": "Qwen3_5GdnAdapter",
                                    "layers.1.self_attn": "Qwen3NextAttentionAdapter",
                                    "layers.2.linear_attn": "Qwen3_5GdnAdapter"}  # fmt: skip
    assert fcp_class(model.layers[1].self_attn).__name__ == "Qwen3NextAttentionAdapter"
    assert caplog.messages == ["enable_packed_cp(Qwen3_5TextModel): 3 modules on fcp: "
                               "2 Qwen3_5GatedDeltaNet -> Qwen3_5GdnAdapter, "
                               "1 Qwen3_5Attention -> Qwen3NextAttentionAdapter"]  # fmt: skip


def test_a_vision_language_wrapper_has_no_unreplaced_mixer():
    """The vision tower's attention and patch conv are not flagged: fcp refuses image inputs
    under a context, so a forward given one never runs them."""
    import transformers

    from tests.test_hf_qwen35_olmo_bailing import SPECIAL, VISION

    config = transformers.Qwen3_5Config(text_config=ref.QWEN3_5_TINY, vision_config=VISION,
                                        **SPECIAL)  # fmt: skip
    vlm = transformers.Qwen3_5ForConditionalGeneration(config)
    assert mixes_tokens(vlm.model.visual.blocks[0].attn)  # flagged, were it not the tower's
    assert unreplaced_mixers(vlm) == {}
    enable_packed_cp(vlm)
    assert len(packed_mixers(vlm)) == 3 and not guards(vlm)


def test_the_rule_on_single_modules():
    from transformers.pytorch_utils import Conv1D

    assert mixes_tokens(nn.Conv1d(4, 4, 3)) and mixes_tokens(nn.Conv1d(4, 4, 1, stride=2))
    assert not mixes_tokens(nn.Conv1d(4, 4, 1))  # per token
    assert not mixes_tokens(Conv1D(4, 4))  # GPT-2's linear layer
    assert mixes_tokens(nn.MultiheadAttention(4, 2)) and mixes_tokens(nn.GRUCell(4, 4))
    assert not mixes_tokens(nn.Linear(4, 4)) and not mixes_tokens(nn.LayerNorm(4))

    class MyAttention(nn.Module):
        pass

    class Custom(MyAttention):  # named by its base
        pass

    class Projections(nn.Module):  # attention by its projections
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(4, 4) for _ in range(3))

    class OlmoLikeAttentionDecoderLayer(nn.Module):  # a layer holding a mixer, not one
        pass

    assert mixes_tokens(Custom()) and mixes_tokens(Projections())
    assert not mixes_tokens(OlmoLikeAttentionDecoderLayer())


@pytest.mark.parametrize("kind", ["LlamaAttention", "MistralAttention"])
def test_foreign_attentions_are_refused(kind):
    model, path, cls = with_foreign(kind)
    assert unreplaced_mixers(model) == {path: cls}
    with pytest.raises(ValueError, match=rf"1 token mixer\(s\) that fcp does not replace: "
                                         rf"{path} \({cls}\)\..*allow_unreplaced=True"):  # fmt: skip
        enable_packed_cp(model)
    assert packed_mixers(model) == {} and not guards(model)  # unchanged


@pytest.mark.parametrize("kind", ["Qwen3Attention", "Conv1d", "GRU", "LSTM"])
def test_an_unreplaced_mixer_is_refused_or_raises_under_a_context(kind, caplog):
    """Refused by default (the model unchanged); with ``allow_unreplaced=True`` the model runs as
    before without a context, and a forward given one raises naming the mixer, from the model and
    from a ``*ForCausalLM`` around it, leaving nothing marked."""
    import transformers

    model, path, cls = with_foreign(kind)
    local, ctx = packed_batch()
    ids = local["input_ids"]
    with torch.no_grad():
        before = model(input_ids=ids).last_hidden_state
    with pytest.raises(ValueError, match=rf"that fcp does not replace: {path} \({cls}\)\. Under a "
                                         r"cp_context .*allow_unreplaced=True"):  # fmt: skip
        enable_packed_cp(model)
    assert packed_mixers(model) == {} and not guards(model)

    with caplog.at_level(logging.INFO, logger="fcp"):
        assert enable_packed_cp(model, allow_unreplaced=True) is model
    assert len(packed_mixers(model)) == 2
    assert any(r.levelno == logging.WARNING and f"{path} ({cls})" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    enable_packed_cp(model)  # idempotent: allowed once, allowed again, guarded once
    assert len(guards(model)) == 1 and guards(model)[0] is UnreplacedGuard.of(
        model.get_submodule(path))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).last_hidden_state, before)
        with pytest.raises(ValueError, match=rf"^{path} \({cls}\) mixes tokens along the sequence "
                                             r"and is not an fcp mixer"):  # fmt: skip
            model(input_ids=ids, cp_context=ctx)
        assert_unmarked(model)
        assert guards(model)[0].expected_by == ()

        lm = transformers.Qwen3_5ForCausalLM(model.config).eval()
        lm.model = model
        enable_packed_cp(lm, allow_unreplaced=True)
        with pytest.raises(ValueError, match=rf"^model\.{path} \({cls}\) mixes tokens"):
            lm(input_ids=ids, cp_context=ctx)
        assert_unmarked(lm)
        assert guards(lm)[0].expected_by == ()
        lm(input_ids=ids)  # without a context it runs
