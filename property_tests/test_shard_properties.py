"""Sharding properties on real gloo groups: shard then gather is the identity (but for the targets
and loss mask of tokens outside every document, which never train), every token lands on exactly
one rank, next-token targets built from unshifted labels are each document's next token wherever
the shard boundaries fall, any of the packing formats (doc_ids, transformers' position_ids /
cu_seq_lens_q / seq_idx) gives the same context and local batch, and a bad batch fails
identically on every rank (so no rank is left waiting in a collective)."""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings, strategies as st

from fcp.layout import doc_ids_from_seq_lens, position_ids_from_doc_ids
from tests import _shard_rank_fns as fns

SETTINGS = settings(max_examples=30, deadline=None)


@st.composite
def packed_batches(draw):
    """Rows of packed documents (single-token docs, pad tails, zero-length slots) as seq_lens."""
    rows = draw(st.integers(1, 2))
    seq_len = draw(st.integers(1, 23))
    lens = []
    for _ in range(rows):
        row, used = [], 0
        for _ in range(draw(st.integers(0, 5))):
            n = draw(st.integers(0, seq_len - used)) if used < seq_len else 0
            row.append(n)
            used += n
        lens.append(row)
    width = max(1, max(len(r) for r in lens))
    seq_lens = torch.full((rows, width), -1000, dtype=torch.long)
    for i, r in enumerate(lens):
        seq_lens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    ids = torch.randint(1, 250, (rows, seq_len), generator=torch.Generator().manual_seed(seq_len))
    batch = {"input_ids": ids, "seq_lens": seq_lens, "loss_mask": (ids % 3 != 0).long()}
    # transformers' unshifted labels, the next-token targets themselves, or both
    form = draw(st.sampled_from(["labels", "shift_labels", "both"]))
    if form != "shift_labels":
        batch["labels"] = ids
    if form != "labels":
        batch["shift_labels"] = _next_tokens(ids, doc_ids_from_seq_lens(seq_lens, seq_len))
    if draw(st.booleans()):  # given positions: restarting at every document, from 7
        batch["position_ids"] = position_ids_from_doc_ids(
            doc_ids_from_seq_lens(seq_lens, seq_len)) + 7  # fmt: skip
    return batch, lens


