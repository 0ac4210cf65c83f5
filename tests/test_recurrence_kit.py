"""The recurrence kit (:mod:`fcp.ops.kit.recurrence`) piece by piece, against dense or per-token
oracles in fp64: run numbering on hand examples, exact masked exponentials, the WY hierarchy
against ``torch.linalg.inv``, the DPLR wiring against a per-token loop. Single process, cheap;
the operators built on the kit (``kda``, ``gla``) are tested end to end, under CP too, in their
own files."""

from __future__ import annotations

import pytest
import torch

from fcp.context import PackedContext
from fcp.ops.kit.recurrence import (
    boundary_decays,
    chunk_runs,
    dplr_maps,
    dplr_outputs,
    dplr_scan,
    entering_state,
    entry_products,
    interior_starts,
    masked_exp,
    merge_inverse,
    unit_lower_inverse,
    wy_forms,
    wy_forms_scalar,
)

F64 = torch.float64
DOCS = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2, 3, 0, 0, 0]])  # runs of 3, 5, 1 tokens, pad 3


def rank_context(doc_ids: torch.Tensor, cp_size: int, rank: int) -> PackedContext:
    """A rank's context for host-side pieces only (nothing here runs a collective)."""
    return PackedContext(doc_ids, group=object(), cp_size=cp_size, cp_rank=rank)


# ---------------------------------------------------------------------------------------------
# run numbering and masks
# ---------------------------------------------------------------------------------------------
def test_chunk_runs_numbers_runs_globally_and_pads_with_the_last_run():
    seg, prev = chunk_runs(PackedContext(DOCS), 3, 4)
    assert seg.tolist() == [[[1, 1, 1, 2], [2, 2, 2, 2], [3, 4, 4, 4]]]
    assert prev.tolist() == [[0, 2, 2]]  # 0 before the row; else the previous chunk's last run
    # rank 1 of 2 (tokens 6..11): ids are the global ones, prev is rank 0's last token's run;
    # 3 chunks of 2 = its 6 tokens, then chunks of 4 pad 2 tokens with the last run
    ctx = rank_context(DOCS, 2, 1)
    seg, prev = chunk_runs(ctx, 3, 2)
    assert seg.tolist() == [[[2, 2], [3, 4], [4, 4]]] and prev.tolist() == [[2, 2, 4]]
    seg, prev = chunk_runs(ctx, 2, 4)
    assert seg.tolist() == [[[2, 2, 3, 4], [4, 4, 4, 4]]] and prev.tolist() == [[2, 4]]


def test_interior_starts_leave_the_shards_first_token_alone():
    assert interior_starts(PackedContext(DOCS)).tolist() == [
        [False, False, False, True, False, False, False, False, True, True, False, False]]
    # rank 1 of 3 (tokens 4..7) starts mid-document; rank 2 (8..11) starts a run at its token 0
    assert interior_starts(rank_context(DOCS, 3, 1)).tolist() == [[False] * 4]
    assert interior_starts(rank_context(DOCS, 3, 2)).tolist() == [[False, True, False, False]]


def test_masked_exp_gives_exact_zeros_and_zero_gradients_where_masked():
    mask = torch.tensor([True, False, True, False])
    x = torch.tensor([-1.0, 1e4, 0.0, float("nan")], dtype=F64, requires_grad=True)
    y = masked_exp(mask, x)
    assert y[1].item() == 0.0 and y[3].item() == 0.0 and torch.isfinite(y).all()
    y.sum().backward()
    assert x.grad[1].item() == 0.0 and x.grad[3].item() == 0.0
    assert torch.equal(x.grad[mask], torch.exp(x.detach()[mask]))


# ---------------------------------------------------------------------------------------------
# diagonal chunk boundaries
# ---------------------------------------------------------------------------------------------
def test_boundary_decays_reach_only_the_carried_run():
    a = torch.full((1, 2, 4), -0.5, dtype=F64)  # [batch, N, C]
    seg = torch.tensor([[[1, 1, 2, 2], [2, 2, 2, 2]]])
    prev = torch.tensor([[1, 2]])
    decay_in, dec = boundary_decays(a, seg, prev)
    expect = torch.tensor([[[-0.5, -1.0, 0, 0], [-0.5, -1.0, -1.5, -2.0]]], dtype=F64).exp()
    expect[0, 0, 2:] = 0.0  # run 2 starts inside chunk 0: no entering state reaches it
    assert torch.equal(decay_in, expect)
    assert dec.tolist() == [[0.0, expect[0, 1, 3].item()]]


