"""The recurrence kit: what every chunked linear recurrence over packed documents shares.

A recurrent operator (``kda``, ``gla``, and the next one) is its *intra-chunk form* over this
kit: the kit numbers the runs (documents and the pad tail), builds decays that are exact zeros
across runs, inverts the WY blocks of a delta rule, composes the chunk transitions by a log-depth
scan (:mod:`fcp.scan`) and wires the shard's transition to the CP state chain
(:func:`fcp.comm.state_chain`). Static shapes throughout, no host synchronisation.

* run numbering - :func:`chunk_runs` (run ids per chunk and of the token before each chunk),
  :func:`interior_starts` (run starts inside the shard, for gate-reset backends);
* exact masking - :func:`masked_exp` (``exp`` where a mask holds, an exact 0 with an exact 0
  gradient elsewhere);
* diagonal (scalar-decay) chunk boundaries - :func:`boundary_decays`, :func:`entry_products`;
* the WY block hierarchy of a decayed delta rule - :func:`wy_forms` (one decay per key
  dimension), :func:`wy_forms_scalar` (one per head), :func:`unit_lower_inverse` and its
  :func:`merge_inverse` step, :func:`diagonal_lower_blocks`;
* the diagonal-plus-low-rank (DPLR) transition ``A = diag(dec) - kd^T w`` - :func:`dplr_maps`
  (its chunk maps), :func:`dplr_scan` (their log-depth composition), :func:`dplr_outputs`
  (scan, CP chain and the outputs in one call; :func:`augmented_start` and :func:`shard_runs` /
  :func:`chunk_run_ids` are its pieces for a backend that runs the shard in a custom op);
* the chunk-to-state-chain wiring - :func:`entering_state` (the state entering this rank's shard
  from its transition, a ``[K, K]`` matrix or a scalar per head).

How a new recurrence plugs in
-----------------------------
A recurrence whose state update is ``S_t = A_t S_{t-1} + k_t u_t^T`` with a DPLR ``A_t`` (the
delta rule's ``diag(d) - beta k k^T``, RWKV-7's ``diag(w) - a b^T``, DeltaProduct's products)
states three things:

1. its **transition** per chunk, as ``(w, kd, dec)`` with ``A = diag(dec) - kd^T w`` and the
   pseudo-values' start ``u0`` (``B = kd^T u0``): :func:`dplr_maps` is the definition;
2. its **intra-chunk form**: how the state entering a chunk reaches the chunk's outputs (``qg``)
   and how the chunk's own pseudo-values do (``aqk``), so that ``o = qg @ S + aqk @ (u0 - w @ S)``;
   with chunks of ``C > 1`` tokens the WY hierarchy (:func:`wy_forms`) folds the tokens' updates
   into ``w`` and ``u0`` (:mod:`fcp.ops.kda.chunked` is the full example);
3. its **reference**: the per-token loop (:func:`fcp.ops.kit.loops.linear_recurrence`), against
   which its tests check the chunked form, single-process and under CP.

Runs never mix: a token that does not continue the run carried into its chunk gets ``w = 0``,
``qg = 0`` and its chunk ``dec = 0`` (exact zeros from :func:`chunk_runs`), so the entering
state reaches only the carried run. Worked example: a hypothetical token-level DPLR recurrence,
``S_t = diag(d_t) S_{t-1} - k_t (w_t^T S_{t-1}) + k_t u_t^T``, ``o_t = S_t^T q_t``, one head,
chunks of one token (so the intra-chunk form is the token's own terms: ``qg = d_t * q_t``,
``aqk = q_t . k_t``)::

    >>> def toy_reference(q, k, w, u, d, doc_ids):  # the definition, one token at a time
    ...     out, s = [], torch.zeros(q.shape[1], u.shape[1], dtype=q.dtype)
    ...     for t in range(q.shape[0]):
    ...         if t == 0 or doc_ids[t] != doc_ids[t - 1]:
    ...             s = torch.zeros_like(s)  # a run starts: the state restarts
    ...         s = d[t, :, None] * s - torch.outer(k[t], w[t] @ s) + torch.outer(k[t], u[t])
    ...         out.append(s.T @ q[t])
    ...     return torch.stack(out)
    >>> def toy_chunked(q, k, w, u, d, ctx):  # [T, K] inputs; batch 1, head 1, T chunks of 1
    ...     n = q.shape[0]
    ...     seg, prev = chunk_runs(ctx, n, 1)  # [1, T, 1], [1, T]
    ...     carry = (seg == prev[..., None])[:, None, :, :, None]  # [1, 1, T, 1, 1]
    ...     q, k, w, u = (x.view(1, 1, n, 1, -1) for x in (q, k, w, u))
    ...     w = torch.where(carry, w, 0.0)  # a run start reads no entering state ...
    ...     dec = torch.where(carry[..., 0, :], d.view(1, 1, n, -1), 0.0)  # ... passes none on
    ...     qg, aqk = q * dec[..., None, :], q @ k.transpose(-1, -2)  # the intra-chunk form
    ...     return dplr_outputs(w, u, k, dec, qg, aqk, ctx).view(n, -1)
    >>> gen = torch.Generator().manual_seed(0)
    >>> q, k, w, u = (torch.randn(6, 3, generator=gen, dtype=torch.float64) for _ in range(4))
    >>> d = torch.rand(6, 3, generator=gen, dtype=torch.float64)
    >>> doc_ids = torch.tensor([[1, 1, 1, 2, 2, 0]])  # documents of 3 and 2 tokens, one pad
    >>> out = toy_chunked(q, k, w, u, d, PackedContext(doc_ids))
    >>> torch.allclose(out, toy_reference(q, k, w, u, d, doc_ids[0]))
    True

The same ``toy_chunked`` runs under CP unchanged: :func:`dplr_outputs` then scans an augmented
state and adds the state entering the shard (one all-gather). A new operator folder holds
``__init__.py`` (the dispatcher), ``chunked.py`` (the intra-chunk form over this kit) and
``reference.py`` (the loop), plus its tests; nothing else in fcp changes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fcp.comm import state_chain
from fcp.context import PackedContext
from fcp.layout import document_starts
from fcp.ops.kit.common import repeat_last
from fcp.scan import chunk_scan, decay_scan, dplr_maps

__all__ = [
    "WyForms",
    "augmented_start",
    "boundary_decays",
    "chunk_run_ids",
    "chunk_runs",
    "diagonal_lower_blocks",
    "dplr_maps",
    "dplr_outputs",
    "dplr_scan",
    "entering_state",
    "entry_products",
    "interior_starts",
    "masked_exp",
    "merge_inverse",
    "shard_runs",
    "unit_lower_inverse",
    "wy_forms",
    "wy_forms_scalar",
]

#: :func:`fcp.scan.chunk_scan` under its generic name: the chunk recurrence of the DPLR
#: transition, ``(states, pseudo, final) = dplr_scan(w, u0, kd, dec, s0)``.
dplr_scan = chunk_scan


# ---------------------------------------------------------------------------------------------
# run numbering and exact masks
# ---------------------------------------------------------------------------------------------
def masked_exp(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` where ``mask``, an exact 0 elsewhere (``mask`` bool, broadcast against ``x``).

    Masked *before* the exponential: no ``inf`` is ever formed, so a masked entry's gradient is
    an exact zero (never ``0 * inf = nan``), whatever ``x`` holds there.

    >>> masked_exp(torch.tensor([True, False]), torch.tensor([0.0, 1000.0])).tolist()
    [1.0, 0.0]
    """
    return torch.exp(torch.where(mask, x, float("-inf")))


