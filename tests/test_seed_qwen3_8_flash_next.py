"""Seed adapter ``fcp.models.qwen3_8_flash_next.cp``: NeMo AutoModel 0.7.0's API and contract, the
frozen pytree context and its fcp view, issue 11's validation (every bad input is a ``ValueError`` /
``TypeError`` naming the argument and value, the same on every rank). Side-by-side runs against
NeMo are in ``property_tests/test_seed_nemo_differential.py`` and
``tests/test_seed_nemo_models.py``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect

import pytest
import torch
import torch.utils._pytree as pytree
from torch.distributed.utils import _apply_to_tensors

from fcp.context import PackedContext
from fcp.models.compat import MissingBatchKeyError, UnsupportedBatchError, shard_layout_class
from fcp.models.qwen3_8_flash_next import cp as qwen

T = torch.tensor
SEED_ALL = ["Qwen3_8_FlashNextCPContext", "packed_boundaries_from_seq_lens",
            "qwen3_8_flash_next_cp_all_gather", "qwen3_8_flash_next_cp_left_halo",
            "shard_batch_for_qwen3_8_flash_next_cp"]  # fmt: skip


def _nemo():
    return pytest.importorskip("nemo_automodel.components.models.qwen3_8_flash_next.cp")


@pytest.mark.parametrize("name", SEED_ALL[1:] + ["_pad_right", "_validate_right_tail_mask"])
def test_every_seed_function_has_nemos_signature(name):
    nemo = _nemo()

    def params(fn):  # names, kinds and defaults (annotations name other modules' types)
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert params(getattr(qwen, name)) == params(getattr(nemo, name))


def test_all_and_context_fields_are_nemos():
    nemo = _nemo()
    assert qwen.__all__ == nemo.__all__ == SEED_ALL
    describe = lambda cls: [(f.name, f.default, f.init, f.repr, f.compare)  # noqa: E731
                            for f in dataclasses.fields(cls)]  # fmt: skip
    assert describe(qwen.Qwen3_8_FlashNextCPContext) == describe(nemo.Qwen3_8_FlashNextCPContext)
    assert qwen.Qwen3_8_FlashNextCPContext.__dataclass_params__.frozen
    for prop in ("global_sequence_length", "global_sequence_lengths", "local_sequence_end"):
        assert isinstance(inspect.getattr_static(qwen.Qwen3_8_FlashNextCPContext, prop), property)


# ------------------------------------------------------------------ context
IDS = torch.arange(8).view(1, 8)
PAD = T([[False] * 5 + [True] * 3])  # True = pad, as in NeMo


def _ctx(**changes):
    kwargs = dict(group=None, rank=0, size=1, global_input_ids=IDS, global_padding_mask=PAD,
                  local_sequence_start=0, local_sequence_length=8)  # fmt: skip
    kwargs.update(changes)
    return qwen.Qwen3_8_FlashNextCPContext(**kwargs)


def test_context_fields_properties_and_fcp_view():
    # NeMo's packed layout: boundaries end at the packed length 5 (a pack-pad segment [3, 5)
    # included); the CP tail [5, 8) is in no document.
    cu = T([0, 2, 3, 5], dtype=torch.int32)
    ctx = _ctx(global_cu_seqlens=cu)
    assert ctx.global_cu_seqlens is cu and ctx.global_padding_mask is PAD  # stored as given
    assert ctx.global_sequence_length == 8 and ctx.local_sequence_end == 8
    assert ctx.global_sequence_lengths.dtype == torch.int64
    assert ctx.global_sequence_lengths.tolist() == [5]
    core = ctx.packed_context
    assert isinstance(core, PackedContext) and core.doc_ids.dtype == torch.int64
    assert core.doc_ids.tolist() == [[1, 1, 2, 3, 3, 0, 0, 0]]
    mask = T([[False] * 8, [False] * 3 + [True] * 5])
    two = _ctx(global_input_ids=IDS.repeat(2, 1), global_padding_mask=mask)
    assert two.packed_context.doc_ids.tolist() == [[1] * 8, [1] * 3 + [0] * 5]
    assert two.global_sequence_lengths.tolist() == [8, 3]


@pytest.mark.parametrize(
    "changes, error, names",
    [
        # issue 11: out-of-order boundaries were silently dropped; a 2-D list was accepted
        (dict(global_cu_seqlens=T([0, 10, 4, 8, 12]), global_input_ids=torch.zeros(1, 12).long(),
              global_padding_mask=torch.zeros(1, 12).bool(), local_sequence_length=12),
         ValueError, ("global_cu_seqlens", "[0, 10, 4, 8, 12]")),
        (dict(global_cu_seqlens=[[0, 5]]), TypeError, ("global_cu_seqlens", "[[0, 5]]")),
        (dict(global_cu_seqlens=T([[0, 5]])), ValueError, ("global_cu_seqlens", "(1, 2)")),
        (dict(global_cu_seqlens=T([0.0, 5.0])), ValueError, ("global_cu_seqlens", "float")),
        (dict(global_cu_seqlens=T([0, 6])), ValueError, ("global_padding_mask", "6")),
        (dict(global_cu_seqlens=T([1, 5])), ValueError, ("global_cu_seqlens", "[1, 5]")),
        (dict(global_padding_mask=T([[False, True] * 4])), ValueError, ("global_padding_mask",)),
        (dict(global_padding_mask=PAD.long()), ValueError, ("global_padding_mask", "int64")),
        (dict(rank=1), ValueError, ("rank=1",)),
        (dict(size=2, local_sequence_length=4), ValueError, ("group", "size=2")),
        (dict(local_sequence_start=1), ValueError, ("local_sequence_start=1",)),
        (dict(local_sequence_length=4), ValueError, ("local_sequence_length=4",)),
        (dict(rank=0.0), TypeError, ("rank", "0.0")),
        (dict(global_input_ids=IDS.float()), ValueError, ("global_input_ids", "float32")),
    ],
)
def test_context_rejects_bad_fields_naming_them(changes, error, names):
    with pytest.raises(error) as info:
        _ctx(**changes)
    assert all(n in str(info.value) for n in names), str(info.value)


def test_context_is_a_frozen_pytree_rebuilt_through_its_constructor():
    ctx = _ctx(global_cu_seqlens=T([0, 2, 5]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.rank = 1
    leaves, spec = pytree.tree_flatten(ctx)
    assert len(leaves) == 3  # input ids, padding mask, boundaries; group and sizes are static
    back = pytree.tree_unflatten([leaf.clone() for leaf in leaves], spec)
    assert torch.equal(back.packed_context.doc_ids, ctx.packed_context.doc_ids)
    with pytest.raises(ValueError, match="global_cu_seqlens"):  # unflatten validates
        pytree.tree_unflatten([leaves[0], leaves[1], T([0, 3, 2])], spec)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:  # while tracing: static checks only, no host sync
        fake = [mode.from_tensor(leaf) for leaf in leaves]
        traced = pytree.tree_unflatten(fake, spec)
        assert traced.packed_context.doc_ids.shape == (1, 8)


def test_replace_fsdp_and_copies_revalidate():
    ctx = _ctx(global_cu_seqlens=T([0, 2, 5]))
    assert dataclasses.replace(ctx) == ctx
    with pytest.raises(ValueError):
        dataclasses.replace(ctx, local_sequence_start=1)
    cast = _apply_to_tensors(lambda t: t, {"ctx": ctx})["ctx"]  # FSDP's input cast
    assert cast == ctx and cast.packed_context is not ctx.packed_context
    clone = copy.deepcopy(ctx)
    assert torch.equal(clone.packed_context.doc_ids, ctx.packed_context.doc_ids)


def test_context_through_compiled_function():
    ctx = _ctx()

    def f(x, c):
        g = qwen.qwen3_8_flash_next_cp_all_gather(x, c)
        return g * c.global_sequence_lengths[:, None]

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(torch.ones(1, 8), ctx), torch.full((1, 8), 5.0))


def test_collectives_without_cp_keep_nemos_conventions():
    ctx = _ctx()
    x = torch.randn(1, 8, 3, requires_grad=True)
    assert qwen.qwen3_8_flash_next_cp_all_gather(x, ctx) is x
    halo = qwen.qwen3_8_flash_next_cp_left_halo(x, ctx, history=10)
    assert halo.shape == (1, 10, 3) and not halo.any() and not halo.requires_grad
    empty = qwen.qwen3_8_flash_next_cp_left_halo(x, ctx, history=0)
    assert empty.shape == (1, 0, 3) and empty.requires_grad  # a view, as NeMo's
    with pytest.raises(TypeError):
        qwen.qwen3_8_flash_next_cp_left_halo(x, ctx, 2)  # history is keyword-only
    with pytest.raises(ValueError, match="local_sequence"):
        qwen.qwen3_8_flash_next_cp_left_halo(x[:, :3], ctx, history=2)


# ------------------------------------------------------------------ sharder
def test_sharder_mutates_the_batch_as_nemo_does():
    batch = {"input_ids": T([[11, 12, 13, 14, 15]]), "labels": T([[12, 13, 14, 15, -100]]),
             "seq_lens": T([[2, 1, -1000]]), "seq_lens_padded": T([[4, 4, -1000]]),
             "qkv_format": "thd", "max_seqlen": None}  # fmt: skip
    factory, out, layout = qwen.shard_batch_for_qwen3_8_flash_next_cp(None, None, batch,
                                                                      padding_token_id=7)
    assert factory is contextlib.nullcontext and out is batch
    assert list(batch) == ["input_ids", "labels", "max_seqlen", "padding_mask", "position_ids",
                           "_qwen3_8_flash_next_cp_context"]  # fmt: skip
    assert batch["input_ids"].tolist() == [[11, 12, 13, 14, 15, 7, 7, 7]]
    assert batch["position_ids"].tolist() == [list(range(8))]  # a global arange, continued
    assert batch["padding_mask"].tolist() == [[False] * 5 + [True] * 3]
    ctx = batch["_qwen3_8_flash_next_cp_context"]
    assert ctx.global_cu_seqlens.tolist() == [0, 2, 3, 5]  # pack-pad segment; ends at 5 < 8
    assert ctx.group is None and ctx.local_sequence_length == 8
    assert layout == shard_layout_class()(original_seq_len=5, padded_seq_len=8)


def test_sharder_positions_continue_into_the_padding():
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.int32), "labels": torch.ones(2, 3).long(),
             "position_ids": T([[[0, 1, 2], [5, 6, 7]]] * 3)}  # mRoPE [3, batch, sequence]
    qwen.shard_batch_for_qwen3_8_flash_next_cp(None, None, batch, pad_multiple=2)
    assert batch["position_ids"].shape == (3, 2, 4)
    assert batch["position_ids"][0].tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]]
    assert batch["input_ids"].dtype == torch.int32


@pytest.mark.parametrize(
    "change, error, names",
    [
        (dict(cu_seqlens=T([0, 10, 4, 8, 12])), ValueError, ("cu_seqlens", "[0, 10, 4, 8, 12]")),
        (dict(cu_seqlens=[[0, 6, 12]]), TypeError, ("cu_seqlens", "[[0, 6, 12]]")),
        (dict(cu_seqlens=T([[0, 6], [6, 12]])), ValueError, ("cu_seqlens", "(2, 2)")),
        (dict(cu_seqlens=T([0.0, 12.0])), ValueError, ("cu_seqlens", "float32")),
        (dict(seq_lens=T([[3, 0, 2]])), ValueError, ("seq_lens", "[3, 0, 2]")),
        (dict(seq_lens=[4, 4]), TypeError, ("seq_lens", "[4, 4]")),
        (dict(position_ids=torch.zeros(1, 11).long()), ValueError, ("position_ids", "(1, 11)")),
        # [stream-dtype] and [meta]: NeMo pads and slices float labels and positions
        (dict(labels=torch.zeros(1, 12)), TypeError, ("labels", "float32")),
        (dict(position_ids=torch.zeros(1, 12)), TypeError, ("position_ids", "float32")),
        (dict(labels=torch.zeros(1, 12, dtype=torch.long, device="meta")), ValueError,
         ("labels", "meta")),
        (dict(cu_seqlens=T([0, 12], device="meta")), ValueError, ("cu_seqlens", "meta")),
        (dict(attention_mask=[[1] * 12]), TypeError, ("attention_mask must",)),
    ],
)
def test_sharder_rejects_bad_batches_naming_them(change, error, names):
    batch = {"input_ids": torch.zeros(1, 12, dtype=torch.long),
             "labels": torch.zeros(1, 12, dtype=torch.long), **change}  # fmt: skip
    before = copy.copy(batch)
    with pytest.raises(error) as info:
        qwen.shard_batch_for_qwen3_8_flash_next_cp(None, None, batch)
    assert all(n in str(info.value) for n in names), str(info.value)
    assert batch.keys() == before.keys() and all(batch[k] is before[k] for k in batch)


def test_stricter_checks_are_documented():
    assert all(f"[{key}]" in qwen.__doc__ for key in ("stream-dtype", "meta", "ranks"))


def test_sharder_errors_keep_nemos_kinds():
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(NotImplementedError) as info:  # and a ValueError too
        qwen.shard_batch_for_qwen3_8_flash_next_cp(None, None, {"input_ids": ids, "labels": ids,
                                                                "max_seqlen": 4})  # fmt: skip
    assert isinstance(info.value, (UnsupportedBatchError, ValueError))
    with pytest.raises(KeyError) as info:
        qwen.shard_batch_for_qwen3_8_flash_next_cp(None, None, {"input_ids": ids})
    assert isinstance(info.value, (MissingBatchKeyError, ValueError))
    with pytest.raises(NotImplementedError):
        qwen.shard_batch_for_qwen3_8_flash_next_cp(
            None, None, {"input_ids": ids, "labels": ids, "attention_mask": T([[0, 1, 1, 1]])})


def test_bad_batch_fails_identically_on_every_rank(rank_pool):
    batch = {"input_ids": torch.zeros(1, 12, dtype=torch.long),
             "labels": torch.zeros(1, 12, dtype=torch.long),
             "cu_seqlens": T([0, 10, 4, 8, 12])}  # fmt: skip
    errors = rank_pool.run(_shard_on_rank, 2, batch, return_exceptions=True)
    assert all(isinstance(e, ValueError) for e in errors)
    assert len({str(e) for e in errors}) == 1 and "[0, 10, 4, 8, 12]" in str(errors[0])


def _shard_on_rank(env, batch):
    qwen.shard_batch_for_qwen3_8_flash_next_cp(env.mesh(), None, batch)


def test_the_sharders_core_is_the_contexts_packed_context(monkeypatch):
    built, post_init = [], PackedContext.__post_init__

    def counting(self):  # every PackedContext constructed, so validated
        built.append(self)
        post_init(self)

    monkeypatch.setattr(PackedContext, "__post_init__", counting)
    batch = {"input_ids": torch.arange(10).view(1, 10), "labels": torch.zeros(1, 10).long(),
             "cu_seqlens": T([0, 4, 10])}  # fmt: skip
    _, batch, _ = qwen.shard_batch_for_qwen3_8_flash_next_cp(None, None, batch)
    (core,) = built  # fcp.shard_batch's
    ctx = batch["_qwen3_8_flash_next_cp_context"]
    x = torch.randn(1, ctx.local_sequence_length, 3)
    for _ in range(3):  # the layers' collectives read the context
        qwen.qwen3_8_flash_next_cp_all_gather(x, ctx)
        qwen.qwen3_8_flash_next_cp_left_halo(x, ctx, history=3)
        assert ctx.packed_context is core
    assert len(built) == 1
    again = dataclasses.replace(ctx)  # __init__ validates and derives the same layout
    assert again == ctx and torch.equal(again.packed_context.doc_ids, core.doc_ids)
    assert core.doc_ids.tolist() == [[1] * 4 + [2] * 6 + [0] * 2]
