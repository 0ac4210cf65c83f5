"""fcp's real client: NeMo AutoModel 0.7.0's own GLM-5.3-Flash and Qwen3.8-Flash-Next model code.

Tiny CPU configurations of both models run once with NeMo's cp modules and once with fcp's
substituted for them (the names NeMo's model files imported are rebound, as a user's one-line
import change would), and report how far logits and gradients differ. The job functions run on a
**fresh** :class:`~tests.support.rank_pool.RankPool`: NeMo's model code imports transformers, and
Qwen's needs FLA blocked (``sys.modules["fla"] = None``) before that import so its gated-delta
layers take their PyTorch fallbacks; this module itself imports neither at import time.

What is compared, and why:

* GLM, single process (KDA + DSA): through the sharder (``cp_mesh=None``) and through the model's
  own non-CP context building (indexed ``attention_mask``, ``cu_seqlens``): NeMo versus fcp,
  logits and every parameter gradient.
* GLM, 2 ranks: NeMo's CPU KDA ignores the FLA CP context (its CPU short conv and recurrence run
  each rank's shard as one sequence), so a KDA model under CP is compared like with like, NeMo's
  cp module versus fcp's on the same (inexact) CPU path; a DSA-only model is compared with the
  non-CP forward too, where CP is exact.
* Qwen, single process (GDN + QSA + PLE, FLA blocked) through the sharder on a one-rank mesh, and
  a packed non-CP forward (``seq_lens``, QSA only; the CPU conv fallback rejects packed GDN rows).
* Qwen, 2 ranks (QSA + PLE; GDN under CP needs FLA's kernels): unpacked, packed ``cu_seqlens``,
  packed ``seq_lens`` with a pack tail: NeMo versus fcp, and fcp versus the non-CP forward.
"""

from __future__ import annotations

import importlib
import sys
import warnings

import torch

NEMO = "nemo_automodel.components.models"
#: Names NeMo's model files bind from the cp modules (``from .cp import ...``).
CP_NAMES = {
    "glm": {
        f"{NEMO}.glm5_next.model": ("Glm5NextPackedContext", "doc_ids_from_cu_seqlens",
                                    "shard_batch_for_glm5_next_cp"),
        f"{NEMO}.glm5_next.layers": ("Glm5NextPackedContext", "all_gather_backward_anchor",
                                     "all_gather_sequence", "build_fla_cp_context"),
    },
    "qwen": {
        f"{NEMO}.qwen3_8_flash_next.model": ("Qwen3_8_FlashNextCPContext",
                                             "packed_boundaries_from_seq_lens",
                                             "shard_batch_for_qwen3_8_flash_next_cp"),
        f"{NEMO}.qwen3_8_flash_next.layers": ("Qwen3_8_FlashNextCPContext",
                                              "qwen3_8_flash_next_cp_all_gather"),
        f"{NEMO}.qwen3_8_flash_next.qsa": ("Qwen3_8_FlashNextCPContext",
                                           "qwen3_8_flash_next_cp_all_gather"),
        f"{NEMO}.qwen3_8_flash_next.engram": ("Qwen3_8_FlashNextCPContext",
                                              "qwen3_8_flash_next_cp_left_halo"),
    },
}  # fmt: skip
CP_MODULES = {"glm": f"{NEMO}.glm5_next.cp", "qwen": f"{NEMO}.qwen3_8_flash_next.cp"}
FCP_MODULES = {"glm": "fcp.models.glm5_next.cp", "qwen": "fcp.models.qwen3_8_flash_next.cp"}


# ---------------------------------------------------------------------------------- set-up
def prepare(block_fla: bool) -> None:
    """Process set-up before NeMo's model code is imported (idempotent; ``block_fla``: for Qwen)."""
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    # NeMo's MoE experts call small torch.compile'd helpers (inductor, max-autotune): seconds of
    # compilation per process for kernels that run the same eagerly. Both sides run eagerly.
    torch.compiler.set_stance("force_eager")
    torch.set_num_threads(1)  # two ranks share the cores: no spinning intra-op threads
    if not block_fla or "fla" in sys.modules:  # blocked before, or in a GLM-only process
        if block_fla and sys.modules["fla"] is not None:
            raise RuntimeError("FLA was imported before it could be blocked: use a fresh process")
        return
    if sys.modules.get("fla") is not None:
        raise RuntimeError("FLA was imported before it could be blocked: use a fresh process")
    sys.modules["fla"] = None
    # NeMo 0.7.0 pins transformers 5.18; 5.2x renamed an output class its Qwen model imports.
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as hf

    if not hasattr(hf, "Qwen3_5MoeModelOutputWithPast"):
        hf.Qwen3_5MoeModelOutputWithPast = hf.Qwen3_5MoeBaseModelOutputWithPast


