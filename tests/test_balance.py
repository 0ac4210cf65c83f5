"""Balanced query work for long documents (:mod:`fcp.ops.kit.balance`): the plan, the piece
exchange, and every balanced operator against one process and against the contiguous layout.

Parity: with one document filling the row (and with documents spanning ranks and a pad tail),
the balanced run's outputs and query gradients are bitwise those of the contiguous run on the
same ranks (each query's arithmetic does not depend on where it runs); key and value gradients
are sums over ranks in another grouping (``assert_close``), and the indexers' ids are bitwise
equal. Rows are 256 tokens per rank: pieces are at least one block of 64 queries.
"""

from __future__ import annotations

import pytest
import torch

from fcp.comm import send_pieces
from fcp.context import PackedContext
from fcp.ops.kit.balance import (
    MIN_GAIN,
    QueryPlan,
    attention_plan,
    banded_cost,
    banded_plan,
    plan_queries,
)
from tests import _attention_rank_fns as attn
from tests import _balance_rank_fns as fns
from tests.support.inputs import attention_inputs, index_inputs
from tests.support.packing import packing

FP32 = dict(atol=2e-5, rtol=2e-5)


def _contiguous_loads(seq: int, size: int, band: int) -> list[float]:
    local = seq // size
    return [banded_cost(r * local, local, band, 1, seq) for r in range(size)]


# ============================================================================ the plan
@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("seq", [8192, 32768])
def test_one_document_is_balanced_within_ten_percent(size, seq):
    """One document filling the row: the contiguous layout's last rank does ~(2P-1)/P times the
    mean; the plan brings every rank within 10% of it."""
    loads = _contiguous_loads(seq, size, seq)
    assert max(loads) / (sum(loads) / size) > 1.4
    plan = banded_plan(seq, size, seq)
    assert plan.moves and plan.imbalance <= 1.10, plan.loads
    assert sum(plan.loads) == pytest.approx(sum(loads))  # the same work, redistributed