def test_entry_products_are_exclusive_prefix_products():
    dec = torch.rand(2, 3, 7, dtype=F64)
    prefix, total = entry_products(dec)
    ones = torch.ones(2, 3, 1, dtype=F64)
    torch.testing.assert_close(prefix, torch.cat([ones, dec[..., :-1]], -1).cumprod(-1))
    torch.testing.assert_close(total, dec.prod(-1))


# ---------------------------------------------------------------------------------------------
# the WY hierarchy
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("c", [1, 2, 8, 16])
def test_unit_lower_inverse_equals_the_dense_inverse(c):
    a = torch.randn(2, 3, c, c, dtype=F64, generator=torch.Generator().manual_seed(c)) * 0.3
    eye = torch.eye(c, dtype=F64)
    torch.testing.assert_close(unit_lower_inverse(a), torch.linalg.inv(eye + a.tril(-1)))


def test_unit_lower_inverse_keeps_block_zeros_exact():
    c, runs = 8, torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])
    a = torch.randn(c, c, dtype=F64) * torch.where(runs[:, None] == runs[None, :], 1.0, 0.0)
    inv = unit_lower_inverse(a)
    assert (inv[runs[:, None] != runs[None, :]] == 0).all()  # exactly, not to rounding
    torch.testing.assert_close(inv, torch.linalg.inv(torch.eye(c, dtype=F64) + a.tril(-1)))


def test_merge_inverse_is_the_two_by_two_block_inverse():
    gen = torch.Generator().manual_seed(3)
    l11, l22 = (torch.eye(2, dtype=F64) + torch.randn(2, 2, dtype=F64, generator=gen).tril(-1)
                for _ in range(2))  # fmt: skip
    l21 = torch.randn(1, 2, 2, dtype=F64, generator=gen)
    d = torch.stack([torch.linalg.inv(l11), torch.linalg.inv(l22)])
    zero = torch.zeros(2, 2, dtype=F64)
    full = torch.cat([torch.cat([l11, zero], 1), torch.cat([l21[0], l22], 1)])
    torch.testing.assert_close(merge_inverse(d, l21)[0], torch.linalg.inv(full))


def dense_wy(q, k, g, beta, runs):
    """The :class:`WyForms` of one chunk by their definitions: ``q, k, g [C, K]``, ``beta [C]``,
    ``runs [C]``."""
    c = q.shape[0]
    same = (runs[:, None] == runs[None, :]) & torch.ones(c, c, dtype=torch.bool).tril()
    cum = g.cumsum(0)
    decay = torch.exp(cum[:, None, :] - cum[None, :, :])  # [t, i, K]: exp(D(i, t])
    def pair(x):  # x_t . (exp(D(i, t]) * k_i) for same-run i <= t
        return torch.where(same, torch.einsum("tk,tik,ik->ti", x, decay, k), 0.0)

    aqk, a = pair(q), pair(k) * beta[:, None]
    t_inv = torch.linalg.inv(torch.eye(c, dtype=F64) + a.tril(-1))
    first = [min(j for j in range(t + 1) if all(runs[m] == runs[t] for m in range(j, t + 1)))
             for t in range(c)]  # fmt: skip
    last = [max(j for j in range(t, c) if all(runs[m] == runs[t] for m in range(t, j + 1)))
            for t in range(c)]  # fmt: skip
    fwd = torch.stack([g[first[t] : t + 1].sum(0) for t in range(c)])
    rev = torch.stack([g[t + 1 : last[t] + 1].sum(0) for t in range(c)])
    return aqk, t_inv, fwd, rev


def test_wy_forms_equal_their_definitions_per_chunk():
    gen = torch.Generator().manual_seed(0)
    c, dk = 8, 4
    runs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 2, 3, 3, 3, 3, 3]])  # [N, C]
    q, k = (torch.randn(1, 2, 2, c, dk, dtype=F64, generator=gen) for _ in range(2))
    g = -torch.rand(1, 2, 2, c, dk, dtype=F64, generator=gen)
    beta = torch.rand(1, 2, 2, c, 1, dtype=F64, generator=gen)
    forms = wy_forms(q, k, g, beta, runs[None, None])
    for h in range(2):
        for n in range(2):
            want = dense_wy(q[0, h, n], k[0, h, n], g[0, h, n], beta[0, h, n, :, 0], runs[n])
            for got, exp in zip(forms, want):
                torch.testing.assert_close(got[0, h, n], exp)
    # a scalar gate per head is the same recurrence as that gate broadcast over K
    gs = g[..., :1]
    scalar = wy_forms_scalar(q, k, gs, beta, runs[None, None])
    broad = wy_forms(q, k, gs.expand_as(g), beta, runs[None, None])
    for got, exp in zip(scalar, broad):
        torch.testing.assert_close(got.expand_as(exp), exp)


