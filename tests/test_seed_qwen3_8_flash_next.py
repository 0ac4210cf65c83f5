"""Seed adapter ``fcp.models.qwen3_8_flash_next.cp``: every name of the Qwen3.8-Flash-Next CP
seed, with its documented signature and behaviour (multi-rank parts on real gloo groups)."""

from __future__ import annotations

import copy
import dataclasses
import inspect

import pytest
import torch
import torch.utils._pytree as pytree

import fcp.layout
from fcp.context import PackedContext
from fcp.models.qwen3_8_flash_next import cp as qwen
from tests import _seed_rank_fns as fns

REQ = "<required>"

# The seed's documented signatures, as literals: (parameter, default) in order.
SEED_FUNCTIONS = {
    "_pad_right": [("tensor", REQ), ("length", REQ), ("value", REQ)],
    "_validate_right_tail_mask": [("mask", REQ), ("input_ids", REQ)],
    "packed_boundaries_from_seq_lens": [
        ("seq_lens", REQ), ("total_tokens", None), ("sentinel", -1000)
    ],
    "qwen3_8_flash_next_cp_all_gather": [
        ("tensor", REQ), ("context", REQ), ("sequence_dim", 1), ("differentiable", True)
    ],
    "qwen3_8_flash_next_cp_left_halo": [("tensor", REQ), ("context", REQ), ("history", REQ)],
    "shard_batch_for_qwen3_8_flash_next_cp": [
        ("cp_mesh", REQ), ("tp_mesh", REQ), ("batch", REQ), ("loss_mask", None),
        ("padding_token_id", 0), ("pad_multiple", 4),
    ],
}
SEED_CONTEXT_INIT = [
    ("group", REQ), ("rank", REQ), ("size", REQ), ("global_input_ids", REQ),
    ("global_padding_mask", REQ), ("local_sequence_start", REQ), ("local_sequence_length", REQ),
    ("global_cu_seqlens", None),
]
SEED_CONTEXT_PROPERTIES = ("global_sequence_length", "global_sequence_lengths",
                           "local_sequence_end")
SEED_ALL = [
    "Qwen3_8_FlashNextCPContext",
    "packed_boundaries_from_seq_lens",
    "qwen3_8_flash_next_cp_all_gather",
    "qwen3_8_flash_next_cp_left_halo",
    "shard_batch_for_qwen3_8_flash_next_cp",
]


def _params(fn):
    out = []
    for p in inspect.signature(fn).parameters.values():
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, (fn, p)
        out.append((p.name, REQ if p.default is inspect.Parameter.empty else p.default))
    return out


@pytest.mark.parametrize("name", sorted(SEED_FUNCTIONS))
def test_seed_function_signature(name):
    assert _params(getattr(qwen, name)) == SEED_FUNCTIONS[name]


def test_seed_context_signature_and_members():
    cls = qwen.Qwen3_8_FlashNextCPContext
    assert dataclasses.is_dataclass(cls)
    assert _params(cls) == SEED_CONTEXT_INIT
    for name in SEED_CONTEXT_PROPERTIES:
        assert isinstance(inspect.getattr_static(cls, name), property), name
    assert list(inspect.signature(cls.__post_init__).parameters) == ["self"]


def test_all_matches_seed():
    assert qwen.__all__ == SEED_ALL
    assert all(hasattr(qwen, n) for n in SEED_ALL)
    assert qwen.packed_boundaries_from_seq_lens is fcp.layout.packed_boundaries_from_seq_lens


# ------------------------------------------------------------------ packed boundaries
def test_packed_boundaries_from_seq_lens():
    f = qwen.packed_boundaries_from_seq_lens
    assert f(torch.tensor([3, 0, 2, -1000]), 8).tolist() == [0, 3, 5, 8]  # pad segment
    assert f(torch.tensor([[3, 2]])).tolist() == [0, 3, 5]
    assert f(torch.tensor([3, 2]), 5).tolist() == [0, 3, 5]  # exactly packed: no pad segment
    assert f(torch.tensor([4, -7]), 6, sentinel=-7).tolist() == [0, 4, 6]
    out = f(torch.tensor([1, 2], dtype=torch.int32), 4)
    assert out.dtype == torch.int64
    with pytest.raises(ValueError, match="total_tokens"):
        f(torch.tensor([3, 2]), 4)
    with pytest.raises(ValueError, match="single row"):
        f(torch.tensor([[3], [2]]), 5)