def _next_tokens(ids: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """The reference next-token targets, by a plain loop: the next token of the same document,
    else -100 (padding included)."""
    out = torch.full_like(ids, -100)
    rows, n = ids.shape
    for r in range(rows):
        for t in range(n - 1):
            if doc_ids[r, t] != 0 and doc_ids[r, t + 1] == doc_ids[r, t]:
                out[r, t] = ids[r, t + 1]
    return out


@SETTINGS
@given(data=packed_batches(), world=st.integers(1, 4), pad_multiple=st.sampled_from([1, 4]),
       use_mesh=st.booleans())
def test_shard_then_gather_is_identity(rank_pool, data, world, pad_multiple, use_mesh):
    batch, lens = data
    before = copy.deepcopy(batch)
    results = rank_pool.run(fns.shard_and_gather, world, batch, pad_multiple, use_mesh)
    rows, seq_len = batch["input_ids"].shape
    padded = -(-seq_len // (world * pad_multiple)) * world * pad_multiple
    local_len = padded // world

    # Reference doc map from the lengths, by a plain loop (zero-length slots take no id).
    ref_doc = torch.zeros(rows, padded, dtype=torch.long)
    for r, row in enumerate(lens):
        pos, doc = 0, 0
        for n in row:
            if n:
                doc += 1
                ref_doc[r, pos : pos + n] = doc
                pos += n

    seen = torch.zeros(rows, padded, dtype=torch.long)
    for rank, res in enumerate(results):
        start, end = res["interval"]
        assert (start, end) == (rank * local_len, (rank + 1) * local_len)
        assert res["cp"] == (world, rank, local_len, seq_len)
        assert torch.equal(res["doc_ids"], ref_doc)
        assert torch.equal(res["local_doc_ids"], ref_doc[:, start:end])
        seen[:, start:end] += 1
        local = res["local"]
        assert "seq_lens" not in local and "labels" not in local  # consumed
        # local slices are the global tensors' slices, padded by meaning
        ids = torch.cat([batch["input_ids"], torch.zeros(rows, padded - seq_len, dtype=torch.long)], 1)
        targets = _next_tokens(ids, ref_doc)  # whole rows: shard boundaries lose nothing
        assert torch.equal(local["input_ids"], ids[:, start:end])
        assert torch.equal(local["shift_labels"], targets[:, start:end])
        assert not local["loss_mask"][ref_doc[:, start:end] == 0].any()
        g = res["gathered"]
        outside = ref_doc[:, :seq_len] == 0
        for key in ("input_ids", "shift_labels", "loss_mask", "position_ids"):
            if key in batch:
                fill = {"shift_labels": -100, "loss_mask": 0}.get(key)
                want = batch[key] if fill is None else batch[key].masked_fill(outside, fill)
                assert torch.equal(g[key], want), key
            assert g[key].shape == (rows, seq_len)
            assert g[key + "@padded"].shape == (rows, padded)
        if "position_ids" not in batch:  # derived: restart at each document
            for r in range(rows):
                for t in range(seq_len):
                    d = ref_doc[r, t]
                    first = int((ref_doc[r, : t + 1] != d).nonzero().max()) + 1 if t and (ref_doc[r, :t] != d).any() else 0
                    assert g["position_ids"][r, t] == t - first
        assert all(torch.equal(res["input_unchanged"][k], before[k]) for k in before)
    assert bool((seen == 1).all())  # every token on exactly one rank
    assert all(torch.equal(batch[k], before[k]) for k in before)  # never mutated


@st.composite
def broken_batches(draw):
    seq_len = draw(st.integers(2, 12))
    ids = torch.ones(1, seq_len, dtype=torch.long)
    kind = draw(st.sampled_from(["neg", "sentinel", "overflow", "cu_order", "mask_hole",
                                 "mask_values", "both", "neither", "cu_rows", "positions_run_on",
                                 "seq_idx_vs_cu", "labels_vs_shift", "unknown_row_tensor",
                                 "max_length"]))  # fmt: skip
    cut = draw(st.integers(1, seq_len - 1))  # two documents: [0, cut) and [cut, seq_len)
    cu = torch.tensor([0, cut, seq_len])
    if kind == "positions_run_on":  # one arange over two documents
        return kind, {"input_ids": ids, "cu_seq_lens_q": cu,
                      "position_ids": torch.arange(seq_len)[None]}
    if kind == "seq_idx_vs_cu":
        return kind, {"input_ids": ids, "cu_seqlens": cu,
                      "seq_idx": torch.zeros(1, seq_len, dtype=torch.int32)}
    if kind == "labels_vs_shift":  # targets that cross into the next document
        return kind, {"input_ids": ids, "cu_seqlens": cu, "labels": ids, "shift_labels": ids}
    if kind == "unknown_row_tensor":
        return kind, {"input_ids": ids, "completion_mask": torch.ones(1, seq_len)}
    if kind == "max_length":
        return kind, {"input_ids": ids, "cu_seqlens": cu, "max_length_k": seq_len}
    if kind == "neg":
        return kind, {"input_ids": ids, "seq_lens": torch.tensor([[2, -3]])}
    if kind == "sentinel":
        return kind, {"input_ids": ids, "seq_lens": torch.tensor([[1, -1000, 1]])}
    if kind == "overflow":
        return kind, {"input_ids": ids, "seq_lens": torch.tensor([[seq_len, 1]])}
    if kind == "cu_order":
        return kind, {"input_ids": ids, "cu_seqlens": torch.tensor([0, 2, 1])}
    if kind == "cu_rows":
        return kind, {"input_ids": ids.repeat(2, 1), "cu_seqlens": torch.tensor([0, 1])}
    if kind == "mask_hole":
        mask = torch.ones(1, seq_len, dtype=torch.long)
        mask[0, 0] = 0
        return kind, {"input_ids": ids, "attention_mask": mask}
    if kind == "mask_values":
        return kind, {"input_ids": ids, "attention_mask": torch.full((1, seq_len), 2)}
    if kind == "both":
        return kind, {"input_ids": ids, "inputs_embeds": torch.zeros(1, seq_len, 2)}
    return kind, {"labels": ids}


@settings(max_examples=30, deadline=None)
@given(case=broken_batches(), world=st.integers(1, 4))
def test_bad_batches_fail_identically_on_every_rank(rank_pool, case, world):
    kind, batch = case
    results = rank_pool.run(fns.shard_error, world, batch, {})
    assert results[0] is not None, kind
    assert results[0][0] == "ValueError"
    assert all(r == results[0] for r in results), results  # same verdict, same message


@st.composite
def flattened_documents(draw):
    """One row of documents packed back to back (transformers' ``DataCollatorWithFlattening``
    has no padding), the first position of every document, and a CP padding multiple."""
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    start = draw(st.sampled_from([0, 0, 2]))  # transformers' position_ids_start
    return lengths, start, draw(st.sampled_from([1, 4]))


def packing_formats(lengths: list[int], start: int) -> list[dict]:
    """The same documents in every format shard_batch reads, each with unshifted labels."""
    n = sum(lengths)
    ids = (torch.arange(n) * 7 % 251 + 1)[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    doc_ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1),
                                      torch.tensor(lengths))[None]  # fmt: skip
    positions = torch.cat([torch.arange(k) + start for k in lengths])[None]
    seq_idx = (doc_ids - 1).int()
    base = {"input_ids": ids, "labels": ids}
    flash = {"cu_seq_lens_q": cu.int(), "cu_seq_lens_k": cu.int(), "max_length_q": max(lengths),
             "max_length_k": max(lengths)}  # fmt: skip
    return [
        {**base, "doc_ids": doc_ids},
        {**base, "position_ids": positions},
        {**base, "position_ids": positions, **flash},
        {**base, "seq_idx": seq_idx},
        {**base, "cu_seqlens": cu},
        {**base, "position_ids": positions, "seq_idx": seq_idx, "doc_ids": doc_ids, **flash},
    ]


@SETTINGS
@given(docs=flattened_documents(), world=st.integers(1, 4))
def test_every_packing_format_gives_the_same_context_and_local_batch(rank_pool, docs, world):
    lengths, start, pad_multiple = docs
    formats = packing_formats(lengths, start)
    results = rank_pool.run(fns.shard_variants, world, formats, pad_multiple)
    for rank_results in results:
        (ref, ref_doc_ids, local_doc_ids), *others = rank_results
        for (local, doc_ids, _), batch in zip(others, formats[1:]):
            assert torch.equal(doc_ids, ref_doc_ids), sorted(batch)
            assert sorted(local) == ["input_ids", "position_ids", "shift_labels"], sorted(batch)
            for key in ("input_ids", "shift_labels"):
                assert torch.equal(local[key], ref[key]), (key, sorted(batch))
            # given positions are kept as given: document-local from ``start`` (0 on padding)
            given = start * (local_doc_ids != 0) if "position_ids" in batch else 0
            assert torch.equal(local["position_ids"], ref["position_ids"] + given), sorted(batch)
