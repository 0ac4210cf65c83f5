"""RWKV-4 (transformers' ``rwkv``) on fcp: its mixers and the adapters that hand them the context.

* ``RwkvSelfAttention`` -> :class:`~..mixers.rwkv.WkvMixer` (token shift + WKV,
  :func:`fcp.ops.wkv.wkv`, + receptance gate): a one-token halo, an all-gather of fp32
  ``[B, A]`` running maxima and one fp32 state-chain all-gather ``[B, A, 1, 3]`` under CP;
* ``RwkvFeedForward`` -> :class:`~..mixers.rwkv.TokenShiftFfnMixer` (token shift + squared-ReLU
  MLP): a one-token halo;
* ``RwkvBlock``, ``RwkvModel``, ``RwkvForCausalLM`` -> :class:`RwkvBlockAdapter`,
  :class:`RwkvModelAdapter`, :class:`RwkvForCausalLMAdapter`: transformers' RWKV code passes no
  keyword arguments down (the model calls ``block(hidden, state=..., use_cache=...)``, the block
  ``attention(x, state=...)``, the causal LM ``rwkv(input_ids, ...)``), so ``cp_context`` would
  never reach the mixers; under a context these adapters run transformers' steps themselves and
  hand the context on. They exchange nothing. Without a context each is transformers' code.

Under a context the model keeps transformers' inference rescaling (``rescale_every``: in eval
mode the blocks' output weights are divided by ``2 ** (block // rescale_every)`` and the hidden
state halved every ``rescale_every`` blocks, by transformers' own ``_rescale_layers``), and
refuses a recurrent ``state``, ``use_cache=True`` and ``output_attentions`` (fcp runs full
packed sequences). The token shift reads the previous token of the same document (zeros at a
document start, as transformers' ``ZeroPad2d`` at a row start); the WKV's sums restart at every
document start.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import TokenShiftFfnMixer, WkvMixer

__all__ = ["FAMILIES", "RwkvBlockAdapter", "RwkvForCausalLMAdapter", "RwkvModelAdapter",
           "ids_first"]


def ids_first(cls_forward):
    """A model adapter's ``forward``: transformers' models take ``input_ids`` (not
    ``hidden_states``) first; under a context it is handed to ``fcp_forward`` in that place."""

    def forward(self, input_ids=None, *args, cp_context=None, **kwargs):
        if cp_context is None:
            return cls_forward(self, input_ids, *args, **kwargs)
        if args:
            raise TypeError(f"{type(self).__name__}.forward: with cp_context, pass everything "
                            "but input_ids by keyword")  # fmt: skip
        return self.fcp_forward(input_ids, cp_context, **kwargs)

    return forward


def _refuse(fn: str, *, state=None, use_cache=None, output_attentions=None) -> None:
    for name, value in (("state", state), ("use_cache", use_cache),
                        ("output_attentions", output_attentions)):  # fmt: skip
        if value is not None and value is not False:
            raise ValueError(f"{fn}: {name}={value!r} is not supported with cp_context (fcp runs "
                             "full packed sequences, without a recurrent state or attentions)")


class RwkvBlockAdapter(FcpMixer):
    """transformers' ``RwkvBlock`` under a context: ``(hidden [B, L, D]) -> (hidden, None,
    None)`` (transformers' ``(hidden, state, attentions)``), the context handed to its time- and
    channel-mixing layers."""

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, *, state=None,
                    use_cache=None, output_attentions=None, **_) -> tuple:  # fmt: skip
        _refuse(f"{type(self).__name__}.forward", state=state, use_cache=use_cache,
                output_attentions=output_attentions)  # fmt: skip
        h = hidden_states
        if self.layer_id == 0:
            h = self.pre_ln(h)
        h = h + self.attention(self.ln1(h), cp_context=ctx)[0]
        h = h + self.feed_forward(self.ln2(h), cp_context=ctx)[0]
        return h, None, None


class RwkvModelAdapter(FcpMixer):
    """transformers' ``RwkvModel`` under a context (``fcp_forward``'s ``hidden_states`` are the
    ``input_ids`` ``[B, L]``, or ``None`` with ``inputs_embeds``): embeddings, the blocks given
    the context, transformers' rescaling, ``ln_out``; an ``RwkvOutput`` without a state."""

    forward = ids_first(FcpMixer.forward)

    def fcp_forward(self, hidden_states, ctx: PackedContext, *, inputs_embeds=None, state=None,
                    use_cache=None, output_attentions=None, output_hidden_states=None,
                    return_dict=None, **_):  # fmt: skip
        from transformers.models.rwkv.modeling_rwkv import RwkvOutput

        fn = f"{type(self).__name__}.forward"
        _refuse(fn, state=state, use_cache=use_cache, output_attentions=output_attentions)
        if (hidden_states is None) == (inputs_embeds is None):
            raise ValueError(f"{fn}: pass exactly one of input_ids and inputs_embeds")
        config = self.config
        if output_hidden_states is None:
            output_hidden_states = config.output_hidden_states
        if self.training == self.layers_are_rescaled:
            self._rescale_layers()  # transformers' eval-mode rescaling, as its forward does
        h = self.embeddings(hidden_states) if inputs_embeds is None else inputs_embeds
        every = () if output_hidden_states else None
        for idx, block in enumerate(self.blocks):
            h = block(h, cp_context=ctx)[0]
            if (self.layers_are_rescaled and config.rescale_every > 0
                    and (idx + 1) % config.rescale_every == 0):  # fmt: skip
                h = h / 2
            if output_hidden_states:
                every = every + (h,)
        h = self.ln_out(h)
        if output_hidden_states:
            every = every + (h,)
        if not (return_dict if return_dict is not None else config.return_dict):
            return tuple(x for x in (h, every) if x is not None)
        return RwkvOutput(last_hidden_state=h, state=None, hidden_states=every, attentions=None)