# ------------------------------------------------------------------ _pad_right / mask
def test_pad_right():
    t = torch.tensor([[1, 2, 3]])
    assert qwen._pad_right(t, 3, 0) is t  # unchanged when no padding is needed
    assert qwen._pad_right(t, 5, 7).tolist() == [[1, 2, 3, 7, 7]]
    m = torch.tensor([[True, False]])
    padded = qwen._pad_right(m, 4, False)
    assert padded.dtype == torch.bool and padded.tolist() == [[True, False, False, False]]
    with pytest.raises(ValueError, match="shorter"):
        qwen._pad_right(t, 2, 0)
    with pytest.raises(ValueError, match="rank-two"):
        qwen._pad_right(torch.ones(1, 3, 2), 4, 0)


def test_validate_right_tail_mask():
    ids = torch.zeros(2, 4, dtype=torch.long)
    out = qwen._validate_right_tail_mask(torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]), ids)
    assert out.dtype == torch.bool and out.device == ids.device
    assert out.tolist() == [[True, True, False, False], [True] * 4]
    with pytest.raises(ValueError, match="follows a 0"):
        qwen._validate_right_tail_mask(torch.tensor([[1, 0, 1, 0], [1] * 4]), ids)
    with pytest.raises(ValueError, match="shape"):
        qwen._validate_right_tail_mask(torch.ones(2, 3), ids)
    with pytest.raises(ValueError, match="binary"):
        qwen._validate_right_tail_mask(torch.full((2, 4), 2), ids)


# ------------------------------------------------------------------ context
IDS = torch.arange(8).view(1, 8)
MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])


def _ctx(**changes):
    kwargs = dict(group=None, rank=0, size=1, global_input_ids=IDS, global_padding_mask=MASK,
                  local_sequence_start=0, local_sequence_length=8)
    kwargs.update(changes)
    return qwen.Qwen3_8_FlashNextCPContext(**kwargs)


def test_context_properties_and_packed_context():
    ctx = _ctx(global_cu_seqlens=torch.tensor([0, 2, 6, 8]))
    assert ctx.global_sequence_length == 8 and ctx.local_sequence_end == 8
    lengths = ctx.global_sequence_lengths
    assert lengths.dtype == torch.int64 and lengths.tolist() == [6]
    assert ctx.global_padding_mask.dtype == torch.bool  # normalised
    core = ctx.packed_context
    assert isinstance(core, PackedContext) and not core.cp_enabled
    assert core.doc_ids.tolist() == [[1, 1, 2, 2, 2, 2, 0, 0]]
    # Without boundaries each row is one document over its valid tokens.
    two = _ctx(global_input_ids=IDS.repeat(2, 1),
               global_padding_mask=torch.tensor([[1] * 8, [1] * 3 + [0] * 5]))
    assert two.packed_context.doc_ids.tolist() == [[1] * 8, [1] * 3 + [0] * 5]
    assert two.global_sequence_lengths.tolist() == [8, 3]


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(rank=1), "rank"),
        (dict(rank=-1), "rank"),
        (dict(size=0), "size"),
        (dict(size=2, local_sequence_length=4), "group"),  # no group for size 2
        (dict(local_sequence_start=1), "local_sequence_start"),
        (dict(local_sequence_length=4), "local_sequence_length"),
        (dict(local_sequence_length=0), "local_sequence_length"),
        (dict(global_padding_mask=MASK[:, :7]), "global_padding_mask"),
        (dict(global_padding_mask=torch.tensor([[1, 1, 0, 1, 1, 1, 0, 0]])),
         "global_padding_mask"),
        (dict(global_input_ids=IDS.float()), "global_input_ids"),
        (dict(global_cu_seqlens=torch.tensor([0, 2, 6])), "global_cu_seqlens"),  # not covering
        (dict(global_cu_seqlens=torch.tensor([0, 2, 7, 8])), "global_cu_seqlens"),  # splits pad
        (dict(global_cu_seqlens=torch.tensor([1, 2, 6, 8])), "global_cu_seqlens"),
        (dict(global_cu_seqlens=torch.tensor([0, 4, 2, 6, 8])), "global_cu_seqlens"),
        (dict(global_input_ids=IDS.repeat(2, 1), global_padding_mask=MASK.repeat(2, 1),
              global_cu_seqlens=torch.tensor([0, 6, 8])), "global_cu_seqlens"),
    ],
)
def test_context_rejects_inconsistent_metadata(changes, match):
    with pytest.raises(ValueError, match=match):
        _ctx(**changes)


