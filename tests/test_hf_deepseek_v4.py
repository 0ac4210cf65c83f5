"""DeepSeek-V4 on fcp: what the standard battery (``tests/test_hf_families.py``, the
``deepseek_v4`` row: transformers' model on each document alone, 1, 2 and 4 ranks) does not
reach.

* :mod:`fcp.ops.pooled_attention` against its float64 definitions on 1, 2 and 4 gloo ranks:
  gated pools (HCA's ``ratio`` rows; CSA's overlapping ``2 * ratio`` rows of two series, pool 0
  without a previous pool), the indexer's choice of pools, and one softmax over the window, the
  visible (or chosen) pools and the sinks, with every input's gradient; documents span ranks,
  are shorter than a pool, and pad tails exist.
* the rotary tables of the adapter (DeepSeek's interleaved pairs on the trailing channels) equal
  transformers' ``DeepseekV4RotaryEmbedding`` for the released checkpoints' YaRN "compress" rope
  and the plain "main" one.
"""

from __future__ import annotations

import pytest
import torch

from fcp.layout import doc_ids_from_seq_lens
from fcp.ops.pooled_attention.reference import (
    gated_pools_reference,
    pool_select_reference,
    pooled_window_attention_reference,
)
from tests import _pooled_attention_rank_fns as fns
from tests.support import cp_jobs

#: two rows of 32 tokens: documents spanning 2 and 3 ranks of 8, shorter than a pool, pad tails
ROWS = [[13, 1, 9, 5], [22, 3, 2]]
SEQ, HEADS, D, DI, HI = 32, 2, 8, 4, 2
RATIO, WINDOW = 3, 5


def _inputs(overlap: bool, seed: int = 0) -> tuple[dict, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    f = 2 * D if overlap else D
    fi = 2 * DI if overlap else DI

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    width = max(len(r) for r in ROWS)
    seq_lens = torch.tensor([r + [-1000] * (width - len(r)) for r in ROWS])
    doc_ids = doc_ids_from_seq_lens(seq_lens, SEQ)
    inputs = {"q": rand(2, SEQ, HEADS, D), "kv": rand(2, SEQ, D), "pkv": rand(2, SEQ, f),
              "pgate": rand(2, SEQ, f), "sinks": rand(HEADS), "ikv": rand(2, SEQ, fi),
              "igate": rand(2, SEQ, fi), "iq": rand(2, SEQ, HI, DI), "hw": rand(2, SEQ, HI)}
    return inputs, doc_ids, rand(2, SEQ, HEADS, D)


def _reference(inputs: dict, doc_ids: torch.Tensor, grad_out: torch.Tensor, overlap: bool,
               topk: int | None) -> dict:  # fmt: skip
    t = {n: x.double().requires_grad_(n in fns.GRADS) for n, x in inputs.items()}
    pools = gated_pools_reference(t["pkv"], t["pgate"], doc_ids, RATIO, overlap)
    selected = None
    if topk is not None:
        keys = gated_pools_reference(t["ikv"], t["igate"], doc_ids, RATIO, overlap)
        selected = pool_select_reference(t["iq"], {k: v[0] for k, v in keys.items()}, t["hw"],
                                         doc_ids, topk, 0.5)  # fmt: skip
    out = pooled_window_attention_reference(t["q"], t["kv"], {k: v[0] for k, v in pools.items()},
                                            doc_ids, WINDOW, sinks=t["sinks"],
                                            selected=selected)  # fmt: skip
    (out * grad_out.double()).sum().backward()
    return {"out": out.detach(), "pools": pools, "selected": selected,
            **{n: t[n].grad for n in fns.GRADS}}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("overlap, topk", [(False, None), (True, 2)], ids=["hca", "csa"])
def test_pooled_attention_equals_its_definition_under_cp(rank_pool, world, overlap, topk):
    inputs, doc_ids, grad_out = _inputs(overlap)
    # chunks of 5 queries: a chunk's slot window starts inside a rank's shard and crosses ranks
    args = (inputs, doc_ids, grad_out, RATIO, WINDOW, overlap, topk, 5)
    res = ([fns.cp_rank(None, *args)] if world == 1
           else rank_pool.run(fns.cp_rank, world, *args))  # fmt: skip
    want = _reference(inputs, doc_ids, grad_out, overlap, topk)
    # the pools each rank holds, by their global end positions
    for r in res:
        for b in range(2):
            for slot, end in enumerate(r["pool_ends"][b].tolist()):
                if end >= 0:
                    torch.testing.assert_close(r["pooled"][b, slot].double(),
                                               want["pools"][(b, end)][0].detach(), atol=1e-5,
                                               rtol=1e-5)  # fmt: skip
    assert sum(int((r["pool_ends"] >= 0).sum()) for r in res) == len(want["pools"])
    if topk is not None:
        ends = cp_jobs.cat_ranks(res, "ends")
        got = [[set(row.tolist()) - {-1} for row in ends[b]] for b in range(2)]
        assert got == want["selected"]
        assert any(len(s) == topk for row in got for s in row)  # the choice is a real one
    torch.testing.assert_close(cp_jobs.cat_ranks(res, "out").double(), want["out"], atol=1e-5,
                               rtol=1e-5)  # fmt: skip
    for name in ("q", "kv", "pkv", "pgate"):
        torch.testing.assert_close(cp_jobs.cat_ranks(res, name).double(), want[name], atol=1e-5,
                                   rtol=1e-5, msg=name)  # fmt: skip
    torch.testing.assert_close(sum(r["sinks"] for r in res).double(), want["sinks"], atol=1e-5,
                               rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("label", ["main", "compress"])
def test_rotary_tables_equal_transformers(label):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    from fcp.integrations.hf.families.deepseek_v4 import _rope, _tables

    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1}  # the released checkpoints' compress rope
    config = hf.DeepseekV4Config(hidden_size=32, num_attention_heads=2, head_dim=16,
                                 partial_rotary_factor=0.5, num_hidden_layers=2,
                                 rope_parameters=yarn)  # fmt: skip
    rotary = hf.DeepseekV4RotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 2, 7, 100, 5000, 70000]])
    x = torch.randn(1, 7, 2, 16)
    cos, sin = rotary(x, positions, layer_type=label)
    mine = _tables(config, label, positions, x.dtype)
    torch.testing.assert_close(mine, (cos, sin), atol=0, rtol=0)
    want = hf.apply_rotary_pos_emb(x.transpose(1, 2), cos, sin).transpose(1, 2)
    torch.testing.assert_close(_rope(x, *mine), want, atol=0, rtol=0)