# ---------------------------------------------------------------------------------------------
# the DPLR transition and its wiring
# ---------------------------------------------------------------------------------------------
def test_dplr_maps_are_diagonal_minus_low_rank():
    gen = torch.Generator().manual_seed(1)
    w, kd = (torch.randn(3, 2, 4, dtype=F64, generator=gen) for _ in range(2))
    u0, dec = torch.randn(3, 2, 5, dtype=F64, generator=gen), torch.rand(3, 4, dtype=F64)
    a, b = dplr_maps(w, u0, kd, dec)
    torch.testing.assert_close(a, torch.diag_embed(dec) - kd.transpose(-1, -2) @ w)
    torch.testing.assert_close(b, kd.transpose(-1, -2) @ u0)
    # the scan applies exactly these maps: S_{i+1} = A_i S_i + B_i
    states, _, final = dplr_scan(w, u0, kd, dec)
    s = torch.zeros(4, 5, dtype=F64)
    for i in range(3):
        torch.testing.assert_close(states[i], s)
        s = a[i] @ s + b[i]
    torch.testing.assert_close(final, s)


def token_loop(q, k, w, u, d, doc_ids):
    """``S_t = diag(d_t) S - k_t (w_t^T S) + k_t u_t^T``, ``o_t = S_t^T q_t`` per (batch, head),
    restarted at every run start: ``[B, H, T, .]`` inputs, ``doc_ids [B, T]``."""
    b, h, t = q.shape[:3]
    out = torch.zeros(b, h, t, u.shape[-1], dtype=q.dtype)
    for r in range(b):
        s = torch.zeros(h, q.shape[-1], u.shape[-1], dtype=q.dtype)
        for i in range(t):
            if i == 0 or doc_ids[r, i] != doc_ids[r, i - 1]:
                s = torch.zeros_like(s)
            ki = k[r, :, i, :, None]
            s = d[r, :, i, :, None] * s - ki * (w[r, :, i, None] @ s) + ki * u[r, :, i, None]
            out[r, :, i] = (s.transpose(-1, -2) @ q[r, :, i, :, None])[..., 0]
    return out


def test_dplr_outputs_equal_a_per_token_loop():
    """One token per chunk (the module docstring's worked example, batch 2 and 3 heads): the
    kit's masks, scan and outputs against the loop; exact zeros keep the runs apart."""
    gen = torch.Generator().manual_seed(2)
    doc_ids = torch.cat([DOCS, torch.tensor([[1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]])])
    b, h, t, dk, dv = 2, 3, doc_ids.shape[1], 4, 3
    q, k, w = (torch.randn(b, h, t, dk, dtype=F64, generator=gen) for _ in range(3))
    u = torch.randn(b, h, t, dv, dtype=F64, generator=gen)
    d = torch.rand(b, h, t, dk, dtype=F64, generator=gen)
    seg, prev = chunk_runs(PackedContext(doc_ids), t, 1)
    carry = (seg == prev[..., None])[:, None, :, :, None]  # [B, 1, T, 1, 1]
    wc = torch.where(carry, w[..., None, :], 0.0)
    dec = torch.where(carry[..., 0, :], d, 0.0)
    qc, kc = q[..., None, :], k[..., None, :]
    out = dplr_outputs(wc, u[..., None, :], kc, dec, qc * dec[..., None, :],
                       qc @ kc.transpose(-1, -2), PackedContext(doc_ids))  # fmt: skip
    torch.testing.assert_close(out[..., 0, :], token_loop(q, k, w, u, d, doc_ids))


def test_entering_state_is_zero_without_cp_for_both_transition_kinds():
    final = torch.randn(2, 3, 4, 5, dtype=F64)
    for transition in (torch.rand(2, 3, dtype=F64), torch.rand(2, 3, 4, 4, dtype=F64)):
        s_in = entering_state(transition, final, PackedContext(DOCS))
        assert s_in.dtype == torch.float32 and s_in.shape == final.shape
        assert not s_in.any()
