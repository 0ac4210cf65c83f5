"""Unit tests of fcp.shard_batch: the worked example, padding by meaning, validation, THD rows,
transformers' packing formats and label convention, and ranks that never join the check."""

from __future__ import annotations

import copy

import pytest
import torch

import fcp
from fcp.loss import loss_token_count
from fcp.shard import gather_sequence, shard_batch
from tests import _shard_rank_fns as fns


def test_worked_example_single_process():
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]),
             "labels": torch.tensor([[5, 6, 7, 8, 9]]),
             "cu_seqlens": torch.tensor([0, 2, 5])}
    before = copy.deepcopy(batch)
    local, ctx = shard_batch(None, batch, pad_multiple=3)
    assert torch.equal(local["input_ids"], torch.tensor([[5, 6, 7, 8, 9, 0]]))
    # transformers' unshifted labels become next-token targets of the same document
    assert torch.equal(local["shift_labels"], torch.tensor([[6, -100, 8, 9, -100, -100]]))
    assert "labels" not in local
    assert torch.equal(local["position_ids"], torch.tensor([[0, 1, 0, 1, 2, 0]]))
    assert torch.equal(ctx.doc_ids, torch.tensor([[1, 1, 2, 2, 2, 0]]))
    assert not ctx.cp_enabled and ctx.original_seq_len == 5 and ctx.local_seq_len == 6
    assert "cu_seqlens" not in local
    assert all(torch.equal(batch[k], before[k]) for k in before) and batch.keys() == before.keys()


def test_worked_example_two_ranks(rank_pool):
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]),
             "labels": torch.tensor([[5, 6, 7, 8, 9]]),
             "cu_seqlens": torch.tensor([0, 2, 5])}
    r0, r1 = rank_pool.run(fns.shard_and_gather, 2, batch, 1, False)
    # rank 0's last token (7) keeps its target 8, which lives on rank 1
    assert torch.equal(r0["local"]["shift_labels"], torch.tensor([[6, -100, 8]]))
    assert torch.equal(r1["local"]["shift_labels"], torch.tensor([[9, -100, -100]]))
    assert torch.equal(r0["local"]["input_ids"], torch.tensor([[5, 6, 7]]))
    assert torch.equal(r1["local"]["input_ids"], torch.tensor([[8, 9, 0]]))
    assert torch.equal(r0["local"]["position_ids"], torch.tensor([[0, 1, 0]]))
    assert torch.equal(r1["local"]["position_ids"], torch.tensor([[1, 2, 0]]))
    assert torch.equal(r1["local_doc_ids"], torch.tensor([[2, 2, 0]]))


def test_thd_rows_get_a_batch_axis_and_embeddings_pad_with_zeros():
    batch = {"inputs_embeds": torch.ones(5, 3), "labels": torch.arange(5),
             "attention_mask": torch.tensor([1, 1, 1, 0, 0])}
    local, ctx = shard_batch(None, batch, pad_multiple=4)
    assert local["inputs_embeds"].shape == (1, 8, 3)
    assert torch.equal(local["inputs_embeds"][0, 5:], torch.zeros(3, 3))
    # the mask's pad tail (tokens 3, 4) trains no more than the CP padding; the document's last
    # token (2) predicts nothing
    assert local["shift_labels"].tolist() == [[1, 2, -100, -100, -100, -100, -100, -100]]
    assert local["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0]]
    assert ctx.doc_ids.tolist() == [[1, 1, 1, 0, 0, 0, 0, 0]]  # mask -> one doc + pad tail


def test_loss_mask_argument_is_sharded_and_padded_with_zero():
    batch = {"input_ids": torch.ones(1, 3, dtype=torch.long)}
    local, _ = shard_batch(None, batch, loss_mask=torch.tensor([[1, 0, 1]]),
                              pad_multiple=2)
    assert local["loss_mask"].tolist() == [[1, 0, 1, 0]]


def test_other_entries_pass_through_unchanged():
    pixel = torch.randn(2, 3)
    local, _ = shard_batch(None, {"input_ids": torch.ones(1, 2, dtype=torch.long),
                                           "pixel_values": pixel, "meta": "x"})
    assert local["pixel_values"] is pixel and local["meta"] == "x"


@pytest.mark.parametrize(
    "batch, kwargs, match",
    [
        ({"labels": torch.ones(1, 2)}, {}, "neither"),
        ({"input_ids": torch.ones(1, 2, dtype=torch.long), "inputs_embeds": torch.ones(1, 2, 3)},
         {}, "both"),
        ({"input_ids": torch.ones(2, 4, dtype=torch.long), "cu_seqlens": torch.tensor([0, 4])},
         {}, "one packed row"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long),
          "attention_mask": torch.tensor([[1, 1, 2, 2]])}, {}, "packed or block"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long),
          "attention_mask": torch.tensor([[1, 0, 1, 1]])}, {}, "attention_mask"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long),
          "attention_mask": torch.ones(1, 4, 4)}, {}, "packed or block"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long), "cu_seqlens": torch.tensor([0, 2]),
          "attention_mask": torch.ones(1, 4)}, {}, "disagrees"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long),
          "labels": torch.ones(1, 3, dtype=torch.long)}, {}, "labels has shape"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long)}, {"pad_multiple": 0}, "pad_multiple"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long), "seq_lens": torch.tensor([[1], [2]])},
         {}, "seq_lens has 2 rows"),
    ],
)
def test_rejects_what_it_cannot_honour(batch, kwargs, match):
    with pytest.raises(ValueError, match=match):
        shard_batch(None, batch, **kwargs)


