"""Mamba (``mamba``) and Falcon-Mamba (``falcon_mamba``) on fcp: Mamba1 layers only.

* ``MambaMixer`` -> :class:`~..mixers.mamba1.Mamba1Mixer` as it is; ``FalconMambaMixer`` ->
  :class:`Mamba1NormedAdapter`: the same layer with transformers' weightless RMS norms of
  ``dt``, ``B`` and ``C`` (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``: ``x /
  sqrt(mean(x^2) + mixer_rms_eps)`` in fp32, per token over the last axis, then back to the
  layer's dtype) between ``x_proj`` and ``dt_proj`` / the scan. Per-token norms: nothing crosses
  ranks for them.
* ``MambaBlock``, ``FalconMambaBlock`` -> :class:`Mamba1BlockAdapter` and ``MambaModel``,
  ``FalconMambaModel`` -> :class:`Mamba1ModelAdapter`: transformers' Mamba models call their
  blocks, and the blocks their mixer, without ``**kwargs``, so a ``cp_context`` given to the
  model would never reach a mixer (fcp's guard would refuse the call). Under a context the two
  adapters run the same code as transformers (embeddings, per block ``residual + mixer(norm(h))``
  with ``residual_in_fp32``, ``norm_f``) and hand the context down; without one, transformers'
  own forwards run. The model's ``forward`` takes the context (its only override besides the
  ``fcp_*`` steps): the model's first argument is ``input_ids``, not ``hidden_states``.

``MambaForCausalLM`` / ``FalconMambaForCausalLM`` call the backbone without ``**kwargs`` too:
:class:`Mamba1CausalLMAdapter` hands the context to the backbone, then applies ``lm_head``
(``logits_to_keep`` as transformers); the loss from ``shift_labels`` is fcp's hook
(:mod:`fcp.integrations.hf.causal_lm`).

Under CP a Mamba1 layer exchanges the ``W - 1``-token halo of its conv over ``x`` and one fp32
state-chain all-gather of ``[B, I, N, N + 1]`` (``I`` channels, ``N`` the state size).
"""

from __future__ import annotations

import sys

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import Mamba1Mixer

__all__ = ["FAMILIES", "Mamba1BlockAdapter", "Mamba1CausalLMAdapter", "Mamba1ModelAdapter",
           "Mamba1NormedAdapter"]


class Mamba1NormedAdapter(Mamba1Mixer):
    """A Mamba1 layer with norms of ``dt``, ``B``, ``C`` before the scan (``dt_layernorm``,
    ``b_layernorm``, ``c_layernorm``): Falcon-Mamba's weightless RMS norms (module doc), Jamba's
    weighted ones (:mod:`.jamba`)."""

    def fcp_ssm_norms(self, dt: torch.Tensor, b: torch.Tensor,
                      c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)


def _forward_from_ids(self, input_ids=None, *args, cp_context=None, inputs_embeds=None, **kwargs):
    """The ``forward`` of a model taking ``input_ids`` first: without a context, transformers'
    own; with one, the embeddings, then ``fcp_forward`` on them."""
    if cp_context is None:
        return FcpMixer.forward(self, input_ids, *args, inputs_embeds=inputs_embeds, **kwargs)
    if args:
        raise TypeError(f"{type(self).__name__}.forward: with cp_context, pass everything but "
                        "input_ids by keyword")  # fmt: skip
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    h = self.get_input_embeddings()(input_ids) if inputs_embeds is None else inputs_embeds
    return self.fcp_forward(h, cp_context, **kwargs)


class Mamba1BlockAdapter(FcpMixer):
    """A Mamba block under a context: ``residual + mixer(norm(h), cp_context=ctx)``, the
    residual in fp32 with ``residual_in_fp32`` (transformers' ``MambaBlock.forward``)."""

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext,
                    **_) -> torch.Tensor:  # fmt: skip
        residual = hidden_states
        h = self.norm(hidden_states.to(dtype=self.norm.weight.dtype))
        if self.residual_in_fp32:
            residual = residual.to(torch.float32)
        return residual + self.mixer(h, cp_context=ctx)


