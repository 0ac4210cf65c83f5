"""Unit tests for fcp.layout.

Expected values are written out by hand or computed by the tiny Python-loop
references below, never by the code under test.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from fcp.checks import ArgumentTypeError
from fcp.groups import GroupInfo, mesh_size, resolve_group
from fcp.layout import (
    PAD_DOC_ID,
    SEQ_LENS_SENTINEL,
    doc_ids_from_cu_seqlens,
    doc_ids_from_seq_lens,
    document_starts,
    lengths_from_doc_ids,
    packed_boundaries_from_seq_lens,
    position_ids_from_doc_ids,
    segment_cu_seqlens,
    validate_doc_ids,
    validate_right_tail_mask,
)
from tests.support.packing import ref_doc_ids_row, ref_positions_row

T = torch.tensor
S = SEQ_LENS_SENTINEL


def random_packing(gen: torch.Generator, batch: int, seq_len: int) -> torch.Tensor:
    """Random valid doc-id map built with a Python loop (independent of fcp)."""
    rows = []
    for _ in range(batch):
        real = int(torch.randint(0, seq_len + 1, (1,), generator=gen))
        lengths, left = [], real
        while left > 0:
            n = int(torch.randint(1, left + 1, (1,), generator=gen))
            lengths.append(n)
            left -= n
        rows.append(ref_doc_ids_row(lengths, seq_len))
    return T(rows, dtype=torch.int64)


# ----------------------------------------------------- doc_ids_from_cu_seqlens


def test_cu_seqlens_worked_example():
    assert doc_ids_from_cu_seqlens(T([0, 3, 5]), 7).tolist() == [[1, 1, 1, 2, 2, 0, 0]]


def test_cu_seqlens_accepts_batch_one_and_int32():
    out = doc_ids_from_cu_seqlens(T([[0, 2, 4]], dtype=torch.int32), 4)
    assert out.dtype == torch.int64
    assert out.tolist() == [[1, 1, 2, 2]]


def test_cu_seqlens_zero_length_docs_shift_nothing():
    expected = [[1, 1, 1, 2, 2, 0, 0]]
    assert doc_ids_from_cu_seqlens(T([0, 0, 3, 3, 5, 5]), 7).tolist() == expected


def test_cu_seqlens_no_docs_and_empty_row():
    assert doc_ids_from_cu_seqlens(T([0]), 3).tolist() == [[0, 0, 0]]
    assert doc_ids_from_cu_seqlens(T([0]), 0).shape == (1, 0)


def test_cu_seqlens_whole_row_single_doc():
    assert doc_ids_from_cu_seqlens(T([0, 4]), 4).tolist() == [[1, 1, 1, 1]]


@pytest.mark.parametrize(
    "cu, seq_len, match",
    [
        (T([1, 3]), 5, r"cu_seqlens\[0\] = 1; must start at 0"),
        (T([0, 4, 3]), 5, r"cu_seqlens\[2\] = 3 is less than cu_seqlens\[1\] = 4"),
        (T([0, 3, 6]), 5, r"cu_seqlens\[-1\] = 6 exceeds seq_len = 5"),
        (T([0.0, 3.0]), 5, r"cu_seqlens must be an integer dtype, got dtype torch.float32"),
        (T([0, 1]).bool(), 5, r"cu_seqlens must be an integer dtype, got dtype torch.bool"),
        (T(0), 5, r"cu_seqlens has shape \(\)"),
        (T([[0, 1], [0, 2]]), 5, r"cu_seqlens has shape \(2, 2\)"),
        (T([], dtype=torch.int64), 5, r"cu_seqlens has shape \(0,\)"),
        ([0, 3], 5, r"cu_seqlens must be a torch.Tensor"),
        (T([0, 3]), -1, r"seq_len=-1 must be >= 0"),
    ],
)
def test_cu_seqlens_rejects(cu, seq_len, match):
    with pytest.raises(ValueError, match=match):
        doc_ids_from_cu_seqlens(cu, seq_len)


# ------------------------------------------------------- doc_ids_from_seq_lens


def test_seq_lens_worked_example():
    out = doc_ids_from_seq_lens(T([[2, 1, S], [4, S, S]]), 5)
    assert out.dtype == torch.int64
    assert out.tolist() == [[1, 1, 2, 0, 0], [1, 1, 1, 1, 0]]


def test_seq_lens_rank_one_is_batch_one():
    assert doc_ids_from_seq_lens(T([1, 1, 1]), 4).tolist() == [[1, 2, 3, 0]]


def test_seq_lens_zero_length_docs_shift_nothing():
    lens = [0, 2, 0, 0, 3, 1, 0]
    out = doc_ids_from_seq_lens(T([lens]), 8)
    assert out.tolist() == [ref_doc_ids_row(lens, 8)]
    assert out.tolist() == doc_ids_from_seq_lens(T([[2, 3, 1]]), 8).tolist()


def test_seq_lens_custom_padding_value_and_empty_shapes():
    assert doc_ids_from_seq_lens(T([[3, -1, -1]]), 3, padding_value=-1).tolist() == [[1, 1, 1]]
    assert doc_ids_from_seq_lens(torch.zeros(2, 0, dtype=torch.int64), 2).tolist() == [[0, 0], [0, 0]]
    assert doc_ids_from_seq_lens(T([[S, S]]), 0).shape == (1, 0)


@pytest.mark.parametrize(
    "lens, seq_len, kwargs, match",
    [
        (T([[1, 2, -5]]), 9, {}, r"seq_lens\[0, 2\] = -5 is negative \(only the sentinel -1000"),
        (T([3, -1]), 9, {}, r"seq_lens\[1\] = -1 is negative"),
        (T([[1, S, 2]]), 9, {}, r"seq_lens\[0, 2\] = 2 follows a sentinel \(-1000\)"),
        (T([[1, S, 0]]), 9, {}, r"seq_lens\[0, 2\] = 0 follows a sentinel"),
        (T([[1, 1], [5, 5]]), 9, {}, r"seq_lens row 1 sums to 10 tokens, more than seq_len = 9"),
        (T([[2**62, 2**62]]), 9, {}, r"seq_lens row 0 sums to 9223372036854775808 tokens"),
        (T([1]), True, {}, r"seq_len must be an int, got True \(bool\)"),
        (T([[1.0, 2.0]]), 9, {}, r"seq_lens must be an integer dtype, got dtype torch.float32"),
        (T([[True]]), 9, {}, r"seq_lens must be an integer dtype, got dtype torch.bool"),
        (T(3), 9, {}, r"seq_lens has shape \(\)"),
        (T([[[1]]]), 9, {}, r"seq_lens has shape \(1, 1, 1\)"),
        (T([1]), 9, {"padding_value": 0}, r"padding_value = 0 must be negative"),
        (T([1]), 2.5, {}, r"seq_len must be an int, got 2.5 \(float\)"),
    ],
)
def test_seq_lens_rejects(lens, seq_len, kwargs, match):
    with pytest.raises(ValueError, match=match):
        doc_ids_from_seq_lens(lens, seq_len, **kwargs)


# ---------------------------------------------------------- segment_cu_seqlens


def test_segment_cu_seqlens_worked_examples():
    assert segment_cu_seqlens(T([1, 1, 1, 2, 2, 0, 0])).tolist() == [0, 3, 5, 7]
    assert segment_cu_seqlens(T([[1, 2, 3]])).tolist() == [0, 1, 2, 3]
    assert segment_cu_seqlens(T([0, 0])).tolist() == [0, 2]
    assert segment_cu_seqlens(T([1, 1, 1, 1])).tolist() == [0, 4]
    out = segment_cu_seqlens(T([], dtype=torch.int64))
    assert out.dtype == torch.int64 and out.tolist() == [0]


@pytest.mark.parametrize(
    "row, match",
    [
        (T([[1, 1], [1, 1]]), r"doc_ids_row has shape \(2, 2\)"),
        (T([1.0, 2.0]), r"doc_ids_row must be an integer dtype, got dtype torch.float32"),
    ],
)
def test_segment_cu_seqlens_rejects(row, match):
    with pytest.raises(ValueError, match=match):
        segment_cu_seqlens(row)


# ---------------------------------------------- packed_boundaries_from_seq_lens


def test_packed_boundaries_worked_examples():
    assert packed_boundaries_from_seq_lens(T([3, 0, 2, S]), 8).tolist() == [0, 3, 5, 8]
    assert packed_boundaries_from_seq_lens(T([[3, 2]])).tolist() == [0, 3, 5]
    # exactly packed: no empty pad segment
    assert packed_boundaries_from_seq_lens(T([3, 2]), 5).tolist() == [0, 3, 5]
    assert packed_boundaries_from_seq_lens(T([S, S]), 4).tolist() == [0, 4]
    assert packed_boundaries_from_seq_lens(T([0]), 0).tolist() == [0]


def test_packed_boundaries_match_segments_of_doc_ids():
    lens = T([[4, 0, 1, 1, 6, S, S]])
    ids = doc_ids_from_seq_lens(lens, 16)
    expected = [0, 4, 5, 6, 12, 16]
    assert segment_cu_seqlens(ids).tolist() == expected
    assert packed_boundaries_from_seq_lens(lens, 16).tolist() == expected


@pytest.mark.parametrize(
    "lens, total, match",
    [
        (T([3, 2]), 4, r"total_tokens = 4 is smaller than the packed length 5"),
        (T([[1], [2]]), None, r"seq_lens has batch 2"),
        (T([3, -2]), None, r"seq_lens\[1\] = -2 is negative"),
        (T([S, 2]), None, r"seq_lens\[1\] = 2 follows a sentinel"),
        (T([1.5]), None, r"seq_lens must be an integer dtype, got dtype torch.float32"),
        (T([3]), -1, r"total_tokens=-1 must be >= 0"),
    ],
)
def test_packed_boundaries_rejects(lens, total, match):
    with pytest.raises(ValueError, match=match):
        packed_boundaries_from_seq_lens(lens, total)


# ------------------------------------------------------- compile-safe helpers


def test_document_starts_worked_example():
    assert document_starts(T([[1, 1, 2, 0, 0]])).tolist() == [[True, False, True, True, False]]
    assert document_starts(T([[0, 0]])).tolist() == [[True, False]]
    assert document_starts(torch.zeros(2, 0, dtype=torch.int64)).shape == (2, 0)


def test_position_ids_worked_example_and_pad_restart():
    ids = T([[1, 1, 1, 2, 2, 0, 0], [1, 2, 3, 4, 5, 6, 7]])
    out = position_ids_from_doc_ids(ids)
    assert out.dtype == torch.int64
    assert out.tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 0, 0, 0, 0, 0, 0]]
    assert position_ids_from_doc_ids(T([[0, 0, 0]])).tolist() == [[0, 1, 2]]


def test_position_ids_random_vs_loop_reference():
    gen = torch.Generator().manual_seed(0)
    ids = random_packing(gen, 6, 33)
    expected = [ref_positions_row(r) for r in ids.tolist()]
    assert position_ids_from_doc_ids(ids).tolist() == expected


def test_lengths_from_doc_ids():
    out = lengths_from_doc_ids(T([[1, 1, 2, 0], [1, 1, 1, 1], [0, 0, 0, 0]]))
    assert out.dtype == torch.int64 and out.tolist() == [3, 4, 0]


def test_position_ids_compiles_once_for_50_packings():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(position_ids_from_doc_ids, fullgraph=True, dynamic=False, backend=counter)
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        ids = random_packing(gen, 2, 48)
        assert torch.equal(compiled(ids), position_ids_from_doc_ids(ids))
    assert counter.frame_count == 1


def test_other_helpers_compile_fullgraph():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def f(ids):
        return document_starts(ids), lengths_from_doc_ids(ids)

    compiled = torch.compile(f, fullgraph=True, dynamic=False, backend=counter)
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        ids = random_packing(gen, 2, 16)
        for got, want in zip(compiled(ids), f(ids)):
            assert torch.equal(got, want)
    assert counter.frame_count == 1


# ------------------------------------------------------------- validate_doc_ids


def test_validate_doc_ids_accepts_valid_maps():
    assert validate_doc_ids(T([[1, 1, 2, 3, 3, 0], [0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6]])) is None
    assert validate_doc_ids(torch.zeros(0, 5, dtype=torch.int64)) is None


@pytest.mark.parametrize(
    "ids, match",
    [
        (T([[1, 1, 3, 0]]), r"doc_ids\[0, 2\] = 3 follows 1 \(doc_ids\[0, 1\]\); ids must step by \+0 or \+1"),
        (T([[1, 2, 1]]), r"doc_ids\[0, 2\] = 1 follows 2"),
        (T([[1, 1], [2, 2]]), r"doc_ids\[1, 0\] = 2 starts the row; a row's first real id must be 1"),
        (T([[1, 0, 2]]), r"doc_ids\[0, 2\] = 2 follows pad"),
        (T([[0, 1]]), r"doc_ids\[0, 1\] = 1 follows pad"),
        (T([[1, -1]]), r"doc_ids\[0, 1\] = -1 is negative"),
        (T([[1, 1]], dtype=torch.int32), r"validate_doc_ids: doc_ids must have dtype torch.int64, got torch.int32"),
        (T([1, 1]), r"doc_ids has shape \(2,\); expected \[batch, sequence\]"),
    ],
)
def test_validate_doc_ids_rejects(ids, match):
    with pytest.raises(ValueError, match=match):
        validate_doc_ids(ids)


def test_validate_doc_ids_reports_first_violation_and_custom_name():
    ids = T([[1, 1, 1, 1], [1, 3, 0, 5], [2, 2, 2, 2]])
    with pytest.raises(ValueError, match=r"^my_ids\[1, 1\] = 3 follows 1"):
        validate_doc_ids(ids, name="my_ids")


# ----------------------------------------------------- validate_right_tail_mask


@pytest.mark.parametrize(
    "mask",
    [T([[1, 1, 0], [0, 0, 0]]), T([[True, True, False], [False, False, False]]), T([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])],
)
def test_validate_right_tail_mask_normalises(mask):
    out = validate_right_tail_mask(mask, like=torch.zeros(2, 3, dtype=torch.int64))
    assert out.dtype == torch.bool
    assert out.tolist() == [[True, True, False], [False, False, False]]


def test_validate_right_tail_mask_like_may_have_hidden_dim():
    out = validate_right_tail_mask(T([[1, 0]]), like=torch.zeros(1, 2, 8))
    assert out.tolist() == [[True, False]]


@pytest.mark.parametrize(
    "mask, like, match",
    [
        (T([[1, 2, 0]]), None, r"attention_mask\[0, 1\] = 2 is not binary"),
        (T([[1.0, 0.5]]), None, r"attention_mask\[0, 1\] = 0.5 is not binary"),
        (T([[1.0, float("nan")]]), None, r"attention_mask\[0, 1\] = nan is not binary"),
        (T([[1, 1, 0], [1, 0, 1]]), None, r"attention_mask\[1, 2\] = 1 follows a 0"),
        (T([[False, True]]), None, r"attention_mask\[0, 1\] = 1 follows a 0"),
        (T([1, 1, 0]), None, r"attention_mask has shape \(3,\)"),
        (T([[1, 1, 0]]), torch.zeros(1, 4), r"attention_mask has shape \(1, 3\) but .* \(1, 4\)"),
        (T([[1, 1, 0]]), torch.zeros(3), r"attention_mask has shape \(1, 3\) but .* \(3,\)"),
    ],
)
def test_validate_right_tail_mask_rejects(mask, like, match):
    with pytest.raises(ValueError, match=match):
        validate_right_tail_mask(mask, like=like)


def test_validate_right_tail_mask_custom_name():
    with pytest.raises(ValueError, match=r"^pad_mask\[0, 2\] = 1 follows a 0"):
        validate_right_tail_mask(T([[1, 0, 1]]), name="pad_mask")


def test_pad_doc_id_is_zero():
    assert PAD_DOC_ID == 0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: validate_doc_ids(T([[1, 1]], dtype=torch.int32)),
         r"^validate_doc_ids: doc_ids must have dtype torch.int64, got torch.int32$"),
        (lambda: validate_doc_ids([[1, 1]]), r"^validate_doc_ids: doc_ids must be a torch.Tensor"),
        (lambda: validate_right_tail_mask(T([[1, 0]], dtype=torch.complex64)),
         r"^validate_right_tail_mask: attention_mask must be bool, int or float, got dtype"),
        (lambda: doc_ids_from_cu_seqlens(T([0, 3]), 2.5),
         r"^doc_ids_from_cu_seqlens: seq_len must be an int, got 2.5 \(float\)$"),
        (lambda: doc_ids_from_seq_lens(T([[1.0]]), 4),
         r"^doc_ids_from_seq_lens: seq_lens must be an integer dtype, got dtype torch.float32$"),
        (lambda: segment_cu_seqlens([1, 1]), r"^segment_cu_seqlens: doc_ids_row must be a torch"),
    ],
)
def test_wrong_types_and_dtypes_are_argument_type_errors(call, match):
    # the rule of fcp.checks: a TypeError that `except ValueError` catches too, naming the function
    with pytest.raises(ArgumentTypeError, match=match) as info:
        call()
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_groups_follow_the_checks_rule():
    with pytest.raises(ArgumentTypeError, match=r"^resolve_group: group must be None, a torch"):
        resolve_group("world")
    with pytest.raises(ArgumentTypeError, match=r"^shard_batch: cp_mesh must be None"):
        resolve_group(3, name="cp_mesh", fn="shard_batch")
    with pytest.raises(ArgumentTypeError, match=r"^mesh_size: mesh must be None"):
        mesh_size(object())
    assert resolve_group(None) == GroupInfo(None, 1, 0)
    assert resolve_group(GroupInfo(None, 1, 0)) == GroupInfo(None, 1, 0)
    assert mesh_size(None) == 1 and mesh_size(GroupInfo(object(), 4, 2)) == 4
