"""transformers models on fcp: packed documents and contiguous CP by in-place mixer replacement.

:func:`enable_packed_cp` turns, in place, a transformers model's token mixers into fcp mixers
(:mod:`.core`: the module object stays, its class becomes ``Packed<HFClass>``, a subclass of the
transformers class, so parameters, buffers, state-dict keys and checkpoints are untouched).
Everything else of the model (embeddings, norms, hyper-connections, MLPs and MoEs) is per token
and stays as it is. Then::

    model = fcp.integrations.hf.enable_packed_cp(model)      # the same object, returned
    local, ctx = fcp.shard_batch(cp_mesh, batch)             # batch: packed rows + seq_lens, ...
    out = model(input_ids=local["input_ids"], cp_context=ctx)

computes every packed document exactly as transformers computes that document alone (a batch of
one, no padding), and under CP each rank returns its contiguous shard of that. Without
``cp_context`` the replaced mixers run the original transformers code. With one, nothing runs
the non-CP path silently: a mixer reached without the context (a decoder layer that dropped it)
raises, and so does a KV cache (``use_cache=True``, ``cache`` / ``past_key_values``).

Supported mixers (:data:`SUPPORTED`; the adapters in :mod:`.models`, the kinds in
:mod:`.mixers`), and what each exchanges under CP (every KDA / Gated DeltaNet layer: a
``(W - 1)``-token left halo of its conv input and one fp32 state-chain all-gather of
``[batch, value_heads, K, K + V]``; nothing else):

* GLM-5.3-Flash (``glm5_next``): ``Glm5NextTextLinearAttention`` (KDA) and
  ``Glm5NextTextAttention`` (k-pool DSA indexer + MLA over the selected tokens, cross-layer
  top-k sharing): all-gathers its compressed KV latent (``kv_lora_rank`` per token) and the
  indexer's pooled keys, never the expanded K/V or the hidden states.
* Kimi-Linear (``kimi_linear``): ``KimiLinearDeltaAttention`` (KDA) and ``KimiLinearAttention``
  (NoPE MLA, causal within each document): all-gathers its expanded K/V
  (``heads * (qk_head_dim + v_head_dim)`` per token).
* Qwen3-Next (``qwen3_next``): ``Qwen3NextGatedDeltaNet`` (Gated DeltaNet) and
  ``Qwen3NextAttention`` (gated GQA, q/k RMSNorm, partial RoPE at **document-local** positions
  computed from the layer's own config, :mod:`.rope`): all-gathers K/V (``2 * kv_heads *
  head_dim`` per token, K already rotated).
* Qwen3.5 (``qwen3_5``) and Qwen3.5-MoE (``qwen3_5_moe``): ``Qwen3_5(Moe)GatedDeltaNet`` (Gated
  DeltaNet, separate projections) and ``Qwen3_5(Moe)Attention`` (Qwen3-Next's attention code; its
  mRoPE text positions are 1-D RoPE at document-local positions): as Qwen3-Next.
* OLMo-Hybrid (``olmo_hybrid``): ``OlmoHybridGatedDeltaNet`` (``beta = 2 sigmoid(b)``) and
  ``OlmoHybridAttention`` (q/k norm over all heads, RoPE or NoPE): as Qwen3-Next.
* Bailing-Hybrid / Ling (``bailing_hybrid``): ``BailingHybridDeltaAttention`` (KDA) and
  ``BailingHybridAttention`` (MLA, interleaved RoPE on ``qk_rope_head_dim`` channels, per-head
  output gate): all-gathers its expanded K/V, as Kimi-Linear.
* The Mamba2 hybrids Nemotron-H (``nemotron_h``: ``NemotronHMamba2Mixer``,
  ``NemotronHAttention``, NoPE), Granite 4.0-H (``granitemoehybrid``:
  ``GraniteMoeHybridMambaLayer``, ``GraniteMoeHybridAttention``, RoPE or NoPE), Falcon-H1
  (``falcon_h1``: ``FalconH1Mixer`` and ``FalconH1Attention`` side by side in every layer, muP
  multipliers) and Bamba (``bamba``: ``BambaMixer``, ``BambaAttention``, RoPE on half of each
  head): a Mamba2 layer exchanges the ``(W - 1)``-token halo of its conv over ``[x | B | C]``
  and one fp32 state-chain all-gather of ``[batch, heads, N, N + P]`` (``N`` the SSM state size,
  ``P`` the head dim); an attention layer all-gathers K/V.
* LFM2 (``lfm2``) and LFM2-MoE (``lfm2_moe``): ``Lfm2(Moe)ShortConv`` (gated short conv:
  exchanges its ``(W - 1)``-token halo of ``[batch, tokens, hidden]``) and ``Lfm2(Moe)Attention``
  (GQA, per-head q/k norm, RoPE): all-gathers K/V.

Qwen3.5's vision-language wrappers hold the same text model: text runs on fcp, and image or
video inputs given with a ``cp_context`` raise a ``ValueError`` (not supported yet).
* Qwen4-Exp (``qwen4_exp``: Qwen3.8-Flash-Next; :mod:`.qwen4_exp`): ``Qwen4ExpTextGatedDeltaNet``
  (Gated DeltaNet, separate projections), ``Qwen4ExpTextAttention`` (gated GQA over a QSA
  selection: the indexer's ``ratio - 1`` token halo, ``ceil(L / ratio)`` compressed keys per
  rank, K/V), ``Qwen4ExpTextPLELayer`` (hashed n-gram Per-Layer Embeddings: an integer halo of
  ``ngram_size - 1`` token ids, the dilated conv's ``(width - 1) * ngram_size`` token halo) and
  ``Qwen4ExpTextDecoderLayer`` (hands the context to its PLE, which transformers calls without
  ``**kwargs``). Image / video inputs with a context raise.

transformers binds these models' recurrent kernels to FLA's Triton kernels whenever FLA is
importable (they fail on a CPU); given a ``cp_context`` the mixers never take that path: they run
fcp's operators.
"""