def allow_fla() -> None:
    """Let GLM's CP path import FLA after Qwen ran with it blocked (run GLM last in a process).

    GLM's CPU layers call FLA only to plan ``build_fla_cp_context`` (host-side metadata), in
    NeMo's cp module and in fcp's alike; Qwen's layers, built before, keep their fallbacks.
    """
    if "fla" in sys.modules and sys.modules["fla"] is None:
        del sys.modules["fla"]


def use_cp(model: str, impl: str) -> None:
    """Make NeMo's ``model`` ("glm" / "qwen") code use ``impl``'s cp module ("nemo" / "fcp")."""
    source = importlib.import_module((CP_MODULES if impl == "nemo" else FCP_MODULES)[model])
    for module_name, names in CP_NAMES[model].items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, getattr(source, name))


GLM_TEXT = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
    num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8,
    index_topk=4, index_head_dim=8, index_n_heads=2, index_kpool=2, linear_head_dim=8,
    linear_num_heads=2, linear_conv_kernel_dim=4, hc_mult=2, hc_sinkhorn_iters=3, pad_token_id=0,
    torch_dtype="float32",
)  # fmt: skip
GLM_VISION = dict(depth=1, hidden_size=16, num_heads=2, out_hidden_size=32, intermediate_size=16,
                  projection_intermediate_size=16, patch_size=2, image_size=8)  # fmt: skip


def build_glm(layer_types: tuple[str, ...], seed: int = 0):
    """A float32 CPU ``Glm5NextForConditionalGeneration`` with seeded random weights."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.glm5_next.config import Glm5NextConfig
    from nemo_automodel.components.models.glm5_next.model import Glm5NextForConditionalGeneration

    text = dict(GLM_TEXT, layer_types=list(layer_types), num_hidden_layers=len(layer_types),
                mlp_layer_types=["dense"] + ["sparse"] * (len(layer_types) - 1))  # fmt: skip
    config = Glm5NextConfig(text_config=text, vision_config=dict(GLM_VISION))
    backend = BackendConfig(attn="sdpa", linear="torch", experts="torch", dispatcher="torch",
                            rope_fusion=False, enable_hf_state_dict_adapter=False)  # fmt: skip
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(config, backend=backend)
    model.initialize_weights(torch.device("cpu"), dtype=torch.float32)
    return model


QWEN_TEXT = dict(
    vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2, hc_count=2,
    hc_lowrank=8, ple_embed_dim=32, indexer_budget=8, indexer_compress_ratio=4,
    indexer_head_dim=8, indexer_kv_heads=1, indexer_n_heads=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]},
    dtype="float32", pad_token_id=0, eos_token_id=63, bos_token_id=1,
)  # fmt: skip


class ModuloEngram(torch.nn.Module):
    """Stand-in for the released 320M-row Engram table: ids ``[B, S, H]`` -> ``[B, S, H, dim]``."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.rows = rows
        self.weight = torch.nn.Parameter(torch.randn(rows, dim) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids % self.rows, self.weight)


def build_qwen(layer_types: tuple[str, ...], seed: int = 0):
    """A float32 CPU ``Qwen3_8_FlashNextForConditionalGeneration`` with PLE on layer 0."""
    from nemo_automodel.components.models.qwen3_8_flash_next.backend import (
        Qwen3_8_FlashNextBackendConfig,
    )
    from nemo_automodel.components.models.qwen3_8_flash_next.config import Qwen3_8_FlashNextConfig
    from nemo_automodel.components.models.qwen3_8_flash_next.engram import (
        Qwen3_8_FlashNextEngramTableConfig,
    )
    from nemo_automodel.components.models.qwen3_8_flash_next.model import (
        Qwen3_8_FlashNextForConditionalGeneration,
    )

    text = dict(QWEN_TEXT, layer_types=list(layer_types), num_hidden_layers=len(layer_types),
                ple_layer_ids=[1])  # fmt: skip
    config = Qwen3_8_FlashNextConfig(text_config=text, language_model_only=True)
    backend = Qwen3_8_FlashNextBackendConfig(attn="sdpa", linear="torch", experts="torch",
                                             dispatcher="torch", rope_fusion=False,
                                             enable_hf_state_dict_adapter=False)  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3_8_FlashNextForConditionalGeneration(
        config, backend=backend, engram_process_group=None,
        engram_table_config=Qwen3_8_FlashNextEngramTableConfig(num_embeddings=1024,
                                                               embedding_dim=2),
    )  # fmt: skip
    model.initialize_weights(torch.device("cpu"), dtype=torch.float32)
    torch.manual_seed(seed + 1)
    for layer in model.model.language_model.layers.values():
        if layer.ple is not None:
            layer.ple.ple_embedding.ngram_embedding = ModuloEngram(1021, 2)
            torch.nn.init.normal_(layer.ple.conv1d.weight, std=0.2)  # NeMo zero-inits it
    return model


