"""The transformers families of the standard parity battery (``tests/test_hf_families.py``): what
each one is, and the documents every family's reference shares.

A family is a row of :data:`FAMILIES`: its tiny configuration (the ``test_config`` of fcp's
registry row, :mod:`fcp.integrations.hf.families`), the fcp mixer kind expected for each of its
transformers mixer classes, its ``*ForCausalLM`` class, how many Hypothesis packings its parity
test draws, and over how many packings its compiled mixers are checked for recompiles (0: checked
elsewhere, on the whole model)::

    family = FAMILIES["lfm2"]
    family.mixers   # {"Lfm2Attention": GqaMixer, "Lfm2ShortConv": GatedShortConvMixer}

:data:`VARIANTS` are configuration variants of a family that take other branches of its adapters
(their tests: ``tests/test_hf_mamba2_lfm2.py``). The references of every family and variant come
from one subprocess per session (the ``hf_references`` fixture of ``conftest.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fcp.integrations.hf import (
    FcpMixer,
    GatedDeltaNetMixer,
    GatedShortConvMixer,
    GqaMixer,
    IndexedMlaMixer,
    KdaMixer,
    MlaMixer,
    SsdMixer,
)
from fcp.integrations.hf.families.deepseek_v4 import DeepseekV4AttentionAdapter
from fcp.integrations.hf.mixers import Mamba1Mixer
from fcp.integrations.hf.mixers import LightningMixer
from fcp.integrations.hf.mixers.rglru import RglruMixer
from tests.support.hf_packings import document_packings
from tests.support.hf_reference import (
    BAILING_HYBRID_TINY,
    DEEPSEEK_V4_TINY,
    FALCON_MAMBA_TINY,
    JAMBA_TINY,
    MAMBA_TINY,
    ZAMBA_TINY,
    BAMBA_TINY,
    FALCON_H1_TINY,
    GEMMA2_TINY,
    GEMMA3_TINY,
    GLM_MOE_DSA_TINY,
    GPT_OSS_TINY,
    GRANITEMOE_SWA_TINY,
    GRANITE_HYBRID_TINY,
    GRANITE_SWA_TINY,
    INKLING2_TINY,
    KIMI_TINY,
    LARA_MINI_TINY,
    LFM2_MOE_TINY,
    LFM2_TINY,
    LFM3_TINY,
    MAMBA2_TINY,
    MINIMAX_TINY,
    NEMOTRON_H_TINY,
    OLMO_HYBRID_TINY,
    QWEN3_5_MOE_TINY,
    QWEN3_5_TINY,
    QWEN3_NEXT_TINY,
    ZAMBA2_TINY,
    ZAYA_TINY,
)
from tests.support.hf_reference import RECURRENT_GEMMA_TINY

HIDDEN = 32
#: the shared pool of documents: shorter than the conv width (1, 2, 3), around a chunk of a
#: rank's shard, up to 37 tokens
LENGTHS = [1, 2, 3, 5, 8, 13, 22, 37]
#: Hypothesis packings of the pool (:func:`~tests.support.hf_packings.document_packings`)
packings = document_packings(LENGTHS)
SEED = 5  # of the pool's token ids and cotangents


@dataclass(frozen=True)
class Family:
    config: dict
    #: transformers mixer class name -> the fcp mixer kind that must replace it
    mixers: dict
    causal_lm: str
    examples: int
    compile_steps: int


def _gdn(prefix: str) -> dict:
    return {f"{prefix}Attention": GqaMixer, f"{prefix}GatedDeltaNet": GatedDeltaNetMixer}


FAMILIES = {
    # Mamba1 (selective scan as per-key gated linear attention); their blocks and models hand
    # the context down (transformers' drop **kwargs): no kind of their own. Their compiled
    # mixers: tests/test_hf_mamba1.py
    "mamba": Family(MAMBA_TINY, {"MambaMixer": Mamba1Mixer, "MambaBlock": FcpMixer,
                                 "MambaModel": FcpMixer}, "MambaForCausalLM", examples=2,
                    compile_steps=0),
    "falcon_mamba": Family(FALCON_MAMBA_TINY, {"FalconMambaMixer": Mamba1Mixer,
                                               "FalconMambaBlock": FcpMixer,
                                               "FalconMambaModel": FcpMixer},
                           "FalconMambaForCausalLM", examples=2, compile_steps=0),
    # Jamba: Mamba1 with dt/B/C norms (its decoder layer hands the context down), NoPE GQA, MoE
    "jamba": Family(JAMBA_TINY, {"JambaMambaMixer": Mamba1Mixer,
                                 "JambaMambaDecoderLayer": FcpMixer, "JambaAttention": GqaMixer},
                    "JambaForCausalLM", examples=2, compile_steps=0),
    # Zamba: multi-head Mamba1 + one shared NoPE attention block (Mamba1 compiled:
    # tests/test_hf_mamba1.py)
    "zamba": Family(ZAMBA_TINY, {"ZambaMambaMixer": Mamba1Mixer, "ZambaAttention": GqaMixer},
                    "ZambaForCausalLM", examples=2, compile_steps=0),
    # KDA + MLA; Gated DeltaNet + gated GQA (their whole models compile: test_hf_kimi_qwen3next)
    "kimi_linear": Family(KIMI_TINY, {"KimiLinearAttention": MlaMixer,
                                      "KimiLinearDeltaAttention": KdaMixer},
                          "KimiLinearForCausalLM", examples=6, compile_steps=0),
    "qwen3_next": Family(QWEN3_NEXT_TINY, _gdn("Qwen3Next"), "Qwen3NextForCausalLM", examples=6,
                         compile_steps=0),
    # Gated DeltaNet variants, KDA + MLA with RoPE
    "qwen3_5": Family(QWEN3_5_TINY, _gdn("Qwen3_5"), "Qwen3_5ForCausalLM", examples=3,
                      compile_steps=10),
    "qwen3_5_moe": Family(QWEN3_5_MOE_TINY, _gdn("Qwen3_5Moe"), "Qwen3_5MoeForCausalLM",
                          examples=3, compile_steps=10),
    "olmo_hybrid": Family(OLMO_HYBRID_TINY, _gdn("OlmoHybrid"), "OlmoHybridForCausalLM",
                          examples=3, compile_steps=10),
    "bailing_hybrid": Family(BAILING_HYBRID_TINY, {"BailingHybridAttention": MlaMixer,
                                                   "BailingHybridDeltaAttention": KdaMixer},
                             "BailingHybridForCausalLM", examples=3, compile_steps=10),
    # Mamba2 hybrids; gated short conv + GQA
    "nemotron_h": Family(NEMOTRON_H_TINY, {"NemotronHAttention": GqaMixer,
                                           "NemotronHMamba2Mixer": SsdMixer},
                         "NemotronHForCausalLM", examples=2, compile_steps=5),
    "granitemoehybrid": Family(GRANITE_HYBRID_TINY, {"GraniteMoeHybridAttention": GqaMixer,
                                                     "GraniteMoeHybridMambaLayer": SsdMixer},
                               "GraniteMoeHybridForCausalLM", examples=2, compile_steps=5),
    "falcon_h1": Family(FALCON_H1_TINY, {"FalconH1Attention": GqaMixer, "FalconH1Mixer": SsdMixer},
                        "FalconH1ForCausalLM", examples=2, compile_steps=5),
    "bamba": Family(BAMBA_TINY, {"BambaAttention": GqaMixer, "BambaMixer": SsdMixer},
                    "BambaForCausalLM", examples=2, compile_steps=5),
    "lfm2": Family(LFM2_TINY, {"Lfm2Attention": GqaMixer, "Lfm2ShortConv": GatedShortConvMixer},
                   "Lfm2ForCausalLM", examples=2, compile_steps=5),
    "lfm2_moe": Family(LFM2_MOE_TINY, {"Lfm2MoeAttention": GqaMixer,
                                       "Lfm2MoeShortConv": GatedShortConvMixer},
                       "Lfm2MoeForCausalLM", examples=2, compile_steps=5),
    # sliding-window + global attention: Gemma 3 (q/k norms, a RoPE per layer type), Granite-SWA
    # and Granite-MoE-SWA (per-head sinks, a RoPE base per layer or NoPE); their layers differ
    # in window and RoPE, one graph each: compiled in tests/test_hf_swa_gemma_granite.py
    # Gemma 2: sliding + global attention with soft-capped scores
    "gemma2": Family(GEMMA2_TINY, {"Gemma2Attention": GqaMixer}, "Gemma2ForCausalLM", examples=2,
                     compile_steps=3),
    "gemma3": Family(GEMMA3_TINY, {"Gemma3Attention": GqaMixer}, "Gemma3ForCausalLM", examples=2,
                     compile_steps=0),
    "granite_swa": Family(GRANITE_SWA_TINY, {"GraniteSWAAttention": GqaMixer},
                          "GraniteSWAForCausalLM", examples=2, compile_steps=0),
    "granitemoe_swa": Family(GRANITEMOE_SWA_TINY, {"GraniteMoeSWAAttention": GqaMixer},
                             "GraniteMoeSWAForCausalLM", examples=2, compile_steps=0),
    # sliding + full attention with sinks (gpt-oss, YaRN RoPE); gated short conv + sliding + full
    # attention with a RoPE per layer type and a per-head output gate (LFM3); Gated DeltaNet +
    # sliding attention with RoPE + NoPE full attention (Lara-Mini; its compiled Gated DeltaNet
    # is Qwen3.5's adapter, compiled above, its attention gpt-oss's kind: compile_steps 0)
    "gpt_oss": Family(GPT_OSS_TINY, {"GptOssAttention": GqaMixer}, "GptOssForCausalLM",
                      examples=2, compile_steps=3),
    "lfm3": Family(LFM3_TINY, {"Lfm3Attention": GqaMixer, "Lfm3ShortConv": GatedShortConvMixer},
                   "Lfm3ForCausalLM", examples=2, compile_steps=3),
    "lara_mini": Family(LARA_MINI_TINY, {"LaraMiniAttention": GqaMixer,
                                         "LaraMiniGatedDeltaNet": GatedDeltaNetMixer},
                        "LaraMiniForCausalLM", examples=2, compile_steps=0),
    # CCA (convolved q/k, a token-shifted half of v) + sliding and full GQA with q/k norm, a RoPE
    # per layer type, MoE with a router state carried across layers (ZAYA)
    "zaya": Family(ZAYA_TINY, {"ZayaAttention": GqaMixer}, "ZayaForCausalLM", examples=2,
                   compile_steps=3),
    # short convs around every block, sliding and full GQA with a per-query relative position
    # bias, per-query sinks, dynamic k/v convs, L2 clips / log scales, block attention residuals
    "inkling2": Family(INKLING2_TINY, {"Inkling2FullAttention": GqaMixer,
                                       "Inkling2ShortConvolution": FcpMixer,
                                       "Inkling2SlidingAttention": GqaMixer},
                       "Inkling2ForCausalLM", examples=2, compile_steps=3),
    # sliding attention with sinks + CSA (overlapping gated pools, lightning indexer) + HCA (gated
    # pools), K = V, mHC and hash-routed MoE (DeepSeek-V4)
    "deepseek_v4": Family(DEEPSEEK_V4_TINY, {"DeepseekV4Attention": DeepseekV4AttentionAdapter},
                          "DeepseekV4ForCausalLM", examples=2, compile_steps=0),
    # MLA with RoPE over a token-level DSA indexer's selection, shared by "shared" layers
    # (GLM-5; its full and shared layers compile to separate graphs: tests/test_hf_glm5_dsa.py)
    "glm_moe_dsa": Family(GLM_MOE_DSA_TINY, {"GlmMoeDsaAttention": IndexedMlaMixer},
                          "GlmMoeDsaForCausalLM", examples=2, compile_steps=0),
    # Mamba2 alone; Zamba2: Mamba2 + shared attention blocks with per-use LoRA adapters (its
    # attention compiles to one graph per hybrid layer, the adapter chosen by layer_idx:
    # tests/test_hf_mamba2_zamba2_minimax.py); MiniMax: lightning attention (GLA with a
    # constant per-head decay) + GQA
    "mamba2": Family(MAMBA2_TINY, {"Mamba2Mixer": SsdMixer}, "Mamba2ForCausalLM", examples=2,
                     compile_steps=3),
    "zamba2": Family(ZAMBA2_TINY, {"Zamba2Attention": GqaMixer, "Zamba2MambaMixer": SsdMixer},
                     "Zamba2ForCausalLM", examples=2, compile_steps=0),
    "minimax": Family(MINIMAX_TINY, {"MiniMaxAttention": GqaMixer,
                                     "MiniMaxLightningAttention": LightningMixer},
                      "MiniMaxForCausalLM", examples=2, compile_steps=3),
    # Griffin: short conv + RG-LRU (an elementwise scan) recurrent blocks beside local attention
    # with partial RoPE (RecurrentGemma)
    "recurrent_gemma": Family(RECURRENT_GEMMA_TINY, {"RecurrentGemmaAttention": GqaMixer,
                                                     "RecurrentGemmaRecurrentBlock": RglruMixer},
                              "RecurrentGemmaForCausalLM", examples=2, compile_steps=3),
}  # fmt: skip

#: configuration variants that take other branches of the adapters: Falcon-H1 without its gated
#: norm (``y * silu(z)``), Granite 4.0-H without RoPE, LFM3 without its output gate;
#: ``{name: (family, config)}``
VARIANTS = {"falcon_h1_no_norm": ("falcon_h1", dict(FALCON_H1_TINY, mamba_rms_norm=False)),
            "granite_nope": ("granitemoehybrid",
                             dict(GRANITE_HYBRID_TINY, position_embedding_type=None)),
            # LFM3 without its per-head output gate, sandwich norms or conv biases
            "lfm3_no_gate": ("lfm3", dict(LFM3_TINY, use_attention_gate=False,
                                          use_sandwich_norm=False, conv_bias=False)),
            # Zamba2 without adapters or RoPE, with GQA (2 kv heads: adapters need 4); MiniMax
            # with a sliding window on its softmax layers
            "zamba2_plain": ("zamba2", dict(ZAMBA2_TINY, use_shared_attention_adapter=False,
                                            use_mem_rope=False, num_key_value_heads=2)),
            "minimax_swa": ("minimax", dict(MINIMAX_TINY, sliding_window=5))}  # fmt: skip


def references() -> dict:
    """``{family or variant: reference}`` (:func:`tests._hf_rank_fns.references`) of every row
    of :data:`FAMILIES` and :data:`VARIANTS`, from one subprocess."""
    from tests import _hf_rank_fns as fns

    configs = {name: f.config for name, f in FAMILIES.items()}
    configs.update({name: config for name, (_, config) in VARIANTS.items()})
    families = {name: family for name, (family, _) in VARIANTS.items()}
    return fns.references(configs, LENGTHS, HIDDEN, seed=SEED, families=families)


def documents() -> dict:
    """The pool of documents alone (``docs``, ``cots``: what :func:`tests._hf_rank_fns.pack`
    reads), for tests that need no transformers outputs."""
    from tests import _hf_rank_fns as fns

    return fns.documents(LENGTHS, HIDDEN, SEED)