@pytest.mark.parametrize("size", [2, 4, 8])
def test_short_documents_move_nothing(size):
    """The smallest band (documents of at most 1024 tokens) is balanced enough contiguously."""
    plan = banded_plan(8192, size, 1024)
    assert not plan.moves
    assert plan.runs(size - 1) == [(8192 - 8192 // size, 8192 // size)]


def test_every_rank_computes_as_many_pieces_as_it_holds():
    for size in (2, 3, 4, 8):
        for band in (256, 2048, 8192):
            plan = banded_plan(8192 // 8 * size, size, band)
            n = len(plan.owners) // size
            assert sorted(plan.owners) == sorted(list(range(size)) * n)
            for r in range(size):
                assert sum(length for _, length in plan.runs(r)) == plan.piece * n


def test_plan_is_a_pure_function_of_static_facts():
    """Two maps with the same band bucket get the same plan, whatever their documents."""
    a = PackedContext(packing(4096, [4096]), group=object(), cp_size=4, cp_rank=1)
    b = PackedContext(packing(4096, [3000, 1096]), group=object(), cp_size=4, cp_rank=3)
    assert a.band == b.band == 4096
    assert attention_plan(a) == attention_plan(b)
    assert not attention_plan(a.replace(balance=False)).moves


def test_plan_example_by_hand():
    """Linear cost over 8 tokens on 2 ranks: rank loads 1+..+4 = 10 and 5+..+8 = 26
    contiguously; the zigzag gives 1+2+7+8 = 18 and 3+4+5+6 = 18."""
    plan = plan_queries(8, 2, lambda s, n: sum(s + i + 1 for i in range(n)), min_piece=1)
    assert plan == QueryPlan((0, 1, 1, 0), 2, (18.0, 18.0))
    assert plan.runs(0) == [(0, 2), (6, 2)] and plan.runs(1) == [(2, 4)]


def test_a_small_gain_keeps_the_identity():
    """A cost model whose contiguous imbalance is below MIN_GAIN moves nothing."""
    bump = 1 + MIN_GAIN / 2
    plan = plan_queries(512, 2, lambda s, n: n * (bump if s >= 256 else 1.0))
    assert not plan.moves


def test_bad_context_balance_flag():
    with pytest.raises(TypeError, match="balance must be a bool, got 'yes'"):
        PackedContext(packing(8, [8]), balance="yes")


# ============================================================================ the exchange
@pytest.mark.parametrize("world,owners", [(2, (0, 1, 1, 0)), (4, (0, 1, 2, 3, 3, 2, 1, 0)),
                                          (3, (2, 0, 1, 1, 2, 0))])  # fmt: skip
def test_send_pieces_round_trip(rank_pool, world, owners):
    seq = 4 * world
    x = torch.arange(seq, dtype=torch.float32).view(1, seq, 1).expand(1, seq, 2).contiguous()
    res = rank_pool.run(fns.round_trip, world, x, owners)
    n, piece = len(owners) // world, seq // len(owners)
    for r, (sent, back, grad) in enumerate(res):
        mine = [g for g, o in enumerate(owners) if o == r]
        want = torch.cat([x[:, g * piece : (g + 1) * piece] for g in mine], 1)
        assert torch.equal(sent, want), (r, sent[0, :, 0])
        assert torch.equal(back, x[:, r * n * piece : (r + 1) * n * piece])
        # d sum(sent^2 / 2 ...) : the gradient of each token is its own value, at home
        assert torch.equal(grad, back)


# ============================================================================ the operators
def _check(rank_pool, name, world, inputs, doc_ids, kw, grad_out):
    want = attn.single_process(name, inputs, doc_ids, kw, grad_out)
    res = rank_pool.run(fns.balanced_and_contiguous, world, name, inputs, doc_ids, kw, grad_out)
    assert all(moved for _, _, moved in res), "the plan should move queries here"
    for key in want:
        on = torch.cat([r[0][key] for r in res], 1)
        off = torch.cat([r[1][key] for r in res], 1)
        if key in ("out", "q", "sinks"):
            assert torch.equal(on, off), (name, key)
        torch.testing.assert_close(on, want[key], **FP32, msg=f"{name} {key}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["one_doc", "spanning"])
def test_doc_causal_balanced(rank_pool, world, layout):
    seq = 256 * world
    lengths = [seq] if layout == "one_doc" else [70, seq - 200, 90]  # pad tail of 40
    doc_ids = packing(seq, lengths)
    inputs = attention_inputs(11, 1, seq, heads=4, kv_heads=2)
    inputs["sinks"] = torch.randn(1, seq, 4)
    _check(rank_pool, "doc_causal", world, inputs, doc_ids, {}, torch.randn(1, seq, 4, 4))


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_balanced(rank_pool, world):
    """Moved queries travel with their exact window (the piece and the 5 tokens before it)."""
    seq = 256 * world
    doc_ids = packing(seq, [seq - 24])
    inputs = attention_inputs(12, 1, seq, heads=4, kv_heads=2)
    _check(rank_pool, "compressed", world, inputs, doc_ids, dict(ratio=4, window=6),
           torch.randn(1, seq, 4, 4))  # fmt: skip


@pytest.mark.parametrize("name,kw", [("kpool", dict(topk=8, kpool=4)),
                                     ("kpool", dict(topk=4, kpool=4, select_tail=False)),
                                     ("qsa", dict(budget=8, ratio=4)),
                                     ("glm", dict(topk=8, kpool=4))])  # fmt: skip
def test_indexers_balanced(rank_pool, name, kw):
    world, seq = 2, 512
    doc_ids = packing(seq, [30, seq - 60])
    inputs = index_inputs(5, 1, seq, index_heads=2, kpool=kw.get("kpool", 4))
    grad_out = torch.randn(1, seq, 4, 6)
    _check(rank_pool, name, world, inputs, doc_ids, kw, grad_out)


def test_balanced_compile_does_not_recompile_over_packings(rank_pool):
    """A compiled balanced call (2 ranks, 512 tokens: the band is the row, so queries move)
    traces once over packings, with no host synchronisation in its graphs, and matches eager."""
    packings = [packing(512, [512]), packing(512, [100, 300, 80]), packing(512, [511]),
                packing(512, [64] * 8)]  # fmt: skip
    assert all(fns.plan_moves(d, 2) for d in packings)
    inputs = attention_inputs(13, 1, 512, heads=2, kv_heads=1)
    grad_out = torch.randn(1, 512, 2, 4)
    for frames, forbidden, worst, graphs in rank_pool.run(attn.cp_compile_rank, 2, "doc_causal",
                                                          inputs, packings, {}, grad_out):
        assert frames == 1 and graphs >= 2 and forbidden == [], (frames, forbidden)
        assert worst <= 1e-5


@pytest.mark.parametrize("owners,match", [
    ((), r"owners has 0 pieces"),
    ((0, 0, 0), r"a whole fraction of local_seq_len=8"),
    ((0, 1), r"gives rank 0 1 pieces, not 2"),
])  # fmt: skip
def test_send_pieces_bad_owners_name_the_problem(owners, match):
    ctx = PackedContext(packing(8, [8]))
    with pytest.raises(ValueError, match=match):
        send_pieces(torch.zeros(1, 8, 2), ctx, owners)


def test_send_pieces_without_cp_is_the_identity():
    x = torch.randn(1, 8, 2)
    assert send_pieces(x, PackedContext(packing(8, [8])), (0, 0)) is x