def chunk_runs(ctx: PackedContext, chunks: int, chunk_size: int):
    """Run ids of this rank's shard in chunks, and of the token before each chunk.

    Returns ``(seg [batch, chunks, chunk_size], prev [batch, chunks])``, int64. Runs (documents
    and the pad tail) are numbered by a cumulative sum of run starts over the replicated *global*
    map, so equal ids mean the same run, across ranks too; ``prev`` is 0 (no run) before rank 0.
    The internal padding to ``chunks * chunk_size`` tokens continues the last run (its tokens get
    zero inputs, so they carry the state through unchanged and the shard's final state is the one
    after its last real token). A token is *carried* into its chunk (sees the state entering it)
    where ``seg == prev[..., None]``. The composition of :func:`shard_runs` (the context's part)
    and :func:`chunk_run_ids` (tensors only: usable inside a custom op's kernel).

    >>> seg, prev = chunk_runs(PackedContext(torch.tensor([[1, 1, 1, 2, 2, 0]])), 2, 4)
    >>> seg.tolist(), prev.tolist()
    ([[[1, 1, 1, 2], [2, 3, 3, 3]]], [[0, 2]])
    """
    return chunk_run_ids(*shard_runs(ctx), chunks, chunk_size)


def shard_runs(ctx: PackedContext) -> tuple[torch.Tensor, torch.Tensor]:
    """``(runs [batch, local_seq], before [batch, 1])``, int64: the run ids (:func:`chunk_runs`)
    of this rank's tokens and of the token before the shard (0 on rank 0)."""
    seg = torch.cumsum(document_starts(ctx.doc_ids), 1)  # >= 1
    s0 = ctx.seq_start
    before = seg[:, s0 - 1 : s0] if s0 > 0 else torch.zeros_like(seg[:, :1])
    return seg[:, s0 : ctx.seq_end], before