def test_context_is_frozen_pytree():
    ctx = _ctx(global_cu_seqlens=torch.tensor([0, 6, 8]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.rank = 1
    leaves, spec = pytree.tree_flatten(ctx)
    # input ids, mask, boundaries and the core's doc-id map
    assert len(leaves) == 4
    back = pytree.tree_unflatten([leaf.clone() for leaf in leaves], spec)
    assert type(back) is qwen.Qwen3_8_FlashNextCPContext
    assert torch.equal(back.packed_context.doc_ids, ctx.packed_context.doc_ids)
    assert (back.rank, back.size, back.local_sequence_end) == (0, 1, 8)


def test_context_through_compiled_function():
    ctx = _ctx()

    def f(x, c):
        g = qwen.qwen3_8_flash_next_cp_all_gather(x, c)
        return g * c.global_sequence_lengths[:, None]

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    x = torch.ones(1, 8)
    torch.testing.assert_close(compiled(x, ctx), torch.full((1, 8), 6.0))


def test_collectives_without_cp():
    ctx = _ctx()
    x = torch.randn(1, 8, 3)
    assert qwen.qwen3_8_flash_next_cp_all_gather(x, ctx) is x
    halo = qwen.qwen3_8_flash_next_cp_left_halo(x, ctx, 5)
    assert halo.shape == (1, 5, 3) and not halo.any()


def test_context_group_disagreement_on_real_group(rank_pool):
    for rank, out in enumerate(rank_pool.run(fns.qwen_context_errors, 2)):
        assert "group has size 2" in out["size"]
        assert "rank" in out["rank"] and f"rank = {1 - rank}" in out["rank"]
        assert out["ok"] == (2, rank, 2 * rank + 2)


# ------------------------------------------------------------------ sharder
PACKED_BATCH = {
    "input_ids": torch.arange(10, 20),  # a THD row without batch axis
    "labels": torch.arange(11, 21),
    "cu_seqlens": torch.tensor([0, 4, 5, 9]),  # pack tail: token 9
}
# Written out by hand: 10 tokens padded to 16 (multiple of cp * pad_multiple = 8 or 16).
PACKED_EXPECTED = dict(
    ids=[10, 11, 12, 13, 14, 15, 16, 17, 18, 19] + [0] * 6,
    labels=[11, 12, 13, 14, 15, 16, 17, 18, 19, 20] + [-100] * 6,
    pos=[0, 1, 2, 3, 0, 0, 1, 2, 3, 0] + [0] * 6,
    doc=[1, 1, 1, 1, 2, 3, 3, 3, 3] + [0] * 7,
    mask=[True] * 9 + [False] * 7,
    cu=[0, 4, 5, 9, 16],
    lengths=[9],
)


@pytest.mark.parametrize("world", [2, 4])
def test_sharder_packed_row_on_real_device_mesh(rank_pool, world):
    exp = PACKED_EXPECTED
    local_len = 16 // world
    for rank, out in enumerate(rank_pool.run(fns.qwen_shard, world, PACKED_BATCH, 4)):
        sl = slice(rank * local_len, (rank + 1) * local_len)
        local = out["local"]
        assert local["input_ids"].tolist() == [exp["ids"][sl]]
        assert local["labels"].tolist() == [exp["labels"][sl]]
        assert local["position_ids"].tolist() == [exp["pos"][sl]]
        assert "cu_seqlens" not in local
        c = out["ctx"]
        assert not c["group_is_none"] and (c["rank"], c["size"]) == (rank, world)
        assert (c["start"], c["length"], c["end"]) == (sl.start, local_len, sl.stop)
        assert c["global_input_ids"].tolist() == [exp["ids"]]
        assert c["global_padding_mask"].tolist() == [exp["mask"]]
        assert c["cu"].tolist() == exp["cu"]
        assert c["global_sequence_length"] == 16
        assert c["global_sequence_lengths"].tolist() == exp["lengths"]
        assert out["packed_doc_ids"].tolist() == out["layout_doc_ids"].tolist() == [exp["doc"]]
        assert out["packed"] == (rank, (sl.start, sl.stop))
        assert out["layout"] == ("PackedContext", world, rank, (sl.start, sl.stop), 10)
        assert out["gathered_ids"].tolist() == [exp["ids"]]
        after = out["batch_after"]
        assert after.keys() == PACKED_BATCH.keys()
        assert all(torch.equal(after[k], PACKED_BATCH[k]) for k in PACKED_BATCH)


def test_sharder_masked_rows_on_real_device_mesh(rank_pool):
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]),
    }
    for rank, out in enumerate(rank_pool.run(fns.qwen_shard, 2, batch, 1)):
        sl = slice(rank * 3, rank * 3 + 3)
        c = out["ctx"]
        assert c["cu"] is None
        assert c["global_padding_mask"].tolist() == [[True] * 6, [True] * 3 + [False] * 3]
        assert c["global_sequence_lengths"].tolist() == [6, 3]
        assert out["local"]["attention_mask"].tolist() == [
            [[True] * 6, [True] * 3 + [False] * 3][r][sl] for r in range(2)
        ]
        assert out["gathered_ids"].tolist() == batch["input_ids"].tolist()
        assert out["packed_doc_ids"].tolist() == [[1] * 6, [1] * 3 + [0] * 3]


