"""transformers' own models run on each document alone: the oracle of fcp's integrations.

Families (:func:`build`): ``"glm5_next"`` (GLM-5.3-Flash), ``"kimi_linear"`` (Kimi-Linear),
``"qwen3_next"`` (Qwen3-Next), ``"qwen3_5"`` / ``"qwen3_5_moe"`` (Qwen3.5 text models),
``"olmo_hybrid"`` (OLMo-Hybrid), ``"bailing_hybrid"`` (Bailing-Hybrid / Ling), the Mamba2
hybrids ``"nemotron_h"`` (Nemotron-H), ``"granitemoehybrid"`` (Granite 4.0-H), ``"falcon_h1"``
(Falcon-H1), ``"bamba"`` (Bamba), ``"lfm2"`` / ``"lfm2_moe"`` (LFM2, LFM2-MoE) and
``"qwen4_exp"`` (Qwen4-Exp's text model): the rows of fcp's family registry
(:mod:`fcp.integrations.hf.families`), each with its tiny configuration and text backbone class.

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

import copy
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _tiny(name: str) -> dict:
    """The tiny configuration of family ``name``'s parity tests: its registry row's
    ``test_config`` as a plain, picklable deep copy (transformers' configs may edit nested
    values, e.g. ``rope_parameters``, in place)."""
    from fcp.integrations.hf.families import family

    return copy.deepcopy(dict(family(name).test_config))


# the families' tiny configurations (the registry, fcp/integrations/hf/families/, holds them)
GLM5_TINY = _tiny("glm5_next")
KIMI_TINY = _tiny("kimi_linear")
QWEN3_NEXT_TINY = _tiny("qwen3_next")
QWEN3_5_TINY = _tiny("qwen3_5")
QWEN3_5_MOE_TINY = _tiny("qwen3_5_moe")
OLMO_HYBRID_TINY = _tiny("olmo_hybrid")
BAILING_HYBRID_TINY = _tiny("bailing_hybrid")
NEMOTRON_H_TINY = _tiny("nemotron_h")
GRANITE_HYBRID_TINY = _tiny("granitemoehybrid")
FALCON_H1_TINY = _tiny("falcon_h1")
BAMBA_TINY = _tiny("bamba")
LFM2_TINY = _tiny("lfm2")
LFM2_MOE_TINY = _tiny("lfm2_moe")
QWEN4_EXP_TINY = _tiny("qwen4_exp")
GEMMA2_TINY = _tiny("gemma2")
GEMMA3_TINY = _tiny("gemma3")
GRANITE_SWA_TINY = _tiny("granite_swa")
GRANITEMOE_SWA_TINY = _tiny("granitemoe_swa")
INKLING2_TINY = _tiny("inkling2")
ZAYA_TINY = _tiny("zaya")
GPT_OSS_TINY = _tiny("gpt_oss")
LFM3_TINY = _tiny("lfm3")
LARA_MINI_TINY = _tiny("lara_mini")
GLM_MOE_DSA_TINY = _tiny("glm_moe_dsa")
DEEPSEEK_V4_TINY = _tiny("deepseek_v4")
MAMBA_TINY = _tiny("mamba")
FALCON_MAMBA_TINY = _tiny("falcon_mamba")
JAMBA_TINY = _tiny("jamba")
ZAMBA_TINY = _tiny("zamba")
RECURRENT_GEMMA_TINY = _tiny("recurrent_gemma")
MAMBA2_TINY = _tiny("mamba2")
ZAMBA2_TINY = _tiny("zamba2")
MINIMAX_TINY = _tiny("minimax")

#: Parameters whose default initialisation makes terms of the formulas vanish (all-ones gates,
#: zero positional terms, zero-centred norms): the tests perturb them so every term matters.
_PERTURB = ("index_kpool_compress", "k_norm", "A_log", "dt_bias", "o_norm", "layernorm",
            "attn_hc.base", "attn_hc.scale", "ffn_hc.base", "ffn_hc.scale", "conv1d")  # fmt: skip
_PERTURB_BY_FAMILY = {
    # Mamba1: A_log (S4D's arange), D (ones), dt_proj (its bias sets dt's range), the norms
    "mamba": ("A_log", ".D", "dt_proj", "norm", "conv1d"),
    "falcon_mamba": ("A_log", ".D", "dt_proj", "norm", "conv1d"),
    "jamba": ("A_log", ".D", "dt_proj", "norm", "conv1d"),
    "zamba": ("A_log", ".D", "dt_proj", "norm", "conv1d"),
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
    # Gemma 3: zero-centred norms (1 + w), q/k norms included; Granite-SWA: zero sinks, norms
    "gemma2": ("norm",),
    "gemma3": ("norm",),
    "granite_swa": ("sinks", "norm"),
    "granitemoe_swa": ("sinks", "norm"),
    # ZAYA: k's temperature (zero init: k would vanish), residual scalings and biases, norms
    "zaya": ("temp", "scale", "bias", "norm", "conv_qk"),
    # Inkling-2: the learned scales of the L2 clips, the dynamic convs' static taps and the
    # attention residuals' queries (zero init), the norms
    "inkling2": ("scale", "static_weight", "query", "norm", "conv1d"),
    # gpt-oss: small sinks, ones norms, zero biases (attention, experts); LFM3: its norms, the
    # conv's zero bias; Lara-Mini: as Qwen3.5
    "gpt_oss": ("sinks", "norm", "bias"),
    "lfm3": ("norm", "conv"),
    "lara_mini": ("A_log", "dt_bias", "norm", "conv1d"),
    # GLM-5: its norms (ones; the indexer's LayerNorm k_norm: ones and zero bias)
    "glm_moe_dsa": ("norm",),
    # DeepSeek-V4: zero sinks and pool position biases, ones norms, the hyper-connections'
    # constant bases and scales
    "deepseek_v4": ("sinks", "position_bias", "norm", "hc.base", "hc.scale", "hc_base",
                    "hc_scale"),
    # RWKV-4: its time-mix, decay and bonus vectors (a fixed ramp), the LayerNorms; xLSTM: its
    # norms (ones) and the gates (zero weights, constant biases at init)
    "rwkv": ("time_", "ln"),
    "xlstm": ("norm", "gate_preact"),
    # RecurrentGemma: zero-centred norms (1 + w), zero biases (the RG-LRU's gates, the branches,
    # conv_1d, o_proj, the MLPs), the recurrence parameter (decays: softplus of it)
    "recurrent_gemma": ("norm", "bias", "recurrent_param"),
    # Mamba2 and Zamba2 (Mamba2 layers; Zamba2's shared blocks: norms); MiniMax: its norms (the
    # lightning layers' slopes are a buffer, constant per head)
    "mamba2": ("A_log", "dt_bias", ".D", "norm", "conv1d"),
    "zamba2": ("A_log", "dt_bias", ".D", "norm", "conv1d"),
    "minimax": ("norm",),
}


def _model_class(family: str):
    """``(config class, text model class)`` of ``family`` (its registry row's ``text_model``)."""
    import importlib

    from fcp.integrations.hf.families import family as row

    text_model = row(family).text_model  # an unknown family raises a ValueError naming the known
    models = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = getattr(models, text_model)
    return cls.config_class, cls


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
    token ids ``[1, L, W]`` (-1: none) or Qwen4-Exp's selection mask ``[1, 1, L, S]``. Ids
    after the query are dropped: GLM-5's indexer takes ``topk(min(index_topk, L))`` of masked
    scores, so a query with fewer visible tokens also lists (tied, masked) future ones."""
    if selection.dtype == torch.bool:
        return [set(torch.nonzero(row).flatten().tolist()) for row in selection[0, 0]]
    return [{s for s in row.tolist() if 0 <= s <= t} for t, row in enumerate(selection[0])]


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
