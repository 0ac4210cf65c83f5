"""MiniMax (``minimax``, MiniMax-Text-01) on fcp: lightning attention beside softmax attention, MoE.

``layer_types`` says which layers run lightning attention (``"linear_attention"``:
``MiniMaxLightningAttention``) and which softmax attention (``"full_attention"``:
``MiniMaxAttention``); every layer's MoE block is per token and stays transformers'.

* The lightning layers are :class:`~..mixers.lightning.LightningMixer` as it is: ``act(qkv_proj)``
  split per head into q, k, v, linear attention with the constant per-head decay ``exp(-s_h)``
  (the ``slope_rate`` buffer) as :func:`fcp.ops.gla.gla`, an RMSNorm over all heads, the sigmoid
  ``output_gate`` of the layer input and ``out_proj``. transformers' ``block_size`` is its
  implementation's tile (rounding only).
* The softmax layers are the Llama layout with RoPE (:class:`~..mixers.gqa.GqaMixer`), over a
  sliding window of ``config.sliding_window`` tokens when it is set (transformers then builds the
  sliding causal mask for every softmax layer: the window is the config's, not the layer's).

transformers' default RoPE of MiniMax rotates every channel of a head whatever
``partial_rotary_factor`` says; fcp's tables honour it, so a default RoPE with a partial factor
is refused (``fcp_check``) rather than computed differently. The decoder layers' residual
factors (``*_alpha_factor`` / ``*_beta_factor``) stay in transformers' code.

Under CP a lightning layer exchanges one fp32 state-chain all-gather of ``[B, H, Dh, 2 Dh]``; a
softmax layer all-gathers K/V (or, with a sliding window, a left halo of ``window - 1`` tokens'
K/V).
"""

from __future__ import annotations

from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import GqaMixer, LightningMixer

__all__ = ["FAMILIES", "MiniMaxAttentionAdapter"]


class MiniMaxAttentionAdapter(GqaMixer):
    """MiniMax's softmax attention: the Llama layout with full-width RoPE, over
    ``config.sliding_window`` tokens when set."""

    @classmethod
    def fcp_check(cls, module) -> None:
        params = module.config.rope_parameters
        factor = params.get("partial_rotary_factor", 1.0)
        if params.get("rope_type", "default") == "default" and factor != 1.0:
            raise NotImplementedError(
                f"{type(module).__name__}: transformers' MiniMax rotates every channel of a head "
                f"with the default RoPE and ignores partial_rotary_factor={factor}; fcp's RoPE "
                "tables honour it, so this configuration is refused")  # fmt: skip
        super().fcp_check(module)

    def fcp_window(self) -> int | None:
        return self.config.sliding_window


#: lightning (4 heads of 8, blocks of 8 tokens in transformers), softmax GQA with RoPE (4 heads,
#: 2 kv heads), lightning; MoE (4 experts, top 2); every residual factor != 1
_MINIMAX_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
                     layer_types=["linear_attention", "full_attention", "linear_attention"],
                     num_attention_heads=4, num_key_value_heads=2, block_size=8,
                     num_local_experts=4, num_experts_per_tok=2, full_attn_alpha_factor=0.9,
                     full_attn_beta_factor=1.1, linear_attn_alpha_factor=1.3,
                     linear_attn_beta_factor=0.7, mlp_alpha_factor=1.2, mlp_beta_factor=0.8,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                     pad_token_id=0)  # fmt: skip

FAMILIES = (Family.of("minimax", "MiniMax", "MiniMaxModel", _MINIMAX_TINY,
                      "lightning attention: one fp32 state-chain all-gather `[B, H, Dh, 2 Dh]`; "
                      "softmax attention: an all-gather of K/V (a `window - 1`-token K/V halo "
                      "with `sliding_window`)",
                      MiniMaxLightningAttention=LightningMixer,
                      MiniMaxAttention=MiniMaxAttentionAdapter),)  # fmt: skip
