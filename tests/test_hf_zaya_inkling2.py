"""ZAYA and Inkling-2 on fcp: what the standard battery (``tests/test_hf_families.py``: per-document
parity on 1, 2 and 4 ranks, the replacement contract, the ``*ForCausalLM`` wrappers) does not
cover.

* :func:`fcp.ops.token_lags.token_lags` (the lagged tokens of ZAYA's grouped conv and delayed
  value, Inkling-2's dynamic conv) equals its definition, and on 2 and 4 ranks (lags reaching
  further back than a shard) equals one process, forward and the gradients of ``x`` and of a
  ``fill`` tensor;
* :func:`fcp.ops.relative_attention.relative_attention` (Inkling-2's attention: a per-query
  table of biases over the backward distance, per-query sinks, full or sliding) equals its
  float64 definition in one process (GQA, pad queries, query chunks, no sinks / per-head sinks /
  per-query sinks), and on 2 and 4 ranks equals one process, forward and the gradients of q, k,
  v, the bias table and the sinks (documents spanning every rank, a window longer than a shard,
  a pad tail);
* a ZAYA layer type whose rope rescales with the sequence is refused before any change.
"""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from fcp.integrations.hf import enable_packed_cp
from fcp.ops.relative_attention import relative_attention
from fcp.ops.relative_attention.reference import relative_attention_reference
from fcp.ops.token_lags import token_lags
from fcp.ops.token_lags.reference import token_lags_reference
from tests.support import cp_jobs
from tests.support.hf_families import FAMILIES
from tests.support.hf_reference import build

HEADS, KV_HEADS, DIM, EXTENT = 4, 2, 8, 5
#: per-token inputs of the operator (the sinks per query); all differentiated
NAMES = ("q", "k", "v", "bias", "sinks")


def _inputs(seed: int, batch: int, seq: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q": (HEADS, DIM), "k": (KV_HEADS, DIM), "v": (KV_HEADS, DIM),
              "bias": (HEADS, EXTENT), "sinks": (HEADS,)}  # fmt: skip
    return {n: torch.randn(batch, seq, *s, generator=gen) for n, s in shapes.items()}


def _doc_ids(rows: list[list[int]], seq: int) -> torch.Tensor:
    """Documents of the given lengths per row, numbered from 1, then a pad tail."""
    ids = [sum(([d + 1] * n for d, n in enumerate(row)), []) for row in rows]
    return torch.tensor([row + [0] * (seq - len(row)) for row in ids])


def _lags_call(t, ctx):
    return token_lags(t["x"], ctx, 5, fill=t["fill"][0, 0])


def token_lags_rank(env, inputs, doc_ids, grad_out):
    """This rank's lags of ``x`` and the gradients of ``x`` and ``fill`` (``env=None``: one
    process); ``fill`` travels as a per-token tensor whose first row is used."""
    ctx = PackedContext(doc_ids) if env is None else cp_jobs.cp_context(env, doc_ids)
    return cp_jobs.forward_backward(_lags_call, inputs, ctx, grad_out, cp_jobs.shard(ctx),
                                    grads=("x", "fill"), params=("fill",))  # fmt: skip


def test_token_lags_match_their_definition():
    doc_ids = _doc_ids([[3, 1, 7], [2, 9]], 12)  # documents shorter than the lags; pads
    x, fill = torch.randn(2, 12, 3), torch.randn(3)
    for f in (0.0, -2.5, fill):
        got = token_lags(x, PackedContext(doc_ids), 5, fill=f)
        assert torch.equal(got.double(), token_lags_reference(x, doc_ids, 5, fill=f))


