"""WKV's exact static-shape PyTorch path: a log-depth scan of stabilised decayed sums, documents
reset exactly, exact under CP.

Per channel the WKV state after token ``t`` is a pair of decayed sums, ``num_t = e^a num_{t-1} +
e^{k_t} v_t`` and ``den_t = e^a den_{t-1} + e^{k_t}``, with ``a <= 0`` constant per channel. The
keys are unbounded, so the sums are kept as ``(r, A, D)`` with ``num = e^r A``, ``den = e^r D``
and ``r`` a running maximum of the exponents (transformers' stabiliser). Two such states compose
associatively: a segment ``L`` followed by a segment ``R`` of ``s`` tokens gives

    r = max(r_L + s a, r_R),   A = A_L e^{r_L + s a - r} + A_R e^{r_R - r}   (D alike)

where every exponent is ``<= 0`` (no overflow, whatever the keys or the decay) and the largest
term has exponent 0 (no underflow of the whole sum). :func:`wkv_scan` composes the tokens by a
Hillis-Steele scan (``log2(T)`` elementwise steps, static shapes, no Python loop over tokens);
a left segment joins only where it ends in the token's own run (documents and the pad tail,
numbered over the replicated map), so runs never mix: cross-run terms are never formed.

**Why the references may be detached.** The output ``wkv_t = num / den`` does not depend on the
reference ``r`` (it cancels exactly), so its gradient equals the partial gradient with every
``r`` held constant: the scan computes ``r`` without gradient, and the gradients flow through
``A``, ``D`` and the explicit decay terms ``s a`` only (no gradient through a ``max``, no
cancelling pair of terms).

**CP.** A shard's map on the state entering it is linear once both sides have a known reference:
``(A, D)_out = e^{R_in + n a - R_out} (A, D)_in + e^{r_r - R_out} (A, D)_r`` (``n`` the shard
length; the transition is an exact 0 where a run starts inside the shard). The references
``R_out`` are a max-plus chain over the ranks: one all-gather of every rank's final ``r``
(fp32 ``[batch, channels]``, no gradient, as above) gives each rank ``R_in`` and ``R_out``
locally; the scaled sums then cross ranks through one :func:`~fcp.comm.state_chain`
(:func:`~fcp.ops.kit.recurrence.entering_state`, a diagonal shard map per channel: fp32
``[batch, channels, 1, 3]``). Every factor the chain multiplies is ``<= 1``.
"""

from __future__ import annotations

import torch

from fcp.comm import all_gather_group
from fcp.context import PackedContext
from fcp.layout import document_starts
from fcp.ops.kit.common import compute_dtype
from fcp.ops.kit.recurrence import chunk_runs, entering_state, masked_exp

__all__ = ["wkv_scan"]


def _scan(r: torch.Tensor, num: torch.Tensor, den: torch.Tensor, a: torch.Tensor,
          seg: torch.Tensor):  # fmt: skip
    """Inclusive scan of the tokens' stabilised states within runs: ``r`` (no gradient), ``num``,
    ``den`` ``[B, T, C]``, ``a [C]``, ``seg [B, T]`` run ids. Returns the three after each token,
    from the run start or the shard start."""
    n = r.shape[1]
    s = 1
    while s < n:
        same = (seg[:, s:] == seg[:, :-s])[..., None]  # the left segment ends in t's run
        r_l, r_r = r[:, :-s], r[:, s:]
        lead = r_l + s * a  # the left segment's exponent at t; gradient to a only
        r_new = torch.where(same, torch.maximum(lead.detach(), r_r), r_r)
        # exactly 0 where the left side is the max (x - x), else <= 0
        left = masked_exp(same, lead - r_new)
        right = torch.exp(r_r - r_new)  # <= 0, a constant
        num = torch.cat([num[:, :s], num[:, :-s] * left + num[:, s:] * right], 1)
        den = torch.cat([den[:, :s], den[:, :-s] * left + den[:, s:] * right], 1)
        r = torch.cat([r[:, :s], r_new], 1)
        s *= 2
    return r, num, den