def setup_cp(model, mesh) -> None:
    """What NeMo's ``apply_cp`` does (without FSDP / EP) for GLM-5.3-Flash and Qwen3.8-Flash-Next:
    the model is marked CP and every block's token mixer gets the CP mesh (softmax attention:
    ``self_attn.setup_cp_attention``; Qwen's Gated DeltaNet: ``linear_attn._cp_mesh``)."""
    model._cp_enabled = True
    model.model.language_model._cp_enabled = True
    model.cp_mesh = mesh
    for layer in model.model.language_model.layers.values():
        attn = getattr(layer, "self_attn", None)  # GLM: every block; Qwen: full attention only
        if attn is not None:
            attn.setup_cp_attention(mesh)
        else:
            layer.linear_attn._cp_mesh = mesh


# ---------------------------------------------------------------------------------- running
def _step(model, call, weights: torch.Tensor):
    """Logits and every parameter gradient of ``sum(call(model).logits * weights)``."""
    model.zero_grad(set_to_none=True)
    logits = call(model).logits
    (logits * weights[:, : logits.shape[1]]).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _max_diff(a, b) -> float:
    """Largest absolute difference of two ``(logits, grads)`` results (a missing gradient is
    zero; inf on a shape mismatch)."""
    (la, ga), (lb, gb) = a, b
    if la.shape != lb.shape:
        return float("inf")
    diffs = [(la - lb).abs().max().item() if la.numel() else 0.0]
    for k in ga.keys() | gb.keys():
        x, y = ga.get(k), gb.get(k)
        x = torch.zeros_like(y) if x is None else x
        y = torch.zeros_like(x) if y is None else y
        diffs.append((x - y).abs().max().item())
    return max(diffs)


def _scale(result) -> float:
    logits, grads = result
    return max([logits.abs().max().item()] + [g.abs().max().item() for g in grads.values()])


def _sharded_call(model_name: str, impl: str, mesh, batch: dict, **kwargs):
    cp = importlib.import_module((CP_MODULES if impl == "nemo" else FCP_MODULES)[model_name])
    shard = getattr(cp, "shard_batch_for_glm5_next_cp" if model_name == "glm"
                    else "shard_batch_for_qwen3_8_flash_next_cp")  # fmt: skip

    def call(model):
        local = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        _, local, _ = shard(mesh, None, local, **kwargs)
        local.pop("labels")
        return model(**local)

    return call


def _cp_step(model, call, weights: torch.Tensor, env):
    """Local logits and the rank-summed gradients (the data-parallel reduction over CP ranks)."""
    import torch.distributed as dist

    model.zero_grad(set_to_none=True)
    logits = call(model).logits
    local = logits.shape[1]
    w = torch.nn.functional.pad(weights, (0, 0, 0, env.world_size * local - weights.shape[1]))
    (logits * w[:, env.rank * local : (env.rank + 1) * local]).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.detach().clone()
        dist.all_reduce(g, group=env.group)
        grads[name] = g
    return logits.detach(), grads


def _versus_reference(cp_result, ref, env) -> tuple[float, float]:
    """``(max diff, scale)`` of a CP result and the non-CP one on this rank's real positions.

    CP padding positions have no non-CP counterpart (their loss weight is zero, so gradients
    compare in full).
    """
    logits, grads = cp_result
    ref_logits, ref_grads = ref
    local = logits.shape[1]
    start = env.rank * local
    valid = max(0, min(local, ref_logits.shape[1] - start))
    mine = (logits[:, :valid], grads)
    theirs = (ref_logits[:, start : start + valid], ref_grads)
    return _max_diff(mine, theirs), _scale(theirs)