class Mamba1ModelAdapter(FcpMixer):
    """A Mamba model under a context: embeddings, every block given the context, ``norm_f``
    (transformers' ``MambaModel.forward`` without a cache)."""

    forward = _forward_from_ids

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, *,
                    output_hidden_states: bool | None = None, return_dict: bool | None = None,
                    **_):  # fmt: skip
        # the cache arguments were refused (or use_cache set False) by the scope's check
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if return_dict is None:
            return_dict = self.config.return_dict
        h, every = hidden_states, ()
        for block in self.layers:
            h = block(h, cp_context=ctx)
            every += (h,)
        h = self.norm_f(h)
        every = (*every, h) if output_hidden_states else None
        if not return_dict:
            return tuple(v for v in (h, every) if v is not None)
        hf_class = type(self).__bases__[1]  # Packed<MambaModel>'s transformers base
        output = getattr(sys.modules[hf_class.__module__], hf_class.__name__[:-5] + "Output")
        return output(last_hidden_state=h, cache=None, hidden_states=every)


class Mamba1CausalLMAdapter(FcpMixer):
    """A Mamba causal LM under a context: the backbone given the context, then ``lm_head``
    (transformers' ``MambaForCausalLM.forward``; the loss from ``shift_labels`` is fcp's hook,
    :mod:`fcp.integrations.hf.causal_lm`)."""

    forward = _forward_from_ids  # the backbone's embeddings, then fcp_forward

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, *,
                    output_hidden_states: bool | None = None, return_dict: bool | None = None,
                    logits_to_keep: int | torch.Tensor = 0, **_):  # fmt: skip
        out = self.backbone(inputs_embeds=hidden_states, cp_context=ctx, return_dict=True,
                            output_hidden_states=output_hidden_states)  # fmt: skip
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            h = h[:, -logits_to_keep:] if logits_to_keep else h
        else:
            h = h[:, logits_to_keep]
        logits = self.lm_head(h.to(self.lm_head.weight.dtype)).float()
        if return_dict is False:
            return tuple(v for v in (logits, out.hidden_states) if v is not None)
        hf_class = type(self).__bases__[1]  # Packed<MambaForCausalLM>'s transformers base
        output = getattr(sys.modules[hf_class.__module__],
                         hf_class.__name__.replace("ForCausalLM", "CausalLMOutput"))  # fmt: skip
        return output(loss=None, logits=logits, cache=None, hidden_states=out.hidden_states)


_CROSSES = ("Mamba1: a `W - 1`-token halo of its conv over `x` and one fp32 state-chain "
            "all-gather `[B, I, N, N + 1]` (I channels, N the state size); blocks and model: "
            "nothing")  # fmt: skip

#: 3 Mamba1 layers: 64 channels (expand 2), state 8, conv 4, dt rank 4, conv and in/out biases
_MAMBA_TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, state_size=8, expand=2,
                   conv_kernel=4, time_step_rank=4, use_bias=True, use_conv_bias=True,
                   residual_in_fp32=True, pad_token_id=0)  # fmt: skip
#: the same with Falcon-Mamba's dt/B/C RMS norms (eps 1e-6)
_FALCON_MAMBA_TINY = dict(_MAMBA_TINY, use_bias=False, mixer_rms_eps=1e-6)

FAMILIES = (
    Family.of("mamba", "Mamba", "MambaModel", _MAMBA_TINY, _CROSSES, MambaMixer=Mamba1Mixer,
              MambaBlock=Mamba1BlockAdapter, MambaModel=Mamba1ModelAdapter,
              MambaForCausalLM=Mamba1CausalLMAdapter),
    Family.of("falcon_mamba", "Falcon-Mamba", "FalconMambaModel", _FALCON_MAMBA_TINY, _CROSSES,
              FalconMambaMixer=Mamba1NormedAdapter, FalconMambaBlock=Mamba1BlockAdapter,
              FalconMambaModel=Mamba1ModelAdapter, FalconMambaForCausalLM=Mamba1CausalLMAdapter),
)
