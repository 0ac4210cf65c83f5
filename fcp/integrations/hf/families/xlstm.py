"""xLSTM (transformers' ``xlstm``, NX-AI's xLSTM-7B architecture) on fcp: its mLSTM layers and
the adapters that hand them the context.

* ``xLSTMLayer`` -> :class:`~..mixers.mlstm.MlstmMixer` (the matrix memory as gated linear
  attention scaled by the max stabiliser, :func:`fcp.ops.mlstm.mlstm_stabilizer` +
  :func:`fcp.ops.gla.gla`): an all-gather of fp32 ``[B, H, 2]`` max-plus maps and one fp32
  state-chain all-gather ``[B, H, K, K + V + 1]`` under CP;
* ``xLSTMBlock``, ``xLSTMModel`` -> :class:`XlstmBlockAdapter`, :class:`XlstmModelAdapter`:
  transformers' xLSTM code passes no keyword arguments down (the model calls ``block(hidden,
  state)``, the block ``mlstm_layer(x, state)``), so ``cp_context`` would never reach the
  mLSTM; under a context these run transformers' steps themselves (norms, the mLSTM given the
  context, the feed-forward, ``out_norm``) and exchange nothing. ``xLSTMForCausalLM`` forwards
  its keyword arguments to the backbone and needs no adapter. Without a context each is
  transformers' code.

Under a context the model refuses a ``cache``, ``use_cache=True`` and ``output_hidden_states``
(fcp runs full packed sequences), and runs the whole shard at once where transformers' eval
mode would cut sequences longer than ``max_inference_chunksize`` into no-grad pieces (the same
values). The stabiliser restarts at ``m = 0`` at every document start, as transformers' zero
initial state.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.families.rwkv import ids_first
from fcp.integrations.hf.mixers import MlstmMixer

__all__ = ["FAMILIES", "XlstmBlockAdapter", "XlstmModelAdapter"]


class XlstmBlockAdapter(FcpMixer):
    """transformers' ``xLSTMBlock`` under a context: ``(hidden [B, L, D]) -> (hidden, None)``
    (transformers' ``(hidden, state)``), the context handed to its mLSTM layer."""

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, *, state=None,
                    **_) -> tuple:  # fmt: skip
        if state is not None:
            raise ValueError(f"{type(self).__name__}: a recurrent `state` cannot be given with "
                             "cp_context")  # fmt: skip
        x = hidden_states
        x = x + self.mlstm_layer(self.norm_mlstm(x), cp_context=ctx)[0]
        return x + self.ffn(self.norm_ffn(x)), None


class XlstmModelAdapter(FcpMixer):
    """transformers' ``xLSTMModel`` under a context (``fcp_forward``'s ``hidden_states`` are the
    ``input_ids`` ``[B, L]``, or ``None`` with ``inputs_embeds``): embeddings, the blocks given
    the context, ``out_norm``; an ``xLSTMOutput`` without a cache."""

    forward = ids_first(FcpMixer.forward)

    def fcp_forward(self, hidden_states, ctx: PackedContext, *, inputs_embeds=None, cache=None,
                    use_cache=None, output_hidden_states=None, return_dict=None, **_):  # fmt: skip
        from transformers.models.xlstm.modeling_xlstm import xLSTMOutput

        fn = f"{type(self).__name__}.forward"
        for name, value in (("cache", cache), ("use_cache", use_cache),
                            ("output_hidden_states", output_hidden_states)):  # fmt: skip
            if value is not None and value is not False:
                raise ValueError(f"{fn}: {name}={value!r} is not supported with cp_context (fcp "
                                 "runs full packed sequences)")  # fmt: skip
        if (hidden_states is None) == (inputs_embeds is None):
            raise ValueError(f"{fn}: pass exactly one of input_ids and inputs_embeds")
        h = self.embeddings(hidden_states) if inputs_embeds is None else inputs_embeds
        for block in self.blocks:
            h = block(h, cp_context=ctx)[0]
        h = self.out_norm(h)
        if return_dict is False:
            return (h,)
        return xLSTMOutput(last_hidden_state=h, cache=None)


#: two blocks of 2 mLSTM heads (q/k head dim 8, v head dim 16), transformers' chunks of 8
#: tokens in its inference path (longer documents cross chunks there), the default soft caps
_TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_heads=2, chunk_size=8,
             pad_token_id=0)

_CROSSES = ("mLSTM: an all-gather of fp32 `[B, H, 2]` (the stabiliser's max-plus maps) and one "
            "fp32 state-chain all-gather `[B, H, K, K + V + 1]`")  # fmt: skip
FAMILIES = (Family.of("xlstm", "xLSTM", "xLSTMModel", _TINY, _CROSSES,
                      xLSTMLayer=MlstmMixer, xLSTMBlock=XlstmBlockAdapter,
                      xLSTMModel=XlstmModelAdapter),)  # fmt: skip
