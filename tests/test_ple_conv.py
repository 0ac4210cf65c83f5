"""Qwen3.8-Flash-Next's PLE dilated conv (NeMo's ``engram.py``) as ``fcp.short_conv(dilation=3)``.

NeMo's PLE layer convolves its ``[batch, seq, hc * hidden]`` state with a depthwise
``nn.Conv1d(kernel_size=4, dilation=ngram_size=3, bias=False)`` (weight ``[C, 1, 4]``) and a SiLU
after it, restarting with 9 zeros of history at every packed segment (``_causal_short_conv`` with
``sequence_ids``, which runs ``_segmented_conv``: one ``F.conv1d`` per run of equal segment id).
Under CP it needs the 9 tokens before a shard.

``fcp.short_conv(x, weight[:, 0], None, ctx, activation="silu", dilation=3)`` is that conv:

* against NeMo's own ``_causal_short_conv`` (called on a stand-in carrying the attributes it
  reads), packed rows with segment ids and every document alone: outputs and the gradients of
  the input and the weight to 1e-6 (fp32; measured ~1e-7);
* under CP on 1, 2 and 4 gloo ranks with shards shorter than the 9-token halo (the halo then
  comes from several ranks back), outputs and input gradients equal NeMo's single-process
  segmented conv to 1e-6, and the per-rank weight gradients sum to NeMo's;
* documents are bitwise isolated (``torch.equal`` outside the changed document), NaN included,
  with and without CP.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests import _hf_rank_fns as fns
from tests.support.packing import doc_ids_from_lengths

WIDTH, DILATION, CHANNELS = 4, 3, 6  # NeMo's PLE: kernel 4, dilation ngram_size = 3 (halo 9)


class NemoPleConv:
    """The attributes NeMo's ``Qwen3_8_FlashNextPLELayer._causal_short_conv`` and
    ``_segmented_conv`` read, around a weight ``[C, 1, W]``; calling it runs NeMo's method."""

    def __init__(self, weight: torch.Tensor, dilation: int):
        from nemo_automodel.components.models.qwen3_8_flash_next.engram import (
            Qwen3_8_FlashNextPLELayer as ple,
        )

        self.conv1d = SimpleNamespace(weight=weight)
        self.conv_kernel_size = weight.shape[-1]
        self.short_conv_dilation = dilation
        self.hc_hidden_size = weight.shape[0]
        self._segmented_conv = functools.partial(ple._segmented_conv, self)
        self._conv = functools.partial(ple._causal_short_conv, self)

    def __call__(self, x: torch.Tensor, sequence_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self._conv(x, None, sequence_ids)


def nemo_fwd_bwd(x, weight, doc_ids, grad, per_document: bool):
    """NeMo's conv on the packed rows (segment ids = doc ids; the pad tail is a segment), or on
    every document (and pad tail) alone without segment ids; output and x / weight gradients."""
    x = x.clone().requires_grad_()
    w = weight[:, None, :].clone().requires_grad_()
    conv = NemoPleConv(w, DILATION)
    if not per_document:
        y = conv(x, doc_ids)
    else:
        rows = []
        for b in range(x.shape[0]):
            ids = doc_ids[b]
            cuts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + [len(ids)]
            rows.append(torch.cat([conv(x[b : b + 1, s:e])[0] for s, e in zip(cuts, cuts[1:])]))
        y = torch.stack(rows)
    (y * grad).sum().backward()
    return y.detach(), x.grad, w.grad[:, 0]


def make(batch, seq, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, CHANNELS, generator=gen)
    weight = 0.5 * torch.randn(CHANNELS, WIDTH, generator=gen)  # NeMo's [C, 1, W] without the 1
    grad = torch.randn(batch, seq, CHANNELS, generator=gen)
    return x, weight, grad


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("per_document", [False, True])
def test_matches_nemo_per_document(per_document):
    """Packed rows (documents shorter than, equal to and longer than the halo; a pad tail)."""
    doc_ids = doc_ids_from_lengths([([1, 9, 4, 23, 10], 1), ([48], 0)])
    x, weight, grad = make(2, 48, seed=0)
    ours = fns.dilated_conv_fwd_bwd(None, x, weight, doc_ids, DILATION, grad)
    for a, b in zip(ours, nemo_fwd_bwd(x, weight, doc_ids, grad, per_document)):
        close(a, b)


@st.composite
def packing(draw):
    world = draw(st.sampled_from([1, 2, 4]))
    local = draw(st.integers(2, 12))  # shards shorter than the 9-token halo: multi-hop
    total = world * local
    rows = []
    for _ in range(draw(st.integers(1, 2))):
        pad = draw(st.one_of(st.just(0), st.integers(0, total)))
        lens, left = [], total - pad
        while left:
            lens.append(min(left, draw(st.one_of(st.integers(1, 10), st.just(total)))))
            left -= lens[-1]
        rows.append((lens, pad))
    return world, doc_ids_from_lengths(rows), draw(st.integers(0, 2**16))


@settings(deadline=None, max_examples=15)
@given(case=packing())
def test_cp_equals_nemo_single_process(rank_pool, case):
    world, doc_ids, seed = case
    x, weight, grad = make(doc_ids.shape[0], doc_ids.shape[1], seed)
    res = rank_pool.run(fns.dilated_conv_fwd_bwd, world, x, weight, doc_ids, DILATION, grad)
    y, dx, dw = nemo_fwd_bwd(x, weight, doc_ids, grad, per_document=False)
    close(torch.cat([r[0] for r in res], 1), y)
    close(torch.cat([r[1] for r in res], 1), dx)
    # per-rank partial sums of the weight gradient: a sum over every token, in another order
    close(sum(r[2] for r in res), dw, tol=1e-5)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_one_document_across_every_rank_with_short_shards(rank_pool, world):
    """4 tokens per rank (< 9): rank 3's halo comes from ranks 0-2, within one document."""
    doc_ids = doc_ids_from_lengths([([2, 13, 1], 0)])
    x, weight, grad = make(1, 16, seed=1)
    res = rank_pool.run(fns.dilated_conv_fwd_bwd, world, x, weight, doc_ids, DILATION, grad)
    y, dx, dw = nemo_fwd_bwd(x, weight, doc_ids, grad, per_document=True)
    close(torch.cat([r[0] for r in res], 1), y)
    close(torch.cat([r[1] for r in res], 1), dx)
    close(sum(r[2] for r in res), dw, tol=1e-5)


@pytest.mark.parametrize("value", [0.5, float("nan"), float("inf")])
@pytest.mark.parametrize("world", [1, 4])
def test_other_documents_bitwise_unchanged(rank_pool, world, value):
    """Changing one document (to other values, or a NaN / inf token) leaves every other token's
    output and input gradient bitwise equal (4 tokens per rank, documents across ranks)."""
    doc_ids = doc_ids_from_lengths([([3, 7, 5, 1], 0)])
    x, weight, grad = make(1, 16, seed=2)
    inside = doc_ids[0] == 2  # tokens 3..9, across ranks 0-2
    poisoned = x.clone()
    poisoned[0, inside] = poisoned[0, inside] * value if value == 0.5 else value
    clean = rank_pool.run(fns.dilated_conv_fwd_bwd, world, x, weight, doc_ids, DILATION, grad)
    dirty = rank_pool.run(fns.dilated_conv_fwd_bwd, world, poisoned, weight, doc_ids, DILATION,
                          grad)  # fmt: skip
    for i in (0, 1):  # output, input gradient
        c, d = (torch.cat([r[i] for r in rs], 1)[:, ~inside] for rs in (clean, dirty))
        assert torch.isfinite(d).all() and torch.equal(c, d)
