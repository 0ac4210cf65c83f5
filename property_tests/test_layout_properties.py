"""Hypothesis properties for fcp.layout.

Round trips between the metadata forms (seq_lens, cu_seqlens, doc-id maps,
boundaries) against tiny Python-loop references, and a strategy of broken
metadata that every entry point must reject with ValueError.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fcp import layout
from tests.support.packing import ref_doc_ids_row, ref_positions_row, ref_segments

S = layout.SEQ_LENS_SENTINEL
ROUND_TRIP = settings(max_examples=80, deadline=None)
BROKEN = settings(max_examples=20, deadline=None)  # per kind of broken input


# ----------------------------------------------------------------- strategies

# Small lengths make single-token and zero-length documents common.
doc_lengths = st.lists(
    st.one_of(st.just(0), st.just(1), st.integers(0, 9)), min_size=0, max_size=8
)


@st.composite
def packed_row(draw):
    """(real lengths incl. zero-length docs, seq_len); pad tail may be empty,
    so a single length can cover the whole row."""
    lengths = draw(doc_lengths)
    pad = draw(st.one_of(st.just(0), st.integers(0, 6)))
    return lengths, sum(lengths) + pad


@st.composite
def packed_batch(draw):
    """([batch][width] lengths with trailing sentinels, seq_len)."""
    rows = draw(st.lists(doc_lengths, min_size=1, max_size=4))
    width = max(len(r) for r in rows) + draw(st.integers(0, 2))
    seq_len = max(sum(r) for r in rows) + draw(st.integers(0, 5))
    return [r + [S] * (width - len(r)) for r in rows], seq_len


# ----------------------------------------------------------------- round trips


@ROUND_TRIP
@given(packed_batch())
def test_seq_lens_to_ids_matches_reference_and_round_trips(batch):
    lens, seq_len = batch
    ids = layout.doc_ids_from_seq_lens(torch.tensor(lens, dtype=torch.int64), seq_len)
    real = [[n for n in r if n != S] for r in lens]
    assert ids.tolist() == [ref_doc_ids_row(r, seq_len) for r in real]
    layout.validate_doc_ids(ids)
    assert layout.lengths_from_doc_ids(ids).tolist() == [sum(r) for r in real]
    for b, row in enumerate(ids):
        bounds = layout.segment_cu_seqlens(row)
        assert bounds.tolist() == ref_segments(row.tolist())
        # Segments of a padded row include the pad tail; as cu_seqlens they
        # would make the pad a document, so rebuild from the real ones only.
        real_bounds = bounds[bounds <= sum(real[b])]
        again = layout.doc_ids_from_cu_seqlens(real_bounds, seq_len)
        assert torch.equal(again[0], row)


@ROUND_TRIP
@given(packed_row())
def test_cu_seqlens_to_ids_to_boundaries(row):
    lengths, seq_len = row
    cu = list(itertools.accumulate(lengths, initial=0))
    ids = layout.doc_ids_from_cu_seqlens(torch.tensor(cu), seq_len)
    assert ids.tolist() == [ref_doc_ids_row(lengths, seq_len)]
    bounds = layout.segment_cu_seqlens(ids[0]).tolist()
    # Zero-length docs leave no boundary; a pad tail adds one at seq_len.
    expected = sorted(set(cu) | ({seq_len} if seq_len > 0 else set()))
    assert bounds == expected


@ROUND_TRIP
@given(packed_row(), st.booleans())
def test_packed_boundaries_equal_segments_of_doc_ids(row, trailing_sentinels):
    lengths, seq_len = row
    lens = lengths + ([S, S] if trailing_sentinels else [])
    seq_lens = torch.tensor([lens], dtype=torch.int64)
    bounds = layout.packed_boundaries_from_seq_lens(seq_lens, seq_len)
    ids = layout.doc_ids_from_seq_lens(seq_lens, seq_len)
    assert bounds.tolist() == layout.segment_cu_seqlens(ids).tolist()
    assert bounds.tolist() == ref_segments(ref_doc_ids_row(lengths, seq_len))
    exact = layout.packed_boundaries_from_seq_lens(seq_lens[0])
    assert exact.tolist() == ref_segments(ref_doc_ids_row(lengths, sum(lengths)))


@ROUND_TRIP
@given(packed_batch())
def test_positions_match_loop_reference(batch):
    lens, seq_len = batch
    ids = layout.doc_ids_from_seq_lens(torch.tensor(lens, dtype=torch.int64), seq_len)
    expected = [ref_positions_row(r) for r in ids.tolist()]
    assert layout.position_ids_from_doc_ids(ids).tolist() == expected


@ROUND_TRIP
@given(packed_row(), st.integers(0, 8), st.data())
def test_zero_length_docs_shift_nothing(row, n_zeros, data):
    lengths, seq_len = row
    with_zeros = list(lengths)
    for _ in range(n_zeros):
        with_zeros.insert(data.draw(st.integers(0, len(with_zeros))), 0)
    a = layout.doc_ids_from_seq_lens(torch.tensor(lengths, dtype=torch.int64), seq_len)
    b = layout.doc_ids_from_seq_lens(torch.tensor(with_zeros, dtype=torch.int64), seq_len)
    assert torch.equal(a, b)


@ROUND_TRIP
@given(packed_batch())
def test_right_tail_mask_of_ids_is_accepted(batch):
    lens, seq_len = batch
    ids = layout.doc_ids_from_seq_lens(torch.tensor(lens, dtype=torch.int64), seq_len)
    mask = (ids != 0).to(torch.int32)
    assert torch.equal(layout.validate_right_tail_mask(mask, like=ids), ids != 0)


# ------------------------------------------------------------- broken metadata


def _seq_lens_row(draw, min_size=1):
    return draw(st.lists(st.integers(0, 6), min_size=min_size, max_size=6))


BROKEN_KINDS = [
    "negative_length",
    "sentinel_then_real",
    "sum_past_seq_len",
    "cu_non_monotone",
    "cu_not_from_zero",
    "cu_past_seq_len",
    "float_dtype",
    "bool_dtype",
    "bad_rank",
    "total_tokens_short",
    "boundaries_batch",
    "mask_non_binary",
    "mask_hole",
    "ids_bad_step",
    "ids_real_after_pad",
]


@st.composite
def broken(draw, kind):
    """(callable, regex) for one class of bad input."""
    row = _seq_lens_row(draw)
    seq_len = sum(row) + draw(st.integers(0, 4))
    j = draw(st.integers(0, len(row) - 1))
    if kind == "negative_length":
        row[j] = draw(st.one_of(st.integers(-999, -1), st.integers(-5000, -1001)))
        return (lambda: layout.doc_ids_from_seq_lens(torch.tensor([row]), seq_len)), r"is negative"
    if kind == "sentinel_then_real":
        bad = row[:j] + [S] * draw(st.integers(1, 3)) + [draw(st.integers(0, 3))]
        fn = draw(st.sampled_from([layout.doc_ids_from_seq_lens,
                                   layout.packed_boundaries_from_seq_lens]))
        return (lambda: fn(torch.tensor(bad), seq_len + 3)), r"follows a sentinel"
    if kind == "sum_past_seq_len":
        short = sum(row) - draw(st.integers(1, 3))
        if short < 0:
            row, short = row + [2], sum(row) + 1
        return (lambda: layout.doc_ids_from_seq_lens(torch.tensor(row), short)), \
            r"more than seq_len"
    if kind == "cu_non_monotone":
        cu = list(itertools.accumulate(row + [1], initial=0))  # last step is strictly positive
        k = len(cu) - 1
        cu[k - 1], cu[k] = cu[k], cu[k - 1]
        return (lambda: layout.doc_ids_from_cu_seqlens(torch.tensor(cu), seq_len + 1)), \
            r"non-decreasing"
    if kind == "cu_not_from_zero":
        cu = [draw(st.integers(1, 3))] + [x + 3 for x in itertools.accumulate(row)]
        return (lambda: layout.doc_ids_from_cu_seqlens(torch.tensor(cu), seq_len + 3)), \
            r"must start at 0"
    if kind == "cu_past_seq_len":
        cu = list(itertools.accumulate(row, initial=0))
        cu[-1] += 1
        short = max(0, cu[-1] - draw(st.integers(1, 3)))
        return (lambda: layout.doc_ids_from_cu_seqlens(torch.tensor(cu), short)), r"exceeds seq_len"
    if kind in ("float_dtype", "bool_dtype"):
        floats = st.sampled_from([torch.float32, torch.float64, torch.bfloat16])
        dtype = draw(floats) if kind == "float_dtype" else torch.bool
        fn = draw(st.sampled_from([layout.doc_ids_from_seq_lens, layout.doc_ids_from_cu_seqlens,
                                   layout.packed_boundaries_from_seq_lens]))
        t = torch.tensor([0] + row).to(dtype)
        return (lambda: fn(t, seq_len)), r"must be an integer dtype"
    if kind == "bad_rank":
        shape = draw(st.sampled_from([(), (1, 1, len(row))]))
        t = torch.tensor(row).reshape(shape) if shape else torch.tensor(row[0])
        fn = draw(st.sampled_from([layout.doc_ids_from_seq_lens, layout.doc_ids_from_cu_seqlens]))
        return (lambda: fn(t, seq_len)), r"has shape"
    if kind == "total_tokens_short":
        row = row + [1]
        t = torch.tensor(row)
        return (lambda: layout.packed_boundaries_from_seq_lens(t, sum(row) - 1)), r"is smaller than"
    if kind == "boundaries_batch":
        t = torch.tensor([row, row])
        return (lambda: layout.packed_boundaries_from_seq_lens(t)), r"has batch 2"
    if kind in ("mask_non_binary", "mask_hole"):
        valid = [1] * (j + 1) + [0] * (len(row) - j + 1)  # >= 2 zeros, so a hole stays a hole
        if kind == "mask_non_binary":
            valid[j] = draw(st.sampled_from([2, -1, 0.5, 3.0]))
            msg = r"is not binary"
        else:
            valid[-1] = 1
            msg = r"follows a 0"
        t = torch.tensor([valid])
        return (lambda: layout.validate_right_tail_mask(t)), msg
    ids = ref_doc_ids_row(row + [1], seq_len + 3)  # >= 1 real token, >= 2 pads
    if kind == "ids_bad_step":
        k = draw(st.integers(0, sum(row)))  # index of a real token
        ids[k] = (ids[k - 1] if k > 0 else 0) + draw(st.integers(2, 4))  # jump of >= +2
        return (lambda: layout.validate_doc_ids(torch.tensor([ids]))), r"doc_ids\[0, \d+\]"
    assert kind == "ids_real_after_pad", kind
    ids[-1] = draw(st.integers(1, 4))  # real id after the pad tail started
    return (lambda: layout.validate_doc_ids(torch.tensor([ids]))), \
        r"doc_ids\[0, \d+\] = \d+ follows"


@pytest.mark.parametrize("kind", BROKEN_KINDS)
@BROKEN
@given(data=st.data())
def test_broken_metadata_is_rejected(kind, data):
    fn, match = data.draw(broken(kind))
    with pytest.raises(ValueError, match=match):
        fn()
