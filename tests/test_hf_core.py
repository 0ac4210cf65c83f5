"""The transformers integration's mechanism and guard (:mod:`fcp.integrations.hf.core`) and its
RoPE tables (:mod:`fcp.integrations.hf.rope`), on tiny GLM-5.3-Flash, Kimi-Linear and Qwen3-Next
models (their numerics: ``tests/test_hf_glm5.py``, ``tests/test_hf_families.py``).

* nothing is copied: each mixer stays the same object with the same attributes (plus the one the
  design documents), its class a cached subclass of the transformers class adding only ``fcp_``
  methods;
* a forward given a ``cp_context`` never runs the non-CP path silently: a decoder layer that drops
  the context, a KV cache, or a context of the wrong type raise, and leave nothing marked;
* the context is checked once, where it enters (the model's forward, or a mixer called alone);
* a configuration fcp cannot compute is refused by ``enable_packed_cp``, before any change;
* a compiled mixer does not recompile across packings (nor because of the guard's marks);
* the RoPE tables are transformers' own, for every rope type fcp accepts.
"""

from __future__ import annotations

import pytest
import torch

import fcp
from fcp.integrations.hf import SUPPORTED, FcpMixer, enable_packed_cp
from tests.support.hf_checks import assert_unmarked, drop_context
from tests.support.hf_reference import GLM5_TINY, KIMI_TINY, QWEN3_NEXT_TINY, build

CONFIGS = {"glm5_next": GLM5_TINY, "kimi_linear": KIMI_TINY, "qwen3_next": QWEN3_NEXT_TINY}
FAMILIES = sorted(CONFIGS)
SEQ = 24


def mixer_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, FcpMixer)]


