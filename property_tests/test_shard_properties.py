"""Sharding properties on real gloo groups: shard then gather is the identity (but for the labels
and loss mask of tokens outside every document, which never train), every token lands on exactly
one rank, labels and doc ids stay aligned, and a bad batch fails identically on every rank (so no
rank is left waiting in a collective)."""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings, strategies as st

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
    labels = torch.roll(ids, -1, 1)
    batch = {"input_ids": ids, "labels": labels, "seq_lens": seq_lens,
             "loss_mask": (labels % 3 != 0).long()}
    if draw(st.booleans()):
        batch["position_ids"] = torch.arange(seq_len).expand(rows, seq_len) * 7
    return batch, lens


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
        assert "seq_lens" not in local  # consumed into the doc map
        # local slices are the global tensors' slices, padded by meaning
        ids = torch.cat([batch["input_ids"], torch.zeros(rows, padded - seq_len, dtype=torch.long)], 1)
        labels = torch.cat([batch["labels"], torch.full((rows, padded - seq_len), -100)], 1)
        labels = torch.where(ref_doc == 0, -100, labels)  # padding never trains
        assert torch.equal(local["input_ids"], ids[:, start:end])
        assert torch.equal(local["labels"], labels[:, start:end])
        assert not local["loss_mask"][ref_doc[:, start:end] == 0].any()
        g = res["gathered"]
        outside = ref_doc[:, :seq_len] == 0
        for key in ("input_ids", "labels", "loss_mask", "position_ids"):
            if key in batch:
                fill = {"labels": -100, "loss_mask": 0}.get(key)
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
                                 "mask_values", "both", "neither", "cu_rows"]))
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