def _entering(r_last, num_last, den_last, a, ctx: PackedContext):
    """``(R_in [B, C], num_in, den_in)``: the state entering this shard, scaled by ``e^-R_in``
    (zeros on rank 0), from every rank's final ``(r, num, den)`` (module doc, CP)."""
    n, rank = ctx.local_seq_len, ctx.cp_rank
    seg = torch.cumsum(document_starts(ctx.doc_ids), 1)
    ends = seg[:, n - 1 :: n]  # [B, world]: each shard's last run
    # a shard passes the state entering it on iff its last token continues the run before it
    passes = torch.cat([torch.zeros_like(ends[:, :1], dtype=torch.bool),
                        ends[:, 1:] == ends[:, :-1]], 1)  # fmt: skip
    finals = all_gather_group(r_last.detach()[None], ctx.group, dim=0, differentiable=False,
                              validate=False)  # [world, B, C]  # fmt: skip
    a_d = a.detach()
    r_out = finals[0]
    r_in = finals[0]  # rank 0: nothing enters (its transition is an exact 0)
    for j in range(1, rank + 1):  # the max-plus chain of the references (static rank)
        r_in = r_out
        joined = torch.maximum(r_in + n * a_d, finals[j])
        r_out = torch.where(passes[:, j, None], joined, finals[j])
    # [B, C], <= 1 (exactly 1 where the entering side is the max)
    transition = masked_exp(passes[:, rank, None], (r_in + n * a) - r_out)
    scale = torch.exp(r_last.detach() - r_out)[..., None]  # <= 1
    final = (torch.stack([num_last, den_last], -1) * scale)[..., None, :]  # [B, C, 1, 2]
    s_in = entering_state(transition, final, ctx)[..., 0, :].to(num_last.dtype)  # [B, C, 2]
    return r_in, s_in[..., 0], s_in[..., 1]


def wkv_scan(k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, u: torch.Tensor,
             ctx: PackedContext) -> torch.Tensor:
    """The ``"scan"`` backend of :func:`fcp.ops.wkv.wkv` (same arguments, checked there).

    Guarantees: exact to fp32 rounding (fp64 for fp64 inputs), every exponent formed ``<= 0``; a
    document's outputs are bitwise independent of every token outside it; deterministic; no host
    synchronisation, static shapes (a new packing never recompiles). Under CP: one all-gather of
    fp32 ``[batch, channels]`` (the references, no gradient) and one
    :func:`~fcp.comm.state_chain` all-gather of fp32 ``[batch, channels, 1, 3]``.
    """
    dt = compute_dtype(k, v, a, u)
    k, v, a, u = (t.to(dt) for t in (k, v, a, u))
    b, n, c = k.shape
    seg, prev = chunk_runs(ctx, n, 1)
    seg, prev = seg[..., 0], prev[:, :1]  # [B, T], [B, 1]: the run before the shard
    r = k.detach()
    unit = torch.exp(k - r)  # 1, carrying k's gradient
    r, num, den = _scan(r, v * unit, unit, a, seg)
    carried = (seg == prev)[..., None]  # [B, T, 1]: tokens of the run entering the shard
    if ctx.cp_enabled:
        r_in, num_in, den_in = _entering(r[:, -1], num[:, -1], den[:, -1], a, ctx)
        steps = torch.arange(1, n + 1, device=k.device, dtype=dt)[:, None]  # [T, 1]
        lead = r_in[:, None] + steps * a  # the entering state's exponent at t
        r_new = torch.where(carried, torch.maximum(lead.detach(), r), r)
        into = masked_exp(carried, lead - r_new)  # e^{(t+1) a}, scaled
        keep = torch.exp(r - r_new)
        num = num * keep + into * num_in[:, None]
        den = den * keep + into * den_in[:, None]
        r = r_new
    else:
        r_in = num_in = den_in = torch.zeros_like(k[:, 0])
    # the state before each token: the previous token's in its run, the entering one at the
    # shard's first token (if it continues the run), none at a run start
    has = torch.cat([carried[:, :1], (seg[:, 1:] == seg[:, :-1])[..., None]], 1)  # [B, T, 1]
    r_p = torch.cat([r_in[:, None], r[:, :-1]], 1)
    num_p = torch.cat([num_in[:, None], num[:, :-1]], 1)
    den_p = torch.cat([den_in[:, None], den[:, :-1]], 1)
    bonus = u + k
    r_o = torch.where(has, torch.maximum(r_p, bonus.detach()), bonus.detach())
    before = masked_exp(has, r_p - r_o)  # <= 0, a constant
    own = torch.exp(bonus - r_o)  # <= 0; gradient to u and k
    # (num_p + v own) / (den_p + own) as v + (num_p - v den_p) / (den_p + own): the same value,
    # but the gradient of a nearly negligible term (the bonus next to a dominant history, or the
    # other way round) is no longer a difference of two nearly equal quotients
    out = (num_p * before + v * own) / (den_p * before + own)
    return out.to(v.dtype)