IDS = torch.ones(1, 4, dtype=torch.long)


@pytest.mark.parametrize(
    "batch, kwargs, exc, match",
    [
        ({"input_ids": [[1, 2, 3]]}, {}, TypeError, r"input_ids must be a torch.Tensor, got \[\[1, 2, 3\]\] \(list\)"),
        ({"input_ids": IDS, "attention_mask": [[1, 1, 1, 1]]}, {}, TypeError,
         "attention_mask must be a torch.Tensor"),
        ({"input_ids": IDS}, {"loss_mask": [[1, 1, 1, 1]]}, TypeError, "^shard_batch: loss_mask must be"),
        ({"input_ids": IDS}, {"padding_token_id": 1.5}, TypeError, "^shard_batch: padding_token_id .* 1.5"),
        ({"input_ids": IDS}, {"padding_token_id": None}, TypeError, "padding_token_id .* None"),
        ({"input_ids": IDS}, {"pad_multiple": True}, TypeError, "^shard_batch: pad_multiple .* True"),
        ({"input_ids": IDS}, {"pad_multiple": 0}, ValueError, "^shard_batch: pad_multiple=0"),
        ({"input_ids": IDS}, {"shard_primary": 1}, TypeError, "shard_primary"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.bool)}, {}, TypeError, "input_ids .*torch.bool"),
        ({"input_ids": torch.ones(1, 4)}, {}, TypeError, "^shard_batch: input_ids must be an integer dtype"),
        ({"input_ids": IDS, "cu_seqlens": [0, 4]}, {}, TypeError, "cu_seqlens must be a torch.Tensor"),
        ({"input_ids": IDS, "cu_seqlens": torch.tensor([0, 4], device="meta")}, {}, ValueError,
         "cu_seqlens is a meta tensor"),
        ({"input_ids": IDS, "labels": torch.ones(1, 4)}, {}, TypeError, "labels .*torch.float32"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long, device="meta")}, {}, ValueError,
         "input_ids is a meta tensor"),
        ({"input_ids": torch.ones(0, 4, dtype=torch.long)}, {}, ValueError, "batch size 0"),
        ({"inputs_embeds": torch.ones(1, 4, 2, dtype=torch.long)}, {}, TypeError,
         "inputs_embeds must be floating point"),
    ],
)
def test_rejects_bad_types_naming_the_argument(batch, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        shard_batch(None, batch, **kwargs)


def test_bad_batch_gives_the_same_error_on_every_rank(rank_pool):
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 3)}
    results = rank_pool.run(fns.shard_error, 2, batch, {})
    assert results[0] == results[1] and results[0][0] == "ArgumentTypeError"
    assert "labels" in results[0][1]


def test_gather_gradients_flow_to_owning_ranks(rank_pool):
    full = torch.randn(1, 7, 2)
    results = rank_pool.run(fns.gather_grad, 2, full)
    weights = torch.arange(14, dtype=full.dtype).view(1, 7, 2)
    padded = torch.cat([weights, torch.zeros(1, 1, 2)], 1) * 2  # both ranks' losses
    for grad, (start, end) in results:
        torch.testing.assert_close(grad, padded[:, start:end])


