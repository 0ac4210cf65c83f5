"""Affine state maps composed by a log-depth associative scan (static shapes, no Python loop).

A linear recurrence split into pieces (chunks of a sequence, or CP ranks) hands each piece the
state ``S_out = A S_in + B`` of the one before. The chunk maps of the *diagonal-plus-low-rank*
(DPLR) transition ``A = diag(dec) - kd^T w`` are those of every delta-rule recurrence (KDA, Gated
DeltaNet; RWKV-7's and DeltaProduct's transitions have the same form); :func:`dplr_maps` builds
them and :func:`chunk_scan` evaluates their chunk recurrence::

    for each chunk i:  states.append(S); u = u0_i - w_i @ S; pseudo.append(u)
                       S = dec_i * S + kd_i^T @ u

without a Python loop over chunks, which ``torch.compile`` would unroll (graph, hence inductor
compile time, linear in the number of chunks ``N``): the graph holds ``O(log N)`` levels of
batched matmuls, forward and backward. :func:`decay_scan` does the same for diagonal transitions
(gated linear attention, Mamba2's SSD). :func:`fold_maps` composes ``[A | B]`` blocks the same
way; :func:`fcp.comm.state_chain` uses it for the chain over CP ranks. The operators reach these
through :mod:`fcp.ops.kit.recurrence` (the recurrence kit: run numbering, the WY hierarchy, the
wiring to the CP state chain); this module is the layer-0 numerics only.

Algebra
-------
Per (batch, value head) and chunk ``i``, with ``w_i [C, K]``, ``u0_i [C, V]``, ``kd_i [C, K]``
(``kd`` not transposed) and ``dec_i [K]``, substituting
``u_i = u0_i - w_i S_i`` into ``S_{i+1} = dec_i * S_i + kd_i^T u_i`` gives the affine map

    S_{i+1} = A_i S_i + B_i,      A_i = diag(dec_i) - kd_i^T w_i    [K, K]
                                  B_i = kd_i^T u0_i                 [K, V]

Maps compose associatively, ``(A2, B2) o (A1, B1) = (A2 A1, A2 B1 + B2)``, so the entering
states ``S_i = (M_{i-1} o ... o M_0)(S_0)`` are an exclusive scan. Work-efficient (Blelloch)
form on a binary tree over the chunks (an odd node at the end of a level is carried up
unpaired, so ``N`` need not be a power of two and nothing is padded):

* up-sweep: ``level[l+1][j] = level[l][2j+1] o level[l][2j]``  (``N - 1`` compositions);
* down-sweep of *states* (never maps): a node entered with ``X`` enters its left child with
  ``X`` and its right child with ``A_left X + B_left`` (``N - 1`` applications ``[K,K] @ [K,V]``);
* ``u_i = u0_i - w_i S_i`` for all chunks in one batched matmul.

Backward (hand-written): with ``G_S``, ``G_u`` the incoming gradients of the
states and pseudo-values and ``G_fin`` that of the final state, the adjoint
``L_i = dLoss/dS_i`` obeys the reversed affine recurrence

    L_N = G_fin,      L_i = A_i^T L_{i+1} + (G_S_i - w_i^T G_u_i),      dS_0 = L_0,

scanned on the *same* tree: a node's reversed map has ``A^T`` with the ``A`` the forward up-sweep
already built (``(A_r A_l)^T = A_l^T A_r^T``), so only its ``[K, V]`` part is composed. Then,
with ``L' = L_{i+1}`` (no ``dA_i`` is ever materialised)::

    du0_i = G_u_i + kd_i L'      dw_i = -du0_i S_i^T      dkd_i = u_i L'^T
    ddec_i = rowsum(L' * S_i)

(autograd through the tree would cost ~2.4x its forward; this costs about the forward.)

Cost (multiply-adds per chunk and head, in units of ``K^3`` for ``C = K = V``): the loop is 2
forward, ~4 backward, sequential. The scan is 6 forward (leaf maps 2, up-sweep 2, down-sweep 1,
``u`` 1) and 6 backward, in ``O(log N)`` batched matmuls. ``C = K`` leaves nothing to gain from
the low rank of ``kd_i^T w_i``.

Context parallelism: ``s0`` and ``u0`` may have any number ``V'`` of columns, so the CP path
(:func:`fcp.ops.kit.recurrence.dplr_outputs`) runs the scan on the augmented state ``[S | P]``
with ``s0 = [0 | I]``, ``u0 -> [u0 | 0]``;
``final = [S_r | M_r]`` feeds ``state_chain``. (The up-sweep root *is* ``[M_r | S_r]``, so the
chain could run between the sweeps without the augmented columns; but the gradient through
``M_r`` needs the prefix products and a ``[K, K]`` adjoint per chunk anyway, so a hand-written
backward for it costs what the augmented one does: only the forward would shrink.)

``benchmarks/bench_kda_scan.py`` measures the whole operator with the scan against the loop it
replaced (eager time, and inductor cold-compile time as the chunk count grows).

Compilation: both scans are ``torch.library`` custom ops (``fcp::chunk_scan_fwd`` /
``_bwd``, ``fcp::decay_scan_fwd`` / ``_bwd``, fake kernels and autograd registered, checked by
``opcheck``). The tree's shape is Python control flow on the chunk count; traced, it guarded on
every level's parity, so each new row length recompiled even with a dynamic sequence dimension.
Opaque, a graph holds one node per scan whatever the count, and a dynamic length compiles once.
The forward hands the backward the leaf maps and the up-sweep's upper levels packed into one
``[..., N + 64, K, K]`` buffer (a size a fake kernel can state; there are ``ceil(log2 N)``).

Precision: every op computes in fp32 (fp64 when an input is fp64), whatever its inputs' (possibly
mixed) dtypes, and its results are in that dtype; the backward returns each input's gradient in
the input's dtype. Each op registers an autocast rule (fp32 inputs, autocast off in the kernel),
so under ``torch.autocast`` the states still accumulate in fp32 and a backward run outside the
region meets the dtypes its forward saved. :func:`fold_maps` turns autocast off around its
matmuls.

Exactness: documents stay bitwise separated for finite inputs, as with the loop. In a chunk whose
last token is in a run that is not the carried one, ``dec_i = 0`` and the nonzero rows of ``kd_i``
(last run) and ``w_i`` (carried run) are disjoint, so ``A_i`` is an exact zero; every composite
containing it is an exact zero and its ``B`` adds only exact zeros to the new run's terms. Results
equal the loop's to fp32 rounding (the same sums, associated differently).

Diagonal transitions
--------------------
Without the delta rule (gated linear attention, Mamba2's SSD: :mod:`fcp.ops.gla`) a chunk's map
is ``S_{i+1} = dec_i * S_i + B_i`` with ``dec_i`` a scalar (or a ``[K, 1]`` column) per chunk:
:func:`decay_scan` composes it on the same tree with elementwise products instead of ``[K, K]``
matmuls (up-sweep ``dec = dec_r dec_l``, ``B = dec_r B_l + B_r``; down-sweep ``X_r = dec_l X +
B_l``), ``O(N K V)`` work in ``O(log N)`` steps. The down-sweep writes the states in place
into one buffer (no per-level interleaving copies). Backward, hand-written: the adjoint
``L_i = dec_i L_{i+1} + G_S_i`` is scanned on the same tree from the right end (a node's
adjoint lives at its last chunk, so nothing is reversed or copied), then ``dB_i = L_{i+1}``
and ``ddec_i = sum(L_{i+1} * S_i)`` over the broadcast dimensions. An exact zero
``dec_i`` (a document start inside chunk ``i``) makes every composite spanning it an exact zero,
so no term of an earlier document reaches a later one.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

__all__ = ["chunk_scan", "decay_scan", "dplr_maps", "fold_maps"]


# ---------------------------------------------------------------------------------------------
# precision (the same inside torch.autocast as outside)
# ---------------------------------------------------------------------------------------------
def _wide(*tensors: torch.Tensor | None) -> torch.dtype:
    """The scans' compute dtype: fp32 for bf16/fp16/fp32 inputs, fp64 when one is fp64. States
    and adjoints accumulate in it whatever the inputs' (possibly mixed) dtypes."""
    dt = torch.float32
    for t in tensors:
        if t is not None:
            dt = torch.promote_types(dt, t.dtype)
    return dt


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """A context that turns autocast off for ``device``'s type where it is on, else a no-op.

    Dynamo folds the test (and guards on the autocast state), so a graph traced outside autocast
    is unchanged; one traced inside holds an autocast-off region, no graph break. (Here, not in
    :mod:`fcp.ops.kit.common`, which re-exports it: the scans are below the operators' layer.)
    """
    kind = device.type
    if kind != "meta" and torch.is_autocast_enabled(kind):  # meta has no autocast state
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()