@pytest.mark.parametrize("world_size", [2, 4])
def test_token_lags_under_cp_equal_one_process(rank_pool, world_size):
    seq = 12  # 4 ranks: shards of 3 tokens, lags 4 back: two ranks' halo
    doc_ids = _doc_ids([[2, 9], [12]], seq)
    gen = torch.Generator().manual_seed(3)
    inputs = {"x": torch.randn(2, seq, 3, generator=gen),
              "fill": torch.randn(1, 1, 3, generator=gen)}  # fmt: skip
    grad_out = torch.randn(2, seq, 5, 3, generator=gen)
    want = token_lags_rank(None, inputs, doc_ids, grad_out)
    got = rank_pool.run(token_lags_rank, world_size, inputs, doc_ids, grad_out)
    torch.testing.assert_close(cp_jobs.cat_ranks(got, "out"), want["out"], atol=0, rtol=0)
    torch.testing.assert_close(cp_jobs.cat_ranks(got, "x"), want["x"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sum(r["fill"] for r in got), want["fill"], atol=1e-6, rtol=1e-6)


def _call(window):
    def call(t, ctx):
        return relative_attention(t["q"], t["k"], t["v"], t["bias"], ctx, window=window,
                                  sinks=t["sinks"])  # fmt: skip

    return call


def relative_attention_rank(env, inputs, doc_ids, window, grad_out):
    """This rank's output and input gradients (``env=None``: one process)."""
    ctx = PackedContext(doc_ids) if env is None else cp_jobs.cp_context(env, doc_ids)
    return cp_jobs.forward_backward(_call(window), inputs, ctx, grad_out, cp_jobs.shard(ctx),
                                    grads=NAMES)  # fmt: skip


@pytest.mark.parametrize(("window", "sinks", "chunk"), [(None, "none", None),
                                                         (None, "per_query", 5),
                                                         (3, "per_head", None),
                                                         (3, "per_query", 5)])  # fmt: skip
def test_relative_attention_matches_its_definition(window, sinks, chunk):
    seq = 24
    doc_ids = _doc_ids([[9, 1, 11], [2, 20]], seq)  # documents shorter and longer than E, pads
    t = _inputs(0, 2, seq)
    sink = {"none": None, "per_head": t["sinks"][0, 0], "per_query": t["sinks"]}[sinks]
    out = relative_attention(t["q"], t["k"], t["v"], t["bias"], PackedContext(doc_ids),
                             window=window, sinks=sink, query_chunk=chunk)  # fmt: skip
    want = relative_attention_reference(t["q"], t["k"], t["v"], t["bias"], doc_ids,
                                        window=window, sinks=sink)  # fmt: skip
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)
    assert torch.equal(out[0, 21:], torch.zeros_like(out[0, 21:]))  # pad queries


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("window", [None, 7])  # 7: longer than a 4-rank shard (6 tokens)
def test_relative_attention_under_cp_equals_one_process(rank_pool, world_size, window):
    seq = 24
    doc_ids = _doc_ids([[3, 17, 2], [24]], seq)  # a document spanning every rank; a pad tail
    inputs = _inputs(1, 2, seq)
    grad_out = torch.randn(2, seq, HEADS, DIM, generator=torch.Generator().manual_seed(2))
    want = relative_attention_rank(None, inputs, doc_ids, window, grad_out)
    got = rank_pool.run(relative_attention_rank, world_size, inputs, doc_ids, window, grad_out)
    for key in ("out", *NAMES):
        torch.testing.assert_close(cp_jobs.cat_ranks(got, key), want[key], atol=1e-6, rtol=1e-6)


def test_zaya_refuses_a_sequence_dependent_rope_before_any_change():
    config = dict(FAMILIES["zaya"].config)
    dynamic = {"rope_type": "dynamic", "rope_theta": 5000.0, "factor": 2.0,
               "partial_rotary_factor": 0.5}  # fmt: skip
    config["rope_parameters"] = dict(config["rope_parameters"], hybrid=dynamic)
    model = build("zaya", config)
    before = [type(m) for m in model.modules()]
    with pytest.raises(NotImplementedError, match="rescales with the sequence length"):
        enable_packed_cp(model)
    assert [type(m) for m in model.modules()] == before
