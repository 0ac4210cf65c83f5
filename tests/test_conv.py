"""Unit tests of the document-masked short convolution."""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from fcp.layout import doc_ids_from_seq_lens
from fcp.ops.conv import short_conv
from fcp.ops.conv.reference import short_conv_reference
from tests import _conv_rank_fns as fns


def test_docstring_example():
    ctx = PackedContext(torch.tensor([[1, 1, 2]]))
    y = short_conv(torch.tensor([[[1.0], [2.0], [3.0]]]), torch.ones(1, 2), None, ctx)
    assert y.flatten().tolist() == [1.0, 3.0, 3.0]


def test_matches_nn_conv1d_on_a_single_document():
    x = torch.randn(2, 9, 3, dtype=torch.float64)
    conv = torch.nn.Conv1d(3, 3, 4, groups=3, padding=3, dtype=torch.float64)
    ref = conv(x.transpose(1, 2))[..., :9].transpose(1, 2)
    y = short_conv(x, conv.weight[:, 0], conv.bias, PackedContext(torch.ones(2, 9, dtype=torch.long)))
    torch.testing.assert_close(y, ref.to(y.dtype), rtol=1e-6, atol=1e-6)


def test_padding_is_its_own_document_and_gets_no_real_gradient():
    doc_ids = torch.tensor([[1, 1, 1, 0, 0]])
    x = torch.randn(1, 5, 2, requires_grad=True)
    y = short_conv(x, torch.randn(2, 4), None, PackedContext(doc_ids))
    y[:, 3:].sum().backward()  # a loss on pad outputs only
    assert torch.isfinite(y).all() and not x.grad[:, :3].any()


def test_rejects_bad_arguments():
    ctx = PackedContext(torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="activation"):
        short_conv(torch.randn(1, 4, 2), torch.randn(2, 3), None, ctx, activation="relu")
    with pytest.raises(ValueError, match="channels"):
        short_conv(torch.randn(1, 4, 2), torch.randn(3, 3), None, ctx)
    with pytest.raises(ValueError, match="local_seq"):
        short_conv(torch.randn(1, 4), torch.randn(3, 3), None, ctx)


def test_reference_resets_at_every_document():
    x = torch.ones(1, 5, 1)
    doc_ids = doc_ids_from_seq_lens(torch.tensor([2, 3]), 5)
    y = short_conv_reference(x, torch.ones(1, 3), None, doc_ids)
    assert y.flatten().tolist() == [1.0, 2.0, 1.0, 2.0, 3.0]


def test_compiled_cp_conv_equals_eager_without_recompiling(rank_pool):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 3, generator=gen)
    weight = torch.randn(3, 4, generator=gen)
    packings = []
    for _ in range(6):
        lens = torch.randint(1, 5, (2, 8), generator=gen)
        lens = torch.where(lens.cumsum(1) > 8, torch.full_like(lens, -1000), lens)
        packings.append(doc_ids_from_seq_lens(lens, 8))
    for outs, frames in rank_pool.run(fns.conv_compiled, 4, x, weight, packings):
        assert frames == 1  # no recompilation across packings
        for (y_e, g_e), (y_c, g_c) in outs:
            torch.testing.assert_close(y_c, y_e, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(g_c, g_e, rtol=1e-6, atol=1e-6)
