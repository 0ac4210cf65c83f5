"""Zamba (``zamba``) on fcp: multi-head Mamba1 layers and one shared attention block.

* ``ZambaMambaMixer`` -> :class:`ZambaMambaMixerAdapter`: Mamba1
  (:class:`~..mixers.mamba1.Mamba1Mixer`) split into ``G = n_mamba_heads`` heads of ``I / G``
  channels, each with its own ``x_proj`` / ``dt_proj`` weights (``x_proj_weight [G, R + 2N, I /
  G]``, ``dt_proj_weight [G, I / G, R]``, ``dt_proj_bias [G, I / G]``) and so its own B and C:
  :func:`fcp.ops.gla.gla` with ``G`` query/key groups of ``I / G`` channel heads each. Its
  ``in_proj`` interleaves x and the gate per channel (transformers' ``view(B, I, 2, L)``).
* ``ZambaAttention`` (the shared transformer block's, reused by every hybrid layer on the
  concatenation of the hidden states and the embeddings) ->
  :class:`~.mamba2_hybrids.NemotronHAttentionAdapter`: the Llama layout without positions, scaled
  by the layer's ``scaling`` (``(head_dim / 2) ** -0.5``).

transformers' Zamba layers hand ``**kwargs`` (the context) down to both; the decoder layers, the
shared block's MLP and the ``linear`` after it stay in transformers' code.

Under CP a Mamba layer exchanges the ``W - 1``-token halo of its conv over ``x`` and one fp32
state-chain all-gather of ``[B, I, N, N + 1]``; each use of the shared attention all-gathers
its K/V.
"""

from __future__ import annotations

import torch

from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.families.mamba2_hybrids import NemotronHAttentionAdapter
from fcp.integrations.hf.mixers import Mamba1Mixer

__all__ = ["FAMILIES", "ZambaMambaMixerAdapter"]


class ZambaMambaMixerAdapter(Mamba1Mixer):
    """Zamba's multi-head Mamba1 layer (module doc)."""

    def fcp_project(self, x: torch.Tensor) -> torch.Tensor:
        xz = self.in_proj(x).unflatten(-1, (self.intermediate_size, 2))  # per channel: x, gate
        return torch.cat([xz[..., 0], xz[..., 1]], -1)

    def fcp_ssm_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        heads, state = self.n_mamba_heads, self.ssm_state_size
        xh = x.unflatten(-1, (heads, self.mamba_head_dim))  # [B, L, G, I / G]
        params = torch.einsum("blgd,grd->blgr", xh, self.x_proj_weight)  # [B, L, G, R + 2N]
        dt, b, c = torch.split(params, [self.time_step_rank, state, state], dim=-1)
        dt = torch.einsum("blgr,gdr->blgd", dt, self.dt_proj_weight).flatten(-2)  # [B, L, I]
        return dt, b, c

    def fcp_ssm_params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        bias = None if self.dt_proj_bias is None else self.dt_proj_bias.flatten()
        return -torch.exp(self.A_log.float()).flatten(0, 1), self.D.flatten(), bias


_CROSSES = ("Mamba1: a `W - 1`-token halo of its conv over `x` and one fp32 state-chain "
            "all-gather `[B, I, N, N + 1]`; shared attention: an all-gather of K/V per "
            "use")  # fmt: skip

#: Mamba1 layers of 2 heads (64 channels, state 8, dt rank 4); the shared attention block (4
#: heads over the 64-wide concatenation, head_dim 8, 2 kv heads) in layers 2 and 4
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
             num_attention_heads=4, num_key_value_heads=2, n_mamba_heads=2, mamba_d_state=8,
             mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, attn_layer_period=2,
             attn_layer_offset=1, pad_token_id=0)  # fmt: skip

FAMILIES = (Family.of("zamba", "Zamba", "ZambaModel", _TINY, _CROSSES,
                      ZambaMambaMixer=ZambaMambaMixerAdapter,
                      ZambaAttention=NemotronHAttentionAdapter),)  # fmt: skip
