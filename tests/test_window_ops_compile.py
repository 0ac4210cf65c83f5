"""The operators the sliding-window and DSA families added (issue 30) compile once for ten
packings: ``torch.compile(fullgraph=True)`` with aot_eager's parts, one frame for every packing of
a shape, no host synchronisation in the graphs, outputs and input gradients equal to eager.

``sliding_window_attention`` is checked with the other softmax operators
(``tests/test_attention.py``); here: ``token_lags``, ``relative_attention``, ``gated_pools`` ->
``pooled_window_attention`` (DeepSeek-V4's HCA and CSA shapes), ``pool_select`` and
``token_indexer`` (integer ids, no gradient: equal to eager bitwise).
"""

from __future__ import annotations

import pytest
import torch

import fcp
from fcp.context import PackedContext
from tests.support.cp_jobs import GraphRecorder
from tests.support.inputs import rel_err
from tests.support.packing import random_packings

B, L, H, D = 2, 24, 2, 8
PACKINGS = random_packings(10, B, L, seed=30)


def _tensors(seed: int, shapes: dict) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


def _lags(t, ctx):
    return fcp.token_lags(t["x"], ctx, 4, fill=t["fill"])


def _relative(t, ctx):
    return fcp.relative_attention(t["q"], t["k"], t["v"], t["bias"], ctx, 0.4, window=7,
                                  sinks=t["sinks"])  # fmt: skip


def _pooled(overlap: bool):
    width = 2 * D if overlap else D

    def run(t, ctx):
        pooled, _ = fcp.gated_pools(t["kv2"][..., :width], t["gate"][..., :width], ctx, 4,
                                    overlap=overlap)  # fmt: skip
        return fcp.pooled_window_attention(t["q"], t["kv"], pooled, ctx, 4, 5, sinks=t["sinks"])

    return run


def _pool_select(t, ctx):
    return fcp.pool_select(t["iq"], t["ik"], t["w"], ctx, 4, 3, 0.5)


def _token_indexer(t, ctx):
    return fcp.token_indexer(t["iq"], t["ikt"], t["w"], ctx, topk=5)


CASES = {
    "token_lags": (_lags, dict(x=(B, L, 6), fill=(6,))),
    "relative_attention": (_relative, dict(q=(B, L, H, D), k=(B, L, 1, D), v=(B, L, 1, D),
                                           bias=(B, L, H, 5), sinks=(B, L, H))),
    "pooled_hca": (_pooled(False), dict(q=(B, L, H, D), kv=(B, L, D), kv2=(B, L, 2 * D),
                                        gate=(B, L, 2 * D), sinks=(H,))),
    "pooled_csa": (_pooled(True), dict(q=(B, L, H, D), kv=(B, L, D), kv2=(B, L, 2 * D),
                                       gate=(B, L, 2 * D), sinks=(H,))),
    "pool_select": (_pool_select, dict(iq=(B, L, H, D), ik=(B, L // 4, D), w=(B, L, H))),
    "token_indexer": (_token_indexer, dict(iq=(B, L, H, D), ikt=(B, L, D), w=(B, L, H))),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_once_for_ten_packings(name):
    fn, shapes = CASES[name]
    inputs = _tensors(0, shapes)
    torch._dynamo.reset()
    recorder = GraphRecorder()
    compiled = torch.compile(fn, fullgraph=True, backend=recorder)
    for doc_ids in PACKINGS:
        ctx = PackedContext(doc_ids)
        results = []
        for f in (compiled, fn):
            xs = {n: x.clone().requires_grad_() for n, x in inputs.items()}
            out = f(xs, ctx)
            if out.is_floating_point():
                grads = torch.autograd.grad(out, list(xs.values()), torch.ones_like(out),
                                            allow_unused=True)  # fmt: skip
                results.append((out.detach(), grads))
            else:
                results.append((out, ()))
        (out_c, grads_c), (out_e, grads_e) = results
        if out_e.is_floating_point():
            assert rel_err(out_c, out_e) <= 1e-6, name
            for a, b in zip(grads_c, grads_e):
                assert (a is None) == (b is None) and (a is None or rel_err(a, b) <= 1e-6), name
            assert any(g is not None and g.abs().sum() > 0 for g in grads_e), name
        else:
            assert torch.equal(out_c, out_e), name
    assert recorder.frames == 1, (name, recorder.frames)
    assert recorder.host_syncs() == [], recorder.host_syncs()
