"""transformers' Mamba2 hybrids (Nemotron-H, Granite 4.0-H, Falcon-H1, Bamba) and LFM2 / LFM2-MoE
trained on packed documents with fcp: per-document parity, the replacement contract, compilation.

:func:`fcp.integrations.hf.enable_packed_cp` replaces, in tiny random text backbones:

* the Mamba2 layers (one mixer kind, :class:`~fcp.integrations.hf.SsdMixer`: conv over
  ``[x | B | C]``, SSD as :func:`fcp.ops.gla.gla`, D skip, gated RMSNorm; Falcon-H1's muP
  multipliers and optional norm in its adapter) and the attention layers (Nemotron-H: NoPE;
  Granite 4.0-H: RoPE or NoPE, ``attention_multiplier``; Falcon-H1: ``key_multiplier``, both
  mixers of every layer in parallel; Bamba: RoPE on half of each head), MoE where the family has
  it (transformers' own);
* LFM2's gated short conv and its GQA attention with per-head q/k norm.

Every packed document must then come out exactly as transformers computes it alone (its
pure-PyTorch ``mamba2_chunk_scan`` / ``causal_conv1d_fn``, mamba_ssm and causal-conv1d blocked),
with the contract of ``tests/test_hf_kimi_qwen3next.py`` (its packings and documents, some shorter
than the conv width, one spanning every rank, padding, two rows): outputs to 1e-5; every
parameter's gradient summed over the CP ranks to 1e-5 relative to the larger of its own largest
entry and a tenth of the model's largest; on 1, 2 and 4 gloo ranks. The Mamba2 configurations
use chunks of 8 tokens, so documents cross chunk boundaries in transformers and in fcp.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import fcp
from fcp.integrations.hf import enable_packed_cp
from tests import _hf_rank_fns as fns
from tests.support.hf_reference import (
    BAMBA_TINY,
    FALCON_H1_TINY,
    GRANITE_HYBRID_TINY,
    LFM2_MOE_TINY,
    LFM2_TINY,
    NEMOTRON_H_TINY,
)
from tests.test_hf_kimi_qwen3next import HIDDEN, LENGTHS, POOL_TIMEOUT_S, packing

CONFIGS = {"nemotron_h": NEMOTRON_H_TINY, "granitemoehybrid": GRANITE_HYBRID_TINY,
           "falcon_h1": FALCON_H1_TINY, "bamba": BAMBA_TINY, "lfm2": LFM2_TINY,
           "lfm2_moe": LFM2_MOE_TINY}  # fmt: skip
FAMILIES = sorted(CONFIGS)
#: configuration variants that take other branches of the adapters: Falcon-H1 without its gated
#: norm (``y * silu(z)``), Granite 4.0-H without RoPE
VARIANTS = {"falcon_h1_no_norm": ("falcon_h1", dict(FALCON_H1_TINY, mamba_rms_norm=False)),
            "granite_nope": ("granitemoehybrid",
                             dict(GRANITE_HYBRID_TINY, position_embedding_type=None))}  # fmt: skip
#: the transformers mixer classes of each family (attention layer, the other mixer)
MIXERS = {"nemotron_h": ("NemotronHAttention", "NemotronHMamba2Mixer"),
          "granitemoehybrid": ("GraniteMoeHybridAttention", "GraniteMoeHybridMambaLayer"),
          "falcon_h1": ("FalconH1Attention", "FalconH1Mixer"),
          "bamba": ("BambaAttention", "BambaMixer"),
          "lfm2": ("Lfm2Attention", "Lfm2ShortConv"),
          "lfm2_moe": ("Lfm2MoeAttention", "Lfm2MoeShortConv")}  # fmt: skip
CAUSAL_LM = {"nemotron_h": "NemotronHForCausalLM",
             "granitemoehybrid": "GraniteMoeHybridForCausalLM",
             "falcon_h1": "FalconH1ForCausalLM", "bamba": "BambaForCausalLM",
             "lfm2": "Lfm2ForCausalLM", "lfm2_moe": "Lfm2MoeForCausalLM"}  # fmt: skip


@pytest.fixture(scope="module")
def references():
    configs = {**CONFIGS, **{case: config for case, (_, config) in VARIANTS.items()}}
    families = {case: family for case, (family, _) in VARIANTS.items()}
    return fns.references(configs, LENGTHS, HIDDEN, seed=11, families=families)


@pytest.mark.parametrize("family", FAMILIES)
@settings(deadline=None, max_examples=2)
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


@pytest.mark.parametrize("case", sorted(VARIANTS))
def test_configuration_variants_on_two_ranks(rank_pool, references, case):
    family, config = VARIANTS[case]
    rows = [[7, 2], [5, 0, 4]]
    results = fns.run(rank_pool, references[case], family, config, 2, rows, 40, POOL_TIMEOUT_S)
    fns.check(references[case], rows, results)


@pytest.mark.parametrize("case", FAMILIES + sorted(VARIANTS))
def test_without_a_context_the_original_code_runs(references, case):
    assert references[case]["no_context_max_diff"] == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_replacement_keeps_the_state_dict_and_loads_it_strictly(family):
    fns.check_replacement(family, CONFIGS[family], MIXERS[family])


def test_an_unknown_model_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match=r"Sequential has no supported token mixer .*"
                                         r"BambaMixer.*FalconH1Mixer.*GraniteMoeHybridMambaLayer.*"
                                         r"Lfm2MoeShortConv.*NemotronHMamba2Mixer"):  # fmt: skip
        enable_packed_cp(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_lm_wrapper(references, family):
    """``*ForCausalLM``: its mixers are replaced, and its logits are the backbone's packed outputs
    through ``lm_head`` (the tiny configs keep Falcon-H1's ``lm_head_multiplier`` and Granite's
    ``logits_scaling`` at 1)."""
    import transformers

    backbone = fns.packed_model(family, CONFIGS[family], references[family]["state"])
    lm = getattr(transformers, CAUSAL_LM[family])(backbone.config)
    lm.model.load_state_dict(references[family]["state"])
    enable_packed_cp(lm)
    assert [type(m) for m in lm.model.modules()] == [type(m) for m in backbone.modules()]
    batch, _ = fns.pack(references[family], [[5, 1, 3]], 30)
    local, ctx = fcp.shard_batch(None, batch)
    with torch.no_grad():
        logits = lm(input_ids=local["input_ids"], cp_context=ctx).logits
        hidden = backbone(input_ids=local["input_ids"], cp_context=ctx).last_hidden_state
    torch.testing.assert_close(logits, lm.lm_head(hidden).to(logits.dtype))


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_mixers_do_not_recompile_across_packings(references, family):
    """Every mixer compiled as the demo does (``mixer.compile``, fullgraph, aot_eager), the model
    run over 5 packings of the same shape: one graph per mixer kind, made at the first step, and
    the compiled model's outputs equal eager's."""
    counts, kinds = fns.compile_counts(family, CONFIGS[family], references[family]["state"], 5)
    assert counts == [kinds] * 5, counts