def test_shard_primary_false_keeps_ids_full_and_slices_differentiably(rank_pool):
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4, 5]]), "labels": torch.tensor([[2, 3, 4, 5, 6]])}
    for rank, (shape, labels, sliced, grad) in enumerate(
        rank_pool.run(fns.primary_kept_full, 2, batch)
    ):
        assert tuple(shape) == (1, 6)  # padded, not sliced
        assert labels.shape == (1, 3)
        expect_ids = torch.tensor([[1, 2, 3, 4, 5, 0]])[:, rank * 3 : rank * 3 + 3]
        assert torch.equal(sliced.argmax(-1), expect_ids)
        assert torch.equal(grad.sum(-1)[0], torch.tensor([8.0 if rank * 3 <= t < rank * 3 + 3
                                                          else 0.0 for t in range(6)]))


def test_gather_sequence_without_cp_unpads():
    local, ctx = shard_batch(None, {"input_ids": torch.arange(3).view(1, 3)},
                                pad_multiple=4)
    assert gather_sequence(local["input_ids"], ctx).tolist() == [[0, 1, 2]]
    assert gather_sequence(local["input_ids"], ctx, unpad=False).shape == (1, 4)


def test_top_level_exports():
    for name in ("shard_batch", "gather_sequence", "PackedContext", "all_gather_sequence",
                 "left_halo", "state_chain", "all_gather_backward_anchor", "PAD_DOC_ID"):
        assert hasattr(fcp, name), name


