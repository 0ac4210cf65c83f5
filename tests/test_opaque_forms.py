"""The opaque custom ops that hide KDA's per-shard work and GLA's per-key pair scores from
Dynamo (:mod:`fcp.ops.kit.opaque`): ``torch.library.opcheck`` (fake kernels, autograd
registration, dynamic-shape AOT dispatch), and the recomputed backward equals autograd through
the same eager pieces, bitwise."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fcp.ops.gla import keyed
from fcp.ops.kda import chunked
from fcp.ops.kit.recurrence import augmented_start
from fcp.scan import chunk_scan


def _kda_args(scalar: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    b, n, h, hv, dk, dv = 1, 40, 1, 2, 4, 5
    q = torch.randn(b, n, h, dk, generator=gen)
    k = F.normalize(torch.randn(b, n, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, n, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(b, n, hv, *(() if scalar else (dk,)), generator=gen))
    beta = torch.rand(b, n, hv, generator=gen)
    runs = torch.tensor([1] * 5 + [2] * 20 + [3] * 15)[None]  # 3 runs, one crossing chunks
    before = torch.ones(1, 1, dtype=torch.int64)  # the shard continues run 1
    return [q, k, v, g, beta], runs, before


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("cp", [False, True])
def test_kda_local_opcheck(scalar, cp):
    tensors, runs, before = _kda_args(scalar)
    args = [t.clone().requires_grad_() for t in tensors]
    torch.library.opcheck(chunked.kda_local_fwd, (*args, runs, before, 16, cp))


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("cp", [False, True])
def test_kda_local_backward_equals_autograd(scalar, cp):
    """The op's forward and backward against autograd through its pieces (prologue, the scan
    op, read-out), on gradients of the output and of the final state."""
    tensors, runs, before = _kda_args(scalar, seed=1)
    gen = torch.Generator().manual_seed(2)
    ours = [t.clone().requires_grad_() for t in tensors]
    ref = [t.clone().requires_grad_() for t in tensors]
    out, final, *_ = chunked.kda_local_fwd(*ours, runs, before, 16, cp)
    w, u0, kd, dec, qg, aqk = chunked._prologue(*ref, runs, before, 16)
    u0, s0 = augmented_start(u0, 4) if cp else (u0, None)
    states, pseudo, final_r = chunk_scan(w, u0, kd, dec, s0)
    out_r = chunked._epilogue(qg, aqk, states, pseudo, 40)
    assert torch.equal(out, out_r) and torch.equal(final, final_r)
    g_out, g_final = torch.randn(out.shape, generator=gen), torch.randn(final.shape, generator=gen)
    ((out * g_out).sum() + (final * g_final).sum()).backward()
    ((out_r * g_out).sum() + (final_r * g_final).sum()).backward()
    for name, a, b in zip("q k v g beta".split(), ours, ref):
        assert torch.equal(a.grad, b.grad), name


def test_gla_pair_scores_opcheck_and_backward():
    gen = torch.Generator().manual_seed(3)
    b, groups, rep, n, c, dk = 1, 2, 2, 3, 8, 4
    q, k = (torch.randn(b, groups, 1, n, c, dk, generator=gen) for _ in range(2))
    a = -F.softplus(torch.randn(b, groups, rep, n, c, dk, generator=gen))
    seg = torch.tensor([1] * 5 + [2] * 10 + [3] * 9).view(b, 1, 1, n, c)
    torch.library.opcheck(keyed.gla_pair_scores,
                          (*[t.clone().requires_grad_() for t in (q, k, a)], seg))  # fmt: skip
    ours = [t.clone().requires_grad_() for t in (q, k, a)]
    ref = [t.clone().requires_grad_() for t in (q, k, a)]
    out, out_r = keyed.gla_pair_scores(*ours, seg), keyed._pair_scores(*ref, seg)
    assert torch.equal(out, out_r)
    weight = torch.randn(out.shape, generator=gen)
    (out * weight).sum().backward()
    (out_r * weight).sum().backward()
    for a_, b_ in zip(ours, ref):
        assert torch.equal(a_.grad, b_.grad)


class _PassThrough(TorchDispatchMode):
    """A user's dispatch mode (a FLOP or byte counter) that sees every op."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_backward_under_hooks_and_dispatch_modes_equals_without():
    """A step run whole under saved-tensor hooks (activation offloading, ``save_on_cpu``) or a
    user's ``TorchDispatchMode``: the recomputing backward kernels run, the hooks and the mode
    see the operators' work, and the gradients are bitwise those of a plain step; the hooks
    are set aside only inside the backward kernels (they never see the recomputation's
    tensors) and are back in place after."""
    import fcp
    from fcp.ops.kda import kda

    tensors, _, _ = _kda_args(False, seed=4)
    doc_ids = torch.tensor([1] * 5 + [2] * 20 + [3] * 15)[None]
    ctx = fcp.shard_batch(None, {"input_ids": doc_ids, "doc_ids": doc_ids})[1]
    packed, mode = [], _PassThrough()

    def pack(t):
        packed.append(t.shape)
        return t

    results = []
    for wrap in ("none", "hooks", "mode"):
        args = [t.clone().requires_grad_() for t in tensors]
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks if wrap == "hooks" else mode if wrap == "mode" else contextlib.nullcontext():
            q, k, v, g, beta = args
            o = kda(q, k, v, g, beta, ctx, chunk_size=16)
            o = fcp.gla(q, k, o[..., :4], g, ctx, chunk_size=16)
            loss = o.square().sum()
            saved = len(packed)
            loss.backward()
            # the recomputation's transient tensors never reach the user's hooks
            assert len(packed) == saved
            if wrap == "hooks":
                assert torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
        results.append([a.grad for a in args])
    assert packed and mode.ops, "the hooks or the mode saw nothing"
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
