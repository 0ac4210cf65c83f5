"""fcp's seed adapters against NeMo AutoModel 0.7.0's own cp modules, on Hypothesis inputs.

Every valid input gives the same result on both (every tensor by dtype, shape and values, every
batch key in order, every context field and property, the ``ShardLayout``) and the same in-place
batch mutation; an invalid one gives an error of the same kind, or fcp's documented stricter
``ValueError`` / ``TypeError`` (see ``tests.support.nemo_diff.check``). Single process, and on 2
and 4 real gloo ranks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

pytest.importorskip("nemo_automodel")

from fcp.models.glm5_next import cp as glm  # noqa: E402
from fcp.models.qwen3_8_flash_next import cp as qwen  # noqa: E402
from tests import _seed_rank_fns as fns  # noqa: E402
from tests.support.nemo_batches import glm_batches, qwen_batches  # noqa: E402
from tests.support.nemo_diff import (  # noqa: E402
    FakeMesh,
    batch_untouched,
    check,
    nemo_modules,
    outcome,
)

NEMO_GLM, NEMO_QWEN = nemo_modules()
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RANKS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _both(name: str, *args, nemo_mod=NEMO_GLM, ours=glm, **kwargs):
    return outcome(getattr(nemo_mod, name), *args, **kwargs), outcome(getattr(ours, name), *args,
                                                                       **kwargs)  # fmt: skip


# ------------------------------------------------------------------ GLM: document maps
def _int_tensors(draw, dims, values):
    shape = tuple(draw(st.integers(0, 4)) for _ in range(dims))
    data = torch.tensor(draw(st.lists(values, min_size=int(torch.Size(shape).numel()),
                                      max_size=int(torch.Size(shape).numel()))))  # fmt: skip
    return data.reshape(shape)


@st.composite
def seq_lens_inputs(draw):
    dims = draw(st.sampled_from([1, 2, 2, 3]))
    lens = _int_tensors(draw, dims, st.sampled_from([0, 1, 2, 3, 5, -1, -1000, -1000]))
    if draw(st.integers(0, 5)) == 0:
        lens = lens.to(draw(st.sampled_from([torch.float32, torch.bool])))
    return lens, draw(st.integers(0, 10)), draw(st.sampled_from([-1000, -1000, -1, 0]))


def _seq_lens_case(lens: torch.Tensor, seq_len: int, sentinel: int) -> str | None:
    if lens.is_floating_point() or lens.dtype == torch.bool:
        return "dtype"
    rows = lens if lens.dim() == 2 else lens.reshape(1, -1)
    if lens.dim() > 2 or sentinel >= 0:
        return "seq-lens"
    for row in rows.tolist():
        real = row[: next((i for i, v in enumerate(row) if v == sentinel), len(row))]
        if any(v < 0 for v in real) or any(v != sentinel for v in row[len(real):]):
            return "seq-lens"
        if sum(real) > seq_len:
            return "seq-lens"
    return None


@FAST
@given(data=seq_lens_inputs())
def test_doc_ids_from_seq_lens(data):
    lens, seq_len, sentinel = data
    n, f = _both("doc_ids_from_seq_lens", lens, seq_len, padding_value=sentinel)
    check(n, f, glm.__doc__, _seq_lens_case(lens, seq_len, sentinel), what="doc_ids_from_seq_lens")


@st.composite
def cu_inputs(draw):
    ends = sorted(draw(st.lists(st.integers(0, 10), min_size=0, max_size=4)))
    cu = [0, *ends] if draw(st.integers(0, 4)) else ends
    if draw(st.integers(0, 5)) == 0:  # out of order
        cu = cu[::-1]
    cu = cu + [draw(st.sampled_from([-1, -1000]))] * draw(st.integers(0, 2))
    if draw(st.integers(0, 6)) == 0 and len(cu) > 2:  # a negative entry inside
        cu.insert(1, -1)
    t = torch.tensor(cu, dtype=torch.long)
    shape = draw(st.sampled_from(["1d", "1d", "row", "rows"]))
    if shape == "row":
        t = t.unsqueeze(0)
    elif shape == "rows":
        t = torch.stack([t, t])
    if draw(st.integers(0, 6)) == 0:
        t = t.float()
    return t, draw(st.integers(0, 10))


def _cu_case(cu: torch.Tensor, seq_len: int) -> str | None:
    if cu.is_floating_point():
        return "dtype"
    if cu.dim() == 2 and cu.shape[0] != 1:
        return "cu-seqlens"
    vals = cu.reshape(-1).tolist()
    real = vals[: next((i for i, v in enumerate(vals) if v < 0), len(vals))]
    if any(v >= 0 for v in vals[len(real):]) or len(real) < 2 or real[0] != 0:
        return "cu-seqlens"
    if any(b < a for a, b in zip(real, real[1:])) or real[-1] > seq_len:
        return "cu-seqlens"
    return None


@FAST
@given(data=cu_inputs())
def test_doc_ids_from_cu_seqlens(data):
    cu, seq_len = data
    n, f = _both("doc_ids_from_cu_seqlens", cu, seq_len)
    check(n, f, glm.__doc__, _cu_case(cu, seq_len), what="doc_ids_from_cu_seqlens")


@FAST
@given(row=st.lists(st.integers(0, 3), max_size=8), form=st.sampled_from(["1d"] * 4 + ["2d",
       "float", "bool"]))  # fmt: skip
def test_segment_cu_seqlens(row, form):
    t = torch.tensor(row, dtype=torch.long)
    case = None
    if form == "2d":
        t, case = t.unsqueeze(0), "segment-row"
    elif form in ("float", "bool"):
        t, case = t.to(torch.float32 if form == "float" else torch.bool), "dtype"
    n, f = _both("segment_cu_seqlens", t)
    check(n, f, glm.__doc__, case, what="segment_cu_seqlens")


@FAST
@given(data=glm_batches(), pad_len=st.integers(-1, 3))
def test_batch_helpers(data, pad_len):
    _, kwargs = data
    batch = kwargs["batch"]
    check(*_both("_normalize_batch_axis", batch=batch), glm.__doc__, None, what="normalize")
    ids = batch["input_ids"]
    for t, value in ((ids if ids.dim() == 2 else ids[None], 7), (torch.ones(2, 3, 2), True)):
        check(*_both("_pad_sequence_dim", t, pad_len, value), glm.__doc__, None, what="pad")


@FAST
@given(data=st.one_of(glm_batches(), glm_batches(invalid=True)))
def test_global_doc_ids_from_batch(data):
    case, kwargs = data
    assume(kwargs)
    batch = dict(kwargs["batch"])
    NEMO_GLM._normalize_batch_axis(batch)
    seq_len = batch["input_ids"].shape[1]
    n, f = _both("_global_doc_ids_from_batch", batch, seq_len)
    check(n, f, glm.__doc__, case, what="_global_doc_ids_from_batch")


# ------------------------------------------------------------------ GLM: context
@st.composite
def glm_contexts(draw):
    rows, cp = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    local = draw(st.integers(1, 4))
    ids = torch.tensor([[draw(st.integers(0, 3)) for _ in range(cp * local)] for _ in range(rows)],
                       dtype=draw(st.sampled_from([torch.int32, torch.int64])))  # fmt: skip
    return ids, draw(st.integers(0, cp - 1)) * local, cp, draw(st.sampled_from([None, cp * local]))


@FAST
@given(data=glm_contexts(), row=st.integers(-4, 4))
def test_glm_context(data, row):
    ids, start, cp, original = data
    kw = dict(seq_start=start, cp_size=cp, original_seq_len=original)
    n, f = _both("Glm5NextPackedContext", ids, **kw)
    check(n, f, glm.__doc__, None, compare_args=False, what="Glm5NextPackedContext")
    theirs, ours = n.value, f.value
    rc = (outcome(theirs.row_cu_seqlens, row), outcome(ours.row_cu_seqlens, row))
    check(*rc, glm.__doc__, None, compare_args=False, what="row_cu_seqlens")
    if rc[0].error is None:
        assert rc[1].value is ours.row_cu_seqlens(row)  # memoised under the row as given
        assert row in ours._cu_seqlens and row in theirs._cu_seqlens
    # dataclasses.replace shares the memo and passes through __init__, as in NeMo
    for ctx in (theirs, ours):
        moved = dataclasses.replace(ctx, seq_start=ctx.seq_start)
        assert moved._cu_seqlens is ctx._cu_seqlens and moved == ctx
        with pytest.raises(TypeError, match="unhashable"):
            hash(ctx)


# ------------------------------------------------------------------ GLM: sharder
@FAST
@given(data=st.one_of(glm_batches(), glm_batches(invalid=True)))
def test_glm_sharder_single_process(data):
    case, kwargs = data
    assume(kwargs)
    n = outcome(NEMO_GLM.shard_batch_for_glm5_next_cp, None, None, **kwargs)
    f = outcome(glm.shard_batch_for_glm5_next_cp, None, None, **kwargs)
    check(n, f, glm.__doc__, case, what="shard_batch_for_glm5_next_cp")
    if f.error is not None:
        batch_untouched(kwargs["batch"], f.kwargs["batch"])
    else:
        assert f.value[1] is f.kwargs["batch"]  # mutated in place, returned


# ------------------------------------------------------------------ Qwen: helpers and context
@st.composite
def boundary_inputs(draw):
    lens = _int_tensors(draw, draw(st.sampled_from([1, 1, 2])),
                        st.sampled_from([0, 1, 2, 4, -1, -1000]))  # fmt: skip
    if draw(st.integers(0, 6)) == 0:
        lens = lens.to(draw(st.sampled_from([torch.float32, torch.bool])))
    total = draw(st.one_of(st.none(), st.integers(0, 12)))
    return lens, total, draw(st.sampled_from([-1000, -1000, -1]))


def _boundaries_case(lens: torch.Tensor, sentinel: int) -> str | None:
    several_rows = lens.dim() == 2 and lens.shape[0] > 1
    if lens.is_floating_point() or lens.dtype == torch.bool or several_rows:
        return "seq-lens"
    vals = lens.reshape(-1).tolist()
    real = vals[: next((i for i, v in enumerate(vals) if v == sentinel), len(vals))]
    return "seq-lens" if any(v != sentinel for v in vals[len(real):]) else None


@FAST
@given(data=boundary_inputs())
def test_packed_boundaries_from_seq_lens(data):
    lens, total, sentinel = data
    n, f = _both("packed_boundaries_from_seq_lens", lens, nemo_mod=NEMO_QWEN, ours=qwen,
                 total_tokens=total, sentinel=sentinel)  # fmt: skip
    check(n, f, qwen.__doc__, _boundaries_case(lens, sentinel), what="packed_boundaries")


@FAST
@given(rows=st.integers(1, 3), seq_len=st.integers(1, 6), data=st.data())
def test_validate_right_tail_mask_and_pad_right(rows, seq_len, data):
    ids = torch.zeros(rows, seq_len, dtype=torch.long)
    mask = torch.tensor(data.draw(st.lists(st.lists(st.sampled_from([0, 1, 1, 2]), min_size=seq_len,
                                                    max_size=seq_len), min_size=rows,
                                           max_size=rows)))  # fmt: skip
    if data.draw(st.booleans()):
        mask = mask[:, : max(1, seq_len - 1)]  # wrong shape: NotImplementedError in both
    mask = mask.to(data.draw(st.sampled_from([torch.int64, torch.float32, torch.bool])))
    n, f = _both("_validate_right_tail_mask", mask, ids, nemo_mod=NEMO_QWEN, ours=qwen)
    check(n, f, qwen.__doc__, None, what="_validate_right_tail_mask")
    length = data.draw(st.integers(seq_len - 1, seq_len + 3))
    n, f = _both("_pad_right", ids, length, data.draw(st.sampled_from([0, 5, True])),
                 nemo_mod=NEMO_QWEN, ours=qwen)  # fmt: skip
    check(n, f, qwen.__doc__, None, what="_pad_right")


@st.composite
def qwen_context_kwargs(draw, size: int = 1, rank: int = 0):
    """Context fields: valid, or with one defect (the case key, or None if NeMo rejects it too)."""
    rows = draw(st.integers(1, 2))
    local = draw(st.integers(1, 4))
    total = local * size
    packed = rows == 1 and draw(st.booleans())
    ids = torch.randint(0, 50, (rows, total)).to(draw(st.sampled_from([torch.int64, torch.int32])))
    kw = dict(group="group" if size > 1 else None, rank=rank, size=size, global_input_ids=ids,
              local_sequence_start=rank * local, local_sequence_length=local)  # fmt: skip
    if packed:
        ends = sorted(set(draw(st.lists(st.integers(1, total), min_size=1, max_size=4))))
        cu = torch.tensor([0, *ends], dtype=draw(st.sampled_from([torch.int64, torch.int32])))
        kw["global_cu_seqlens"] = cu
        kw["global_padding_mask"] = (torch.arange(total) >= ends[-1]).unsqueeze(0)
    else:
        n_valid = [draw(st.integers(0, total)) for _ in range(rows)]
        kw["global_padding_mask"] = torch.tensor([[i >= n for i in range(total)] for n in n_valid])
    defect = draw(st.sampled_from([None] * 6 + [
        "rank", "start", "length", "mask-dtype", "mask-shape", "ids-dtype", "cu-order", "cu-2d",
        "cu-list", "cu-float", "cu-rows", "interior-pad", "cu-mask", "size-int"]))
    case = None
    if defect == "rank":
        kw["rank"] = size
    elif defect == "start":
        kw["local_sequence_start"] = rank * local + 1
    elif defect == "length":
        kw["local_sequence_length"] = local + 1
    elif defect == "mask-dtype":
        kw["global_padding_mask"] = kw["global_padding_mask"].long()
    elif defect == "mask-shape":
        kw["global_padding_mask"] = kw["global_padding_mask"][:, :-1]
    elif defect == "ids-dtype":
        kw["global_input_ids"] = ids.float()
    elif defect == "cu-order" and total >= 3:
        kw["global_cu_seqlens"] = torch.tensor([0, total, 1])
        kw["global_input_ids"], kw["global_padding_mask"] = ids[:1], torch.zeros(1, total).bool()
    elif defect == "cu-2d":
        kw["global_cu_seqlens"] = torch.tensor([[0, total]])
        kw["global_input_ids"], kw["global_padding_mask"] = ids[:1], torch.zeros(1, total).bool()
    elif defect == "cu-list":
        kw["global_cu_seqlens"], case = [[0, total]], "non-tensor"
    elif defect == "cu-float":
        kw["global_cu_seqlens"], case = torch.tensor([0.0, total]), "context-cu"
        kw["global_input_ids"], kw["global_padding_mask"] = ids[:1], torch.zeros(1, total).bool()
    elif defect == "cu-rows" and rows == 2:
        kw["global_cu_seqlens"] = torch.tensor([0, total])
    elif defect == "interior-pad" and total >= 3 and not packed:
        mask = torch.zeros(rows, total, dtype=torch.bool)
        mask[:, 1] = True
        kw["global_padding_mask"], case = mask, "context-mask"
    elif defect == "cu-mask" and packed:
        kw["global_padding_mask"], case = ~kw["global_padding_mask"], "context-mask"
    elif defect == "size-int":
        kw["size"], case = float(size), "context-ints"
    return case, kw


@FAST
@given(data=qwen_context_kwargs())
def test_qwen_context_single_process(data):
    case, kwargs = data
    n, f = _both("Qwen3_8_FlashNextCPContext", nemo_mod=NEMO_QWEN, ours=qwen, **kwargs)
    check(n, f, qwen.__doc__, case, compare_args=False, what="Qwen3_8_FlashNextCPContext")
    if f.error is None:
        again = dataclasses.replace(f.value)
        assert again == f.value and again.packed_context.doc_ids.dtype == torch.int64


@FAST
@given(data=st.one_of(qwen_batches(), qwen_batches(invalid=True)))
def test_qwen_sharder_single_process(data):
    """NeMo needs a mesh object even at size one: a duck-typed one; fcp takes ``None``."""
    case, kwargs = data
    assume(kwargs)
    mesh = FakeMesh()
    n = outcome(NEMO_QWEN.shard_batch_for_qwen3_8_flash_next_cp, mesh, None, share=(mesh,),
                **kwargs)
    f = outcome(qwen.shard_batch_for_qwen3_8_flash_next_cp, None, None, **kwargs)
    # NeMo mutates the batch before some of its errors; fcp validates first.
    check(n, f, qwen.__doc__, case, compare_args=n.error is None, what="qwen sharder")
    if f.error is not None:
        batch_untouched(kwargs["batch"], f.kwargs["batch"])


@pytest.mark.parametrize("model,batches", [("glm", glm_batches), ("qwen", qwen_batches)])
@RANKS
@given(data=st.data(), world=st.sampled_from([2, 4]))
def test_sharder_on_ranks(rank_pool, model, batches, data, world):
    case, kwargs = data.draw(st.one_of(batches(), batches(invalid=True)))
    assume(kwargs)
    verdicts = rank_pool.run(fns.shard_diff, world, model, case, kwargs)
    assert len(set(verdicts)) == 1  # every rank reached the same verdict


@RANKS
@given(data=st.data(), world=st.sampled_from([2, 4]))
def test_qwen_context_on_ranks(rank_pool, data, world):
    case, kwargs = data.draw(qwen_context_kwargs(world))  # rank 0's fields; shifted per rank
    verdicts = rank_pool.run(fns.qwen_context_diff, world, case, kwargs)
    assert len(set(verdicts)) == 1


# ------------------------------------------------------------------ collectives on real ranks
@RANKS
@given(world=st.sampled_from([2, 4]), local=st.integers(1, 3), dim=st.sampled_from([1, -1, 0]),
       use_function=st.booleans())  # fmt: skip
def test_glm_all_gather_sequence(rank_pool, world, local, dim, use_function):
    shape = [2, world * local, 3]
    if dim == -1:
        shape = [2, 3, world * local]
    elif dim == 0:
        shape = [world * local, 3]
    full = torch.randint(-5, 6, shape).float()
    rank_pool.run(fns.glm_gather_diff, world, full, dim, use_function)


def test_glm_backward_anchor_and_fla_context(rank_pool):
    full = torch.randint(-5, 6, (2, 4, 3)).float()
    rank_pool.run(fns.glm_anchor_diff, 2, full)
    doc_ids = torch.tensor([[1] * 5 + [2] * 6 + [3] * 3 + [0] * 2, [1] * 3 + [4] * 13])
    rank_pool.run(fns.glm_fla_diff, 4, doc_ids, 4)
    rank_pool.run(fns.glm_fla_diff, 2, doc_ids, 2)


@RANKS
@given(world=st.sampled_from([2, 4]), k=st.integers(1, 2), compress=st.sampled_from([1, 2]),
       dim=st.sampled_from([1, -1]), differentiable=st.booleans())  # fmt: skip
def test_qwen_all_gather(rank_pool, world, k, compress, dim, differentiable):
    full = torch.randint(-5, 6, (2, world * 2 * k, 3)).float()
    rank_pool.run(fns.qwen_gather_diff, world, full, dim, differentiable, compress)


@RANKS
@given(world=st.sampled_from([2, 4]), k=st.integers(1, 2), history=st.integers(0, 9))
def test_qwen_left_halo(rank_pool, world, k, history):
    full = torch.randint(-5, 6, (2, world * 2 * k, 3)).float()
    rank_pool.run(fns.qwen_halo_diff, world, full, history)
