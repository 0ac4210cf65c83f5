"""Properties of fcp's collectives on real gloo groups (1-4 ranks), forward and backward.

Every CP result is compared with a single-process reference computed on the concatenated global
tensors; gradients with autograd through that reference. fp32/fp64 must match to 1e-6 (the
collectives only move data, so they are exact in practice); bf16 data is moved bit-exactly too,
but the state chain accumulates in fp32, so its bf16 case is held to 1e-2 relative. With
``dtype=torch.float32`` a bf16 gradient summed over ranks is rounded once (within 2**-8).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from tests import _comm_rank_fns as fns

DTYPES = [torch.float32, torch.float64, torch.bfloat16]
SETTINGS = settings(max_examples=25, deadline=None)
FEW = settings(max_examples=12, deadline=None)
#: what every property draws: the world size, the data's dtype and the seed of its values
COMMON = dict(world=st.integers(1, 4), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))


def _seeded(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


@SETTINGS
@given(
    ndim=st.integers(2, 4),
    dim_pick=st.integers(0, 3),
    local=st.integers(1, 5),
    shard_div=st.sampled_from([1, 1, 4]),
    **COMMON,
)
def test_all_gather_sequence_matches_concat(rank_pool, world, ndim, dim_pick, local, shard_div,
                                            dtype, seed):
    dim = dim_pick % ndim
    shape = [2, 3, 2, 3][:ndim]
    shape[dim] = local * world
    full = _seeded(shape, dtype, seed)
    weights = _seeded([world, *shape], torch.float32, seed + 1)
    results = rank_pool.run(fns.gather_fwd_bwd, world, full, weights, dim, shard_div)
    # Reference: every rank's loss is sum(full * w_r); rank r's grad is its slice of sum_r w_r.
    ref_grad = weights.sum(0)
    for rank, (out, grad) in enumerate(results):
        assert out.dtype == dtype and torch.equal(out, full)
        expect = ref_grad.narrow(dim, rank * local, local).to(dtype)
        tol = 1e-6 if dtype != torch.bfloat16 else 3e-2  # bf16: the reduce-scatter sums in bf16
        torch.testing.assert_close(grad.double(), expect.double(), rtol=tol, atol=tol)


@SETTINGS
@given(local=st.integers(1, 6), history_factor=st.floats(0, 3.5), channels=st.integers(1, 3),
       **COMMON)
def test_left_halo_matches_global_slice(rank_pool, world, local, history_factor, channels,
                                        dtype, seed):
    history = int(history_factor * local)
    full = _seeded([2, local * world, channels], dtype, seed)
    weights = _seeded([world, 2, history, channels], torch.float32, seed + 1)
    results = rank_pool.run(fns.halo_fwd_bwd, world, full, history, weights)

    # Reference on the global tensor, with autograd through plain slicing.
    ref_full = full.double().requires_grad_()
    loss = 0
    for rank in range(world):
        start = rank * local
        left = max(0, start - history)
        ref = torch.cat([ref_full.new_zeros(2, history - (start - left), channels),
                         ref_full[:, left:start]], 1)
        loss = loss + (ref * weights[rank].double()).sum()
        out, _ = results[rank]
        assert out.shape == (2, history, channels) and out.dtype == dtype
        assert torch.equal(out, ref.detach().to(dtype))
    loss.backward()
    tol = 1e-6 if dtype != torch.bfloat16 else 2e-2
    for rank, (_, grad) in enumerate(results):
        expect = ref_full.grad[:, rank * local : (rank + 1) * local]
        torch.testing.assert_close(grad.double(), expect, rtol=tol, atol=tol)


@SETTINGS
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), k=st.integers(1, 4),
       v=st.integers(1, 4), **COMMON)
def test_state_chain_matches_sequential_reference(rank_pool, world, lead, k, v, dtype, seed):
    ms = (_seeded([world, *lead, k, k], torch.float64, seed) * 0.5).to(dtype)
    ss = _seeded([world, *lead, k, v], dtype, seed + 1)
    weights = _seeded([world, *lead, k, v], torch.float32, seed + 2)
    results = rank_pool.run(fns.chain_fwd_bwd, world, ms, ss, weights)

    m_ref = ms.double().requires_grad_()
    s_ref = ss.double().requires_grad_()
    loss = 0
    expected = []
    for rank in range(world):
        acc = torch.zeros([*lead, k, v], dtype=torch.float64)
        for j in range(rank):
            acc = m_ref[j] @ acc + s_ref[j]
        expected.append(acc)
        loss = loss + (acc * weights[rank].double()).sum()
    if world > 1:
        loss.backward()
    else:
        m_ref.grad, s_ref.grad = torch.zeros_like(m_ref), torch.zeros_like(s_ref)
    tol = 1e-6 if dtype != torch.bfloat16 else 1e-2
    for rank, (s_in, m_grad, s_grad, out_dtype) in enumerate(results):
        assert out_dtype == torch.float32  # fp32 accumulation whatever the input dtype
        torch.testing.assert_close(s_in.double(), expected[rank], rtol=tol, atol=tol)
        torch.testing.assert_close(m_grad.double(), m_ref.grad[rank], rtol=tol, atol=tol)
        torch.testing.assert_close(s_grad.double(), s_ref.grad[rank], rtol=tol, atol=tol)


@FEW
@given(
    world=st.integers(1, 4),
    local=st.integers(1, 5),
    history_factor=st.floats(0, 2.5),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_widened_gather_and_halo_round_summed_gradients_once(rank_pool, world, local,
                                                             history_factor, dtype, seed):
    """``dtype=torch.float32``: results in at least fp32 holding the input's values exactly, and
    each token's gradient (its own plus every rank's partial) summed before one rounding."""
    history = int(history_factor * local)
    full = _seeded([2, local * world, 3], dtype, seed)
    wg = _seeded([world, 2, local * world, 3], torch.float32, seed + 1)
    wh = _seeded([world, 2, history + local, 3], torch.float32, seed + 2)
    results = rank_pool.run(fns.widened_fwd_bwd, world, full, history, wg, wh)

    wide = torch.promote_types(dtype, torch.float32)
    exact_g, exact_h = wg.double().sum(0), torch.zeros_like(full, dtype=torch.float64)
    for rank in range(world):
        for i in range(history + local):  # extended position i is global token rank*L - H + i
            p = rank * local - history + i
            if p >= 0:
                exact_h[:, p] += wh[rank, :, i].double()
    bf16 = dtype == torch.bfloat16
    tol = dict(rtol=2**-8, atol=1e-5) if bf16 else dict(rtol=1e-6, atol=1e-6)
    for rank, (g, h, grad_g, grad_h) in enumerate(results):
        assert g.dtype == h.dtype == wide and grad_g.dtype == grad_h.dtype == dtype
        assert torch.equal(g, full.to(wide))
        start = rank * local
        halo = full[:, max(0, start - history) : start + local].to(wide)
        assert torch.equal(h[:, history + local - halo.shape[1] :], halo)
        assert not h[:, : history + local - halo.shape[1]].any()  # before the sequence start
        mine = slice(start, start + local)
        torch.testing.assert_close(grad_g.double(), exact_g[:, mine], **tol)
        torch.testing.assert_close(grad_h.double(), exact_h[:, mine], **tol)
