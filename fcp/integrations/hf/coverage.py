"""Which modules of a model mix tokens along the sequence without being fcp mixers.

Under a ``cp_context`` every module of the forward sees a packed, sharded batch: a module that
mixes tokens and is not an fcp mixer would mix documents together and see only its rank's shard,
silently. :func:`enable_packed_cp <fcp.integrations.hf.enable_packed_cp>` therefore refuses a
model holding one (or, with ``allow_unreplaced=True``, guards it:
:class:`~fcp.integrations.hf.core.UnreplacedGuard`). The detection rule, :func:`mixes_tokens`,
flags a module when

* it is one of torch's sequence mixers: ``nn.MultiheadAttention``, a recurrence
  (``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` and their cells), or an ``nn.Conv1d`` wider than one
  token or with a stride (in a language model a 1-D conv runs along the sequence; a width-1,
  stride-1 one is per token; transformers' GPT-2 ``Conv1D`` is a linear layer, not an
  ``nn.Conv1d``);
* a class of its MRO is named like a token mixer, by transformers' naming: a name ending in
  :data:`MIXER_SUFFIXES` (``Qwen3Attention``, ``LlamaFlashAttention2``, ``MambaMixer``,
  ``Qwen3NextGatedDeltaNet``, ``Lfm2ShortConv``, ``RecurrentGemmaRecurrentBlock``, ...; a
  decoder layer, ``...AttentionDecoderLayer``, is not: it holds its mixer);
* or it holds attention projections (:data:`QKV_PROJECTIONS`: ``q_proj`` and ``k_proj``,
  ``query`` and ``key``, ``q`` and ``k`` (xLSTM's mLSTM layer), or a fused ``qkv_proj`` /
  ``query_key_value`` / ``Wqkv`` / ``c_attn`` / ``qkv``), whatever its class is called;
* or it is a token shift: an ``nn.ZeroPad2d`` / ``nn.ConstantPad2d`` that pads or crops the
  second-to-last axis (the sequence of ``[B, L, D]`` hidden states; RWKV's ``time_shift``,
  ``ZeroPad2d((0, 0, 1, -1))``, in its time- and channel-mixing layers).

:func:`unreplaced` walks the model from the top and reports the outermost flagged modules (a
flagged module's own submodules are part of it). A module that holds fcp mixers is a container
(the model, a decoder layer, Qwen4-Exp's decoder layer adapter that only hands its mixers the
context): never reported itself, its children are walked. Otherwise the walk does not descend
into

* an fcp mixer (or a module about to become one): its submodules (a Gated DeltaNet's
  ``conv1d``, an MLA's indexer) run inside it, on the CP path;
* a transformers model whose ``input_modalities`` are images and video only (the vision tower of
  a ``*ForConditionalGeneration``): fcp refuses image and video inputs under a context, so a text
  forward given one never runs it.

No module of the 14 supported families is flagged (``tests/test_hf_coverage.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

from fcp.integrations.hf.core import FcpMixer

__all__ = ["MIXER_SUFFIXES", "QKV_PROJECTIONS", "mixes_tokens", "unreplaced"]

#: How transformers names its token-mixer classes (a trailing version digit allowed:
#: ``FlashAttention2``, ``Mamba2``).
MIXER_SUFFIXES = ("Attention", "Mixer", "Mamba", "MambaLayer", "DeltaNet", "ShortConv",
                  "RecurrentBlock", "Recurrence", "Retention", "RNN", "LSTM", "GRU")  # fmt: skip

#: Child names that make a module an attention: all of one tuple present.
QKV_PROJECTIONS = (("q_proj", "k_proj"), ("query", "key"), ("q", "k"), ("qkv_proj",),
                   ("query_key_value",), ("Wqkv",), ("c_attn",), ("qkv",))  # fmt: skip

_NAMED_MIXER = re.compile(rf"({'|'.join(MIXER_SUFFIXES)})\d*$")
#: media a cp_context refuses (:data:`~fcp.integrations.hf.core.MULTIMODAL_INPUTS`)
_REFUSED_MODALITIES = {"image", "video"}


def mixes_tokens(module: nn.Module) -> bool:
    """Whether ``module`` mixes tokens along the sequence by the module doc's rule (its
    submodules aside)."""
    if isinstance(module, (nn.MultiheadAttention, nn.RNNBase, nn.RNNCellBase)):
        return True
    if isinstance(module, nn.Conv1d):
        return module.kernel_size != (1,) or module.stride != (1,)
    if isinstance(module, (nn.ZeroPad2d, nn.ConstantPad2d)):
        return any(module.padding[2:])  # (left, right, top, bottom): top/bottom shift the tokens
    if any(_NAMED_MIXER.search(cls.__name__) for cls in type(module).__mro__):
        return True
    children = dict(module.named_children())
    return any(all(name in children for name in names) for names in QKV_PROJECTIONS)


def _refused_tower(module: nn.Module) -> bool:
    modalities = getattr(module, "input_modalities", None)
    if not modalities or not hasattr(module, "config"):
        return False
    modalities = {modalities} if isinstance(modalities, str) else set(modalities)
    return modalities <= _REFUSED_MODALITIES


def unreplaced(model: nn.Module, is_fcp: Callable[[nn.Module], bool] | None = None
               ) -> dict[str, nn.Module]:  # fmt: skip
    """``{qualified name: module}`` of ``model``'s token mixers that are not fcp mixers (the
    module doc's walk), in module order. ``is_fcp(module)``: whether ``module`` is (or is about
    to become) an fcp mixer; by default, whether it is an :class:`FcpMixer`."""
    is_fcp = is_fcp or (lambda m: isinstance(m, FcpMixer))
    holds: dict[int, bool] = {}  # id -> whether a proper submodule is an fcp mixer
    found: dict[str, nn.Module] = {}
    seen: set[int] = set()  # a shared module is reported once, under its first name

    def holds_fcp(module: nn.Module) -> bool:
        if id(module) not in holds:
            holds[id(module)] = any(is_fcp(c) or holds_fcp(c) for c in module.children())
        return holds[id(module)]

    def walk(module: nn.Module, name: str, top: bool) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if not holds_fcp(module):
            if is_fcp(module) or (not top and _refused_tower(module)):
                return
            if mixes_tokens(module):
                found[name] = module
                return
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, False)

    walk(model, "", True)
    return found