def register_fp32_autocast(*ops) -> None:
    """Register, for every autocast device type (``cpu``, ``cuda``), autocast's own rule for the
    custom ops ``ops``: under autocast, floating inputs are cast to fp32 (fp64 stays) and the
    kernel runs with autocast off, forward and backward ops alike. Unregistered, a custom op is
    an autocast fallthrough: its kernel's matmuls would run in bf16 and save bf16 tensors for a
    backward that, run outside the region, meets fp32 gradients."""
    for op in ops:
        for device in ("cpu", "cuda"):
            if torch.amp.is_autocast_available(device):
                op.register_autocast(device, torch.float32)


# ---------------------------------------------------------------------------------------------
# tree helpers (static shapes: every branch below depends on Python ints only)
# ---------------------------------------------------------------------------------------------
def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def _pairs(x: torch.Tensor):
    """``[..., n, R, S]`` -> (left ``[..., n//2, R, S]``, right, odd last ``[..., 1, R, S]`` or
    ``None``): node ``2j`` and ``2j + 1``, by reshape/unbind (views, no strided copies)."""
    n = x.shape[-3]
    even = n - n % 2
    body = x if even == n else x[..., :even, :, :]
    left, right = body.unflatten(-3, (even // 2, 2)).unbind(-3)
    return left, right, (None if even == n else x[..., even:, :, :])


def _interleave(a: torch.Tensor, b: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
    """``[a_0, b_0, a_1, b_1, ..., tail]`` along dim -3."""
    out = torch.stack([a, b], -3).flatten(-4, -3)
    return out if tail is None else torch.cat([out, tail], -3)


def _up(a: torch.Tensor, b: torch.Tensor):
    """Up-sweep. ``a [..., N, K, K]``, ``b [..., N, K, V]`` -> per-level lists, last level one node:
    the map of the whole range."""
    la, lb = [a], [b]
    while a.shape[-3] > 1:
        a_l, a_r, a_odd = _pairs(a)
        b_l, b_r, b_odd = _pairs(b)
        a, b = a_r @ a_l, (a_r @ b_l).add_(b_r)
        if a_odd is not None:
            a, b = torch.cat([a, a_odd], -3), torch.cat([b, b_odd], -3)
        la.append(a)
        lb.append(b)
    return la, lb


def _down(la, lb, x: torch.Tensor) -> torch.Tensor:
    """Down-sweep of states from ``x [..., 1, K, V]`` (entering the root) -> ``[..., N, K, V]``."""
    for a, b in zip(reversed(la[:-1]), reversed(lb[:-1])):
        a_l, _, odd = _pairs(a)
        b_l = _pairs(b)[0]
        xp = x if odd is None else x[..., : a_l.shape[-3], :, :]
        x = _interleave(xp, (a_l @ xp).add_(b_l), None if odd is None else x[..., -1:, :, :])
    return x


def _rev_up(la, g: torch.Tensor):
    """Up-sweep of the reversed (adjoint) maps ``L -> A^T L + g``: only the ``[K, V]`` parts are
    composed, ``g_node = A_l^T g_r + g_l``; the ``A`` are the forward levels'."""
    gl = [g]
    for a in la[:-1]:
        a_l = _pairs(a)[0]
        g_l, g_r, odd = _pairs(g)
        g = (_t(a_l) @ g_r).add_(g_l)
        if odd is not None:
            g = torch.cat([g, odd], -3)
        gl.append(g)
    return gl


def _rev_down(la, gl, x: torch.Tensor) -> torch.Tensor:
    """Down-sweep of adjoints from ``x [..., 1, K, V]`` (the adjoint after the root's range) ->
    the adjoint after every chunk, ``L_{i+1}``, ``[..., N, K, V]``."""
    for a, g in zip(reversed(la[:-1]), reversed(gl[:-1])):
        _, a_r, odd = _pairs(a)
        g_r = _pairs(g)[1]
        xp = x if odd is None else x[..., : a_r.shape[-3], :, :]
        x = _interleave((_t(a_r) @ xp).add_(g_r), xp, None if odd is None else x[..., -1:, :, :])
    return x


# ---------------------------------------------------------------------------------------------
# the diagonal-plus-low-rank chunk transition
# ---------------------------------------------------------------------------------------------
def dplr_maps(w: torch.Tensor, u0: torch.Tensor, kd: torch.Tensor,
              dec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The affine chunk maps ``S_{i+1} = A_i S_i + B_i`` of a diagonal-plus-low-rank transition.

    Args:
        w, kd: ``[..., N, C, K]`` (``kd`` not transposed); u0: ``[..., N, C, V]``;
        dec: ``[..., N, K]``; one floating dtype.

    Returns:
        ``A [..., N, K, K] = diag(dec_i) - kd_i^T w_i`` and ``B [..., N, K, V] = kd_i^T u0_i``, in
        the inputs' dtype. (:func:`chunk_scan` composes exactly these; this is the definition.)

    >>> a, b = dplr_maps(torch.ones(1, 1, 2), torch.ones(1, 1, 1), torch.ones(1, 1, 2),
    ...                  torch.full((1, 2), 0.5))
    >>> a.tolist(), b.tolist()
    ([[[-0.5, -1.0], [-1.0, -0.5]]], [[[1.0], [1.0]]])
    """
    kd_t = _t(kd)
    a = (kd_t @ w).neg_()  # A_i = diag(dec_i) - kd_i^T w_i
    a.diagonal(dim1=-2, dim2=-1).add_(dec)
    return a, kd_t @ u0  # B_i = kd_i^T u0_i


# ---------------------------------------------------------------------------------------------
# the scan with its hand-written backward, as opaque custom ops
# ---------------------------------------------------------------------------------------------
# The tree's shape (levels, odd nodes) is Python control flow on the chunk count. Traced by
# torch.compile, it would specialise the graph on that count (a guard per level's parity: every
# new row length recompiles, even with a dynamic sequence dimension). As custom ops the tree
# runs eagerly inside one graph node whose fake kernel gives the output shapes as expressions of
# the chunk count, so a dynamic length compiles once.

#: Extra rows of the packed upper tree levels: ``sum_{l >= 1} ceil(N / 2^l) < N + levels`` and
#: there are at most 62 levels (N < 2**62).
TREE_SLACK = 64


def _pack_upper(levels: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The up-sweep's levels above the leaves, ``[..., n_l, K, K]`` for ``l >= 1``, in one
    ``[..., N + 64, K, K]`` buffer (a size a fake kernel can state; the tail is zero). The leaves
    ``like [..., N, K, K]`` stay a tensor of their own (no copy of the largest level)."""
    n = like.shape[-3]
    used = sum(t.shape[-3] for t in levels)
    tail = like.new_zeros(*like.shape[:-3], n + TREE_SLACK - used, *like.shape[-2:])
    return torch.cat([*levels, tail], -3)


def _unpack_levels(a: torch.Tensor, upper: torch.Tensor) -> list[torch.Tensor]:
    levels, at, n = [a], 0, a.shape[-3]
    while n > 1:
        n = -(-n // 2)
        levels.append(upper[..., at : at + n, :, :])
        at += n
    return levels


@torch.library.custom_op("fcp::chunk_scan_fwd", mutates_args=())
def chunk_scan_fwd(w: torch.Tensor, u0: torch.Tensor, kd: torch.Tensor, dec: torch.Tensor,
                   s0: Optional[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor]:  # fmt: skip
    """``(states, pseudo, final, a, upper)``: :func:`chunk_scan`'s results and, for the
    backward, the leaf maps ``a [..., N, K, K]`` and the up-sweep's upper levels packed into
    ``[..., N + 64, K, K]``; all in the compute dtype (:func:`_wide`)."""
    dt = _wide(w, u0, kd, dec, s0)
    w, u0, kd, dec = w.to(dt), u0.to(dt), kd.to(dt), dec.to(dt)
    a, b = dplr_maps(w, u0, kd, dec)
    if s0 is None:
        x0 = b.new_zeros(*b.shape[:-3], 1, *b.shape[-2:])
    else:
        x0 = s0[..., None, :, :].to(dt)
    if a.shape[-3] == 0:  # no chunks: nothing happens to the state
        return b.clone(), u0.clone(), x0[..., 0, :, :].clone(), a, _pack_upper([], a)
    la, lb = _up(a, b)
    states = _down(la, lb, x0)
    if states is x0:  # one chunk: the state entering it is s0 (outputs never alias inputs)
        states = x0.clone()
    final = (la[-1] @ x0).add_(lb[-1])[..., 0, :, :]
    pseudo = (w @ states).neg_().add_(u0)
    return states, pseudo, final, a, _pack_upper(la[1:], a)


@chunk_scan_fwd.register_fake
def _(w, u0, kd, dec, s0):
    n, k, v = w.shape[-3], w.shape[-1], u0.shape[-1]
    lead, dt = u0.shape[:-3], _wide(w, u0, kd, dec, s0)
    return (u0.new_empty(*lead, n, k, v, dtype=dt), u0.new_empty(u0.shape, dtype=dt),
            u0.new_empty(*lead, k, v, dtype=dt), u0.new_empty(*lead, n, k, k, dtype=dt),
            u0.new_empty(*lead, n + TREE_SLACK, k, k, dtype=dt))  # fmt: skip


@torch.library.custom_op("fcp::chunk_scan_bwd", mutates_args=())
def chunk_scan_bwd(w: torch.Tensor, kd: torch.Tensor, states: torch.Tensor,
                   pseudo: torch.Tensor, a: torch.Tensor, upper: torch.Tensor,
                   g_states: Optional[torch.Tensor],
                   g_pseudo: Optional[torch.Tensor], g_final: Optional[torch.Tensor],
                   want_ds0: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor]:  # fmt: skip
    """``(dw, du0, dkd, ddec, ds0)`` (``ds0`` empty unless ``want_ds0``) in the compute dtype
    of all inputs (:func:`_wide`); see the module docstring's backward."""
    dt = _wide(w, kd, states, pseudo, a, upper, g_states, g_pseudo, g_final)
    w, kd, states, pseudo = w.to(dt), kd.to(dt), states.to(dt), pseudo.to(dt)
    la = _unpack_levels(a.to(dt), upper.to(dt))
    g_pseudo = torch.zeros_like(pseudo) if g_pseudo is None else g_pseudo.to(dt)
    g = (_t(w) @ g_pseudo).neg_()  # dLoss/dS_i through u_i, plus the direct state gradient
    if g_states is not None:
        g = g.add_(g_states)
    if g_final is None:
        x_end = g.new_zeros(*g.shape[:-3], 1, *g.shape[-2:])
    else:
        x_end = g_final[..., None, :, :].to(dt)
    ds0 = g.new_zeros(0)
    if w.shape[-3] == 0:  # no chunks: final = s0
        lam = g
        if want_ds0:
            ds0 = x_end[..., 0, :, :].clone()
    else:
        gl = _rev_up(la, g)
        lam = _rev_down(la, gl, x_end)  # L_{i+1}
        if want_ds0:
            ds0 = (_t(la[-1]) @ x_end).add_(gl[-1])[..., 0, :, :]
    du0 = (kd @ lam).add_(g_pseudo)
    dw = (du0 @ _t(states)).neg_()
    dkd = pseudo @ _t(lam)
    ddec = (lam * states).sum(-1)
    return dw, du0, dkd, ddec, ds0


@chunk_scan_bwd.register_fake
def _(w, kd, states, pseudo, a, upper, g_states, g_pseudo, g_final, want_ds0):
    dt = _wide(w, kd, states, pseudo, a, upper, g_states, g_pseudo, g_final)
    ds0 = states.new_empty(*states.shape[:-3], *states.shape[-2:], dtype=dt) if want_ds0 else (
        states.new_empty(0, dtype=dt))
    return (w.new_empty(w.shape, dtype=dt), pseudo.new_empty(pseudo.shape, dtype=dt),
            kd.new_empty(kd.shape, dtype=dt), states.new_empty(states.shape[:-1], dtype=dt),
            ds0)  # fmt: skip


def _chunk_scan_setup(ctx, inputs, output):
    w, _, kd, _, s0 = inputs
    states, pseudo, _, a, upper = output
    ctx.has_s0 = s0 is not None
    ctx.dtypes = [None if t is None else t.dtype for t in inputs]
    # the levels only feed the backward; unused outputs' gradients stay None (no zeros made)
    ctx.mark_non_differentiable(a, upper)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(w, kd, states, pseudo, a, upper)


def _chunk_scan_backward(ctx, g_states, g_pseudo, g_final, _g_a, _g_upper):
    w, kd, states, pseudo, a, upper = ctx.saved_tensors
    want_ds0 = ctx.has_s0 and ctx.needs_input_grad[4]
    grads = chunk_scan_bwd(w, kd, states, pseudo, a, upper, g_states, g_pseudo, g_final,
                           want_ds0)  # fmt: skip
    # each input's gradient in its own dtype (the op computes in the wider one)
    return tuple(None if dt is None or (i == 4 and not want_ds0) else grad.to(dt)
                 for i, (grad, dt) in enumerate(zip(grads, ctx.dtypes)))  # fmt: skip


chunk_scan_fwd.register_autograd(_chunk_scan_backward, setup_context=_chunk_scan_setup)
register_fp32_autocast(chunk_scan_fwd, chunk_scan_bwd)


def chunk_scan(
    w: torch.Tensor,
    u0: torch.Tensor,
    kd: torch.Tensor,
    dec: torch.Tensor,
    s0: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk recurrence of a diagonal-plus-low-rank transition (:func:`dplr_maps`): states
    entering every chunk, pseudo-values, final state.

    Args:
        w, kd: ``[..., N, C, K]`` (``kd`` not transposed);
        u0: ``[..., N, C, V']``; dec: ``[..., N, K]``;
        s0: state entering chunk 0, ``[..., K, V']``; ``None`` is zero (and skips its gradient).
            CP: ``[0 | I]`` with ``u0 = [u0 | 0]`` (``V' = V + K``).

    Returns:
        ``states [..., N, K, V']``, ``pseudo [..., N, C, V']``, ``final [..., K, V']`` (what the
        loop above stacks and ends with), in fp32 (fp64 when an input is fp64). Differentiable
        in all inputs, each gradient in its input's dtype (hand-written backward: no double
        backward, forward-mode AD or vmap).
    """
    states, pseudo, final, _, _ = chunk_scan_fwd(w, u0, kd, dec, s0)
    return states, pseudo, final


# ---------------------------------------------------------------------------------------------
# diagonal transitions: decay_scan
# ---------------------------------------------------------------------------------------------
def _up_decay(dec: torch.Tensor, b: torch.Tensor, reverse: bool = False):
    """Up-sweep: per-level lists of ``dec`` and ``b``, the last level one node. A node composes
    its children ``l``, ``r`` as ``dec = dec_l dec_r`` and ``b = dec_r b_l + b_r`` (the map
    ``S -> dec * S + b``), or, ``reverse``, ``b = dec_l b_r + b_l`` (the adjoint map, applied
    from the right end). An odd last node is carried up unchanged."""
    ld, lb = [dec], [b]
    while dec.shape[-3] > 1:
        d_l, d_r, d_odd = _pairs(dec)
        b_l, b_r, b_odd = _pairs(b)
        b = torch.addcmul(b_l, d_l, b_r) if reverse else torch.addcmul(b_r, d_r, b_l)
        dec = d_r * d_l
        if d_odd is not None:
            dec, b = torch.cat([dec, d_odd], -3), torch.cat([b, b_odd], -3)
        ld.append(dec)
        lb.append(b)
    return ld, lb


def _empty_states(dec: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    shape = torch.broadcast_shapes(b.shape, dec.shape, x.shape)
    return torch.empty(shape, dtype=b.dtype, device=b.device)


def _decay_sweeps(dec: torch.Tensor, b: torch.Tensor, x0: torch.Tensor):
    """``(states [..., N, K, V], final [..., K, V])`` of ``S -> dec * S + b`` from ``x0 [..., 1,
    K, V]``: the up-sweep, then the down-sweep written in place into one buffer. A level-``l``
    node ``j`` covers chunks ``[j 2^l, (j + 1) 2^l)`` (clipped at ``N``), so its entering state
    lives at ``states[j 2^l]``: a left child shares it, a right child's is ``dec_l * it + b_l``,
    one strided ``addcmul`` per level."""
    ld, lb = _up_decay(dec, b)
    states = _empty_states(dec, b, x0)
    states[..., :1, :, :] = x0
    for level in range(len(ld) - 2, -1, -1):
        step, pairs = 2**level, ld[level].shape[-3] // 2
        left = slice(0, 2 * pairs, 2)
        entering = states[..., :: 2 * step, :, :][..., :pairs, :, :]
        states[..., step :: 2 * step, :, :] = torch.addcmul(
            lb[level][..., left, :, :], ld[level][..., left, :, :], entering
        )
    return states, torch.addcmul(lb[-1], ld[-1], x0)[..., 0, :, :]


def _adjoint_sweeps(dec: torch.Tensor, g: torch.Tensor, x_end: torch.Tensor):
    """The reverse recurrence ``L_i = dec_i L_{i+1} + g_i`` from ``L_N = x_end [..., 1, K, V]``:
    ``(L_{i+1} for every chunk i [..., N, K, V], L_0 [..., K, V])``, on the forward's tree. A
    node's adjoint *after* its range lives at its last chunk (clipped at ``N``): a right child
    shares it, a left child's is ``dec_r * it + g_r`` (no reversal copies)."""
    n = g.shape[-3]
    ld, lg = _up_decay(dec, g, reverse=True)
    after = _empty_states(dec, g, x_end)
    after[..., n - 1 :, :, :] = x_end
    for level in range(len(ld) - 2, -1, -1):
        step, pairs = 2**level, ld[level].shape[-3] // 2
        right = slice(1, 2 * pairs, 2)
        g_r, d_r = lg[level][..., right, :, :], ld[level][..., right, :, :]
        full = min(pairs, (n - 2 * step) // (2 * step) + 1)  # pairs whose right child is whole
        src = after[..., 2 * step - 1 :: 2 * step, :, :][..., :full, :, :]
        dst = after[..., step - 1 :: 2 * step, :, :]
        dst[..., :full, :, :] = torch.addcmul(g_r[..., :full, :, :], d_r[..., :full, :, :], src)
        if full < pairs:  # the last right child is cut short by N: its end is chunk N - 1
            dst[..., full:pairs, :, :] = torch.addcmul(
                g_r[..., full:, :, :], d_r[..., full:, :, :], after[..., n - 1 :, :, :]
            )
    return after, torch.addcmul(lg[-1], ld[-1], x_end)[..., 0, :, :]


@torch.library.custom_op("fcp::decay_scan_fwd", mutates_args=())
def decay_scan_fwd(dec: torch.Tensor, b: torch.Tensor,
                   s0: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(states, final)`` of :func:`decay_scan` (an opaque op, like :func:`chunk_scan_fwd`), in
    the compute dtype (:func:`_wide`)."""
    dt = _wide(dec, b, s0)
    dec, b = dec.to(dt), b.to(dt)
    x0 = b.new_zeros(*b.shape[:-3], 1, *b.shape[-2:]) if s0 is None else s0[..., None, :, :].to(dt)
    if b.shape[-3] == 0:
        shape = torch.broadcast_shapes(b.shape, dec.shape, x0.shape[:-3] + (0,) + x0.shape[-2:])
        return b.new_empty(shape), x0[..., 0, :, :].expand(shape[:-3] + shape[-2:]).clone()
    states, final = _decay_sweeps(dec, b, x0)
    return states, final


@decay_scan_fwd.register_fake
def _(dec, b, s0):
    x_shape = b.shape[:-3] + b.shape[-2:] if s0 is None else s0.shape
    shape = torch.broadcast_shapes(b.shape, dec.shape, x_shape[:-2] + (1,) + x_shape[-2:])
    dt = _wide(dec, b, s0)
    return b.new_empty(shape, dtype=dt), b.new_empty(shape[:-3] + shape[-2:], dtype=dt)


@torch.library.custom_op("fcp::decay_scan_bwd", mutates_args=())
def decay_scan_bwd(states: torch.Tensor, dec: torch.Tensor, b_like: torch.Tensor,
                   s0_like: Optional[torch.Tensor], g_states: Optional[torch.Tensor],
                   g_final: Optional[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ddec, db, ds0)`` shaped like ``dec``, ``b_like`` and ``s0_like`` (``ds0`` empty when
    ``s0_like`` is ``None``), in the compute dtype of ``states``, ``dec`` and the gradients
    (:func:`_wide`); only the shapes of ``b_like`` and ``s0_like`` are read."""
    dt = _wide(states, dec, g_states, g_final)
    states, dec = states.to(dt), dec.to(dt)
    g = torch.zeros_like(states) if g_states is None else g_states.to(dt)
    if g_final is None:
        x_end = g.new_zeros(*g.shape[:-3], 1, *g.shape[-2:])
    else:
        x_end = g_final[..., None, :, :].to(dt).expand(*g.shape[:-3], 1, *g.shape[-2:])
    if g.shape[-3] == 0:
        lam, ds0 = g, x_end[..., 0, :, :].clone()
    else:
        lam, ds0 = _adjoint_sweeps(dec, g, x_end)  # L_{i+1}, L_0
    ddec = (lam * states).sum_to_size(dec.shape)
    db = lam.sum_to_size(b_like.shape)
    ds0 = g.new_zeros(0) if s0_like is None else ds0.sum_to_size(s0_like.shape)
    if db is g_states:  # no chunks: outputs never alias inputs
        db = db.clone()
    return ddec, db, ds0


@decay_scan_bwd.register_fake
def _(states, dec, b_like, s0_like, g_states, g_final):
    dt = _wide(states, dec, g_states, g_final)
    ds0 = states.new_empty(0 if s0_like is None else s0_like.shape, dtype=dt)
    return states.new_empty(dec.shape, dtype=dt), states.new_empty(b_like.shape, dtype=dt), ds0


def _decay_scan_setup(ctx, inputs, output):
    dec, b, s0 = inputs
    ctx.has_s0 = s0 is not None
    ctx.set_materialize_grads(False)
    # shapes only (empty expands): the backward needs no copy of b or s0
    b_like = b.new_empty(()).expand(b.shape)
    s0_like = None if s0 is None else s0.new_empty(()).expand(s0.shape)
    ctx.save_for_backward(output[0], dec, b_like, s0_like)


def _decay_scan_backward(ctx, g_states, g_final):
    states, dec, b_like, s0_like = ctx.saved_tensors
    ddec, db, ds0 = decay_scan_bwd(states, dec, b_like, s0_like, g_states, g_final)
    want_ds0 = ctx.has_s0 and ctx.needs_input_grad[2]
    # each input's gradient in its own dtype (the op computes in the wider one)
    return (ddec.to(dec.dtype), db.to(b_like.dtype),
            ds0.to(s0_like.dtype) if want_ds0 else None)  # fmt: skip


decay_scan_fwd.register_autograd(_decay_scan_backward, setup_context=_decay_scan_setup)
register_fp32_autocast(decay_scan_fwd, decay_scan_bwd)


def decay_scan(
    dec: torch.Tensor, b: torch.Tensor, s0: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence ``S_{i+1} = dec_i * S_i + b_i`` with diagonal (elementwise) transitions.

    Args:
        dec: ``[..., N, K or 1, V or 1]`` (broadcast against ``b``; a scalar per chunk is
            ``[..., N, 1, 1]``), usually decays in ``[0, 1]``.
        b: ``[..., N, K, V]``.
        s0: state entering chunk 0, ``[..., K, V]``; ``None`` is zero (and skips its gradient).

    Returns:
        ``states [..., N, K, V]`` (the state entering every chunk, ``states[..., 0] = s0``) and
        ``final [..., K, V]`` (after the last), in fp32 (fp64 when an input is fp64). Equal to
        the loop ``for i: states.append(S); S = dec[i] * S + b[i]`` up to the association of
        the sums; log-depth, no Python loop over ``N``. Differentiable in all inputs, each
        gradient in its input's dtype (hand-written backward: no double backward, forward-mode
        AD or vmap).

    >>> dec = torch.tensor([0.5, 0.0, 1.0]).view(3, 1, 1)
    >>> states, final = decay_scan(dec, torch.ones(3, 1, 1))
    >>> states.flatten().tolist(), final.item()
    ([0.0, 1.0, 1.0], 2.0)
    """
    return decay_scan_fwd(dec, b, s0)


def fold_maps(blocks: torch.Tensor) -> torch.Tensor:
    """Composition ``M_{n-1} o ... o M_0`` of blocks ``[n, ..., K, K + V]`` (``[A_j | B_j]``, rank
    order) by a log-depth tree, as ``[..., K, K + V]``. Its ``[..., K:]`` part is the state that
    ``state_chain`` accumulates over ranks ``0..n-1`` (``acc = A_j @ acc + B_j`` from zero)."""
    k = blocks.shape[-2]
    m = blocks.movedim(0, -3)
    with autocast_off(blocks.device):  # composed in the blocks' dtype, inside autocast too
        while m.shape[-3] > 1:
            left, right, odd = _pairs(m)
            m = right[..., :k] @ left + torch.nn.functional.pad(right[..., k:], (k, 0))
            if odd is not None:
                m = torch.cat([m, odd], -3)
    return m[..., 0, :, :]