def test_sharder_single_process_and_errors():
    before = copy.deepcopy(PACKED_BATCH)
    factory, local, layout = qwen.shard_batch_for_qwen3_8_flash_next_cp(None, None, PACKED_BATCH)
    with factory():
        pass
    assert local["input_ids"].tolist() == [PACKED_EXPECTED["ids"][:12]]  # pad to 4 only
    assert local["cp_context"].global_cu_seqlens.tolist() == [0, 4, 5, 9, 12]
    assert layout.original_seq_len == 10 and layout.global_seq_len == 12
    assert all(torch.equal(PACKED_BATCH[k], before[k]) for k in before)
    with pytest.raises(ValueError, match="batch size one"):
        qwen.shard_batch_for_qwen3_8_flash_next_cp(
            None, None, {"input_ids": torch.zeros(2, 4, dtype=torch.long),
                         "seq_lens": torch.tensor([[2, 2], [4, -1000]])})
    with pytest.raises(ValueError, match="input_ids"):
        qwen.shard_batch_for_qwen3_8_flash_next_cp(
            None, None, {"inputs_embeds": torch.ones(1, 4, 2)})
    with pytest.raises(ValueError, match="pad_multiple"):
        qwen.shard_batch_for_qwen3_8_flash_next_cp(
            None, None, {"input_ids": torch.zeros(1, 4, dtype=torch.long)}, pad_multiple=0)


# ------------------------------------------------------------------ collectives on real groups
def test_all_gather_on_real_group(rank_pool):
    world = 2
    full = torch.randn(1, 8, 3)
    weights = torch.arange(full.numel(), dtype=full.dtype).view_as(full)
    for rank, (g, grad, g_comp, g_dim2, bad) in enumerate(
        rank_pool.run(fns.qwen_gather, world, full)
    ):
        torch.testing.assert_close(g, full)
        torch.testing.assert_close(grad, world * weights[:, rank * 4 : rank * 4 + 4])
        torch.testing.assert_close(g_comp, full.unflatten(1, (2, 4)).sum(2))
        torch.testing.assert_close(g_dim2, full.transpose(1, 2))
        assert bad is not None and "whole fraction" in bad


@pytest.mark.parametrize("history", [2, 6])  # 6 > local length 3: spans earlier ranks
def test_left_halo_on_real_group(rank_pool, history):
    world, local = 4, 3
    full = torch.arange(1.0, 13.0).view(1, 12, 1)
    outs = rank_pool.run(fns.qwen_halo, world, full, history)
    count = torch.zeros(12)
    for rank, _ in enumerate(outs):
        start = rank * local
        want = [0.0] * max(0, history - start) + [float(v) for v in range(1, 13)][
            max(0, start - history) : start
        ]
        for t in range(max(0, start - history), start):
            count[t] += 1
        assert outs[rank][0].view(-1).tolist() == want
    for rank, (_, grad) in enumerate(outs):
        # d(sum of every rank's halo)/d token = number of ranks whose halo holds it
        assert grad.view(-1).tolist() == count[rank * local : (rank + 1) * local].tolist()
