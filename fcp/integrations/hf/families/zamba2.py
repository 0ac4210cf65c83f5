"""Zamba2 (``zamba2``) on fcp: Mamba2 layers and a few *shared* attention blocks.

``layers_block_type`` lists the layers: a ``"linear_attention"`` layer is a Mamba2 block
(``Zamba2MambaMixer``); a ``"hybrid"`` layer runs a shared transformer block, then a Mamba2
block. The shared block's input is ``concat([hidden_states, original embeddings], -1)``
(``[B, L, 2 D]``, per token), its attention (``Zamba2Attention``) and MLP carry per-use LoRA
adapters, and its output goes through a per-layer ``linear`` into the Mamba2 block's input. Of
all that, only the attention and the Mamba2 mixer mix tokens: the concatenation, the norms, the
adapters, the MLP and the linear are per token and stay transformers' code.

* The Mamba2 mixers are :class:`~..mixers.mamba2.SsdMixer` as it is (the same code as Mamba2's
  and the Mamba2 hybrids', ``time_step_limit = (time_step_min, inf)``).
* The attention (:class:`Zamba2AttentionAdapter`) is GQA over the ``2 D``-wide input with heads
  of ``attention_head_dim = 2 D / num_attention_heads``, scaled by ``(head_dim / 2) ** -0.5``,
  RoPE at document-local positions when ``use_mem_rope``. With
  ``use_shared_attention_adapter``, q, k and v each add the LoRA adapter of this use of the block
  (``linear_*_adapter_list[layer_dic[layer_idx]]``, chosen by the decoder layer's ``layer_idx``
  keyword). The blocks are shared by tying their parameters (``num_mem_blocks`` distinct blocks,
  reused in turn); each hybrid layer holds its own module, so each is replaced on its own and the
  tied parameters' gradients add up as in transformers.

transformers' default RoPE of Zamba2 rotates every channel of a head whatever
``partial_rotary_factor`` says; a default RoPE with a partial factor is refused (``fcp_check``).
Compiled (``mixer.compile``, ``dynamic=False``), the attention makes one graph per hybrid layer:
the adapter of each use is chosen by the Python ``layer_idx`` the decoder layer passes, a
constant of the graph. All compiled mixers share one frame (``FcpMixer.forward``) and so dynamo's
recompile limit (``torch._dynamo.config.recompile_limit``, 8): with ``fullgraph=True`` a Zamba2
with more than 7 hybrid layers (Zamba2-2.7B has 9) fails with ``FailOnRecompileLimitHit`` unless
that limit is raised to the number of hybrid layers + 1 (the Mamba2 layers' graph) or more
(measured: 7 hybrid layers, 8 graphs, pass; 10 fail).

Under CP a Mamba2 layer exchanges the ``W - 1``-token halo of its conv over ``[x, B, C]`` and one
fp32 state-chain all-gather of ``[B, H, N, N + P]``; a shared attention block all-gathers K/V.
"""

from __future__ import annotations

import torch

from fcp.context import PackedContext
from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import GqaMixer, SsdMixer

__all__ = ["FAMILIES", "Zamba2AttentionAdapter"]


class Zamba2AttentionAdapter(GqaMixer):
    """Zamba2's shared attention: GQA over ``[hidden | embeddings]`` with per-use LoRA adapters on
    q, k, v (chosen by ``layer_idx``), RoPE only with ``use_mem_rope`` (module doc)."""

    @classmethod
    def fcp_check(cls, module) -> None:
        config = module.config
        if config.use_mem_rope:
            params = config.rope_parameters
            factor = params.get("partial_rotary_factor", 1.0)
            if params.get("rope_type", "default") == "default" and factor != 1.0:
                raise NotImplementedError(
                    f"{type(module).__name__}: transformers' Zamba2 rotates every channel of a "
                    f"head with the default RoPE and ignores partial_rotary_factor={factor}; "
                    "fcp's RoPE tables honour it, so this configuration is refused")  # fmt: skip
        super().fcp_check(module)

    @staticmethod
    def fcp_uses_rope(config) -> bool:
        return bool(config.use_mem_rope)

    def fcp_forward(self, hidden_states: torch.Tensor, ctx: PackedContext, *, layer_idx: int,
                    **_):  # fmt: skip
        x = hidden_states
        q, k, v = (proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.config.use_shared_attention_adapter:
            use = self.layer_dic[layer_idx]  # this use of the shared block
            q = q + self.linear_q_adapter_list[use](x)
            k = k + self.linear_k_adapter_list[use](x)
            v = v + self.linear_v_adapter_list[use](x)
        shape = (*x.shape[:2], -1, self.head_dim)
        q, k = self.fcp_rotate_qk(q.view(shape), k.view(shape), ctx)
        o = self.fcp_attend(q, k, v.view(shape), x, ctx)
        return self.fcp_attention_output(o.flatten(2), None), None


#: Mamba2 (4 heads of 16, 2 groups, state 8, conv 4, chunks of 8), then three uses of two shared
#: blocks (block 0 twice, each use with its own LoRA adapters; GQA of 4 heads of 16 with RoPE)
_ZAMBA2_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                    layers_block_type=["linear_attention", "hybrid", "hybrid", "linear_attention",
                                       "hybrid"],
                    mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2,
                    n_mamba_heads=4, chunk_size=8, num_attention_heads=4, num_key_value_heads=4,
                    num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=4,
                    use_mem_rope=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    pad_token_id=0)  # fmt: skip

FAMILIES = (Family.of("zamba2", "Zamba2", "Zamba2Model", _ZAMBA2_TINY,
                      "Mamba2: a `W - 1`-token halo of its conv over `[x, B, C]` and one fp32 "
                      "state-chain all-gather `[B, H, N, N + P]`; shared attention: an "
                      "all-gather of K/V",
                      Zamba2MambaMixer=SsdMixer,
                      Zamba2Attention=Zamba2AttentionAdapter),)  # fmt: skip
