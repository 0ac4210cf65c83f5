"""fcp.scan's scans against the plain loops they replace, fp64, forward and hand-written
backward: every tree shape (odd levels), broadcast decays, exact zeros; their custom ops pass
``torch.library.opcheck`` and compile once for every chunk count (a dynamic length)."""

from __future__ import annotations

import pytest
import torch

from fcp import scan
from fcp.scan import chunk_scan, decay_scan


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


# ---------------------------------------------------------------------------------------------
# chunk_scan (the delta rule's affine chunk maps)
# ---------------------------------------------------------------------------------------------
def chunk_loop(w, u0, kd, dec, s0):
    """The recurrence of :func:`fcp.scan.chunk_scan`'s docstring, one chunk at a time."""
    state = w.new_zeros(*w.shape[:-3], w.shape[-1], u0.shape[-1]) if s0 is None else s0
    states, pseudo = [], []
    for i in range(w.shape[-3]):
        states.append(state)
        u = u0[..., i, :, :] - w[..., i, :, :] @ state
        pseudo.append(u)
        state = dec[..., i, :, None] * state + kd[..., i, :, :].transpose(-1, -2) @ u
    stack = (lambda xs, like: torch.stack(xs, -3) if xs else like.new_zeros(
        *like.shape[:-3], 0, *like.shape[-2:]))  # fmt: skip
    return stack(states, state[..., None, :, :]), stack(pseudo, u0), state


def chunk_inputs(n, with_s0, seed, c=3, k=4, v=5):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(2, *shape, generator=gen, dtype=torch.float64) / 2  # noqa: E731
    dec = torch.rand(2, n, k, generator=gen, dtype=torch.float64)
    return r(n, c, k), r(n, c, v), r(n, c, k), dec, (r(k, v) if with_s0 else None)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8])
@pytest.mark.parametrize("with_s0", [False, True])
def test_chunk_scan_equals_the_loop_forward_and_backward(n, with_s0):
    xs = chunk_inputs(n, with_s0, seed=n)
    leaves = [x.requires_grad_() for x in xs if x is not None]
    gen = torch.Generator().manual_seed(7)
    cot = [torch.randn(2, n, 4, 5, generator=gen, dtype=torch.float64),
           torch.randn(2, n, 3, 5, generator=gen, dtype=torch.float64),
           torch.randn(2, 4, 5, generator=gen, dtype=torch.float64)]  # fmt: skip
    results = []
    for fn in (chunk_scan, chunk_loop):
        outs = fn(*xs)
        loss = sum((o * g).sum() for o, g in zip(outs, cot))
        grads = []  # no chunks and no s0: nothing depends on the inputs
        if loss.requires_grad:
            grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
        results.append((*outs, *grads))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("with_s0", [False, True])
def test_scan_ops_pass_opcheck(with_s0):
    xs = chunk_inputs(5, with_s0, seed=3)
    torch.library.opcheck(scan.chunk_scan_fwd, xs)
    states, pseudo, final, a, upper = scan.chunk_scan_fwd(*xs)
    torch.library.opcheck(scan.chunk_scan_bwd, (xs[0], xs[2], states, pseudo, a, upper,
                                                torch.randn_like(states), None,
                                                torch.randn_like(final), with_s0))  # fmt: skip
    dec, b, s0 = inputs(5, (4, 1), with_s0, seed=4)
    torch.library.opcheck(scan.decay_scan_fwd, (dec, b, s0))
    states, final = scan.decay_scan_fwd(dec, b, s0)
    torch.library.opcheck(scan.decay_scan_bwd, (states, dec, b, s0, None, torch.randn_like(final)))


def test_a_single_chunk_returns_no_view_of_the_entering_state():
    """One chunk: the entering state is the output; it must be a copy (custom ops never alias)."""
    w, u0, kd, dec, s0 = chunk_inputs(1, True, seed=5)
    states = chunk_scan(w, u0, kd, dec, s0)[0]
    assert torch.equal(states[:, 0], s0) and states.data_ptr() != s0.data_ptr()


def test_scans_compile_once_for_every_chunk_count():
    """The tree's shape depends on the chunk count; inside the opaque ops it does not reach the
    graph, so a dynamic count compiles once (it used to guard on every level's parity)."""
    import torch._dynamo.testing

    def both(w, u0, kd, dec, s0, ddec, b):
        states, pseudo, final = chunk_scan(w, u0, kd, dec, s0)
        d_states, d_final = decay_scan(ddec, b)
        return states.sum() + pseudo.sum() + final.sum() + d_states.sum() + d_final.sum()

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(both, backend=counter, fullgraph=True, dynamic=True)
    for n in (6, 7, 11, 16):  # none equal to another size (duck sizing would tie them)
        xs = [x.requires_grad_() for x in chunk_inputs(n, True, seed=n)]
        dec, b, _ = inputs(n, (1, 1), False, seed=n)
        args = (*xs, dec.requires_grad_(), b.requires_grad_())
        got = torch.autograd.grad(compiled(*args), args)
        want = torch.autograd.grad(both(*args), args)
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    assert counter.frame_count == 1, counter.frame_count