class RwkvForCausalLMAdapter(FcpMixer):
    """transformers' ``RwkvForCausalLM`` under a context: its backbone given the context, then
    ``head``; the loss comes from ``shift_labels`` (:mod:`fcp.integrations.hf.causal_lm`)."""

    forward = ids_first(FcpMixer.forward)

    def fcp_forward(self, hidden_states, ctx: PackedContext, *, logits_to_keep=0,
                    return_dict=None, **kwargs):  # fmt: skip
        from transformers.modeling_utils import slice_logits_to_keep
        from transformers.models.rwkv.modeling_rwkv import RwkvCausalLMOutput

        out = self.rwkv(hidden_states, cp_context=ctx, return_dict=True, **kwargs)
        logits = self.head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
        if not (return_dict if return_dict is not None else self.config.return_dict):
            return tuple(x for x in (logits, out.hidden_states) if x is not None)
        return RwkvCausalLMOutput(logits=logits, state=None, hidden_states=out.hidden_states)


#: two blocks (attention width 32 = hidden, FFN 64), no inference rescaling inside the tiny
#: stack (rescale_every 0: eval and train run the same weights)
_TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
             intermediate_size=64, context_length=64, rescale_every=0, pad_token_id=0)

_CROSSES = ("time mixing: a one-token halo (token shift), an all-gather of fp32 `[B, A]` running "
            "maxima and one fp32 state-chain all-gather `[B, A, 1, 3]` (WKV); channel mixing: a "
            "one-token halo")  # fmt: skip
FAMILIES = (Family.of("rwkv", "RWKV-4", "RwkvModel", _TINY, _CROSSES,
                      RwkvSelfAttention=WkvMixer, RwkvFeedForward=TokenShiftFfnMixer,
                      RwkvBlock=RwkvBlockAdapter, RwkvModel=RwkvModelAdapter,
                      RwkvForCausalLM=RwkvForCausalLMAdapter),)  # fmt: skip