# ------------------------------------------------------------------ ranks must agree
def packed(lengths: list[int], total: int) -> dict:
    """One packed row of ``total`` tokens: documents of ``lengths``, then a pad tail."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    ids = torch.arange(total)[None] + 1
    return {"input_ids": ids, "labels": ids.clone(), "cu_seqlens": cu}


SHARDERS = ["fcp", "glm", "qwen"]  # fcp.shard_batch and the two seed sharders


def _disagree(rank_pool, world, batches, sharder, **kwargs):
    res = rank_pool.run(fns.shard_own_batch, world, batches, sharder, kwargs, timeout=10)
    assert all(r[0] == "ValueError" for r in res), res  # no rank returns normally
    return res


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sharder", SHARDERS)
def test_ranks_with_different_maps_all_raise_naming_the_first_difference(rank_pool, sharder,
                                                                        world):
    good, bad = packed([10, 22], 32), packed([12, 20], 32)  # the same length, docs cut elsewhere
    batches = [good] * world
    batches[world - 1] = bad
    res = _disagree(rank_pool, world, batches, sharder)
    assert len({r[1] for r in res}) == 1  # the same message on every rank
    msg = res[0][1]
    assert "different document maps" in msg and f"rank {world - 1}'s differs" in msg, msg
    assert "row 0, token 10 (doc id 1 vs 2" in msg, msg


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sharder", SHARDERS)
def test_ranks_with_different_lengths_all_raise_naming_them(rank_pool, sharder, world):
    batches = [packed([10, 22], 32)] * world
    batches[1] = packed([10, 30], 40)
    res = _disagree(rank_pool, world, batches, sharder)
    assert len({r[1] for r in res}) == 1
    assert "different lengths" in res[0][1] and "rank 1: 1 row(s) x 40 tokens" in res[0][1]


@pytest.mark.parametrize("sharder", SHARDERS)
def test_a_rank_rejecting_its_batch_makes_the_others_raise(rank_pool, sharder):
    """A batch valid on rank 0 only: rank 1 raises its own error, rank 0 is told, nobody hangs."""
    bad = dict(packed([10, 22], 32), cu_seqlens=torch.tensor([0, 20, 10, 32]))
    res = _disagree(rank_pool, 2, [packed([10, 22], 32), bad], sharder)
    assert "rank(s) [1] rejected their batch" in res[0][1], res
    assert "rejected" not in res[1][1] and "cu_seqlens" in res[1][1], res


def test_agreement_check_can_be_skipped(rank_pool):
    batches = [packed([10, 22], 32), packed([12, 20], 32)]
    res = rank_pool.run(fns.shard_own_batch, 2, batches, "fcp", {"check_agreement": False},
                        timeout=10)  # fmt: skip
    assert res == [("ok", 32), ("ok", 32)]


# ------------------------------------------------------------------ padding never trains
@pytest.mark.parametrize("world", [2, 4])
def test_pad_tail_labels_and_loss_mask_are_ignored(rank_pool, world):
    """44 real tokens in a 48-token row: 44 loss tokens (the pad tail's labels were counted)."""
    batch = dict(packed([20, 24], 48), loss_mask=torch.ones(1, 48, dtype=torch.long))
    batch["shift_labels"] = batch.pop("labels")  # aligned targets, sharded as given
    res = rank_pool.run(fns.local_labels, world, batch, "fcp", timeout=10)
    labels = torch.cat([r[0] for r in res], 1)
    loss_mask = torch.cat([r[1] for r in res], 1)
    assert sum(int(loss_token_count(r[0])) for r in res) == 44
    assert labels[0, :44].tolist() == list(range(1, 45)) and (labels[0, 44:] == -100).all()
    assert loss_mask[0].tolist() == [1] * 44 + [0] * (labels.shape[1] - 44)


def test_pad_tail_labels_of_seq_lens_rows_are_ignored_unless_asked():
    ones = torch.ones(2, 5, dtype=torch.long)
    batch = {"input_ids": ones, "shift_labels": ones,
             "seq_lens": torch.tensor([[2, 1], [4, -1000]])}  # fmt: skip
    assert shard_batch(None, batch)[0]["shift_labels"].tolist() == [[1, 1, 1, -100, -100],
                                                                   [1, 1, 1, 1, -100]]
    kept = shard_batch(None, batch, ignore_padding=False, pad_multiple=2)[0]["shift_labels"]
    assert kept.tolist() == [[1] * 5 + [-100], [1] * 5 + [-100]]  # only the CP padding
    # built from labels: the pad tail is a run of its own, whose targets stay when asked
    ids = torch.arange(1, 6).repeat(2, 1)
    batch = {"input_ids": ids, "labels": ids, "seq_lens": torch.tensor([[2, 1], [4, -1000]])}
    assert shard_batch(None, batch)[0]["shift_labels"].tolist() == [[2, -100, -100, -100, -100],
                                                                   [2, 3, 4, -100, -100]]
    kept = shard_batch(None, batch, ignore_padding=False)[0]["shift_labels"]
    assert kept.tolist() == [[2, -100, -100, 5, -100], [2, 3, 4, -100, -100]]


def test_seed_sharders_keep_nemos_labels_on_the_pad_tail(rank_pool):
    batch = dict(packed([20, 24], 48), loss_mask=torch.ones(1, 48, dtype=torch.long))
    res = rank_pool.run(fns.local_labels, 2, batch, "glm", timeout=10)
    assert torch.cat([r[0] for r in res], 1).tolist() == [list(range(1, 49))]
    assert torch.cat([r[1] for r in res], 1).tolist() == [[1] * 48]


# ------------------------------------------------------------------ the three sharders agree
def _meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


BAD_INPUTS = {  # change to packed([3, 5], 8) -> (error type, message part naming the argument)
    "float labels": (lambda b: {"labels": b["labels"].float()}, "ArgumentTypeError",
                     "labels must be an integer dtype"),
    "meta labels": (lambda b: {"labels": _meta(b["labels"])}, "ValueError",
                    "labels is a meta tensor"),
    "float position_ids": (lambda b: {"position_ids": torch.arange(8.0)[None]},
                           "ArgumentTypeError", "position_ids must be an integer dtype"),
    "meta input_ids": (lambda b: {"input_ids": _meta(b["input_ids"])}, "ValueError",
                       "input_ids is a meta tensor"),
    "meta cu_seqlens": (lambda b: {"cu_seqlens": _meta(b["cu_seqlens"])}, "ValueError",
                        "cu_seqlens is a meta tensor"),
    "meta seq_lens": (lambda b: {"cu_seqlens": None, "seq_lens": _meta(torch.tensor([[3, 5]]))},
                      "ValueError", "seq_lens is a meta tensor"),
    "list attention_mask": (lambda b: {"cu_seqlens": None, "attention_mask": [[1] * 8]},
                            "ArgumentTypeError", "attention_mask must be a torch.Tensor"),
    "meta attention_mask": (lambda b: {"cu_seqlens": None,
                                       "attention_mask": _meta(torch.ones(1, 8))},
                            "ValueError", "attention_mask is a meta tensor"),
}  # fmt: skip


@pytest.mark.parametrize("sharder", SHARDERS)
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_the_three_sharders_reject_the_same_bad_inputs_naming_them(sharder, case):
    """The Qwen sharder used to accept float and meta labels; meta packing tensors crashed all
    three in ``Tensor.item()``; a list attention_mask was reported as ``mask``."""
    change, kind, words = BAD_INPUTS[case]
    batch = packed([3, 5], 8)
    batch = {k: v for k, v in {**batch, **change(batch)}.items() if v is not None}
    got = fns.shard_with(sharder, None, batch, {})
    assert got[0] == kind and words in got[1], got



# ------------------------------------------------------------------ transformers' packing formats
FEATURES = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]  # four documents
FLAT_DOC_IDS = torch.tensor([[1, 1, 1, 2, 2, 3, 3, 3, 3, 4]])


