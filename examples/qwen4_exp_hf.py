"""transformers' Qwen4-Exp (``qwen4_exp``: Qwen3.8-Flash-Next) as a byte-level language model on
fcp.

:class:`Qwen4ExpLM` is transformers' own ``Qwen4ExpForCausalLM`` (built from
``examples/configs/qwen4_exp_tiny.json``, random init) with
:func:`fcp.integrations.hf.enable_packed_cp` applied: its Gated DeltaNet, QSA attention and PLE
layers run fcp's operators, so packed documents stay separate (the PLE's n-gram history
included) and the sequence can be split over CP ranks::

    model = Qwen4ExpLM.from_config()
    local, ctx = fcp.shard_batch(cp_group, batch)
    logits = model(local["input_ids"], ctx)            # [batch, local_seq, vocab], fp32

The contract of :class:`examples.glm5_hf.Glm5NextLM`: ``blocks`` are the decoder layers (the
units FSDP2 shards), ``mixers()`` the fcp-backed token mixers and PLE layers (the modules the
demo compiles; the decoder layers, with their MoE, stay eager), ``compile_layers(...)`` compiles
the decoder layers whole instead, one graph per layer kind (the tiny configuration's 4 layers are
4 kinds: Gated DeltaNet or QSA attention, with or without a PLE, n-gram tables of two
sizes).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from examples.glm5_hf import Glm5NextLM
from fcp import PackedContext
from fcp.integrations.hf import enable_packed_cp

__all__ = ["CONFIG", "Qwen4ExpLM"]

CONFIG = Path(__file__).resolve().parent / "configs" / "qwen4_exp_tiny.json"


class Qwen4ExpLM(Glm5NextLM):
    """transformers' ``Qwen4ExpForCausalLM`` on fcp (its own ``lm_head`` over the bytes)."""

    config_path = CONFIG

    def build(self, config: dict) -> None:
        from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
        from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM

        cfg = Qwen4ExpTextConfig(**config)
        cfg._attn_implementation = "eager"  # unused by fcp's modules; no SDPA dispatch
        self.lm = enable_packed_cp(Qwen4ExpForCausalLM(cfg))
        self.config = cfg

    @property
    def blocks(self) -> nn.ModuleList:
        return self.lm.model.layers

    def mixers(self) -> list[nn.Module]:
        """Per layer in the order they run: the PLE (if any), then the token mixer."""
        layers = self.lm.model.layers
        return [m for layer in layers for m in (layer.ple, getattr(layer, "linear_attn", None)
                                                or layer.self_attn) if m is not None]  # fmt: skip

    def forward(self, input_ids: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        logits = self.lm(input_ids=input_ids, cp_context=ctx, use_cache=False).logits
        return logits.to(torch.promote_types(logits.dtype, torch.float32))