def chunk_run_ids(runs: torch.Tensor, before: torch.Tensor, chunks: int,
                  chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_runs` from :func:`shard_runs`' ``(runs, before)``: ``runs`` padded to
    ``chunks * chunk_size`` by repeating the last run and cut into chunks, and the run of the
    token before each chunk."""
    n_pad = chunks * chunk_size - runs.shape[1]
    if not statically_known_true(n_pad == 0):
        # the last token's run repeated by an index (a `cat` would guard on n_pad == 0 and
        # specialise a dynamic length)
        runs = runs[:, repeat_last(runs.shape[1], n_pad, runs.device)]
    local = runs.reshape(runs.shape[0], chunks, chunk_size)
    # each chunk's predecessor is the previous chunk's last token, the first chunk's `before`:
    # a roll and a `where`, not `cat([before, local[:, :-1, -1]])`, whose `chunks - 1` sized
    # slice made a dynamic graph guard on `chunks - 1 == 1` (a recompile when the chunk count
    # left 2)
    last = local[:, :, -1].roll(1, 1)
    first = torch.arange(chunks, device=runs.device) == 0
    return local, torch.where(first, before, last)


def augmented_start(u0: torch.Tensor, dk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CP's augmented chunk scan (:func:`dplr_outputs`): ``([u0 | 0] [.., C, V + K], the
    entering state [0 | I] [lead, K, V + K])`` for ``u0 [lead, N, C, V]``. From ``[0 | I]`` the
    scan's states are ``[S | P]``: the states from zero and each chunk's response to the state
    entering the shard; the final ``P`` is the shard's transition."""
    u0 = torch.cat([u0, u0.new_zeros(*u0.shape[:-1], dk)], -1)
    lead = u0.shape[:-3]
    eye = torch.eye(dk, dtype=u0.dtype, device=u0.device).expand(*lead, dk, dk)
    return u0, torch.cat([u0.new_zeros(*lead, dk, u0.shape[-1] - dk), eye], -1)


def interior_starts(ctx: PackedContext) -> torch.Tensor:
    """bool ``[batch, local_seq]``: run starts inside this rank's shard, local position 0
    excluded (where a backend that restarts documents by a gate writes its reset decay; the
    shard's first token is the initial state's business).

    >>> interior_starts(PackedContext(torch.tensor([[1, 1, 2, 0]]))).tolist()
    [[False, False, True, True]]
    """
    starts = document_starts(ctx.doc_ids)[:, ctx.seq_start : ctx.seq_end]
    return torch.cat([torch.zeros_like(starts[:, :1]), starts[:, 1:]], 1)


# ---------------------------------------------------------------------------------------------
# diagonal transitions: a scalar log decay per token
# ---------------------------------------------------------------------------------------------
def boundary_decays(a: torch.Tensor, seg: torch.Tensor, prev: torch.Tensor):
    """Decays from each chunk's start, for the tokens that see the state entering it.

    Args:
        a: ``[..., N, C]`` log decays (<= 0); seg ``[..., N, C]`` and prev ``[..., N]`` run ids
            (:func:`chunk_runs`, broadcast against ``a``).

    Returns:
        ``decay_in [..., N, C]``: ``exp(a_start + ... + a_t)`` for tokens of the run going on
        before the chunk, exact 0 for the others; ``dec [..., N]``: the chunk's transition (its
        last token's ``decay_in``: nonzero only if the whole chunk continues that run).
    """
    decay_in = masked_exp(seg == prev[..., None], torch.cumsum(a, -1))
    return decay_in, decay_in[..., -1]


def entry_products(dec: torch.Tensor):
    """``dec [..., N]`` chunk transitions -> ``(prefix [..., N], total [...])``: the products of
    the decays before each chunk (how the state entering the shard reaches chunk ``n``) and of
    all of them (the shard's transition ``m_r``), by :func:`fcp.scan.decay_scan` (fp32, fp64 for
    fp64 ``dec``).

    >>> prefix, total = entry_products(torch.tensor([0.5, 0.5, 0.0]))
    >>> prefix.tolist(), total.item()
    ([1.0, 0.5, 0.25], 0.0)
    """
    d = dec[..., None, None]
    prefix, total = decay_scan(d, torch.zeros_like(d), dec.new_ones(*dec.shape[:-1], 1, 1))
    return prefix[..., 0, 0], total[..., 0, 0]


# ---------------------------------------------------------------------------------------------
# the WY block hierarchy (log depth over the C tokens of a chunk; C a power of two)
# ---------------------------------------------------------------------------------------------
def _halves(x: torch.Tensor, nb: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., nb * 2 * s, D]`` -> the left and right halves ``[..., nb, s, D]`` of each block."""
    left, right = x.reshape(*x.shape[:-2], nb, 2, s, x.shape[-1]).unbind(-3)
    return left, right


def _merge(m: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Diagonal blocks ``[..., 2nb, s, s]`` plus lower off-diagonal blocks ``[..., nb, s, s]`` ->
    lower-triangular ``[..., nb, 2s, 2s]`` blocks (the upper block is an exact zero)."""
    m0, m1 = m.reshape(*off.shape[:-3], -1, 2, *m.shape[-2:]).unbind(-3)
    return torch.cat([torch.cat([m0, torch.zeros_like(off)], -1), torch.cat([off, m1], -1)], -2)


def merge_inverse(d: torch.Tensor, l21: torch.Tensor) -> torch.Tensor:
    """One step of the log-depth block inversion of a unit-lower-triangular matrix.

    ``d [..., 2nb, s, s]``: inverses of the diagonal blocks ``L11``, ``L22`` of each pair;
    ``l21 [..., nb, s, s]``: the pairs' lower blocks. Returns the inverses of the ``[2s, 2s]``
    blocks, ``[..., nb, 2s, 2s]``: ``inv([[L11, 0], [L21, L22]]) = [[D11, 0], [-D22 L21 D11,
    D22]]``. As stable as forward substitution (no Neumann-series cancellation); zeros between
    documents stay exact zeros.
    """
    d11, d22 = d.reshape(*l21.shape[:-3], -1, 2, *d.shape[-2:]).unbind(-3)
    return _merge(d, -(d22 @ (l21 @ d11)))


def diagonal_lower_blocks(x: torch.Tensor, nb: int, s: int) -> torch.Tensor:
    """The lower-left ``[s, s]`` block of each of the ``nb`` diagonal ``[2s, 2s]`` blocks of
    ``x [.., C, C]`` (``C = 2 s nb``), as ``[.., nb, s, s]`` (views, no copy)."""
    blocks = x.reshape(*x.shape[:-2], nb, 2 * s, nb, 2 * s).diagonal(dim1=-4, dim2=-2)
    return blocks.movedim(-1, -3)[..., s:, :s]


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """``(I + tril(a, -1))^-1`` for ``a [..., C, C]`` (``C`` a power of two; only the strict
    lower triangle is read), by :func:`merge_inverse` on blocks of 1, 2, 4, ... tokens: log
    depth, ``[..., C, C]`` in ``a``'s dtype, exact zeros where the blocks of ``a`` are.

    >>> unit_lower_inverse(torch.tensor([[9.0, 9.0], [2.0, 9.0]])).tolist()
    [[1.0, 0.0], [-2.0, 1.0]]
    """
    c = a.shape[-1]
    t_inv = a.new_ones(*a.shape[:-1], 1, 1)  # [.., C, 1, 1]: inverses of the unit diagonal
    s = 1
    while s < c:
        t_inv = merge_inverse(t_inv, diagonal_lower_blocks(a, c // (2 * s), s))
        s *= 2
    return t_inv[..., 0, :, :]


class _Level(NamedTuple):
    """One level ``s`` of a chunk's binary block hierarchy (see :func:`wy_forms`): ``nb``
    pairs of blocks of ``s`` tokens; whether each token is in the document of the pair's
    boundary token ``r`` (``left_in``, ``right_in``: ``[.., nb, s, 1]``); the right blocks'
    ``fwd`` and the left blocks' ``rev`` sums; and the sums for blocks of ``2s``."""

    nb: int
    left_in: torch.Tensor
    right_in: torch.Tensor
    f_r: torch.Tensor
    r_l: torch.Tensor
    fwd: torch.Tensor
    rev: torch.Tensor


def _level(seg, g, fwd, rev, s: int) -> _Level:
    """Level ``s`` from the block-local sums ``fwd``/``rev`` of blocks of ``s`` tokens."""
    nb = g.shape[-2] // (2 * s)
    seg_l, seg_r = seg.reshape(*seg.shape[:-1], nb, 2, s).unbind(-2)  # [.., nb, s]
    ref = seg_l[..., -1:]  # document of the boundary token r
    left_in, right_in = (seg_l == ref)[..., None], (seg_r == ref)[..., None]
    f_l, f_r = _halves(fwd, nb, s)
    r_l, r_r = _halves(rev, nb, s)
    g_r = _halves(g, nb, s)[1]
    # block-local sums for blocks of 2s: extend across the boundary within the document
    # (sums of same-sign terms; `where`, not a multiply, keeps other documents out exactly)
    f_next = f_r + torch.where(right_in, f_l[..., -1:, :], 0.0)
    head_in = (seg_l == seg_r[..., :1])[..., None]
    r_next = r_l + torch.where(head_in, g_r[..., :1, :] + r_r[..., :1, :], 0.0)
    return _Level(nb, left_in, right_in, f_r, r_l, torch.cat([f_l, f_next], -2).reshape(g.shape),
                  torch.cat([r_next, r_r], -2).reshape(g.shape))  # fmt: skip


class WyForms(NamedTuple):
    """What :func:`wy_forms` returns (``[..]`` the leading ``[B, H, N]`` dims, per chunk)."""

    aqk: torch.Tensor  #: ``[.., C, C]`` decayed ``q_t . k_i`` for ``i <= t`` in t's run, else 0
    t_inv: torch.Tensor  #: ``[.., C, C]`` ``(I + A)^-1``, the WY form's block inverse
    fwd: torch.Tensor  #: ``[.., C, K or 1]`` sum of g from the chunk (or run) start through t
    rev: torch.Tensor  #: ``[.., C, K or 1]`` sum of g after t to the chunk (or run) end


def wy_forms(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             seg: torch.Tensor) -> WyForms:
    """In-chunk pairwise matrices of a decayed delta rule and within-run decay sums, by a binary
    block hierarchy (one log decay per key dimension).

    Inputs: q, k, g ``[B, H, N, C, K]``, beta ``[B, H, N, C, 1]``, seg ``[B, 1, N, C]`` run ids
    (:func:`chunk_runs`); one floating dtype; ``C`` a power of two. With ``D(i, t] = sum_{i < s
    <= t} g_s`` (zero-free only inside one run) it returns :class:`WyForms`:

    * ``aqk``: ``q_t . (exp(D(i, t]) * k_i)`` for ``i <= t`` in t's run, else 0;
    * ``t_inv``: ``(I + A)^-1`` with ``A[t, i] = beta_t k_t . (exp(D(i, t]) * k_i)`` for
      ``i < t`` in t's run;
    * ``fwd``, ``rev``: the within-run sums of g through ``t`` and after ``t``.

    Level ``s`` pairs each block of ``s`` tokens (left, ending at token ``r``) with the next
    (right). A left/right pair's decay factors through ``r``: ``exp(D(i, t]) = exp(D(r, t]) *
    exp(D(i, r])``, two exponents that are sums of the block-local ``fwd``/``rev`` sums, so every
    exponent is <= 0 for g <= 0 (no overflow, however strong the decay) and is a direct sum of
    the g's it spans, never a difference of long cumulative sums (no cancellation, also in the
    gradient of g). Each factor is masked to the run of ``r``, so only same-run pairs survive, as
    exact zeros otherwise, and other runs' g never enter another run's sums. ``(I + A)^-1`` is
    built level by level alongside (:func:`merge_inverse`). Cost ``O(C^2 K)`` per chunk, like the
    dense form, without a ``[C, C, K]`` tensor.
    """
    c = q.shape[-2]
    fwd, rev = g, torch.zeros_like(g)
    aqk = (q * k).sum(-1)[..., None, None]  # [.., C, 1, 1]: the diagonal, D(t, t] = 0
    t_inv = torch.ones_like(aqk)
    s = 1
    while s < c:
        lv = _level(seg, g, fwd, rev, s)
        q_r = _halves(q, lv.nb, s)[1]
        k_l, k_r = _halves(k, lv.nb, s)
        beta_r = _halves(beta, lv.nb, s)[1]
        k_from = (k_l * masked_exp(lv.left_in, lv.r_l)).transpose(-1, -2)  # [.., nb, K, s]
        to_t = masked_exp(lv.right_in, lv.f_r)  # [.., nb, s, K]
        aqk = _merge(aqk, (q_r * to_t) @ k_from)
        t_inv = merge_inverse(t_inv, ((k_r * to_t) @ k_from) * beta_r)
        fwd, rev = lv.fwd, lv.rev
        s *= 2
    return WyForms(aqk[..., 0, :, :], t_inv[..., 0, :, :], fwd, rev)


def wy_forms_scalar(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    seg: torch.Tensor) -> WyForms:
    """:func:`wy_forms` for one log decay per head (Gated DeltaNet): ``g [B, H, N, C, 1]``.

    Same outputs (``fwd``/``rev`` ``[.., C, 1]``). A scalar gate leaves the K-sum, so the pair
    decays form one ``[C, C]`` matrix per chunk, ``E[t, i] = exp(D(i, t])`` for ``i <= t`` in t's
    run (exact 0 elsewhere), and ``aqk = (q k^T) * E``, ``A = beta (k k^T) * E`` are two plain
    chunk-sized matmuls: no ``[.., K]`` gate, decayed copy of q or k, ``[.., K]`` exponential or
    per-level small matmul is formed. The exponents come from the same binary hierarchy: the
    pair ``(i, t)`` split at boundary ``r`` gets ``D(r, t] + D(i, r]``, two direct sums of the
    g's they span (<= 0, no cancellation), masked to ``r``'s run before the exponential.
    ``(I + A)^-1`` is :func:`unit_lower_inverse` of the dense ``A``.
    """
    c = q.shape[-2]
    fwd, rev = g, torch.zeros_like(g)
    expo = torch.zeros_like(g)[..., None]  # [.., C, 1, 1]: exponents of the diagonal, D(t, t]
    same = torch.ones_like(seg, dtype=torch.bool)[..., None, None]  # [B, 1, N, C, 1, 1]
    s = 1
    while s < c:
        lv = _level(seg, g, fwd, rev, s)
        expo = _merge(expo, lv.f_r + lv.r_l.transpose(-1, -2))  # D(r, t] + D(i, r]
        same = _merge(same, lv.right_in & lv.left_in.transpose(-1, -2))
        fwd, rev = lv.fwd, lv.rev
        s *= 2
    same = same[..., 0, :, :]  # [B, 1, N, C, C]: i <= t in t's run
    decay = masked_exp(same, expo[..., 0, :, :])  # [B, H, N, C, C]
    k_t = k.transpose(-1, -2)
    # `where` as well as the zero decay: a product overflowing elsewhere stays out exactly
    aqk = torch.where(same, (q @ k_t) * decay, 0.0)
    a = torch.where(same, (k @ k_t) * decay, 0.0) * beta  # only its strict lower part is read
    return WyForms(aqk, unit_lower_inverse(a), fwd, rev)


# ---------------------------------------------------------------------------------------------
# the chunk-to-state-chain wiring
# ---------------------------------------------------------------------------------------------
def entering_state(transition: torch.Tensor, final: torch.Tensor,
                   ctx: PackedContext) -> torch.Tensor:
    """The state entering this rank's shard, from every rank's shard map ``S_out = M S_in + S``.

    Args:
        transition: the shard's ``M``: ``[..., K, K]`` (a DPLR shard), or ``[...]``, a scalar
            per head (a diagonal shard: ``M = m I``, formed here in ``transition``'s dtype).
        final: ``[..., K, V]``, the state the shard reaches from zero.
        ctx: this rank's :class:`~fcp.context.PackedContext`.

    Returns:
        fp32 ``[..., K, V]``: zeros on rank 0 and without CP. One
        :func:`~fcp.comm.state_chain` all-gather of ``[..., K, K + V]``.
    """
    if transition.dim() == final.dim() - 2:  # a scalar per head: m I
        eye = torch.eye(final.shape[-2], dtype=transition.dtype, device=transition.device)
        transition = transition[..., None, None] * eye
    return state_chain(transition, final, ctx)


def dplr_outputs(w: torch.Tensor, u0: torch.Tensor, kd: torch.Tensor, dec: torch.Tensor,
                 qg: torch.Tensor, aqk: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
    """The outputs of a chunked DPLR recurrence on this rank's shard, the CP chain included.

    Args (``[..]`` the leading ``[batch, heads, N]`` dims, ``N`` chunks of ``C`` tokens; one
    floating dtype, the compute dtype):
        w, kd: ``[.., C, K]``; u0: ``[.., C, V]``; dec: ``[.., K]``: the chunk transitions
            ``A = diag(dec) - kd^T w``, ``B = kd^T u0`` (:func:`dplr_maps`), exact zeros across
            runs (the module docstring);
        qg: ``[.., C, K]``: how the state entering a chunk reaches its outputs;
        aqk: ``[.., C, C]``: how the chunk's pseudo-values ``u0 - w S`` reach them;
        ctx: this rank's :class:`~fcp.context.PackedContext`.

    Returns:
        ``o = qg @ S + aqk @ (u0 - w @ S)`` per chunk, ``[.., C, V]`` in the inputs' dtype, with
        ``S`` the state entering each chunk (from zero at the shard's start without CP). Under CP
        the scan runs on the augmented state ``[S | P]`` from ``[0 | I]`` (``u0 -> [u0 | 0]``),
        which yields the shard's transition ``M`` (the final ``P``) and each token's response to
        the state entering the shard in the same pass; that state
        (:func:`entering_state`) is then added to the outputs of the shard's first run.
    """
    dv = u0.shape[-1]
    cp = ctx.cp_enabled
    state = None  # zero
    if cp:
        u0, state = augmented_start(u0, w.shape[-1])
    # the chunk recurrence, composed as affine maps by a log-depth scan (no Python loop over
    # chunks, so the compiled graph does not grow with the sequence length)
    states, pseudo, state = dplr_scan(w, u0, kd, dec, state)
    out = qg @ states + aqk @ pseudo  # [.., C, V(+K)]
    if cp:
        s_in = entering_state(state[..., dv:], state[..., :dv], ctx).to(out.dtype)
        # only tokens of the run going on at the shard start have a nonzero response row
        out = out[..., :dv] + out[..., dv:] @ s_in.unsqueeze(-3)
    return out
