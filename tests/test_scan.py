"""fcp.scan.decay_scan (diagonal transitions) against the plain loop it replaces, fp64, forward
and hand-written backward: every tree shape (odd levels), broadcast decays, exact zeros."""

from __future__ import annotations

import pytest
import torch

from fcp.scan import decay_scan


def loop(dec, b, s0):
    """``for i: states.append(S); S = dec[i] * S + b[i]`` (the definition)."""
    state = torch.zeros_like(b[..., 0, :, :]) if s0 is None else s0
    states = []
    for i in range(b.shape[-3]):
        states.append(state)
        state = dec[..., i, :, :] * state + b[..., i, :, :]
    return torch.stack(states, -3), state


def inputs(n, dec_shape, with_s0, seed):
    gen = torch.Generator().manual_seed(seed)
    dec = torch.rand(2, 3, n, *dec_shape, generator=gen, dtype=torch.float64)
    dec = torch.where(torch.rand(dec.shape, generator=gen, dtype=torch.float64) < 0.2, 0.0, dec)
    b = torch.randn(2, 3, n, 4, 5, generator=gen, dtype=torch.float64)
    s0 = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64) if with_s0 else None
    return dec, b, s0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 8, 13])
@pytest.mark.parametrize("dec_shape", [(1, 1), (4, 1)])
@pytest.mark.parametrize("with_s0", [False, True])
def test_equals_the_loop_forward_and_backward(n, dec_shape, with_s0):
    dec, b, s0 = inputs(n, dec_shape, with_s0, seed=n)
    leaves = [x.requires_grad_() for x in (dec, b, s0) if x is not None]
    gen = torch.Generator().manual_seed(99)
    g_states = torch.randn(2, 3, n, 4, 5, generator=gen, dtype=torch.float64)
    g_final = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    results = []
    for fn in (decay_scan, loop):
        states, final = fn(dec, b, s0)
        grads = torch.autograd.grad((states * g_states).sum() + (final * g_final).sum(), leaves)
        results.append((states, final, *grads))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("use", ["states", "final"])
def test_backward_with_one_output_unused(use):
    dec, b, s0 = inputs(6, (1, 1), True, seed=1)
    leaves = [x.requires_grad_() for x in (dec, b, s0)]
    results = []
    for fn in (decay_scan, loop):
        states, final = fn(dec, b, s0)
        out = states if use == "states" else final
        results.append(torch.autograd.grad(out.sum(), leaves))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_zero_decay_separates_exactly():
    """An exact zero transition: every later state is bitwise independent of earlier inputs."""
    dec, b, _ = inputs(7, (1, 1), False, seed=2)
    dec[..., 3, :, :] = 0.0
    other = b.clone()
    other[..., :3, :, :] = 1e3 * torch.randn_like(other[..., :3, :, :])
    s1, f1 = decay_scan(dec, b)
    s2, f2 = decay_scan(dec, other)
    assert torch.equal(s1[..., 4:, :, :], s2[..., 4:, :, :]) and torch.equal(f1, f2)
