"""Unit tests of the token-history operator (the n-gram history of Qwen4-Exp's PLE layers)."""

from __future__ import annotations

import pytest
import torch

from fcp.checks import ArgumentTypeError
from fcp.context import PackedContext
from fcp.ops.token_history import token_history
from fcp.ops.token_history.reference import token_history_reference
from tests import _token_history_rank_fns as fns
from tests.support.packing import EDGE_PACKINGS, packing, random_packings

EOS = 2


def test_docstring_example():
    ctx = PackedContext(torch.tensor([[1, 1, 1, 1, 2]]))
    got = token_history(torch.tensor([[5, 6, 2, 7, 8]], dtype=torch.int32), ctx, 3, fill=EOS,
                        reset=EOS)  # fmt: skip
    assert got.dtype == torch.int64
    assert got[0].tolist() == [[5, 2, 2], [6, 5, 2], [2, 6, 5], [7, 2, 2], [8, 2, 2]]


@pytest.mark.parametrize("name", sorted(EDGE_PACKINGS))
def test_single_process_equals_the_reference(name):
    """Every edge layout, histories longer and shorter than its documents, with and without a
    reset token (ids 1-3, so the reset id 2 is frequent)."""
    doc_ids = packing(*EDGE_PACKINGS[name])
    tokens = torch.randint(1, 4, doc_ids.shape, generator=torch.Generator().manual_seed(0))
    ctx = PackedContext(doc_ids)
    for size in (1, 2, 4, 7):
        for fill, reset in ((EOS, EOS), (-1, None)):
            want = token_history_reference(tokens, doc_ids, size, fill=fill, reset=reset)
            got = token_history(tokens, ctx, size, fill=fill, reset=reset)
            assert torch.equal(got, want), (name, size, reset)


def test_rejects_bad_arguments():
    ctx = PackedContext(torch.ones(1, 4, dtype=torch.long))
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ArgumentTypeError, match="token_history: tokens must be"):
        token_history(ids.float(), ctx, 2, fill=0)
    with pytest.raises(ValueError, match=r"tokens must have shape \[batch, local_seq\]"):
        token_history(ids[:, :3], ctx, 2, fill=0)
    with pytest.raises(ValueError, match="size=0"):
        token_history(ids, ctx, 0, fill=0)
    with pytest.raises(ArgumentTypeError, match="fill"):
        token_history(ids, ctx, 2, fill=1.5)
    with pytest.raises(ArgumentTypeError, match="reset"):
        token_history(ids, ctx, 2, fill=0, reset="eos")
    with pytest.raises(ValueError, match="backend"):
        token_history(ids, ctx, 2, fill=0, backend="nccl")
    with pytest.raises(ArgumentTypeError, match="ctx must be a PackedContext"):
        token_history(ids, ids, 2, fill=0)


def test_compiled_on_ranks_is_one_graph_across_packings(rank_pool):
    """2 ranks, ``fullgraph=True``: four packings (documents shorter than the history, one
    spanning both ranks, pad tails) compile once, equal eager, and synchronise nothing."""
    doc_ids_list = random_packings(4, 2, 8, seed=1)
    tokens = torch.randint(1, 4, (2, 8), generator=torch.Generator().manual_seed(1))
    for frames, syncs, worst, _ in rank_pool.run(fns.cp_compile_rank, 2, tokens, doc_ids_list,
                                                 5, EOS, EOS):  # fmt: skip
        assert (frames, syncs, worst) == (1, [], 0.0)