def packed_batch(seed: int, seq: int = SEQ):
    """Two rows of random documents (a fresh packing per seed), sharded for one process."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(seq - 2, generator=gen)[:2].sort().values + 1
    lens = torch.tensor([[int(cuts[0]), int(cuts[1] - cuts[0]), seq - int(cuts[1])],
                         [seq - 3, -1000, -1000]])  # fmt: skip
    ids = torch.randint(1, 128, (2, seq), generator=gen)
    return fcp.shard_batch(None, {"input_ids": ids, "seq_lens": lens})


@pytest.mark.parametrize("family", FAMILIES)
def test_each_mixer_is_the_same_object_with_nothing_copied(family):
    model = build(family, CONFIGS[family])
    names = [n for n, m in model.named_modules() if type(m).__name__ in SUPPORTED]
    before = {n: (model.get_submodule(n), type(model.get_submodule(n)),
                  dict(vars(model.get_submodule(n)))) for n in names}  # fmt: skip
    enable_packed_cp(model)
    assert mixer_names(model) == names
    for name, (module, hf_class, attrs) in before.items():
        now = model.get_submodule(name)
        assert now is module and isinstance(now, hf_class)
        # the instance's own attributes are the original objects, plus the documented mark
        assert vars(now).keys() == attrs.keys() | {"fcp_expected_by"}
        assert all(vars(now)[k] is v for k, v in attrs.items())
        # the class adds methods only, all named fcp_* (besides the dispatch that every
        # Module already has: forward, __call__, __reduce_ex__)
        added = set(dir(type(now))) - set(dir(hf_class))
        assert added and all(a.startswith("fcp_") for a in added), added
        assert type(now).__getattr__ is torch.nn.Module.__getattr__  # no attribute fall-through


@pytest.mark.parametrize("family", FAMILIES)
def test_a_decoder_layer_that_drops_the_context_raises(family):
    model = enable_packed_cp(build(family, CONFIGS[family]))
    drop_context(model.layers[1])
    mixer = [n for n in mixer_names(model) if n.startswith("layers.1.")][0]
    local, ctx = packed_batch(0)
    with pytest.raises(ValueError, match=rf"{mixer} .*decoder layer \(layers\.1\) did not forward"):
        model(input_ids=local["input_ids"], cp_context=ctx)
    assert_unmarked(model)  # the exception left nothing marked
    del model.layers[1].forward
    with torch.no_grad():
        out = model(input_ids=local["input_ids"], cp_context=ctx)
    assert out.last_hidden_state.shape[:2] == (2, SEQ)
    assert_unmarked(model)


def test_the_outermost_model_names_the_mixer_and_a_wrapper_that_drops_the_context_raises():
    """A ``*ForCausalLM`` whose inner model is never given the context: the outer model's
    mark makes its mixers raise, named from the outer model."""
    import transformers

    backbone = build("qwen3_next", QWEN3_NEXT_TINY)
    lm = transformers.Qwen3NextForCausalLM(backbone.config)
    lm.model = backbone
    enable_packed_cp(lm)
    drop_context(backbone)
    local, ctx = packed_batch(1)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.linear_attn .*did not forward"):
        lm(input_ids=local["input_ids"], cp_context=ctx)
    assert_unmarked(lm)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_kv_cache_or_a_wrong_context_with_cp_raises(family):
    from transformers import DynamicCache

    model = enable_packed_cp(build(family, CONFIGS[family]))
    local, ctx = packed_batch(2)
    ids = local["input_ids"]
    with pytest.raises(ValueError, match="without a KV cache.*use_cache=True"):
        model(input_ids=ids, cp_context=ctx, use_cache=True)
    for name in ("cache", "past_key_values"):
        with pytest.raises(ValueError, match=f"without a KV cache.*{name}"):
            model(input_ids=ids, cp_context=ctx, **{name: DynamicCache(config=model.config)})
    with pytest.raises(TypeError, match="cp_context must be a PackedContext"):
        model(input_ids=ids, cp_context=ctx.doc_ids)
    assert_unmarked(model)
    with torch.no_grad():  # use_cache omitted: no cache is built whatever the config says
        assert model.config.use_cache and model(input_ids=ids, cp_context=ctx).cache is None


def test_the_context_is_checked_once_where_it_enters(monkeypatch):
    """A model forward checks its ``cp_context`` once, in its scope's pre-hook; the mixers it
    reaches take it as checked. A mixer called on its own, outside an enabled model's forward,
    is its own entry point: it checks the context (type, no KV cache) itself."""
    from transformers import DynamicCache

    import fcp.integrations.hf.core as core

    calls, check = [], core.check_context
    monkeypatch.setattr(core, "check_context",
                        lambda *a, **k: calls.append(k["fn"]) or check(*a, **k))  # fmt: skip
    model = enable_packed_cp(build("qwen3_next", QWEN3_NEXT_TINY))
    local, ctx = packed_batch(3)
    with torch.no_grad():
        model(input_ids=local["input_ids"], cp_context=ctx)
    assert calls == ["Qwen3NextModel.forward"]
    attn, x = model.layers[1].self_attn, torch.randn(2, SEQ, QWEN3_NEXT_TINY["hidden_size"])
    with torch.no_grad():
        attn(x, position_embeddings=None, attention_mask=None, cp_context=ctx)
    assert calls == ["Qwen3NextModel.forward", "PackedQwen3NextAttention.forward"]
    with pytest.raises(TypeError, match="cp_context must be a PackedContext"):
        attn(x, position_embeddings=None, attention_mask=None, cp_context=ctx.doc_ids)
    with pytest.raises(ValueError, match="without a KV cache.*past_key_values"):
        attn(x, position_embeddings=None, attention_mask=None, cp_context=ctx,
             past_key_values=DynamicCache(config=model.config))  # fmt: skip
    assert_unmarked(model)


@pytest.mark.parametrize("family", ["glm5_next", "qwen3_next"])
def test_a_compiled_mixer_does_not_recompile_across_packings(family):
    """Every mixer compiled as the demo does (``mixer.compile``, fullgraph, aot_eager), the
    model run eagerly (its guard marks the mixers every step) over 4 packings: one graph per
    mixer kind, compiled at the first step."""
    import torch._dynamo.testing

    model = enable_packed_cp(build(family, CONFIGS[family]))
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    for name in mixer_names(model):
        model.get_submodule(name).compile(backend=counter, fullgraph=True, dynamic=False)
    kinds = len({type(model.get_submodule(n)) for n in mixer_names(model)})
    counts = []
    with torch.no_grad():
        for step in range(4):
            local, ctx = packed_batch(10 + step)
            model(input_ids=local["input_ids"], cp_context=ctx)
            counts.append(counter.frame_count)
    assert counts == [kinds] * 4, counts


def test_an_unsupported_configuration_is_refused_before_any_change():
    model = build("qwen3_next", QWEN3_NEXT_TINY)
    model.layers[2].linear_attn.activation = "gelu"
    with pytest.raises(NotImplementedError, match="SiLU.*'gelu'"):
        enable_packed_cp(model)
    assert not any(isinstance(m, FcpMixer) for m in model.modules())
    model = build("qwen3_next", dict(QWEN3_NEXT_TINY, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25}))  # fmt: skip
    with pytest.raises(NotImplementedError, match="'dynamic'"):
        enable_packed_cp(model)
    assert not any(isinstance(m, FcpMixer) for m in model.modules())


SCALED_ROPE = {"default": {}, "linear": {"factor": 2.0},
               "yarn": {"factor": 4.0, "original_max_position_embeddings": 128},
               "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}}  # fmt: skip


@pytest.mark.parametrize("rope_type", sorted(SCALED_ROPE))
def test_rope_tables_are_transformers_own(rope_type):
    """:func:`~fcp.integrations.hf.rope.rope_tables` from a config equals transformers' rotary
    module of that config bitwise (frequencies and attention scaling), partial rotary included;
    and traced inside a fullgraph compile."""
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

    from fcp.integrations.hf.rope import rope_tables

    rope = {"rope_type": rope_type, "rope_theta": 1000.0, "partial_rotary_factor": 0.5,
            **SCALED_ROPE[rope_type]}  # fmt: skip
    config = Qwen3NextConfig(hidden_size=32, num_attention_heads=2, head_dim=16,
                             max_position_embeddings=512, rope_parameters=rope)  # fmt: skip
    positions = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(0))
    x = torch.zeros(2, 7, 4, dtype=torch.bfloat16)
    want = Qwen3NextRotaryEmbedding(config)(x, positions)
    got = rope_tables(config, positions, x.dtype)
    assert got[0].shape == (2, 7, 8) and all(torch.equal(g, w) for g, w in zip(got, want))
    torch._dynamo.reset()
    compiled = torch.compile(rope_tables, fullgraph=True, backend="aot_eager", dynamic=False)
    assert all(torch.equal(g, w) for g, w in zip(compiled(config, positions, x.dtype), want))


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear"])
def test_no_sequence_by_sequence_mask_is_built_under_a_context(family):
    """transformers' eager causal mask is ``[batch, 1, seq, seq]`` (16 GiB at 64k tokens) and
    fcp's mixers never read it: under a context the model gets an empty mask mapping."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seq = 97  # prime: no layer width equals it

    class SquareOutputs(TorchDispatchMode):
        found: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2:] == (seq, seq):
                    self.found.append(str(func))
            return out

    model = enable_packed_cp(build(family, CONFIGS[family]))
    ids = torch.randint(1, 100, (1, seq))
    local, ctx = fcp.shard_batch(None, {"input_ids": ids, "seq_lens": torch.tensor([[40, 57]])})
    with torch.no_grad(), SquareOutputs() as mode:
        model(input_ids=local["input_ids"], cp_context=ctx)
    assert mode.found == [], mode.found
    from transformers.masking_utils import create_causal_mask

    with torch.no_grad(), SquareOutputs() as mode:  # what the model would have built
        create_causal_mask(config=model.config, inputs_embeds=torch.zeros(1, seq, 8),
                           attention_mask=None, cache=None,
                           position_ids=torch.arange(seq)[None])  # fmt: skip
    assert mode.found, "the probe no longer sees transformers' mask"
