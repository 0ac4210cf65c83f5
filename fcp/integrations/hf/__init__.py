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
raises, and so does a KV cache (``use_cache=True``, ``cache`` / ``past_key_values``). Nor does a
token mixer fcp does not replace (a foreign attention such as a ``Qwen3Attention`` put into a
Qwen3.5, an ``nn.Conv1d`` or ``nn.GRU`` over the sequence; the rule: :mod:`.coverage`):
:func:`enable_packed_cp` refuses a model holding one, naming each, and with
``allow_unreplaced=True`` enables it but makes each such module raise when called under a
context. :func:`packed_mixers` lists what was replaced (also logged at INFO, logger ``"fcp"``),
:func:`unreplaced_mixers` what the rule flags.

:func:`compile_layers` compiles the model's decoder layers one by one (regional compilation), so
that layers of one kind share one graph: compile time grows with the kinds of layers, not the
depth (:mod:`.compile`).

Supported families and mixers: the registry :mod:`fcp.integrations.hf.families`, one module and
one row per transformers family (what each replaces, with which mixer kind of :mod:`.mixers`, and
what crosses ranks per layer); :data:`SUPPORTED` and :func:`enable_packed_cp`'s refusal are
derived from it, and ``python -m fcp.integrations.hf.families`` prints the guide's model table.

