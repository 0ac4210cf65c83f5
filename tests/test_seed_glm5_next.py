"""Seed adapter ``fcp.models.glm5_next.cp``: every name of the GLM-5.3-Flash CP seed, with its
documented signature and behaviour (multi-rank parts on real gloo groups)."""

from __future__ import annotations

import copy
import dataclasses
import inspect

import pytest
import torch
import torch.utils._pytree as pytree

import fcp.comm
import fcp.layout
import fcp.shard
from fcp.context import PackedContext
from fcp.models.glm5_next import cp as glm
from tests import _seed_rank_fns as fns

REQ = "<required>"
FACTORY = "<default_factory>"

# The seed's documented signatures, as literals: (parameter, default) in order.
SEED_FUNCTIONS = {
    "_global_doc_ids_from_batch": [("batch", REQ), ("seq_len", REQ)],
    "_normalize_batch_axis": [("batch", REQ)],
    "_pad_sequence_dim": [("tensor", REQ), ("pad_len", REQ), ("value", REQ)],
    "all_gather_backward_anchor": [("gathered", REQ)],
    "all_gather_sequence": [("tensor", REQ), ("cp_group", REQ), ("dim", 1)],
    "build_fla_cp_context": [
        ("packed_context", REQ), ("row", REQ), ("cp_group", REQ), ("conv_kernel_size", REQ)
    ],
    "doc_ids_from_cu_seqlens": [("cu_seqlens", REQ), ("seq_len", REQ)],
    "doc_ids_from_seq_lens": [("seq_lens", REQ), ("seq_len", REQ), ("padding_value", -1000)],
    "segment_cu_seqlens": [("doc_ids_row", REQ)],
    "shard_batch_for_glm5_next_cp": [
        ("cp_mesh", REQ), ("tp_mesh", REQ), ("batch", REQ), ("loss_mask", None),
        ("padding_token_id", 0), ("shard_primary", False),
    ],
}
SEED_CONTEXT_INIT = [
    ("doc_ids", REQ), ("seq_start", 0), ("cp_size", 1), ("original_seq_len", None),
    ("_cu_seqlens", FACTORY),
]
SEED_CONTEXT_PROPERTIES = ("cp_enabled", "local_doc_ids", "local_seq_len")
SEED_FUNCTION_CLASSES = {
    "_AllGatherBackwardAnchor": {"forward": ["ctx", "gathered"],
                                 "backward": ["ctx", "grad_output"]},
    "_AllGatherSequence": {"forward": ["ctx", "local_tensor", "group", "dim"],
                           "backward": ["ctx", "grad_output"]},
}


def _params(fn, skip_self=False):
    out = []
    for p in list(inspect.signature(fn).parameters.values())[int(skip_self):]:
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, (fn, p)
        if p.default is inspect.Parameter.empty:
            out.append((p.name, REQ))
        elif repr(p.default) == "<factory>":
            out.append((p.name, FACTORY))
        else:
            out.append((p.name, p.default))
    return out


@pytest.mark.parametrize("name", sorted(SEED_FUNCTIONS))
def test_seed_function_signature(name):
    assert _params(getattr(glm, name)) == SEED_FUNCTIONS[name]


def test_seed_context_signature_and_members():
    cls = glm.Glm5NextPackedContext
    assert dataclasses.is_dataclass(cls)
    assert _params(cls) == SEED_CONTEXT_INIT
    for name in SEED_CONTEXT_PROPERTIES:
        assert isinstance(inspect.getattr_static(cls, name), property), name
    assert [p.name for p in inspect.signature(cls.row_cu_seqlens).parameters.values()] == [
        "self", "row"
    ]


@pytest.mark.parametrize("name", sorted(SEED_FUNCTION_CLASSES))
def test_seed_autograd_function_signatures(name):
    cls = getattr(glm, name)
    assert issubclass(cls, torch.autograd.Function)
    for method, params in SEED_FUNCTION_CLASSES[name].items():
        assert list(inspect.signature(getattr(cls, method)).parameters) == params