def collated(**kwargs) -> dict:
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(**kwargs)([{"input_ids": f} for f in FEATURES])


COLLATOR_KWARGS = [{}, {"return_flash_attn_kwargs": True}, {"return_seq_idx": True},
                   {"return_flash_attn_kwargs": True, "return_seq_idx": True},
                   {"return_flash_attn_kwargs": True, "position_ids_start": 2}]  # fmt: skip


@pytest.mark.parametrize("kwargs", COLLATOR_KWARGS, ids=str)
def test_data_collator_with_flattening_gives_the_documents_of_doc_ids(kwargs):
    """transformers' collator output straight into shard_batch: its documents, not one per row
    (they used to pass through unread), and the same local batch as doc_ids with HF labels."""
    batch = collated(**kwargs)
    local, ctx = shard_batch(None, batch, pad_multiple=4)
    assert ctx.doc_ids[:, :10].tolist() == FLAT_DOC_IDS.tolist()
    assert sorted(local) == ["input_ids", "position_ids", "shift_labels"]  # every key consumed
    ids = batch["input_ids"]
    ref, ref_ctx = shard_batch(None, {"input_ids": ids, "labels": ids, "doc_ids": FLAT_DOC_IDS},
                               pad_multiple=4)  # fmt: skip
    assert torch.equal(ctx.doc_ids, ref_ctx.doc_ids)
    assert torch.equal(local["input_ids"], ref["input_ids"])
    assert local["shift_labels"].tolist() == [[6, 7, -100, 9, -100, 11, 12, 13, -100, -100,
                                               -100, -100]]  # fmt: skip
    assert torch.equal(local["shift_labels"], ref["shift_labels"])
    start = kwargs.get("position_ids_start", 0)
    assert torch.equal(local["position_ids"][:, :10], ref["position_ids"][:, :10] + start)


def test_data_collator_batch_shards_over_two_ranks_like_doc_ids(rank_pool):
    batch = collated(return_flash_attn_kwargs=True, return_seq_idx=True)
    ids = batch["input_ids"]
    ref = {"input_ids": ids, "labels": ids, "doc_ids": FLAT_DOC_IDS}
    got, want = zip(*rank_pool.run(fns.shard_variants, 2, [batch, ref], 2))
    for (local, doc_ids, _), (ref_local, ref_doc_ids, _) in zip(got, want):
        assert torch.equal(doc_ids, ref_doc_ids) and local.keys() == ref_local.keys()
        assert all(torch.equal(local[k], ref_local[k]) for k in local)


def test_position_ids_alone_describe_documents_and_a_mask_the_pad_tail():
    pos = torch.tensor([[3, 4, 5, 3, 4, 9, 7, 7]])  # restarts at 3, 5 (9 is no +1) and 6, 7
    local, ctx = shard_batch(None, {"input_ids": torch.ones(1, 8, dtype=torch.long),
                                    "position_ids": pos,
                                    "attention_mask": torch.tensor([[1] * 6 + [0] * 2])})
    assert ctx.doc_ids.tolist() == [[1, 1, 1, 2, 2, 3, 0, 0]]
    assert torch.equal(local["position_ids"], pos)  # the model reads them as given


