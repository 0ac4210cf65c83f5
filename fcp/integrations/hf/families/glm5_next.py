"""GLM-5.3-Flash (transformers' ``glm5_next``) on fcp: its mixers are kinds as they are.

* ``Glm5NextTextLinearAttention`` -> :class:`~..mixers.kda.KdaMixer` (KDA: one short conv over
  ``[q, k, v]``, a per-channel forget gate, a low-rank output gate);
* ``Glm5NextTextAttention`` -> :class:`~..mixers.mla.IndexedMlaMixer` (a k-pool DSA indexer
  selects the tokens, NoPE MLA attends to them, top-k shared across layers): under CP it
  all-gathers its compressed KV latent (``kv_lora_rank`` per token) and the indexer's pooled keys,
  never the expanded K/V or the hidden states.

Everything else (MoE, hyper-connections, norms) is per token and stays transformers' code.
"""

from __future__ import annotations

from fcp.integrations.hf.families.family import Family
from fcp.integrations.hf.mixers import IndexedMlaMixer, KdaMixer

__all__ = ["FAMILIES"]

#: The tiny GLM-5.3-Flash of the tests: well under a second per forward on a CPU.
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
             num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
             q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=8, v_head_dim=8,
             n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, index_topk=8,
             index_head_dim=8, index_n_heads=2, index_kpool=4, linear_head_dim=8,
             linear_num_heads=2, linear_conv_kernel_dim=4, hc_mult=2, hc_sinkhorn_iters=3,
             pad_token_id=0)  # fmt: skip

#: what crosses ranks: the KV latent, never the expanded K/V or the hidden states
_CROSSES = ("KDA: a `W - 1`-token conv halo and one fp32 state-chain all-gather "
            "`[B, H, K, K + V]`; indexed MLA: all-gathers of the KV latent (`kv_lora_rank` per "
            "token) and of the indexer's pooled keys")  # fmt: skip
FAMILIES = (Family.of("glm5_next", "GLM-5.3-Flash", "Glm5NextTextModel", _TINY, _CROSSES,
                      Glm5NextTextLinearAttention=KdaMixer,
                      Glm5NextTextAttention=IndexedMlaMixer),)
