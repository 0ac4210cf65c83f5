"""Seed adapter ``fcp.models.glm5_next.cp``: NeMo AutoModel 0.7.0's API and contract (signatures,
names, the mutable context and what FSDP / ``dataclasses.replace`` do to it), fcp's view of it,
and worked examples. Side-by-side runs against NeMo on Hypothesis inputs are in
``property_tests/test_seed_nemo_differential.py``; NeMo's own models in
``tests/test_seed_nemo_models.py``."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle

import pytest
import torch
from torch.distributed.utils import _apply_to_tensors

from fcp.context import PackedContext
from fcp.models.compat import ShardLayout, shard_layout_class
from fcp.models.glm5_next import cp as glm
from tests.support.python_subprocess import run_python

T = torch.tensor


def _nemo():
    return pytest.importorskip("nemo_automodel.components.models.glm5_next.cp")


# ------------------------------------------------------------------ API: NeMo's, name for name
SEED_NAMES = ["Glm5NextPackedContext", "_AllGatherBackwardAnchor", "_AllGatherSequence",
              "_global_doc_ids_from_batch", "_normalize_batch_axis", "_pad_sequence_dim",
              "all_gather_backward_anchor", "all_gather_sequence", "build_fla_cp_context",
              "doc_ids_from_cu_seqlens", "doc_ids_from_seq_lens", "segment_cu_seqlens",
              "shard_batch_for_glm5_next_cp", "_PAD_DOC_ID", "ShardLayout"]  # fmt: skip


@pytest.mark.parametrize("name", SEED_NAMES)
def test_every_seed_name_has_nemos_signature(name):
    nemo = _nemo()
    theirs, ours = getattr(nemo, name), getattr(glm, name)
    if name == "_PAD_DOC_ID":
        assert ours == theirs == 0
    elif name == "ShardLayout":
        assert ours is theirs  # NeMo's own class while NeMo is importable
    elif inspect.isclass(theirs) and issubclass(theirs, torch.autograd.Function):
        for method in ("forward", "backward"):
            assert inspect.signature(getattr(ours, method)) == inspect.signature(
                getattr(theirs, method))
    else:
        assert str(inspect.signature(ours)) == str(inspect.signature(theirs))


def test_context_is_nemos_mutable_dataclass():
    nemo = _nemo()
    def describe(cls):
        return [(f.name, f.default, f.default_factory, f.init, f.repr, f.compare)
                for f in dataclasses.fields(cls)]  # fmt: skip

    assert describe(glm.Glm5NextPackedContext) == describe(nemo.Glm5NextPackedContext)
    params = glm.Glm5NextPackedContext.__dataclass_params__
    assert not params.frozen and params.eq
    ctx = glm.Glm5NextPackedContext(T([[1, 1, 2, 0]], dtype=torch.int32))
    with pytest.raises(TypeError, match="unhashable"):
        hash(ctx)
    assert repr(ctx) == repr(nemo.Glm5NextPackedContext(ctx.doc_ids))


def test_shard_layout_fallback_is_an_identical_dataclass():
    nemo_cls = shard_layout_class()
    describe = lambda cls: [(f.name, f.default) for f in dataclasses.fields(cls)]  # noqa: E731
    assert describe(ShardLayout) == describe(nemo_cls)
    assert ShardLayout.__dataclass_params__.frozen == nemo_cls.__dataclass_params__.frozen


def test_imports_and_works_without_nemo_and_fla():
    """fcp never needs NeMo: a fallback ShardLayout; without FLA, FLA planning raises as NeMo."""
    code = (
        "import sys; sys.modules['nemo_automodel'] = None; sys.modules['fla'] = None\n"
        "import torch\n"
        "from fcp.models.glm5_next import cp as g\n"
        "from fcp.models.qwen3_8_flash_next import cp as q\n"
        "b = {'input_ids': torch.tensor([[1, 2, 3]]), 'labels': torch.tensor([[2, 3, -100]])}\n"
        "_, _, lg = g.shard_batch_for_glm5_next_cp(None, None, dict(b))\n"
        "_, _, lq = q.shard_batch_for_qwen3_8_flash_next_cp(None, None, dict(b))\n"
        "same = g.ShardLayout is q.ShardLayout is type(lq)\n"
        "print(type(lg).__module__, same, lq.padded_seq_len)\n"
        "try:\n"
        "    g.build_fla_cp_context(g.Glm5NextPackedContext(torch.ones(1, 4, dtype=torch.int32)),"
        " 0, None, 4)\n"
        "except RuntimeError as err:\n"
        "    print('RuntimeError', 'fla' in str(err))\n"
        "print('nemo_automodel' in sys.modules and sys.modules['nemo_automodel'] is None)\n"
    )
    assert run_python(code).split("\n")[:3] == ["fcp.models.compat True 4", "RuntimeError True", "True"]


# ------------------------------------------------------------------ document maps: NeMo's numbering
def test_doc_ids_number_documents_as_nemo():
    # int32, and a zero-length document still uses an id (NeMo enumerates every slot)
    out = glm.doc_ids_from_seq_lens(T([2, 0, 2]), 5)
    assert out.dtype == torch.int32 and out.tolist() == [[1, 1, 3, 3, 0]]
    assert glm.doc_ids_from_seq_lens(T([[3, -1000], [2, 2]]), 4).tolist() == [[1, 1, 1, 0],
                                                                                [1, 1, 2, 2]]
    with pytest.raises(TypeError):
        glm.doc_ids_from_seq_lens(T([2]), 3, -1000)  # padding_value is keyword-only
    out = glm.doc_ids_from_cu_seqlens(T([0, 2, 2, 5, -1]), 6)
    assert out.dtype == torch.int32 and out.tolist() == [[1, 1, 3, 3, 3, 0]]
    seg = glm.segment_cu_seqlens(T([1, 1, 2, 1, 0, 0], dtype=torch.int32))
    assert seg.dtype == torch.int32 and seg.tolist() == [0, 2, 3, 4, 6]


@pytest.mark.parametrize(
    "fn, args, key",
    [
        (glm.doc_ids_from_seq_lens, (T([4, 4]), 6), "seq-lens"),  # NeMo truncates
        (glm.doc_ids_from_seq_lens, (T([2.5, 1.5]), 4), "dtype"),
        (glm.doc_ids_from_cu_seqlens, (T([0, 4, 2, 6]), 6), "cu-seqlens"),  # out of order
        (glm.doc_ids_from_cu_seqlens, (T([0, 3, -1, 6]), 6), "cu-seqlens"),  # inner negative
        (glm.doc_ids_from_cu_seqlens, (T([0]), 3), "cu-seqlens"),  # NeMo: one document
        (glm.doc_ids_from_cu_seqlens, (T([[0, 2, 4], [0, 1, 4]]), 4), "cu-seqlens"),
        (glm.segment_cu_seqlens, (T([[1, 1, 2]]),), "segment-row"),
        (glm.doc_ids_from_cu_seqlens, ([0, 2],), "non-tensor"),
        (glm.doc_ids_from_cu_seqlens, (T([0, 2, 5]), 5.0), "seq-len"),  # NeMo's arange takes it
        (glm.doc_ids_from_cu_seqlens, (T([0, 2, 5], device="meta"), 5), "meta"),
        (glm.shard_batch_for_glm5_next_cp, (None, None, {"input_ids": T([[1, 2]], device="meta")}),
         "meta"),
    ],
)
def test_documented_stricter_errors(fn, args, key):
    assert f"[{key}]" in glm.__doc__
    with pytest.raises((ValueError, TypeError)):
        fn(*args)


@pytest.mark.parametrize("name", ["doc_ids_from_seq_lens", "doc_ids_from_cu_seqlens"])
def test_a_negative_seq_len_raises_nemos_runtime_error_that_is_a_value_error(name):
    arg = T([[2, 3]]) if name == "doc_ids_from_seq_lens" else T([0, 2, 5])
    with pytest.raises(RuntimeError, match="seq_len=-1 must be >= 0") as ours:
        getattr(glm, name)(arg, -1)
    assert isinstance(ours.value, ValueError) and "[ranks]" in glm.__doc__
    with pytest.raises(RuntimeError):  # NeMo 0.7.0's kind
        getattr(_nemo(), name)(arg, -1)


# ------------------------------------------------------------------ the context
DOC_IDS = T([[1, 1, 1, 1, 2, 3, 3, 3, 3, 3, 0, 0]], dtype=torch.int32)


def test_context_properties_and_row_boundaries():
    ctx = glm.Glm5NextPackedContext(DOC_IDS, seq_start=3, cp_size=4, original_seq_len=10)
    assert ctx.cp_enabled and ctx.local_seq_len == 3
    assert ctx.local_doc_ids.tolist() == [[1, 2, 3]] and ctx.local_doc_ids.dtype == torch.int32
    dev, cpu = ctx.row_cu_seqlens(0)
    assert dev.dtype == cpu.dtype == torch.int64 and cpu.tolist() == [0, 4, 5, 10, 12]
    assert ctx.row_cu_seqlens(0) is ctx._cu_seqlens[0]  # memoised under the row as given
    assert ctx.row_cu_seqlens(-1)[1].tolist() == [0, 4, 5, 10, 12] and -1 in ctx._cu_seqlens
    with pytest.raises(IndexError):
        ctx.row_cu_seqlens(1)


def test_replace_fsdp_copy_and_pickle_keep_nemos_behaviour():
    ctx = glm.Glm5NextPackedContext(DOC_IDS, seq_start=6, cp_size=2, original_seq_len=10)
    ctx.row_cu_seqlens(0)
    moved = dataclasses.replace(ctx, seq_start=0)
    assert moved._cu_seqlens is ctx._cu_seqlens and moved.seq_start == 0
    # FSDP's mixed-precision input cast rebuilds dataclasses field by field through __init__
    cast = _apply_to_tensors(lambda t: t.float() if t.is_floating_point() else t, {"c": ctx})["c"]
    assert type(cast) is glm.Glm5NextPackedContext and cast == ctx
    for clone in (copy.deepcopy(ctx), pickle.loads(pickle.dumps(ctx))):
        assert torch.equal(clone.doc_ids, ctx.doc_ids) and clone.seq_start == 6
    ctx.seq_start = 0  # mutable, as NeMo's
    assert ctx.local_doc_ids.tolist() == [[1, 1, 1, 1, 2, 3]]


def test_to_packed_context_renumbers_runs_as_int64():
    ids = T([[2, 2, 5, 5, 2, 0]], dtype=torch.int32)  # runs 2 | 5 | 2 | pad
    ctx = glm.Glm5NextPackedContext(ids, original_seq_len=5)
    core = ctx.to_packed_context(None)
    assert isinstance(core, PackedContext) and core.doc_ids.dtype == torch.int64
    assert core.doc_ids.tolist() == [[1, 1, 2, 2, 3, 0]] and core.original_seq_len == 5
    assert ctx.to_packed_context(None) is core  # memoised per group
    ctx.doc_ids = T([[1, 1, 1, 1, 1, 1]], dtype=torch.int32)  # assigning a field drops the memo
    assert ctx.to_packed_context(None).doc_ids.tolist() == [[1] * 6]
    back = glm.Glm5NextPackedContext.from_packed_context(core)
    assert back.doc_ids.dtype == torch.int32 and back.to_packed_context(None) is core
    with pytest.raises(ValueError, match="cp_size=2"):
        glm.Glm5NextPackedContext(T([[1, 1]]), cp_size=2).to_packed_context(None)
    # NeMo's non-CP forward builds left-padded maps; fcp's core rejects them, clearly
    left = glm.Glm5NextPackedContext(T([[0, 0, 1, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="right tail"):
        left.to_packed_context(None)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(doc_ids=DOC_IDS[0]), ValueError),
        (dict(doc_ids=DOC_IDS.float()), ValueError),
        (dict(doc_ids=[[1, 1]]), TypeError),
        (dict(doc_ids=DOC_IDS, cp_size=5), ValueError),
        (dict(doc_ids=DOC_IDS, cp_size=4, seq_start=4), ValueError),
        (dict(doc_ids=DOC_IDS, original_seq_len=13), ValueError),
        (dict(doc_ids=DOC_IDS, cp_size=2.0), TypeError),
    ],
)
def test_context_rejects_bad_layout(kwargs, error):
    assert "[context]" in glm.__doc__
    with pytest.raises(error):
        glm.Glm5NextPackedContext(**kwargs)


def test_core_view_flows_into_compiled_code():
    ctx = glm.Glm5NextPackedContext(DOC_IDS)

    def f(x, core):
        return x * core.local_valid

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    out = compiled(torch.ones(1, 12), ctx.to_packed_context())
    assert out.sum().item() == 10


# ------------------------------------------------------------------ sharder: NeMo's contract
def test_sharder_mutates_the_batch_as_nemo_does():
    batch = {"input_ids": T([11, 12, 13]), "labels": T([12, 13, -100]),
             "_packed_seq_ids": T([1, 1, 2]), "pixel_values": torch.ones(2, 2)}  # fmt: skip
    ids = batch["input_ids"]
    factory, out, layout = glm.shard_batch_for_glm5_next_cp(None, None, batch)
    assert factory is __import__("contextlib").nullcontext and out is batch
    assert list(batch) == ["input_ids", "labels", "pixel_values", "position_ids", "padding_mask",
                           "glm5_next_packed_context"]  # fmt: skip
    assert batch["input_ids"].tolist() == [[11, 12, 13]] and batch["input_ids"].data_ptr() == (
        ids.data_ptr())  # the THD row got its batch axis; unpadded, unsliced
    assert batch["padding_mask"].tolist() == [[False] * 3]
    ctx = batch["glm5_next_packed_context"]
    assert ctx.doc_ids.dtype == torch.int32 and ctx.doc_ids.tolist() == [[1, 1, 2]]
    assert layout == shard_layout_class()(original_seq_len=3, padded_seq_len=3)


def test_sharder_rejects_before_touching_the_batch():
    batch = {"input_ids": T([[1, 2, 3, 4]]), "attention_mask": T([[0, 1, 1, 1]])}
    before = copy.deepcopy(batch)
    with pytest.raises(ValueError, match="right tail"):
        glm.shard_batch_for_glm5_next_cp(None, None, batch)
    assert batch.keys() == before.keys() and all(torch.equal(batch[k], before[k]) for k in batch)
    with pytest.raises(KeyError):
        glm.shard_batch_for_glm5_next_cp(None, None, {"labels": T([[1]])})


# ------------------------------------------------------------------ collectives without a group
def test_anchor_is_b11_zero_and_nan_safe():
    g = torch.full((2, 3, 4), float("nan"), requires_grad=True)
    anchor = glm.all_gather_backward_anchor(g)
    assert anchor.shape == (2, 1, 1) and anchor.requires_grad and not anchor.any()
    (anchor.sum() + 0.0).backward()
    assert g.grad.shape == g.shape and not g.grad.any() and not g.grad.isnan().any()
    f = glm._AllGatherBackwardAnchor.apply(torch.ones(3, 2, requires_grad=True))
    assert f.shape == (3, 1, 1)


def test_none_group_is_the_default_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(ValueError, match="Default process group"):
        glm.all_gather_sequence(torch.ones(1, 2), None)
    with pytest.raises(TypeError):
        glm.all_gather_sequence(torch.ones(1, 2), None, 1)  # dim is keyword-only


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
    fla_cp = pytest.importorskip("fla.ops.cp")
    doc_ids = T([[1] * 5 + [2] * 6 + [3] * 3 + [0] * 2], dtype=torch.int32)
    segments = T([0, 5, 11, 14, 16])
    fields = ("pre_num_ranks", "is_first_rank", "post_num_ranks", "is_last_rank",
              "pre_num_conv_tokens", "conv1d_kernel_size", "layout")  # fmt: skip
    for rank in range(4):
        group = fake_world4(rank)
        layout = glm.Glm5NextPackedContext(doc_ids, seq_start=4 * rank, cp_size=4)
        got = glm.build_fla_cp_context(layout, 0, group, 4)
        ref = fla_cp.build_cp_context(segments, group, conv1d_kernel_size=4)
        assert isinstance(got, fla_cp.FLACPContext) and got.group is group
        assert all(getattr(got, n) == getattr(ref, n) for n in fields)
        assert got.cu_seqlens.tolist() == ref.cu_seqlens.tolist()
        assert glm.build_fla_cp_context(layout, -1, group, 4) is got  # memoised, row -1 = 0


# ------------------------------------------------------------------ one cache, converted once
def _constructions(monkeypatch) -> list:
    """Every :class:`PackedContext` constructed (so validated) from now on, in order."""
    built, post_init = [], PackedContext.__post_init__

    def counting(self):
        built.append(self)
        post_init(self)

    monkeypatch.setattr(PackedContext, "__post_init__", counting)
    return built


def test_the_sharders_core_serves_every_forward(fake_world4, monkeypatch):
    """Shard once, then three steps of what NeMo's model does with the context: FSDP's input
    cast rebuilds it, KDA plans FLA per row, NeMo's non-CP path reads row boundaries."""
    pytest.importorskip("fla.ops.cp")
    group = fake_world4(1)
    built = _constructions(monkeypatch)
    batch = {"input_ids": torch.arange(28).view(2, 14) + 1,
             "_packed_seq_ids": T([[1] * 5 + [2] * 6 + [3] * 3, [4] * 9 + [0] * 5])}  # fmt: skip
    _, batch, _ = glm.shard_batch_for_glm5_next_cp(group, None, batch)
    (core,) = built  # fcp.shard_batch's, validated once
    ctx = batch["glm5_next_packed_context"]
    assert ctx.to_packed_context(group) is core and core.seq_start == ctx.seq_start == 4
    plans = [glm.build_fla_cp_context(ctx, row, group, 4) for row in range(2)]
    for _ in range(3):
        step = _apply_to_tensors(lambda t: t.float() if t.is_floating_point() else t, {"c": ctx})
        step = step["c"]
        assert step is not ctx and step == ctx and step.to_packed_context(group) is core
        assert all(glm.build_fla_cp_context(step, r, group, 4) is plans[r] for r in range(2))
        assert all(step.row_cu_seqlens(r) is core.row_cu_seqlens(r) for r in range(2))
    assert core.row_cu_seqlens(1)[1].tolist() == [0, 9, 16]
    assert len(built) == 1
    for clone in (copy.deepcopy(ctx), pickle.loads(pickle.dumps(ctx))):  # the core stays behind
        assert clone.to_packed_context(group) is not core
        assert torch.equal(clone.to_packed_context(group).doc_ids, core.doc_ids)


