"""Jamba (``jamba``) on fcp: Mamba1 layers with dt / B / C RMS norms, NoPE GQA attention, MoE.

* ``JambaMambaMixer`` -> :class:`~.mamba.Mamba1NormedAdapter`: Mamba1
  (:class:`~..mixers.mamba1.Mamba1Mixer`) with the layer's weighted RMS norms of ``dt``, ``B``
  and ``C`` (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``, per token) before the scan.
* ``JambaMambaDecoderLayer`` -> :class:`JambaMambaDecoderLayerAdapter`: transformers' layer
  calls its mixer without ``**kwargs``, so the context would not reach it; under a context the
  adapter runs the same code (``h + mamba(input_layernorm(h))``, then ``h +
  feed_forward(pre_ff_layernorm(h))``, the MoE block or MLP untouched) and hands it down.
* ``JambaAttention`` -> :class:`~.mamba2_hybrids.NemotronHAttentionAdapter`: the Llama layout
  without positions (Jamba has no RoPE: the Mamba layers carry order), as Nemotron-H's.

Under CP a Mamba layer exchanges the ``W - 1``-token halo of its conv over ``x`` and one fp32
state-chain all-gather of ``[B, I, N, N + 1]``; an attention layer all-gathers K/V.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.core import FcpMixer
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.families.mamba import Mamba1NormedAdapter
from fcp.integrations.hf.families.mamba2_hybrids import NemotronHAttentionAdapter

__all__ = ["FAMILIES", "JambaMambaDecoderLayerAdapter"]


class JambaMambaDecoderLayerAdapter(FcpMixer):
    """Jamba's Mamba decoder layer under a context (module doc)."""

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext,
                    **_) -> torch.Tensor:  # fmt: skip
        h = hidden_states + self.mamba(self.input_layernorm(hidden_states), cp_context=ctx)
        return h + self.feed_forward(self.pre_ff_layernorm(h))


_CROSSES = ("Mamba1: a `W - 1`-token halo of its conv over `x` and one fp32 state-chain "
            "all-gather `[B, I, N, N + 1]`; attention: an all-gather of K/V; Mamba decoder "
            "layer: nothing")  # fmt: skip

#: Mamba1 (64 channels, state 8, dt rank 4), NoPE GQA attention (4 heads, 2 kv heads), Mamba1,
#: attention; MoE (4 experts, top 2) on the odd layers, an MLP on the even ones
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
             attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
             num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
             mamba_dt_rank=4, mamba_conv_bias=True, mamba_proj_bias=False,
             use_mamba_kernels=True, pad_token_id=0)  # fmt: skip

FAMILIES = (Family.of("jamba", "Jamba", "JambaModel", _TINY, _CROSSES,
                      JambaMambaMixer=Mamba1NormedAdapter,
                      JambaMambaDecoderLayer=JambaMambaDecoderLayerAdapter,
                      JambaAttention=NemotronHAttentionAdapter),)  # fmt: skip