def test_pad_doc_id_and_thin_reexports():
    assert glm._PAD_DOC_ID == 0
    # Delegation, not a second implementation.
    assert glm.doc_ids_from_cu_seqlens is fcp.layout.doc_ids_from_cu_seqlens
    assert glm.doc_ids_from_seq_lens is fcp.layout.doc_ids_from_seq_lens
    assert glm.segment_cu_seqlens is fcp.layout.segment_cu_seqlens
    assert glm.all_gather_backward_anchor is fcp.comm.all_gather_backward_anchor
    assert issubclass(glm._AllGatherBackwardAnchor, torch.autograd.Function)


# ------------------------------------------------------------------ layout functions
def test_doc_ids_from_cu_seqlens():
    out = glm.doc_ids_from_cu_seqlens(torch.tensor([0, 3, 5]), 7)
    assert out.dtype == torch.int64
    assert out.tolist() == [[1, 1, 1, 2, 2, 0, 0]]
    assert glm.doc_ids_from_cu_seqlens(torch.tensor([0, 3, 3, 5]), 5).tolist() == [
        [1, 1, 1, 2, 2]
    ]
    with pytest.raises(ValueError, match="exceeds seq_len"):
        glm.doc_ids_from_cu_seqlens(torch.tensor([0, 3, 9]), 7)


def test_doc_ids_from_seq_lens():
    lens = torch.tensor([[2, 1, -1000], [4, -1000, -1000]])
    assert glm.doc_ids_from_seq_lens(lens, 5).tolist() == [[1, 1, 2, 0, 0], [1, 1, 1, 1, 0]]
    assert glm.doc_ids_from_seq_lens(torch.tensor([[3, -1]]), 4, padding_value=-1).tolist() == [
        [1, 1, 1, 0]
    ]
    with pytest.raises(ValueError, match="more than seq_len"):
        glm.doc_ids_from_seq_lens(torch.tensor([[3, 3]]), 5)


def test_segment_cu_seqlens():
    assert glm.segment_cu_seqlens(torch.tensor([1, 1, 1, 2, 2, 0, 0])).tolist() == [0, 3, 5, 7]
    assert glm.segment_cu_seqlens(torch.tensor([[1, 2, 2, 3]])).tolist() == [0, 1, 3, 4]


# ------------------------------------------------------------------ Glm5NextPackedContext
DOC_IDS = torch.tensor([[1, 1, 1, 1, 2, 3, 3, 3, 3, 3, 0, 0]])


def test_packed_context_properties():
    ctx = glm.Glm5NextPackedContext(DOC_IDS, seq_start=3, cp_size=4, original_seq_len=10)
    assert ctx.cp_enabled and ctx.local_seq_len == 3
    assert ctx.local_doc_ids.tolist() == [[1, 2, 3]]
    single = glm.Glm5NextPackedContext(DOC_IDS)
    assert not single.cp_enabled and single.local_seq_len == 12
    assert torch.equal(single.local_doc_ids, DOC_IDS)


def test_row_cu_seqlens_memoised_device_and_cpu():
    ctx = glm.Glm5NextPackedContext(DOC_IDS, seq_start=6, cp_size=2)
    dev, cpu = ctx.row_cu_seqlens(0)
    assert dev.tolist() == cpu.tolist() == [0, 4, 5, 10, 12]
    assert cpu.device.type == "cpu" and dev.device == DOC_IDS.device
    assert ctx.row_cu_seqlens(0)[1] is cpu  # memoised
    assert set(ctx._cu_seqlens) == {0}
    # Each instance has its own memo (a dataclass default_factory, not a shared dict).
    assert glm.Glm5NextPackedContext(DOC_IDS)._cu_seqlens == {}
    with pytest.raises(ValueError, match="row"):
        ctx.row_cu_seqlens(1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(doc_ids=DOC_IDS.int()), "int64"),
        (dict(doc_ids=DOC_IDS[0]), r"\[batch, sequence\]"),
        (dict(doc_ids=DOC_IDS, cp_size=5), "not divisible by cp_size"),
        (dict(doc_ids=DOC_IDS, cp_size=0), "cp_size"),
        (dict(doc_ids=DOC_IDS, cp_size=4, seq_start=4), "seq_start"),
        (dict(doc_ids=DOC_IDS, cp_size=4, seq_start=12), "seq_start"),
        (dict(doc_ids=DOC_IDS, original_seq_len=13), "original_seq_len"),
    ],
)
def test_packed_context_rejects_bad_layout(kwargs, match):
    with pytest.raises(ValueError, match=match):
        glm.Glm5NextPackedContext(**kwargs)