def test_a_changed_field_never_serves_a_stale_core():
    ctx = glm.Glm5NextPackedContext(DOC_IDS.clone(), original_seq_len=10)
    core = ctx.to_packed_context(None)
    assert ctx.row_cu_seqlens(0) is core.row_cu_seqlens(0)  # boundaries live in the core's memo
    ctx.original_seq_len = 12  # NeMo code assigns fields
    assert ctx.to_packed_context(None) is not core
    assert ctx.to_packed_context(None).original_seq_len == 12
    ctx.doc_ids[0, :2] = 7  # an in-place edit of the map
    assert ctx.row_cu_seqlens(0)[1].tolist() == [0, 2, 4, 5, 10, 12]
    assert ctx.to_packed_context(None).doc_ids.tolist() == [[1, 1, 2, 2, 3] + [4] * 5 + [0, 0]]
    moved = dataclasses.replace(ctx, original_seq_len=11)  # shares the memo, not its entries
    assert moved.to_packed_context(None).original_seq_len == 11
    assert ctx.to_packed_context(None).original_seq_len == 12
    # NeMo's non-CP forward builds left-padded maps, which no core represents: memoised too
    left = glm.Glm5NextPackedContext(T([[0, 0, 1, 1]], dtype=torch.int32))
    assert left.row_cu_seqlens(0) is left.row_cu_seqlens(-1) is left._cu_seqlens[0]
    left.doc_ids = T([[0, 1, 1, 1]], dtype=torch.int32)
    assert left.row_cu_seqlens(0)[1].tolist() == [0, 1, 4]
