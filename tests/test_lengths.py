"""Row lengths that change: ``shard_batch(pad_to=...)`` buckets, and a compiled CP block costs at
most one recompile over rows of four lengths (one process and 2 gloo ranks; ``dynamic=True``:
none), with ``shard_batch``'s default arguments.

The block (:func:`tests._length_rank_fns.block`) chains a short conv, KDA, gated linear attention
and document-causal attention. Before the scans became opaque custom ops, the second and every
later length recompiled: the log-depth tree guarded on the parity of the chunk count at every
level, and paddings written as a ``cat`` guarded on their remainder. Before KDA's in-chunk form
became one too (and the run numbering lost a ``chunks - 1`` sized slice), the dynamic graph
guarded on its chunk count at KDA's default chunk of 64: rows of 2 local chunks, then 3,
compiled a third time (the README then asked for ``pad_multiple=64``).
"""

from __future__ import annotations

import math

import pytest
import torch

import fcp
from fcp.shard import padded_length
from tests import _length_rank_fns as fns

#: global row lengths: one-chunk and multi-chunk rows, multiples of 16 and 64 and neither
LENGTHS = [96, 136, 192, 264]
#: global rows on 2 ranks with ``shard_batch``'s defaults: local 96, 128, 160, 200 tokens, in
#: KDA's and GLA's default chunks of 64 a multiple of the chunk or not, 2, 2, 3 and 4 chunks
DEFAULT_CHUNK_LENGTHS = [192, 256, 320, 400]


def _brute_force(seq: int, multiple: int, pad_to) -> int:
    """The definition, by search: the smallest admissible length >= seq (at least one)."""
    candidates = range(multiple, 4 * (seq + multiple) * (pad_to if isinstance(pad_to, int) else 1))
    if pad_to == "pow2":
        ok = [multiple << j for j in range(40)]
        return next(n for n in ok if n >= seq)
    step = multiple if pad_to is None else math.lcm(multiple, pad_to)
    return next(n for n in candidates if n % step == 0 and n >= seq)


@pytest.mark.parametrize("pad_to", [None, 1, 6, 64, "pow2"])
@pytest.mark.parametrize("multiple", [1, 2, 4, 12])
def test_padded_length_is_the_smallest_admissible_length(multiple, pad_to):
    for seq in [0, 1, 5, 63, 64, 65, 100, 1000]:
        got = padded_length(seq, multiple, pad_to)
        assert got == _brute_force(seq, multiple, pad_to), (seq, multiple, pad_to)
        if pad_to == "pow2":
            assert got < 2 * max(seq, multiple)


def test_pad_to_examples():
    ids = torch.arange(1, 38)[None]  # 37 tokens
    sizes = {p: fcp.shard_batch(None, {"input_ids": ids}, pad_to=p)[1].global_seq_len
             for p in (None, 16, 64, "pow2")}  # fmt: skip
    assert sizes == {None: 37, 16: 48, 64: 64, "pow2": 64}


@pytest.mark.parametrize("bad, exc, match", [
    (0, ValueError, r"shard_batch: pad_to=0 must be >= 1"),
    (1.5, TypeError, r"shard_batch: pad_to must be an int, got 1.5"),
    (True, TypeError, r"pad_to must be an int, got True"),
    ("pow3", ValueError, r"pad_to='pow3' is not one of None, a positive int or 'pow2'"),
])  # fmt: skip
def test_bad_pad_to_raises_naming_it(bad, exc, match):
    with pytest.raises(exc, match=match):
        fcp.shard_batch(None, {"input_ids": torch.ones(1, 5, dtype=torch.int64)}, pad_to=bad)


def test_bucket_padding_never_trains_and_changes_no_real_token():
    """The block's outputs and input gradients on the real tokens are bitwise the same with and
    without a bucket; the bucket's tokens get label -100 and loss mask 0."""
    x, w, doc_ids = fns.row(37, seed=3)
    targets = torch.arange(37)[None]
    results = []
    for pad_to in (None, 64, "pow2"):
        batch = {"inputs_embeds": x, "doc_ids": doc_ids, "shift_labels": targets,
                 "loss_mask": torch.ones(1, 37)}  # fmt: skip
        local, ctx = fcp.shard_batch(None, batch, pad_to=pad_to)
        if pad_to is not None:
            assert ctx.global_seq_len == 64
            assert (local["shift_labels"][0, 37:] == -100).all()
            assert local["loss_mask"][0, 37:].eq(0).all()
            assert fcp.loss.loss_token_count(local["shift_labels"]) == 37
        xs = local["inputs_embeds"].clone().requires_grad_()
        out = fns.block(xs, w, ctx)
        (out[:, :37] * torch.linspace(-1, 1, 37)[None, :, None]).sum().backward()
        results.append((out[:, :37].detach(), xs.grad[:, :37]))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_four_row_lengths_cost_one_recompile():
    """Dynamo's default: the first length compiles a static graph, the second recompiles once
    with a dynamic sequence dimension, the others reuse it; compiled equals eager."""
    res = fns.lengths_run(None, LENGTHS, dynamic=None)
    assert res["frames"] == [1, 2, 2, 2], res
    assert res["diff"] <= 1e-6, res


def test_dynamic_true_compiles_once_for_every_length():
    res = fns.lengths_run(None, LENGTHS, dynamic=True)
    assert res["frames"] == [1, 1, 1, 1], res
    assert res["diff"] <= 1e-6, res


def test_four_row_lengths_cost_one_recompile_on_two_ranks(rank_pool):
    results = rank_pool.run(fns.lengths_run, 2, LENGTHS, None, timeout=600)
    for rank, res in enumerate(results):
        assert res["local"] == [n // 2 for n in LENGTHS], res
        assert res["frames"] == [1, 2, 2, 2], (rank, res)
        assert res["diff"] <= 1e-6, (rank, res)


def test_default_arguments_cost_one_recompile_on_two_ranks(rank_pool):
    """``shard_batch``'s default padding (``pad_multiple=1``) and the operators' default chunk
    (64): local lengths that are multiples of the chunk and those that are not, and chunk
    counts 2, 3, 4, share the one dynamic graph."""
    results = rank_pool.run(fns.lengths_run, 2, DEFAULT_CHUNK_LENGTHS, None, 64, timeout=600)
    for rank, res in enumerate(results):
        assert res["local"] == [96, 128, 160, 200], res
        assert res["frames"] == [1, 2, 2, 2], (rank, res)
        assert res["diff"] <= 1e-6, (rank, res)
