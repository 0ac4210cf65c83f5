"""transformers' own models run on each document alone: the oracle of fcp's integrations.

Families (:func:`build`): ``"glm5_next"`` (GLM-5.3-Flash), ``"kimi_linear"`` (Kimi-Linear),
``"qwen3_next"`` (Qwen3-Next), ``"qwen3_5"`` / ``"qwen3_5_moe"`` (Qwen3.5 text models),
``"olmo_hybrid"`` (OLMo-Hybrid), ``"bailing_hybrid"`` (Bailing-Hybrid / Ling), the Mamba2
hybrids ``"nemotron_h"`` (Nemotron-H), ``"granitemoehybrid"`` (Granite 4.0-H), ``"falcon_h1"``
(Falcon-H1), ``"bamba"`` (Bamba), ``"lfm2"`` / ``"lfm2_moe"`` (LFM2, LFM2-MoE) and
``"qwen4_exp"`` (Qwen4-Exp's text model), each with a tiny configuration below.

transformers binds its hybrid models' recurrent kernels to FLA's Triton kernels whenever FLA is
importable, and those fail on a CPU; with FLA blocked (``sys.modules["fla"] = None`` before
transformers is imported) it uses its pure-PyTorch fallbacks. Likewise mamba_ssm and
causal-conv1d are blocked, so the Mamba2 and LFM2 layers run transformers' PyTorch paths
(``mamba2_chunk_scan``, ``causal_conv1d_fn``) even where those packages are installed. Blocking
is process-wide, so the reference runs in a fresh subprocess:
``python -m tests.support.hf_reference IN OUT``.

:func:`per_document` (called from the test process) writes the job, runs the subprocess, and
returns for every document its output (``last_hidden_state`` ``[n, hidden]``) and the gradient
of ``sum(output * cotangent)`` for every parameter; :func:`per_document_jobs` runs several
models in one subprocess (one transformers import).

Ties. GLM-5.3-Flash's indexer takes ``torch.topk`` of scores with a ``relu`` inside, so equal
scores (often exact zeros) at the selection boundary are common, and ``torch.topk`` leaves their
order unspecified. fcp's rule is documented: equal scores go to the earlier pool. The reference
therefore runs the indexer with that rule (a stable descending sort in place of ``topk``, only
inside the indexer's forward) and reports how many query rows the rule decided, i.e. where
transformers' own ``topk`` picked a different, equally valid set. Qwen4-Exp's QSA indexer has the
same cutoff ties (a block scores exactly 0 when every head's dot product is <= 0) and the same
rule (equal scores to the earlier block); it returns a selection mask, read as sets per row.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

#: The issue's tiny GLM-5.3-Flash: well under a second per forward on a CPU.
GLM5_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                 num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                 kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=8,
                 v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                 index_topk=8, index_head_dim=8, index_n_heads=2, index_kpool=4,
                 linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=4, hc_mult=2,
                 hc_sinkhorn_iters=3, pad_token_id=0)  # fmt: skip

#: Tiny Kimi-Linear: KDA, NoPE MLA (kv latent 16, rope part 8, queries without LoRA), KDA.
KIMI_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                 num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                                                   "linear_attention"],
                 mlp_layer_types=["dense", "sparse", "dense"], num_attention_heads=2,
                 num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                 qk_rope_head_dim=8, v_head_dim=8, linear_num_heads=2, linear_head_dim=8,
                 linear_conv_kernel_dim=4, num_local_experts=4, num_experts_per_tok=2, n_group=1,
                 topk_group=1, n_shared_experts=1, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2)  # fmt: skip

#: Tiny Qwen3-Next: Gated DeltaNet (2 key heads, 4 value heads), gated GQA attention (4 query
#: heads, 2 kv heads, head_dim 16, partial rotary 0.25: 4 rotated channels), Gated DeltaNet.
QWEN3_NEXT_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                       layer_types=["linear_attention", "full_attention", "linear_attention"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16, pad_token_id=0)  # fmt: skip

_GDN_ATTN_GDN = ["linear_attention", "full_attention", "linear_attention"]

#: Tiny Qwen3.5: Qwen3-Next's shapes with separate GDN projections; mRoPE text positions (rotary
#: dim 8: 4 frequencies split over the three axes by mrope_section).
QWEN3_5_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                    layer_types=_GDN_ATTN_GDN, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                    pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.5,
                                                     "mrope_section": [2, 1, 1]})  # fmt: skip

#: Tiny Qwen3.5-MoE: the same mixers, a sparse MoE (4 experts, top 2, shared expert) per layer.
QWEN3_5_MOE_TINY = dict({k: v for k, v in QWEN3_5_TINY.items() if k != "intermediate_size"},
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16)  # fmt: skip

#: Tiny OLMo-Hybrid: GDN (2 key heads, 4 value heads, beta scaled by 2), attention with q/k norm
#: over all heads and RoPE (head_dim 8), post-norm decoder layers.
OLMO_HYBRID_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                        layer_types=_GDN_ATTN_GDN, num_attention_heads=4, num_key_value_heads=2,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                        linear_value_head_dim=8, linear_conv_kernel_dim=4, pad_token_id=0,
                        eos_token_id=2, rope_parameters={"rope_type": "default",
                                                         "rope_theta": 10000.0})  # fmt: skip

#: Tiny Bailing-Hybrid: KDA (2 heads of 8), MLA with query LoRA 16, kv latent 16, interleaved RoPE
#: on 4 channels per head and a per-head output gate, MoE (4 experts, top 2, shared expert).
BAILING_HYBRID_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                           moe_intermediate_size=16, num_hidden_layers=3,
                           layer_types=_GDN_ATTN_GDN, mlp_layer_types=["dense", "sparse", "dense"],
                           num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                           q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                           qk_rope_head_dim=4, v_head_dim=8, num_experts=4, num_experts_per_tok=2,
                           n_group=1, topk_group=1, n_shared_experts=1, short_conv_kernel_size=4,
                           rope_theta=10000.0, pad_token_id=0, eos_token_id=2)  # fmt: skip

#: Tiny Nemotron-H: Mamba2 (4 heads of 8, 2 groups, state 8, conv 4, chunks of 8 tokens), a MoE
#: block (4 experts, top 2, shared expert), NoPE GQA attention (4 heads, 2 kv heads), Mamba2.
NEMOTRON_H_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                       layers_block_type=["linear_attention", "moe", "full_attention",
                                          "linear_attention"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
                       conv_kernel=4, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                       pad_token_id=0)  # fmt: skip

#: Tiny Granite 4.0-H: Mamba2 (4 heads of 16, 2 groups, state 8, chunks of 8), GQA with RoPE and
#: attention_multiplier scaling, Mamba2; MoE (4 experts, top 2) + shared MLP; muP multipliers.
GRANITE_HYBRID_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=16,
                           shared_intermediate_size=32, num_hidden_layers=3,
                           layer_types=["linear_attention", "full_attention", "linear_attention"],
                           num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4,
                           mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                           mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2,
                           position_embedding_type="rope", embedding_multiplier=2.0,
                           residual_multiplier=0.5, attention_multiplier=0.3,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           pad_token_id=0)  # fmt: skip

#: Tiny Falcon-H1: every layer runs Mamba2 (4 heads of 8, 2 groups, state 8, chunks of 8, gated
#: RMSNorm per group, gate after the norm) and RoPE GQA in parallel; every muP multiplier != 1.
FALCON_H1_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=32,
                      mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                      mamba_chunk_size=8, mamba_rms_norm=True, mamba_norm_before_gate=True,
                      ssm_multipliers=[0.5, 1.5, 0.7, 1.2, 0.9], ssm_in_multiplier=1.3,
                      ssm_out_multiplier=0.8, attention_in_multiplier=0.9,
                      attention_out_multiplier=1.1, key_multiplier=0.7, mlp_multipliers=[1.2, 0.8],
                      embedding_multiplier=1.5, time_step_limit=(0.0, 3.0),
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      pad_token_id=0)  # fmt: skip

#: Tiny Bamba: Mamba2 (4 heads of 16, 2 groups, state 8, chunks of 8), GQA with RoPE on half of
#: each head (Bamba's fixed partial_rotary_factor 0.5), Mamba2.
BAMBA_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2,
                  mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=2, mamba_chunk_size=8, pad_token_id=0,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip

#: Tiny LFM2: gated short conv (width 3, with biases), GQA with per-head q/k norm and RoPE (4
#: heads, 2 kv heads, head_dim 8), gated short conv.
LFM2_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                 layer_types=["conv", "full_attention", "conv"], num_attention_heads=4,
                 num_key_value_heads=2, conv_L_cache=3, conv_bias=True,
                 block_auto_adjust_ff_dim=False, pad_token_id=0,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip

#: Tiny LFM2-MoE: LFM2's mixers; a dense first layer, then MoE (4 experts, top 2, expert bias).
LFM2_MOE_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                     moe_intermediate_size=16, num_hidden_layers=3,
                     layer_types=["conv", "full_attention", "conv"], num_attention_heads=4,
                     num_key_value_heads=2, conv_L_cache=3, num_dense_layers=1, num_experts=4,
                     num_experts_per_tok=2, pad_token_id=0,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip

#: Tiny Qwen4-Exp text model: Gated DeltaNet (2 key heads, 4 value heads) with PLE, Gated
#: DeltaNet, QSA attention (4 query heads, 2 kv heads, head_dim 16, partial rotary 0.5: 8 rotated
#: channels, mRoPE sections [2, 1, 1]; 2 index heads of 8, blocks of 4, budget 8 = 2 blocks),
#: Gated DeltaNet with PLE; MoE everywhere, 2 hyper-connection streams; PLE: 3-grams (2 hashed
#: orders x 2 heads of 4 over primes after 50), a width-4 conv at dilation 3; eos id 2.
QWEN4_EXP_TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4,
                      layer_types=["linear_attention", "linear_attention", "indexed_attention",
                                   "linear_attention"],
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]},
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16, hc_count=2, hc_lowrank=8,
                      ple_layer_ids=[1, 4], ple_embed_dim=16, ple_conv_kernel_size=4,
                      ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
                      make_ngram_vocab_size_divisible_by=8, indexer_n_heads=2, indexer_kv_heads=1,
                      indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4,
                      pad_token_id=0, eos_token_id=2)  # fmt: skip

#: Parameters whose default initialisation makes terms of the formulas vanish (all-ones gates,
#: zero positional terms, zero-centred norms): the tests perturb them so every term matters.
_PERTURB = ("index_kpool_compress", "k_norm", "A_log", "dt_bias", "o_norm", "layernorm",
            "attn_hc.base", "attn_hc.scale", "ffn_hc.base", "ffn_hc.scale", "conv1d")  # fmt: skip
_PERTURB_BY_FAMILY = {
    "glm5_next": _PERTURB,
    "kimi_linear": ("A_log", "dt_bias", "o_norm", "layernorm", "conv1d"),
    "qwen3_next": ("A_log", "dt_bias", "norm", "conv1d"),
    "qwen3_5": ("A_log", "dt_bias", "norm", "conv1d"),
    "qwen3_5_moe": ("A_log", "dt_bias", "norm", "conv1d"),
    "olmo_hybrid": ("A_log", "dt_bias", "norm", "conv1d"),
    "bailing_hybrid": ("A_log", "dt_bias", "norm", "layernorm", "conv1d"),
    # Mamba2: A_log, dt_bias, D (".D" is the only such name) and the gated norm start as
    # constants; LFM2: its norms
    "nemotron_h": ("A_log", "dt_bias", ".D", "norm", "conv1d"),
    "granitemoehybrid": ("A_log", "dt_bias", ".D", "norm", "conv1d"),
    "falcon_h1": ("A_log", "dt_bias", ".D", "norm", "conv1d"),
    "bamba": ("A_log", "dt_bias", ".D", "norm", "conv1d"),
    "lfm2": ("norm", "conv"),
    "lfm2_moe": ("norm", "conv"),
    # zero-centred norms (1 + w, w = 0), the PLE conv (zero init), the indexer's norms
    "qwen4_exp": ("A_log", "dt_bias", "norm", "conv1d"),
}

#: family -> (transformers module, config class, text model class)
_MODULES = {
    "glm5_next": ("glm5_next", "Glm5NextTextConfig", "Glm5NextTextModel"),
    "kimi_linear": ("kimi_linear", "KimiLinearConfig", "KimiLinearModel"),
    "qwen3_next": ("qwen3_next", "Qwen3NextConfig", "Qwen3NextModel"),
    "qwen3_5": ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5TextModel"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeTextModel"),
    "olmo_hybrid": ("olmo_hybrid", "OlmoHybridConfig", "OlmoHybridModel"),
    "bailing_hybrid": ("bailing_hybrid", "BailingHybridConfig", "BailingHybridModel"),
    "nemotron_h": ("nemotron_h", "NemotronHConfig", "NemotronHModel"),
    "granitemoehybrid": ("granitemoehybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridModel"),
    "falcon_h1": ("falcon_h1", "FalconH1Config", "FalconH1Model"),
    "bamba": ("bamba", "BambaConfig", "BambaModel"),
    "lfm2": ("lfm2", "Lfm2Config", "Lfm2Model"),
    "lfm2_moe": ("lfm2_moe", "Lfm2MoeConfig", "Lfm2MoeModel"),
    "qwen4_exp": ("qwen4_exp", "Qwen4ExpTextConfig", "Qwen4ExpTextModel"),
}


def _model_class(family: str):
    if family not in _MODULES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(_MODULES)}")
    import importlib

    name, config_class, model_class = _MODULES[family]
    package = f"transformers.models.{name}"
    configs = importlib.import_module(f"{package}.configuration_{name}")
    models = importlib.import_module(f"{package}.modeling_{name}")
    return getattr(configs, config_class), getattr(models, model_class)


def build(family: str, config: dict, seed: int = 0):
    """A randomly initialised fp32 backbone of ``family`` (one of the module doc's), eval mode,
    eager attention."""
    config_class, model_class = _model_class(family)
    torch.manual_seed(seed)
    cfg = config_class(**config)
    cfg._attn_implementation = "eager"
    model = model_class(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in _PERTURB_BY_FAMILY[family]):
                p.add_(0.3 * torch.randn_like(p))
    return model


def _stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """``Tensor.topk`` whose equal values go to the lower index (a stable sort)."""
    order = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((self.gather(dim, order), order))


def selection_rows(selection: torch.Tensor) -> list[set[int]]:
    """The selected token set of every query of an indexer's output for one sequence: GLM's
    token ids ``[1, L, W]`` (-1: none) or Qwen4-Exp's selection mask ``[1, 1, L, S]``."""
    if selection.dtype == torch.bool:
        return [set(torch.nonzero(row).flatten().tolist()) for row in selection[0, 0]]
    return [set(row.tolist()) - {-1} for row in selection[0]]


def indexer_selections(model, tie_rule: bool) -> list:
    """Record every indexer output of ``model``; with ``tie_rule``, its ``topk`` breaks ties by
    the earlier pool (only while an indexer runs)."""
    selections, original = [], torch.Tensor.topk

    def pre(module, args, kwargs):
        if tie_rule:
            torch.Tensor.topk = _stable_topk

    def post(module, args, kwargs, out):
        torch.Tensor.topk = original
        selections.append(out)

    for m in model.modules():
        if type(m).__name__.endswith("Indexer"):
            m.register_forward_pre_hook(pre, with_kwargs=True)
            m.register_forward_hook(post, with_kwargs=True)
    return selections


def _forward_backward(model, ids: torch.Tensor, cot: torch.Tensor):
    """``(output [n, hidden], {name: gradient})`` of ``sum(output * cot)``, in fp32."""
    model.zero_grad(set_to_none=True)
    dtype = next(model.parameters()).dtype
    out = model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
    (out * cot.to(dtype)).sum().backward()
    grads = {n: p.grad.clone().float() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().float(), grads


def _float64_run(job: dict) -> dict:
    """The reference's own fp32 rounding, measured: the same model in float64 on each document
    (fp64 has no grouped matmul, so the experts loop; transformers' Gated DeltaNet kernels
    compute in fp32 whatever the dtype)."""
    model = build(job["family"], job["config"], job["seed"])
    model.load_state_dict(job["state_dict"])
    model.double()
    model.config._experts_implementation = "eager"
    indexer_selections(model, True)
    runs = [_forward_backward(model, ids, cot) for ids, cot in zip(job["documents"],
                                                                   job["cotangents"])]  # fmt: skip
    return {"outputs_float64": [o for o, _ in runs], "grads_float64": [g for _, g in runs]}


def _run(job: dict) -> dict:
    model, plain = (build(job["family"], job["config"], job["seed"]) for _ in range(2))
    model.load_state_dict(job["state_dict"])
    plain.load_state_dict(job["state_dict"])
    ours, theirs = indexer_selections(model, True), indexer_selections(plain, False)
    outs, grads = [], []
    for ids, cot in zip(job["documents"], job["cotangents"]):
        out, grad = _forward_backward(model, ids, cot)
        outs.append(out)
        grads.append(grad)
        with torch.no_grad():
            plain(input_ids=ids[None], use_cache=False)
    # rows where transformers' own topk picked another (equally valid) set among tied scores
    tie_rows = sum(a != b for sel_a, sel_b in zip(ours, theirs)
                   for a, b in zip(selection_rows(sel_a), selection_rows(sel_b)))
    # fcp's replacement modules without a cp_context run transformers' own code
    from fcp.integrations.hf import enable_packed_cp

    with torch.no_grad():
        ids = max(job["documents"], key=len)[None]  # the longest: every layer's every phase
        before = plain(input_ids=ids, use_cache=False).last_hidden_state
        after = enable_packed_cp(plain)(input_ids=ids, use_cache=False).last_hidden_state
    extra = _float64_run(job) if job.get("float64") else {}
    return {"outputs": outs, "grads": grads, "tie_rows": int(tie_rows),
            "indexed_rows": sum(len(selection_rows(s)) for s in ours),
            "no_context_max_diff": float((before - after).abs().max()), **extra}


def per_document(family: str, config: dict, state_dict: dict, documents: list, cotangents: list,
                 seed: int = 0, float64: bool = False) -> dict:  # fmt: skip
    """Run transformers' model on each document alone in a subprocess with FLA blocked.

    ``documents``: int64 ``[n_i]`` token ids; ``cotangents``: ``[n_i, hidden]``.
    Returns ``{"outputs": [[n_i, hidden]], "grads": [{param name: gradient}] (one per
    document), "tie_rows", "indexed_rows", "no_context_max_diff"}`` (the last: how far
    ``enable_packed_cp(model)`` without a ``cp_context`` is from the original, on the longest
    document);
    with ``float64``, also ``"outputs_float64"`` / ``"grads_float64"``: the same model in float64
    (its distance from the fp32 run is the reference's own rounding noise).
    """
    return per_document_jobs([dict(family=family, config=config, state_dict=state_dict,
                                   documents=documents, cotangents=cotangents, seed=seed,
                                   float64=float64)])[0]  # fmt: skip


def per_document_jobs(jobs: list[dict]) -> list[dict]:
    """:func:`per_document` for several models in one subprocess (one transformers import):
    ``jobs`` of dicts with :func:`per_document`'s arguments as keys (``seed`` optional)."""
    jobs = [dict(job, seed=job.get("seed", 0)) for job in jobs]
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.pt"), os.path.join(tmp, "out.pt")
        torch.save(jobs, src)
        proc = subprocess.run([sys.executable, "-m", "tests.support.hf_reference", src, dst],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
        if proc.returncode:
            raise RuntimeError(f"reference subprocess failed:\n{proc.stderr[-4000:]}")
        return torch.load(dst, weights_only=False)


if __name__ == "__main__":
    sys.modules["fla"] = None  # transformers' pure-PyTorch fallbacks (FLA's kernels need a GPU)
    sys.modules["causal_conv1d"] = None  # the PyTorch conv fallback even where it is installed
    sys.modules["mamba_ssm"] = None  # and transformers' PyTorch Mamba2 scan
    torch.set_num_threads(1)
    torch.save([_run(job) for job in torch.load(sys.argv[1], weights_only=False)], sys.argv[2])