transformers binds these models' recurrent kernels to FLA's Triton kernels whenever FLA is
importable (they fail on a CPU); given a ``cp_context`` the mixers never take that path: they run
fcp's operators.
"""

from __future__ import annotations

import logging
from collections import Counter

from torch import nn

from fcp.integrations.hf.causal_lm import CausalLMLoss
from fcp.integrations.hf.compile import compile_layers, decoder_layers, layer_kinds
from fcp.integrations.hf.core import ContextScope, FcpMixer, UnreplacedGuard, fcp_class, replace
from fcp.integrations.hf.coverage import unreplaced
from fcp.integrations.hf.families import SUPPORTED, supported_families
from fcp.integrations.hf.mixers import GatedDeltaNetMixer, GatedShortConvMixer, GqaMixer
from fcp.integrations.hf.mixers import IndexedMlaMixer, KdaMixer, MlaMixer, PleMixer, QsaGqaMixer
from fcp.integrations.hf.mixers import SsdMixer

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
    "UnreplacedGuard",
    "compile_layers",
    "decoder_layers",
    "enable_packed_cp",
    "layer_kinds",
    "packed_mixers",
    "unreplaced_mixers",
]

_log = logging.getLogger("fcp")


def enable_packed_cp(model: nn.Module, *, allow_unreplaced: bool = False) -> nn.Module:
    """Replace ``model``'s supported token mixers (:data:`SUPPORTED`) in place; return ``model``.

    ``model`` is a transformers model or any module containing one (e.g. a
    ``Glm5NextForConditionalGeneration``, ``KimiLinearForCausalLM``, ``Qwen3NextForCausalLM``,
    ``Qwen3_5ForConditionalGeneration`` (text inputs only under a ``cp_context``),
    ``NemotronHForCausalLM``, ``Lfm2ForCausalLM``, or one decoder layer). The mixers stay the
    same objects (their class is swapped), so parameters, buffers, their names, optimizers built
    before the call and checkpoints stay valid. Registers the context guard
    (:class:`~fcp.integrations.hf.core.ContextScope`) on ``model`` and on every
    ``PreTrainedModel`` inside it that holds replaced mixers, and logs what it replaced (INFO,
    logger ``"fcp"``; :func:`packed_mixers` lists it). Idempotent.

    Raises ``ValueError`` if ``model`` has no supported mixer, ``NotImplementedError`` for a
    supported mixer whose configuration fcp cannot compute (e.g. a conv activation other than
    SiLU, a sequence-dependent rope type), and ``ValueError`` naming every module that mixes
    tokens along the sequence and is not replaced (:func:`unreplaced_mixers`; the rule:
    :mod:`.coverage`), which under a ``cp_context`` would silently run non-CP code on the packed,
    sharded batch. Each raises before any change to ``model``.

    Under a ``cp_context`` the model's loss comes from ``shift_labels`` (what
    :func:`fcp.shard_batch` makes of ``labels``), and ``labels=`` alone raises
    (:mod:`.causal_lm`: shifting inside a shard would lose every shard's last target).

    ``allow_unreplaced=True`` enables such a model anyway, for unreplaced mixers that never run
    under a ``cp_context`` (or a module the rule flags wrongly, run without one): each gets an
    :class:`~fcp.integrations.hf.core.UnreplacedGuard` and raises a ``ValueError`` naming it when
    called inside a forward given a ``cp_context``; without one it runs as it is. A module allowed
    so stays allowed in later calls.
    """
    targets = [(m, SUPPORTED[type(m).__name__]) for m in model.modules()
               if type(m).__name__ in SUPPORTED and not isinstance(m, FcpMixer)]  # fmt: skip
    for module, adapter in targets:  # every check before any change
        adapter.fcp_check(module)
    pending = {id(m) for m, _ in targets}

    def is_fcp(m: nn.Module) -> bool:
        return isinstance(m, FcpMixer) or id(m) in pending

    if not any(is_fcp(m) for m in model.modules()):
        raise ValueError(f"enable_packed_cp: {type(model).__name__} has no supported token mixer; "
                         f"the supported families and their mixers:\n{supported_families()}")
    left = unreplaced(model, is_fcp)
    refused = {name: m for name, m in left.items()
               if not allow_unreplaced and UnreplacedGuard.of(m) is None}  # fmt: skip
    if refused:
        raise ValueError(_refusal(model, refused))
    for module, adapter in targets:
        replace(module, adapter)
    guards = {id(m): UnreplacedGuard.attach(m) for m in left.values()}
    _register_scopes(model, guards)
    CausalLMLoss.register(model)  # labels under a context: right or refused (.causal_lm)
    _log_summary(model, left)
    return model


def packed_mixers(model: nn.Module) -> dict[str, str]:
    """``{qualified name: fcp class name}`` of ``model``'s fcp mixers (the kind or the model's
    adapter each runs on, e.g. ``"layers.1.self_attn": "Qwen3NextAttentionAdapter"``), in module
    order; empty before :func:`enable_packed_cp`."""
    return {name: fcp_class(m).__name__ for name, m in model.named_modules()
            if isinstance(m, FcpMixer)}  # fmt: skip


def unreplaced_mixers(model: nn.Module) -> dict[str, str]:
    """``{qualified name: class name}`` of ``model``'s modules that mix tokens along the sequence
    and are neither fcp mixers nor supported by fcp (:mod:`.coverage`'s rule), in module order:
    what :func:`enable_packed_cp` refuses (or, with ``allow_unreplaced=True``, guards)."""
    found = unreplaced(model, lambda m: isinstance(m, FcpMixer) or type(m).__name__ in SUPPORTED)
    return {name: type(m).__name__ for name, m in found.items()}


def _refusal(model: nn.Module, refused: dict[str, nn.Module]) -> str:
    listed = "; ".join(f"{name or '<the model itself>'} ({type(m).__name__})"
                       for name, m in refused.items())  # fmt: skip
    return (f"enable_packed_cp: {type(model).__name__} has {len(refused)} token mixer(s) that fcp "
            f"does not replace: {listed}. Under a cp_context each would run its non-CP code on the "
            "packed, sharded batch (mixing documents, blind to the other ranks' tokens) without "
            "an error. Replace them with supported mixers, or, if they do not run under a "
            "cp_context, pass enable_packed_cp(model, allow_unreplaced=True): each then raises a "
            "ValueError when called inside a forward given a cp_context. The model is unchanged.")


def _register_scopes(model: nn.Module, guards: dict[int, UnreplacedGuard]) -> None:
    """A scope on ``model`` and on every ``PreTrainedModel`` inside it holding fcp mixers (a
    wrapper that drops the context leaves the inner model's mark set by the outer one)."""
    from transformers import PreTrainedModel  # not a dependency of fcp: imported when needed

    for owner in model.modules():
        if owner is not model and not isinstance(owner, PreTrainedModel):
            continue
        named = list(owner.named_modules())
        mixers = [(n, m) for n, m in named if isinstance(m, FcpMixer)]
        if mixers:
            owned = [(n, guards[id(m)]) for n, m in named if id(m) in guards]
            ContextScope.register(owner, mixers, owned)


def _log_summary(model: nn.Module, left: dict[str, nn.Module]) -> None:
    counts = Counter((type(m).__bases__[1].__name__, fcp_class(m).__name__)
                     for m in model.modules() if isinstance(m, FcpMixer))  # fmt: skip
    replaced = ", ".join(f"{n} {hf} -> {fcp}" for (hf, fcp), n in counts.items())
    _log.info("enable_packed_cp(%s): %d modules on fcp: %s", type(model).__name__,
              sum(counts.values()), replaced)  # fmt: skip
    if left:
        _log.warning("enable_packed_cp(%s): %d token mixer(s) left unreplaced "
                     "(allow_unreplaced=True), raising under a cp_context: %s",
                     type(model).__name__, len(left),
                     "; ".join(f"{n} ({type(m).__name__})" for n, m in left.items()))  # fmt: skip


def __getattr__(name: str):
    # the trainers import transformers' Trainer (and TRL): only when asked for
    if name == "PackedCPTrainer":
        from fcp.integrations.hf.trainer import PackedCPTrainer

        return PackedCPTrainer
    if name == "PackedCPSFTTrainer":
        from fcp.integrations.hf.sft import PackedCPSFTTrainer  # needs TRL

        return PackedCPSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