IDS5 = torch.arange(1, 6)[None]
CU = torch.tensor([0, 2, 5])


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"cu_seqlens": CU, "position_ids": torch.arange(5)[None]},
         ("position_ids disagrees with cu_seqlens", "row 0, token 2",
          "cu_seqlens starts a document there", "position_ids continues", "restart")),
        ({"cu_seqlens": CU, "position_ids": torch.tensor([[0, 1, 0, 1, 0]])},
         ("position_ids disagrees with cu_seqlens", "row 0, token 4",
          "position_ids starts a document there")),
        ({"cu_seq_lens_q": CU, "cu_seq_lens_k": torch.tensor([0, 3, 5], dtype=torch.int32)},
         ("cu_seq_lens_k disagrees with cu_seq_lens_q", "row 0, token 2")),
        ({"doc_ids": torch.tensor([[1, 1, 1, 2, 2]]), "seq_idx": torch.tensor([[0, 0, 1, 1, 1]])},
         ("seq_idx disagrees with doc_ids", "row 0, token 2")),
        ({"cu_seqlens": CU, "seq_lens": torch.tensor([[2, 2]])},
         ("seq_lens disagrees with cu_seqlens", "row 0, token 4", "puts it in the padding")),
        ({"cu_seqlens": torch.tensor([0, 2, 4]), "attention_mask": torch.ones(1, 5)},
         ("attention_mask disagrees with cu_seqlens", "row 0, token 4", "marks it as valid")),
        ({"doc_ids": torch.tensor([[1, 1, 2, 0, 0]]), "padding_mask": torch.ones(1, 5)},
         ("padding_mask disagrees with doc_ids", "row 0, token 3")),
        ({"position_ids": torch.tensor([[0, 1, 0, 1, 2]]), "seq_idx": torch.tensor([[0] * 5])},
         ("seq_idx disagrees with position_ids", "row 0, token 2")),
        ({"cu_seqlens": CU, "max_length_q": 2}, ("max_length_q=2", "3 tokens", "cu_seqlens")),
        ({"position_ids": torch.tensor([[0, 1, 0, 1, 2]]), "max_length_k": torch.tensor(2)},
         ("max_length_k=2", "3 tokens")),
        ({"cu_seq_lens_q": torch.tensor([[0, 2], [0, 3]])}, ("cu_seq_lens_q",)),
        ({"seq_idx": torch.zeros(1, 4, dtype=torch.int32)}, ("seq_idx", "(1, 4)")),
        ({"max_length_q": torch.tensor([2, 3])}, ("max_length_q", "one-element")),
    ],
)
def test_keys_describing_different_documents_raise_naming_both_and_the_token(extra, words):
    with pytest.raises(ValueError) as err:
        shard_batch(None, {"input_ids": IDS5, **extra})
    assert all(w in str(err.value) for w in words), str(err.value)


def test_agreeing_sources_are_all_consumed():
    batch = {"input_ids": IDS5, "cu_seqlens": CU, "cu_seq_lens_q": CU.int(),
             "cu_seq_lens_k": CU.int(), "max_length_q": 3, "max_length_k": torch.tensor(3),
             "doc_ids": torch.tensor([[1, 1, 2, 2, 2]]), "seq_idx": torch.tensor([[4, 4, 0, 0, 0]]),
             "position_ids": torch.tensor([[0, 1, 0, 1, 2]]), "seq_lens": torch.tensor([[2, 3]]),
             "max_seqlen": 3, "seq_lens_padded": torch.tensor([[2, 3]])}  # fmt: skip
    local, ctx = shard_batch(None, batch)
    assert ctx.doc_ids.tolist() == [[1, 1, 2, 2, 2]]
    assert sorted(local) == ["input_ids", "position_ids"]


# ------------------------------------------------------------------ labels and shift_labels
def test_shift_labels_keep_the_target_across_a_shard_boundary(rank_pool):
    """One 6-token document on 2 ranks: rank 0's last token predicts rank 1's first token.
    Shifting inside each shard (what a model shifting HF labels does) loses it."""
    ids = torch.tensor([[11, 12, 13, 14, 15, 16]])
    r0, r1 = rank_pool.run(fns.shard_and_gather, 2, {"input_ids": ids, "labels": ids}, 1, False)
    assert r0["local"]["shift_labels"].tolist() == [[12, 13, 14]]  # 14 lives on rank 1
    assert r1["local"]["shift_labels"].tolist() == [[15, 16, -100]]
    assert "labels" not in r0["local"] and "labels" not in r1["local"]
    assert r0["gathered"]["shift_labels"].tolist() == [[12, 13, 14, 15, 16, -100]]