def test_packed_context_is_frozen_pytree():
    ctx = glm.Glm5NextPackedContext(DOC_IDS, seq_start=6, cp_size=2, original_seq_len=10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.seq_start = 0
    leaves, spec = pytree.tree_flatten(ctx)
    assert len(leaves) == 1 and leaves[0] is DOC_IDS
    other = torch.zeros_like(DOC_IDS)
    back = pytree.tree_unflatten([other], spec)
    assert type(back) is glm.Glm5NextPackedContext and back.doc_ids is other
    assert (back.seq_start, back.cp_size, back.original_seq_len) == (6, 2, 10)
    assert back._cu_seqlens == {}


def test_to_packed_context_without_group():
    ctx = glm.Glm5NextPackedContext(DOC_IDS, original_seq_len=10)
    core = ctx.to_packed_context(None)
    assert isinstance(core, PackedContext)
    assert core.doc_ids is DOC_IDS and core.original_seq_len == 10 and not core.cp_enabled
    assert ctx.to_packed_context(None) is core  # memoised
    back = glm.Glm5NextPackedContext.from_packed_context(core)
    assert back.to_packed_context(None) is core
    with pytest.raises(ValueError, match="cp_size=2"):
        glm.Glm5NextPackedContext(DOC_IDS, cp_size=2).to_packed_context(None)


# ------------------------------------------------------------------ batch helpers
def test_pad_sequence_dim():
    t = torch.tensor([[1, 2], [3, 4]])
    assert glm._pad_sequence_dim(t, 0, 9) is t
    assert glm._pad_sequence_dim(t, 2, 9).tolist() == [[1, 2, 9, 9], [3, 4, 9, 9]]
    e = torch.ones(1, 2, 3)
    padded = glm._pad_sequence_dim(e, 1, 0.0)
    assert padded.shape == (1, 3, 3) and padded[:, 2].abs().sum() == 0
    with pytest.raises(ValueError, match="pad_len"):
        glm._pad_sequence_dim(t, -1, 0)


def test_normalize_batch_axis_returns_new_batch():
    batch = {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([6, 7, -100]),
             "cu_seqlens": torch.tensor([0, 3])}
    before = copy.deepcopy(batch)
    out = glm._normalize_batch_axis(batch)
    assert out is not batch
    assert out["input_ids"].tolist() == [[5, 6, 7]] and out["labels"].tolist() == [[6, 7, -100]]
    assert out["cu_seqlens"].tolist() == [0, 3]
    assert all(torch.equal(batch[k], before[k]) for k in before)


def test_global_doc_ids_from_batch():
    ids = torch.zeros(2, 5, dtype=torch.long)
    got = glm._global_doc_ids_from_batch(
        {"input_ids": ids, "seq_lens": torch.tensor([[2, 2], [3, -1000]])}, 5
    )
    assert got.tolist() == [[1, 1, 2, 2, 0], [1, 1, 1, 0, 0]]
    got = glm._global_doc_ids_from_batch(
        {"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1] * 5])}, 5
    )
    assert got.tolist() == [[1, 1, 1, 0, 0], [1] * 5]


# ------------------------------------------------------------------ sharder
GLM_BATCH = {
    "input_ids": torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17, 18]]),
    "labels": torch.tensor([[11, 12, 13, -100, 15, 16, -100, -100, -100]]),
    "seq_lens": torch.tensor([[4, 3, -1000]]),
    "seq_lens_padded": torch.tensor([[8, 8, -1000]]),
}
LOSS_MASK = torch.tensor([[1, 1, 1, 0, 1, 1, 0, 0, 0]])


