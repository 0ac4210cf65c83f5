"""Mamba2, Zamba2 and MiniMax on fcp: what only these families have.

Their per-document parity (outputs and rank-summed parameter gradients to 1e-5 on 1, 2 and 4
ranks), replacement contract, ``*ForCausalLM`` wrapper and compiled mixers are in
``tests/test_hf_families.py``; their configuration variants (Zamba2 without adapters or RoPE,
with GQA; MiniMax with a sliding window) in ``tests/test_hf_mamba2_lfm2.py``. Here:

* MiniMax's lightning attention is :func:`fcp.ops.gla.gla` with a constant decay per head for
  decays from strong (``exp(-9)`` per token) to almost none (``slope_rate = 1e-7``), against
  transformers' block-wise layer (blocks of 8 tokens) run on each document alone: outputs and
  input gradients. (A slope of exactly 0 is no oracle: transformers builds its in-block causal
  mask from ``slope * (i - j) >= 0``, and ``0 * (i - j)`` is ``-0.0 >= 0`` above the diagonal
  too, so its block attends to later tokens; the real slopes are all positive, and fcp's
  ``a = 0`` is :func:`~fcp.ops.gla.gla`'s, tested there.)
* Zamba2's shared blocks: the hybrid layers that reuse a block hold tied parameters, each with
  the adapters of its own use, and stay so when replaced;
* Zamba2's compiled mixers: one graph for the Mamba2 layers and one per hybrid layer for the
  shared attention (the LoRA adapter of each use is chosen by the Python ``layer_idx``), made at
  the first packing, none after;
* a default RoPE with a ``partial_rotary_factor`` (which transformers' MiniMax and Zamba2 ignore)
  is refused, naming the layer.
"""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from fcp.integrations.hf import enable_packed_cp
from fcp.integrations.hf.mixers import LightningMixer
from tests import _hf_rank_fns as fns
from tests.support.hf_families import FAMILIES
from tests.support.hf_reference import build

#: one row: documents of 1, 19 (across three of transformers' 8-token blocks), 3 and 10 tokens,
#: then 7 pad tokens
LENGTHS = (1, 19, 3, 10)
SEQ = 40


def _lightning_layer(slopes: list[float]):
    """MiniMax's first layer (lightning attention) with the decay rates ``slopes`` (one per head)
    and its block-wise decay tables recomputed from them, as transformers' init does."""
    model = build("minimax", FAMILIES["minimax"].config)
    layer = model.layers[0].self_attn
    assert type(layer).__name__ == "MiniMaxLightningAttention"
    with torch.no_grad():
        slope = torch.tensor(slopes)[:, None, None]
        layer.slope_rate.copy_(slope)
        tables = layer.decay_factors(slope)
        for name, table in zip(("query_decay", "key_decay", "diagonal_decay"), tables):
            getattr(layer, name).copy_(table)
    return model, layer


def test_lightning_attention_is_gla_with_a_constant_decay_per_head():
    # exp(-9) per token (a < -8), moderate, almost none (module doc: not exactly 0), weak
    model, layer = _lightning_layer([9.0, 0.7, 1e-7, 1e-3])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, SEQ, 32, generator=gen)
    cot = torch.randn(1, SEQ, 32, generator=gen)
    doc_ids = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(LENGTHS)]
                        + [torch.zeros(SEQ - sum(LENGTHS), dtype=torch.long)])[None]  # fmt: skip

    want_out, want_grad, start = [], [], 0
    for n in LENGTHS:  # transformers on each document alone
        xd = x[:, start : start + n].clone().requires_grad_()
        out, _ = layer(xd, position_embeddings=None, attention_mask=None)
        (out * cot[:, start : start + n]).sum().backward()
        want_out.append(out.detach())
        want_grad.append(xd.grad)
        start += n

    enable_packed_cp(model)
    assert isinstance(layer, LightningMixer)
    xp = x.clone().requires_grad_()
    out, state = layer(xp, cp_context=PackedContext(doc_ids))
    assert state is None
    (out * cot).sum().backward()
    start = 0
    for n, o, g in zip(LENGTHS, want_out, want_grad):
        torch.testing.assert_close(out[:, start : start + n], o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(xp.grad[:, start : start + n], g, atol=1e-5, rtol=1e-5)
        start += n
    assert torch.isfinite(out).all()


def test_zamba2_shared_blocks_stay_tied_with_an_adapter_per_use():
    model = build("zamba2", FAMILIES["zamba2"].config)
    # hybrid layers 1, 2, 4: blocks 0, 1, 0 (num_mem_blocks=2)
    attn = {i: model.layers[i].shared_transformer.self_attn for i in (1, 2, 4)}
    enable_packed_cp(model)
    assert attn[1] is not attn[4] and attn[1].q_proj.weight is attn[4].q_proj.weight
    assert attn[1].q_proj.weight is not attn[2].q_proj.weight
    # each use of block 0 reads its own adapter (uses 0 and 2 of the three hybrid layers)
    assert attn[1].layer_dic == {1: 0, 2: 1, 4: 2}
    adapters = attn[1].linear_q_adapter_list
    assert not isinstance(adapters[0], torch.nn.Identity)
    assert not isinstance(adapters[2], torch.nn.Identity)
    assert adapters[0][0].weight is not adapters[2][0].weight


def test_zamba2_compiles_one_graph_per_use_of_a_shared_block_and_no_more():
    config = FAMILIES["zamba2"].config
    hybrid = config["layers_block_type"].count("hybrid")
    counts, _ = fns.compile_counts("zamba2", config, 3)  # outputs checked against eager's
    assert counts == [1 + hybrid] * 3, counts


@pytest.mark.parametrize("family", ["minimax", "zamba2"])
def test_a_default_rope_with_a_partial_factor_is_refused(family):
    config = dict(FAMILIES[family].config)
    config["rope_parameters"] = dict(config["rope_parameters"], partial_rotary_factor=0.5)
    model = build(family, config)
    with pytest.raises(NotImplementedError, match="partial_rotary_factor=0.5"):
        enable_packed_cp(model)
