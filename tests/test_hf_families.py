"""transformers' hybrid families trained on packed documents with fcp: the standard parity battery,
run on every row of :data:`tests.support.hf_families.FAMILIES`.

:func:`fcp.integrations.hf.enable_packed_cp` replaces the token mixers of tiny random text
backbones:

* Kimi-Linear: KDA with a per-channel gate, NoPE MLA; Bailing-Hybrid: KDA with a full-width
  output gate, MLA with interleaved RoPE on its rope channels and a per-head output gate;
* Qwen3-Next: Gated DeltaNet with one gate per value head, interleaved projections, its conv and
  SiLU-gated norm, and gated GQA attention with q/k norm and partial RoPE at document-local
  positions; Qwen3.5 / Qwen3.5-MoE: the same with separate projections (mRoPE text positions are
  1-D RoPE); OLMo-Hybrid: Gated DeltaNet with ``beta = 2 sigmoid(b)``, attention with q/k norm
  over all heads and fp32 RoPE tables;
* the Mamba2 hybrids Nemotron-H, Granite 4.0-H, Falcon-H1 and Bamba (one mixer kind: conv over
  ``[x | B | C]``, SSD as :func:`fcp.ops.gla.gla`, D skip, gated RMSNorm; their attention NoPE,
  RoPE, muP-scaled or half-rotated), their MoE transformers' own; LFM2 / LFM2-MoE: gated short
  conv and GQA with per-head q/k norm;
* sliding-window and full attention: Gemma 2 (soft-capped scores), Gemma 3 (q/k norms, a RoPE
  per layer type), gpt-oss (per-head sinks, YaRN), Granite-SWA / -MoE-SWA (sinks, a RoPE base
  per layer or NoPE), LFM3 (gated short conv beside them), Lara-Mini (Gated DeltaNet beside
  them), ZAYA (convolutional q/k, a token-shifted value half), Inkling-2 (static and dynamic
  short convs, a per-query relative-position bias, per-query sinks), DeepSeek-V4 (sliding
  layers with sinks, CSA and HCA compressed attention with a lightning indexer); GLM-5 (MLA
  over a token-level DSA indexer with RoPE, its selection shared across layers).

Every packed document must then come out exactly as transformers computes it alone (its
pure-PyTorch paths: FLA, mamba_ssm and causal-conv1d blocked): outputs to 1e-5; every parameter's
gradient, summed over the CP ranks, to 1e-5 relative to the larger of its own largest entry and a
tenth of the model's largest gradient entry (fp32 rounding of differently ordered sums); on 1, 2
and 4 gloo ranks, for Hypothesis packings (documents shorter than the conv width, a document
spanning every rank, padding, two rows; for the sliding-window families windows longer than
a shard). The Mamba2 configurations use chunks of 8 tokens, so
documents cross chunk boundaries in transformers and in fcp.

The reference (transformers itself, in one subprocess for every family: the session's
``hf_references``) runs once over a pool of documents; each example packs a subset of them.
What only one family has is tested in its own module (``tests/test_hf_kimi_qwen3next.py``,
``tests/test_hf_qwen35_olmo_bailing.py``, ``tests/test_hf_mamba2_lfm2.py``).
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings

import fcp
from fcp.integrations.hf import enable_packed_cp
from tests import _hf_rank_fns as fns
from tests.support.hf_families import FAMILIES, documents, packings
from tests.support.hf_reference import build

NAMES = sorted(FAMILIES)


@pytest.mark.parametrize("family", NAMES)
def test_packed_documents_equal_transformers_on_each_document(rank_pool, hf_references, family):
    reference, config = hf_references[family], FAMILIES[family].config

    @settings(deadline=None, max_examples=FAMILIES[family].examples)
    @given(case=packings)
    def packed_equals_each_document(case):
        world, rows, seq = case
        fns.check(reference, rows, fns.run(rank_pool, reference, family, config, world, rows, seq))

    packed_equals_each_document()


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("family", NAMES)
def test_one_document_spanning_every_rank_with_padding(rank_pool, hf_references, family, world):
    fns.check_spanning_every_rank(rank_pool, hf_references[family], family,
                                  FAMILIES[family].config, world)  # fmt: skip


#: the families with sliding-window layers (their tiny windows: 5-7 tokens)
WINDOWED = [name for name in NAMES
            if {"sliding_window", "sliding_window_size"} & set(FAMILIES[name].config)]  # fmt: skip


@pytest.mark.parametrize("family", WINDOWED)
def test_windows_longer_than_a_shard(rank_pool, hf_references, family):
    """4 ranks of 4 tokens: the 13-token document spans every rank and every window is longer
    than a shard, so a sliding layer's K/V halo comes from more than the previous rank's last
    tokens (two ranks for windows of 6 and more); the second row packs four short documents."""
    fns.check_spanning_every_rank(rank_pool, hf_references[family], family,
                                  FAMILIES[family].config, 4, rows=((5,), (3, 2, 1, 0)),
                                  seq=16)  # fmt: skip


@pytest.mark.parametrize("family", NAMES)
def test_without_a_context_the_original_code_runs(hf_references, family):
    assert hf_references[family]["no_context_max_diff"] == 0.0


@pytest.mark.parametrize("family", NAMES)
def test_replacement_keeps_the_state_dict_and_loads_it_strictly(family):
    fns.check_replacement(family, FAMILIES[family].config, FAMILIES[family].mixers)


@pytest.mark.parametrize("wrapped", [False, True])
def test_an_unknown_model_is_refused_naming_the_supported_ones(wrapped):
    model = torch.nn.Linear(2, 2)
    if wrapped:
        model = torch.nn.Sequential(model)
    with pytest.raises(ValueError, match=f"{type(model).__name__} has no supported token "
                                         "mixer") as error:  # fmt: skip
        enable_packed_cp(model)
    # every family of the battery is named with its mixer classes (the whole registry:
    # tests/test_hf_registry.py)
    for name, family in FAMILIES.items():
        line = re.search(rf"^  {name} \(.*\): (.*)$", str(error.value), re.MULTILINE)
        # the registry row may also adapt a model class (Mamba's *ForCausalLM, which drops the
        # context otherwise): the battery's kinds are among its classes
        assert line and set(family.mixers) <= set(line.group(1).split(", ")), (name, line)


@pytest.mark.parametrize("family", NAMES)
def test_causal_lm_wrapper(family):
    """``*ForCausalLM`` (a model wrapping the backbone): its mixers are replaced, and its logits are
    the backbone's packed outputs through ``lm_head`` (the tiny configs keep Falcon-H1's
    ``lm_head_multiplier`` and Granite's ``logits_scaling`` at 1)."""
    import transformers

    backbone = enable_packed_cp(build(family, FAMILIES[family].config))
    lm = getattr(transformers, FAMILIES[family].causal_lm)(backbone.config)
    lm.base_model.load_state_dict(backbone.state_dict())  # .model, or .backbone (Mamba)
    enable_packed_cp(lm)
    assert [type(m) for m in lm.base_model.modules()] == [type(m) for m in backbone.modules()]
    batch, _ = fns.pack(documents(), [[5, 1, 3]], 30)
    local, ctx = fcp.shard_batch(None, batch)
    with torch.no_grad():
        logits = lm(input_ids=local["input_ids"], cp_context=ctx).logits
        hidden = backbone(input_ids=local["input_ids"], cp_context=ctx).last_hidden_state
    torch.testing.assert_close(logits, lm.lm_head(hidden).to(logits.dtype))


@pytest.mark.parametrize("family", [name for name in NAMES if FAMILIES[name].compile_steps])
def test_compiled_mixers_do_not_recompile_across_packings(family):
    """Every mixer compiled as the demo does (``mixer.compile``, fullgraph, aot_eager), the model
    run over 5 or 10 packings of the same shape: one graph per mixer kind, made at the first step,
    and the compiled model's outputs equal eager's."""
    steps = FAMILIES[family].compile_steps
    counts, kinds = fns.compile_counts(family, FAMILIES[family].config, steps)
    assert counts == [kinds] * steps, counts