def test_sharder_single_process_default_keeps_primary_full():
    factory, local, layout = glm.shard_batch_for_glm5_next_cp(None, None, GLM_BATCH)
    with factory():
        pass
    assert local is not GLM_BATCH and "cp_context" not in GLM_BATCH
    assert local["input_ids"].tolist() == GLM_BATCH["input_ids"].tolist()  # cp 1: no padding
    assert isinstance(local["cp_context"], PackedContext)
    assert isinstance(layout, glm.Glm5NextPackedContext)
    assert layout.doc_ids.tolist() == [[1, 1, 1, 1, 2, 2, 2, 0, 0]]
    assert not {"seq_lens", "seq_lens_padded"} & set(local)


# Expected values written out by hand (padding_token_id=99; doc lengths 4, 3, pack tail 2).
# Positions restart per document and in the pack tail; CP padding positions are 0.
GLM_EXPECTED = {
    2: dict(len=10, ids=[10, 11, 12, 13, 14, 15, 16, 17, 18, 99],
            labels=[11, 12, 13, -100, 15, 16, -100, -100, -100, -100],
            loss=[1, 1, 1, 0, 1, 1, 0, 0, 0, 0],
            pos=[0, 1, 2, 3, 0, 1, 2, 0, 1, 0],
            doc=[1, 1, 1, 1, 2, 2, 2, 0, 0, 0], segments=[0, 4, 7, 10]),
    4: dict(len=12, ids=[10, 11, 12, 13, 14, 15, 16, 17, 18, 99, 99, 99],
            labels=[11, 12, 13, -100, 15, 16, -100, -100, -100, -100, -100, -100],
            loss=[1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0],
            pos=[0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 0, 0],
            doc=[1, 1, 1, 1, 2, 2, 2, 0, 0, 0, 0, 0], segments=[0, 4, 7, 12]),
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shard_primary", [False, True])
def test_sharder_on_real_device_mesh(rank_pool, world, shard_primary):
    exp = GLM_EXPECTED[world]
    local_len = exp["len"] // world
    outs = rank_pool.run(fns.glm_shard, world, GLM_BATCH, shard_primary, LOSS_MASK)
    for rank, out in enumerate(outs):
        sl = slice(rank * local_len, (rank + 1) * local_len)
        local = out["local"]
        want_ids = exp["ids"] if not shard_primary else exp["ids"][sl]
        assert local["input_ids"].tolist() == [want_ids]
        assert local["labels"].tolist() == [exp["labels"][sl]]
        assert local["loss_mask"].tolist() == [exp["loss"][sl]]
        assert local["position_ids"].tolist() == [exp["pos"][sl]]
        assert not {"seq_lens", "seq_lens_padded"} & set(local)
        assert out["ctx"] == ("PackedContext", world, rank, (sl.start, sl.stop), 9)
        assert out["ctx_doc_ids"].tolist() == [exp["doc"]]
        assert out["layout"] == ("Glm5NextPackedContext", sl.start, world, local_len, 9, True)
        assert out["layout_local_doc_ids"].tolist() == [exp["doc"][sl]]
        assert out["layout_row0"][1].tolist() == exp["segments"]
        assert out["core_is_ctx"] and out["memo_shared"]
        after = out["batch_after"]
        assert after.keys() == GLM_BATCH.keys()
        assert all(torch.equal(after[k], GLM_BATCH[k]) for k in GLM_BATCH)


# ------------------------------------------------------------------ collectives
@pytest.mark.parametrize("use_function", [False, True])
def test_all_gather_sequence_values_and_gradient(rank_pool, use_function):
    world = 2
    full = torch.randn(2, 6, 3)
    weights = torch.arange(full.numel(), dtype=full.dtype).view_as(full)
    for rank, (gathered, grad) in enumerate(
        rank_pool.run(fns.glm_gather_grad, world, full, use_function)
    ):
        torch.testing.assert_close(gathered, full)
        # Every rank's loss is sum(gathered * weights): each shard gets world * its weights.
        torch.testing.assert_close(grad, world * weights[:, rank * 3 : (rank + 1) * 3])


def test_all_gather_sequence_without_group_is_identity():
    x = torch.randn(2, 3)
    assert glm.all_gather_sequence(x, None) is x
    assert glm._AllGatherSequence.apply(x, None, 1).tolist() == x.tolist()


def test_backward_anchor_single_process():
    g = torch.randn(2, 3, requires_grad=True)
    a = glm.all_gather_backward_anchor(g)
    assert a.shape == () and float(a.detach()) == 0.0 and a.requires_grad
    (a + (g * 2).sum()).backward()
    torch.testing.assert_close(g.grad, torch.full((2, 3), 2.0))
    b = glm._AllGatherBackwardAnchor.apply(torch.full((2,), float("inf"), requires_grad=True))
    assert float(b.detach()) == 0.0
    assert glm.all_gather_backward_anchor(torch.ones(2)).requires_grad is False


def test_backward_anchor_keeps_rank_in_gather_backward(rank_pool):
    full = torch.randn(1, 4, 2)
    weights = torch.arange(full.numel(), dtype=full.dtype).view_as(full)
    (anchor0, grad0), (anchor1, grad1) = rank_pool.run(fns.glm_anchor, 2, full, timeout=20)
    assert float(anchor0) == 0.0 and anchor1 is None
    # Rank 0: its own x.sum() plus rank 1's use of rank 0's shard; rank 1: its weights only.
    torch.testing.assert_close(grad0, 1.0 + weights[:, :2])
    torch.testing.assert_close(grad1, weights[:, 2:])


# ------------------------------------------------------------------ FLA context
@pytest.fixture
def fake_world4():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        return dist.group.WORLD

    try:
        yield init
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_build_fla_cp_context_matches_fla(fake_world4):
    pytest.importorskip("fla")
    fla_cp = pytest.importorskip("fla.ops.cp")
    # Documents of 5, 6 and 3 tokens, then 2 pad tokens; 4 ranks of 4 tokens.
    doc_ids = torch.tensor([[1] * 5 + [2] * 6 + [3] * 3 + [0] * 2])
    segments = torch.tensor([0, 5, 11, 14, 16])
    # Hand-derived FLA metadata per rank: local boundaries, conv tokens before the shard,
    # (pre_num_ranks, is_first_rank, post_num_ranks, is_last_rank).
    expected = {
        0: ([0, 4], 0, (0, True, 1, False)),
        1: ([0, 1, 4], 4, (1, False, 1, False)),
        2: ([0, 3, 4], 3, (1, False, 1, False)),
        3: ([0, 2, 4], 1, (1, False, 0, True)),
    }
    for rank in range(4):
        group = fake_world4(rank)
        layout = glm.Glm5NextPackedContext(doc_ids, seq_start=4 * rank, cp_size=4)
        got = glm.build_fla_cp_context(layout, 0, group, 4)
        ref = fla_cp.build_cp_context(segments, group, conv1d_kernel_size=4)
        assert isinstance(got, fla_cp.FLACPContext)
        for name in ("pre_num_ranks", "is_first_rank", "post_num_ranks", "is_last_rank",
                     "pre_num_conv_tokens", "conv1d_kernel_size"):
            assert getattr(got, name) == getattr(ref, name), (rank, name)
        assert got.cu_seqlens.tolist() == ref.cu_seqlens.tolist()
        assert got.group is group
        assert glm.build_fla_cp_context(layout, 0, group, 4) is got  # memoised per step
        local, conv, flags = expected[rank]
        assert got.cu_seqlens.tolist() == local and got.pre_num_conv_tokens == conv
        assert (got.pre_num_ranks, got.is_first_rank, got.post_num_ranks,
                got.is_last_rank) == flags