def test_given_shift_labels_are_sharded_as_given_and_may_accompany_agreeing_labels():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    shift = torch.tensor([[6, -100, 8, 9, -100]])
    for batch in ({"shift_labels": shift}, {"shift_labels": shift, "labels": ids}):
        local, _ = shard_batch(None, {"input_ids": ids, "cu_seqlens": CU, **batch},
                               pad_multiple=2)  # fmt: skip
        assert local["shift_labels"].tolist() == [[6, -100, 8, 9, -100, -100]]
        assert "labels" not in local


@pytest.mark.parametrize(
    "shift, words",
    [
        (torch.tensor([[6, 7, 8, 9, -100]]), ("row 0, token 1", "shift_labels[0, 1] = 7",
                                              "another document")),
        (torch.tensor([[6, -100, 8, 8, -100]]), ("row 0, token 3", "labels[0, 4]")),
        (torch.tensor([[6, -100, 8, 9, 1]]), ("row 0, token 4", "last token")),
    ],
)
def test_labels_and_shift_labels_that_disagree_raise_naming_the_position(shift, words):
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with pytest.raises(ValueError, match="labels and shift_labels disagree") as err:
        shard_batch(None, {"input_ids": ids, "labels": ids, "shift_labels": shift,
                           "cu_seqlens": CU})  # fmt: skip
    assert all(w in str(err.value) for w in words), str(err.value)


def test_shift_labels_on_the_pad_tail_need_not_agree_when_padding_is_ignored():
    ids = torch.tensor([[5, 6, 7, 0, 0]])
    shift = torch.tensor([[6, 7, -100, 3, 3]])  # anything on the pad tail
    batch = {"input_ids": ids, "labels": ids, "shift_labels": shift, "seq_lens": torch.tensor([3])}
    assert shard_batch(None, batch)[0]["shift_labels"].tolist() == [[6, 7, -100, -100, -100]]
    with pytest.raises(ValueError, match="row 0, token 3"):
        shard_batch(None, batch, ignore_padding=False)


# ------------------------------------------------------------------ keys shard_batch does not know
@pytest.mark.parametrize(
    "batch, key",
    [
        ({"input_ids": torch.ones(2, 4, dtype=torch.long), "completion_mask": torch.ones(2, 4)},
         "completion_mask"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long), "token_embeds": torch.ones(1, 4, 3)},
         "token_embeds"),
        ({"input_ids": torch.ones(4, dtype=torch.long), "assistant_masks": torch.ones(4)},
         "assistant_masks"),  # a THD row
    ],
)
def test_unknown_tensors_laid_out_like_the_tokens_raise_naming_them(batch, key):
    with pytest.raises(ValueError, match=f"shard_batch: {key} is a tensor .*extra_token_keys"):
        shard_batch(None, batch)
    if batch["input_ids"].dim() == 2:  # listed, it is sharded like any token stream
        local, _ = shard_batch(None, batch, extra_token_keys=(key,), pad_multiple=3)
        assert local[key].shape[:2] == (batch["input_ids"].shape[0], 6)


# ------------------------------------------------------------------ ranks that never join
@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_without_the_group_makes_the_waiting_ranks_raise_in_bounded_time(rank_pool, world):
    """Ranks 0 .. world/2 - 1 pass the CP group, the others None (no CP): the waiting ranks raise
    a RuntimeError naming the missing ranks after join_timeout, not the collective timeout."""
    join_timeout, with_group = 1.5, list(range(world // 2))
    res = rank_pool.run(fns.mixed_group_kinds, world, with_group, join_timeout,
                        return_exceptions=True, timeout=30)  # fmt: skip
    missing = list(range(world // 2, world))
    for rank, r in enumerate(res):
        if rank in missing:
            assert isinstance(r, float) and r < join_timeout, (rank, r)  # no CP: no waiting
            continue
        assert isinstance(r, RuntimeError), (rank, r)
        msg = str(r)
        assert f"CP rank(s) {missing}" in msg and "join_timeout=1.5" in msg, msg
        assert "cp_mesh=None" in msg and f"while CP rank {rank} waited" in msg, msg
        waited = float(msg.rsplit("[after ", 1)[1].split(" s]")[0])
        assert join_timeout <= waited < join_timeout + 3.0, waited


@pytest.mark.parametrize("value, exc", [(0, ValueError), (-1.0, ValueError), ("5", TypeError),
                                        (None, TypeError)])  # fmt: skip
def test_join_timeout_is_checked(value, exc):
    with pytest.raises(exc, match="shard_batch: join_timeout"):
        shard_batch(None, {"input_ids": IDS5}, join_timeout=value)