from __future__ import annotations

from torch import nn

from fcp.integrations.hf.core import ContextScope, FcpMixer, replace
from fcp.integrations.hf.mixers import GatedDeltaNetMixer, GatedShortConvMixer, GqaMixer
from fcp.integrations.hf.mixers import IndexedMlaMixer, KdaMixer, MlaMixer, PleMixer, QsaGqaMixer
from fcp.integrations.hf.mixers import SsdMixer
from fcp.integrations.hf.models import ADAPTERS
from fcp.integrations.hf.qwen4_exp import ADAPTERS as QWEN4_EXP_ADAPTERS

__all__ = [
    "SUPPORTED",
    "FcpMixer",
    "GatedDeltaNetMixer",
    "GatedShortConvMixer",
    "GqaMixer",
    "IndexedMlaMixer",
    "KdaMixer",
    "MlaMixer",
    "SsdMixer",
    "PleMixer",
    "QsaGqaMixer",
    "enable_packed_cp",
]

#: transformers class name -> the fcp mixer (a kind or a model's adapter) that replaces it
#: (:mod:`.models`; Qwen4-Exp's own module, :mod:`.qwen4_exp`, builds on its Qwen3-Next rows).
SUPPORTED = {**ADAPTERS, **QWEN4_EXP_ADAPTERS}


def enable_packed_cp(model: nn.Module) -> nn.Module:
    """Replace ``model``'s supported token mixers (:data:`SUPPORTED`) in place; return ``model``.

    ``model`` is a transformers model or any module containing one (e.g. a
    ``Glm5NextForConditionalGeneration``, ``KimiLinearForCausalLM``, ``Qwen3NextForCausalLM``,
    ``Qwen3_5ForConditionalGeneration`` (text inputs only under a ``cp_context``),
    ``NemotronHForCausalLM``, ``Lfm2ForCausalLM``, or one decoder layer). The mixers stay the
    same objects (their class is swapped), so parameters, buffers, their names, optimizers built
    before the call and checkpoints stay valid. Registers the context guard
    (:class:`~fcp.integrations.hf.core.ContextScope`) on ``model`` and on every
    ``PreTrainedModel`` inside it that holds replaced mixers. Idempotent. Raises ``ValueError``
    if ``model`` has no supported mixer, and ``NotImplementedError`` for a supported mixer whose
    configuration fcp cannot compute (e.g. a conv activation other than SiLU, a
    sequence-dependent rope type).
    """
    targets = [(m, SUPPORTED[type(m).__name__]) for m in model.modules()
               if type(m).__name__ in SUPPORTED and not isinstance(m, FcpMixer)]  # fmt: skip
    for module, adapter in targets:  # every check before any change
        adapter.fcp_check(module)
    for module, adapter in targets:
        replace(module, adapter)
    mixers = [(name, m) for name, m in model.named_modules() if isinstance(m, FcpMixer)]
    if not mixers:
        raise ValueError(f"enable_packed_cp: {type(model).__name__} has no supported token mixer "
                         f"(supported: {sorted(SUPPORTED)})")  # fmt: skip
    ContextScope.register(model, mixers)
    from transformers import PreTrainedModel  # not a dependency of fcp: imported when needed

    for owner in model.modules():
        if owner is not model and isinstance(owner, PreTrainedModel):
            inner = [(n, m) for n, m in owner.named_modules() if isinstance(m, FcpMixer)]
            if inner:
                ContextScope.register(owner, inner)
    return model
