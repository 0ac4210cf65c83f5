"""transformers' GLM-5.3-Flash (``glm5_next``) as a byte-level language model on fcp.

:class:`Glm5NextLM` is transformers' own ``Glm5NextTextModel`` (built from
``examples/configs/glm5_next_tiny.json``, random init) with a language-model head, and
:func:`fcp.integrations.hf.enable_packed_cp` applied: its KDA and k-pool DSA layers run fcp's
operators, so packed documents stay separate and the sequence can be split over CP ranks::

    model = Glm5NextLM.from_config()
    local, ctx = fcp.shard_batch(cp_group, batch)
    logits = model(local["input_ids"], ctx)            # [batch, local_seq, vocab], fp32

The same ``forward(input_ids, ctx)`` contract as the home-made models of
:mod:`examples.models`, so the demo and the tests drive both the same way. ``blocks`` are the
decoder layers (the units FSDP2 shards), ``mixers()`` the fcp-backed token mixers (the modules
the demo compiles). :meth:`~Glm5NextLM.compile_layers` compiles the decoder layers whole, one
graph per layer kind (:func:`fcp.integrations.hf.compile_layers`), MoE and hyper-connections
included::

    model = Glm5NextLM.from_config().compile_layers(backend="aot_eager", fullgraph=True)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from fcp import PackedContext
from fcp.integrations.hf import compile_layers, enable_packed_cp

__all__ = ["CONFIG", "Glm5NextLM"]

CONFIG = Path(__file__).resolve().parent / "configs" / "glm5_next_tiny.json"


class Glm5NextLM(nn.Module):
    """transformers' ``Glm5NextTextModel`` on fcp plus a linear head over the byte vocabulary.

    A subclass for another transformers model sets ``config_path`` and overrides :meth:`build`
    (and ``blocks``, ``mixers``, ``forward``; :class:`examples.qwen4_exp_hf.Qwen4ExpLM`)."""

    pad_multiple = 1  # no operator of this model needs more than the CP size
    config_path = CONFIG

    def __init__(self, config: dict, seed: int = 0):
        super().__init__()
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)  # same weights on every rank and in the single-process twin
        try:
            self.build({k: v for k, v in config.items() if not k.startswith("_")})
        finally:
            torch.random.set_rng_state(state)

    def build(self, config: dict) -> None:
        """Make the model's modules from ``config`` (the JSON's keys), under the fixed seed."""
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

        cfg = Glm5NextTextConfig(**config)
        cfg._attn_implementation = "eager"  # unused by fcp's modules; no SDPA dispatch
        self.backbone = enable_packed_cp(Glm5NextTextModel(cfg))
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        nn.init.normal_(self.head.weight, std=0.02)
        self.config = cfg

    @classmethod
    def from_config(cls, path: str | Path | None = None, **overrides) -> "Glm5NextLM":
        config = json.loads(Path(path or cls.config_path).read_text())
        config.update(overrides)
        return cls(config)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.backbone.layers

    def mixers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.backbone.layers]

    def compile_layers(self, **compile_kwargs) -> "Glm5NextLM":
        """Compile each of :attr:`blocks` on its own, in place (``torch.compile`` keyword
        arguments), and return the model: layers of one kind share one graph, so the compile
        time follows the kinds of layers, not the depth
        (:func:`fcp.integrations.hf.compile_layers`). The embeddings and the head stay eager."""
        compile_layers(self, layers=self.blocks, **compile_kwargs)
        return self

    def forward(self, input_ids: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        out = self.backbone(input_ids=input_ids, cp_context=ctx, use_cache=False)
        logits = self.head(out.last_hidden_state)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))