def glm_job(env) -> dict[str, tuple[float, float]]:
    """GLM-5.3: ``{check: (max |NeMo - fcp| or |fcp - reference|, scale)}`` on this rank."""
    prepare(block_fla=False)
    allow_fla()
    ids = torch.randint(1, 64, (1, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([[1] * 5 + [2] * 4 + [0] * 2])  # indexed: doc 2 crosses the rank boundary
    cu = torch.tensor([0, 5, 9])
    weights = torch.randn(1, 11, 64, generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask}
    out: dict[str, tuple[float, float]] = {}
    model = build_glm(("linear_attention", "deepseek_sparse_attention"))
    calls = {
        "single/sharder": lambda impl: _sharded_call("glm", impl, None, batch),
        "single/attention_mask": lambda impl: lambda m: m(ids, attention_mask=mask),
        "single/cu_seqlens": lambda impl: lambda m: m(ids, cu_seqlens=cu),
    }
    for name, make in calls.items():
        results = {}
        for impl in ("nemo", "fcp"):
            use_cp("glm", impl)
            results[impl] = _step(model, make(impl), weights)
        out[name] = (_max_diff(results["nemo"], results["fcp"]), _scale(results["fcp"]))

    mesh = env.mesh()
    for layers, exact in ((("linear_attention", "deepseek_sparse_attention"), False),
                          (("deepseek_sparse_attention", "deepseek_sparse_attention"), True)):
        model = build_glm(layers)
        if exact:  # the non-CP forward of the same weights
            use_cp("glm", "fcp")
            ref = _step(model, lambda m: m(ids, attention_mask=mask), weights)
        setup_cp(model, mesh)
        results = {}
        for impl in ("nemo", "fcp"):
            use_cp("glm", impl)
            results[impl] = _cp_step(model, _sharded_call("glm", impl, mesh, batch), weights, env)
        tag = "+".join("kda" if t == "linear_attention" else "dsa" for t in layers)
        out[f"cp/{tag}/nemo-vs-fcp"] = (_max_diff(results["nemo"], results["fcp"]),
                                        _scale(results["fcp"]))  # fmt: skip
        if exact:
            out[f"cp/{tag}/fcp-vs-non-cp"] = _versus_reference(results["fcp"], ref, env)
    return out


def qwen_single_job(env) -> dict[str, tuple[float, float]]:
    """Qwen3.8, one rank: GDN + QSA + PLE through the sharder; a packed non-CP forward."""
    prepare(block_fla=True)
    ids = torch.randint(1, 62, (2, 12), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": ids, "labels": ids,
             "attention_mask": torch.tensor([[1] * 12, [1] * 9 + [0] * 3])}  # fmt: skip
    out = {}
    model = build_qwen(("linear_attention", "full_attention"))
    mesh = env.mesh()
    setup_cp(model, mesh)
    results = {}
    for impl in ("nemo", "fcp"):
        use_cp("qwen", impl)
        results[impl] = _step(model, _sharded_call("qwen", impl, mesh, batch, pad_multiple=4),
                              weights)  # fmt: skip
    out["single/sharder"] = (_max_diff(results["nemo"], results["fcp"]), _scale(results["fcp"]))
    model = build_qwen(("full_attention", "full_attention"))
    seq_lens = torch.tensor([[5, 7]])
    results = {}
    for impl in ("nemo", "fcp"):
        use_cp("qwen", impl)
        results[impl] = _step(model, lambda m: m(ids[:1], seq_lens=seq_lens), weights[:1])
    out["single/seq_lens"] = (_max_diff(results["nemo"], results["fcp"]), _scale(results["fcp"]))
    return out


def qwen_cp_job(env) -> dict[str, tuple[float, float]]:
    """Qwen3.8, 2 ranks (QSA + PLE): NeMo versus fcp, and fcp versus the non-CP forward."""
    prepare(block_fla=True)
    length = 13
    ids = torch.randint(1, 62, (1, length), generator=torch.Generator().manual_seed(3))
    ids[0, 6] = 63  # an EOS inside the row: PLE hashing restarts after it
    weights = torch.randn(1, length, 64, generator=torch.Generator().manual_seed(5))
    doc_positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6]])
    cases = {  # (extra batch keys, the non-CP forward's kwargs)
        "unpacked": ({}, {}),
        "cu_seqlens": ({"cu_seqlens": torch.tensor([0, 6, length]), "position_ids": doc_positions},
                       {"cu_seqlens": torch.tensor([0, 6, length]),
                        "position_ids": doc_positions}),
        "seq_lens": ({"seq_lens": torch.tensor([[4, 7]]),
                      "seq_lens_padded": torch.tensor([[4, 9]])},
                     {"seq_lens": torch.tensor([[4, 7]])}),
    }  # fmt: skip
    mesh = env.mesh()
    out = {}
    for name, (extra, ref_kwargs) in cases.items():
        model = build_qwen(("full_attention", "full_attention"))
        use_cp("qwen", "fcp")
        ref = _step(model, lambda m: m(ids, **ref_kwargs), weights)
        setup_cp(model, mesh)
        batch = {"input_ids": ids, "labels": ids, **extra}
        results = {}
        for impl in ("nemo", "fcp"):
            use_cp("qwen", impl)
            call = _sharded_call("qwen", impl, mesh, batch, pad_multiple=4)
            results[impl] = _cp_step(model, call, weights, env)
        out[f"cp/{name}/nemo-vs-fcp"] = (_max_diff(results["nemo"], results["fcp"]),
                                         _scale(results["fcp"]))  # fmt: skip
        out[f"cp/{name}/fcp-vs-non-cp"] = _versus_reference(results["fcp"], ref, env)
    return out
