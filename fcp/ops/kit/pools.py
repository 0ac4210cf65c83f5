"""Document-aligned pools of ``k`` tokens under contiguous CP, and the indexers' selection pipeline.

What the two indexers (:mod:`fcp.ops.kpool_indexer`, GLM-5.3-Flash's DSA k-pool indexer, and
:mod:`fcp.ops.qsa_indexer`, Qwen3.8-Flash-Next's QSA selection) share: where pools end, a static
table of pool slots, the ``k`` tokens behind each pool end (across rank boundaries), the
all-gather of one summary vector per pool, the relu-of-dot-product head scores, a top-k with a
fixed tie rule, and the expansion of chosen pools (plus the query's incomplete pool, the *tail*)
back to global token ids. Each indexer brings only its pooled keys, its queries and its layout::

    plan = plan_pools(ctx, k)                               # replicated slot table
    keys = my_pooled_keys(..., plan.ends)                        # [batch, C, Di], this rank's
    rows = select_pools(q, gather_pool_keys(keys, ctx), plan, ctx, k, n_pools,
                        tail=..., head_weights=w, scale=scale)

Pools. Pool ``j`` of a document covers its document-local positions ``[j*k, (j+1)*k)``; only
complete pools exist. A token *ends a pool* iff it is real (doc id != 0) and its document-local
position ``p`` has ``(p + 1) % k == 0``; its pool is the ``k`` tokens up to and including it, all
in its document. A pool ending at ``e`` is visible to query ``t`` iff ``doc(e) == doc(t) != 0``
and ``e <= t``. Pool ends are at least ``k`` apart (the ``k - 1`` tokens before an end share its
document), so each run of ``k`` positions holds at most one: slot ``c`` of a rank holds the pool
end among its local positions ``[c*k, (c+1)*k)``, if any. A rank of ``L`` tokens has ``ceil(L /
k)`` slots, a static shape whatever the packing, and the slots are position-aligned: the slots a
range of positions can hold are known without looking at the map.

Worked example (``k = 4``, two ranks of 8 tokens: rank 0 owns 0-7, rank 1 owns 8-15)::

    global position  0 1 2 3 4 5 6 7 | 8 9 10 11 12 13 14 15
    doc id           1 1 1 1 1 1 2 2 | 2 2  2  2  2  2  2  0
    document pos     0 1 2 3 4 5 0 1 | 2 3  4  5  6  7  8  0
    ends a pool            X         |   X              X

    pool_slots -> [[3, -1, 9, 13]]   (2 slots per rank, rank-major, ascending, -1 = empty)

The pool ending at 9 covers tokens 6..9 and straddles the rank boundary: rank 1 reads tokens
6 and 7 through :func:`fcp.comm.left_halo` (``k - 1`` tokens). Query 14 sees the pools ending at
9 and 13; its tail is token 14 (document positions 8..8, the start of its incomplete pool).

Scoring. A query ``t`` sees only pools of its document, which started fewer than
``ctx.band`` tokens before it, so :func:`select_pools` scores each chunk of queries against
the slots of positions ``[first query - band + 1, last query]`` only (``fcp::pool_top``, a
custom op looping over query chunks: the compiled graph does not grow with the sequence, and
the transient scores are bounded by the chunk; ``fcp::pool_selection`` adds the ordering, the
pools' tokens and the tail, and ``fcp::pool_slot_table`` builds the slot table, so a dynamic
compile traces none of that arithmetic). The result is the same as scoring every slot
of the row, bitwise: the slots left out are invisible to the chunk, the per-(query, pool)
scores do not depend on which others are computed, and the tie rule orders slots by position.

Everything is compile-safe: static shapes from Python ints, no host synchronisation; the slot
table is derived on every rank from the replicated doc-id map (no communication), and the only
collectives are one ``k - 1`` token left halo and one all-gather of the per-slot summaries.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from fcp.checks import check_positive_int, check_tensor
from fcp.comm import all_gather_group, left_halo
from fcp.context import PackedContext
from fcp.layout import PAD_DOC_ID, document_starts, position_ids_from_doc_ids
from fcp.ops.kit.balance import attention_plan, run_balanced
from fcp.ops.kit.common import register_fp32_autocast, scalar_tensor

__all__ = [
    "check_selection",
    "PoolPlan",
    "plan_pools",
    "gather_pool_keys",
    "relu_head_scores",
    "select_pools",
    "SCORE_CHUNK_ELEMENTS",
    "pool_top",
    "pool_selection",
    "pool_slot_table",
    "score_chunks",
    "score_chunk_rows",
    "scored_pairs",
    "slot_of",
    "slot_window",
    "pool_ends",
    "slot_capacity",
    "pool_slots",
    "local_slots",
    "pool_windows",
    "all_gather_slots",
    "visible_pools",
    "visible_slots",
    "top_pools",
    "by_score",
    "pool_tokens",
    "tail_tokens",
    "doc_lengths",
    "place_tail",
    "rank_pools_reference",
]


def pool_ends(doc_ids: torch.Tensor, kpool: int) -> torch.Tensor:
    """bool ``[batch, seq]``: the token is real and ends a complete document-aligned pool.

    >>> pool_ends(torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0]]), 2).int().tolist()
    [[0, 1, 0, 0, 1, 0, 1, 0]]
    """
    pos = position_ids_from_doc_ids(doc_ids)
    return (doc_ids != PAD_DOC_ID) & ((pos + 1) % kpool == 0)


def slot_capacity(local_len: int, kpool: int) -> int:
    """Slots per rank: ``ceil(local_len / kpool)``, the most pool ends one interval can hold.
    Integer arithmetic: exact, and on a symbolic length (a dynamic compile) no float symbol."""
    return -(-local_len // kpool)


def pool_slots(doc_ids: torch.Tensor, kpool: int, cp_size: int) -> torch.Tensor:
    """int64 ``[batch, cp_size * C]``: global end positions of every rank's pools, -1 for empty.

    ``C = slot_capacity(seq // cp_size, kpool)``; slot ``r*C + c`` holds the pool end among
    rank ``r``'s local positions ``[c*kpool, (c+1)*kpool)`` (at most one), so valid entries
    ascend along the row and :func:`slot_of` maps a position to its slot. Computed from the
    replicated map on every rank (same answer everywhere, no communication).
    """
    batch, seq = doc_ids.shape
    local = seq // cp_size
    cap = slot_capacity(local, kpool)
    ends = pool_ends(doc_ids, kpool).view(batch, cp_size, local)
    ends = torch.cat([ends, ends.new_zeros(batch, cp_size, cap * kpool - local)], -1)
    offset = torch.arange(kpool, device=doc_ids.device)
    at = torch.where(ends.view(batch, cp_size, cap, kpool), offset, -1).amax(-1)  # [b, r, C]
    first = torch.arange(cp_size, device=doc_ids.device)[:, None] * local + (
        torch.arange(cap, device=doc_ids.device) * kpool
    )
    return torch.where(at >= 0, first + at, -1).flatten(1)


def slot_of(position: int, local_len: int, kpool: int) -> int:
    """The slot of :func:`pool_slots` that a pool ending at global ``position`` occupies.

    >>> slot_of(9, 8, 4)  # rank 1, local position 1: its first slot
    2
    """
    cap = slot_capacity(local_len, kpool)
    return (position // local_len) * cap + (position % local_len) // kpool


def local_slots(slots: torch.Tensor, ctx: PackedContext, kpool: int) -> torch.Tensor:
    """This rank's part of :func:`pool_slots`: int64 ``[batch, C]`` global end positions."""
    cap = slot_capacity(ctx.local_seq_len, kpool)
    return slots[:, ctx.cp_rank * cap : (ctx.cp_rank + 1) * cap]


def pool_windows(
                 x: torch.Tensor, ends: torch.Tensor, ctx: PackedContext, kpool: int
) -> torch.Tensor:
    """The ``kpool`` tokens of each local pool: ``[batch, C, kpool, *channels]``.

    Args:
        x: ``[batch, local_seq, *channels]``, this rank's shard (any dtype; no gradient flows).
        ends: int64 ``[batch, C]`` from :func:`local_slots` (-1 = empty slot: its window holds
            arbitrary finite tokens of the shard; callers mask it).
        ctx: the rank's context; ``kpool - 1`` tokens before the interval come from
            :func:`fcp.comm.left_halo` (zeros before the sequence start, never read by a pool).

    Row ``i`` of a window is the token ``end - kpool + 1 + i`` (ascending positions).
    """
    x = x.detach()
    halo = left_halo(x, ctx, kpool - 1)
    both = torch.cat([halo, x], 1) if kpool > 1 else x  # index j + kpool - 1 = local token j
    first = (ends - ctx.seq_start).clamp(min=0)  # window start, in ``both`` coordinates
    idx = first[..., None] + torch.arange(kpool, device=x.device)  # [b, C, k]
    rows = torch.arange(x.shape[0], device=x.device)[:, None, None]
    return both[rows, idx]


def all_gather_slots(per_slot: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
    """``[batch, C, ...] -> [batch, cp_size * C, ...]`` in rank order (no gradient; identity
    without CP). The slots line up with :func:`pool_slots`. A slot count is not a fraction of
    the local length, so this is the group form: every rank's ``C`` is the same by
    construction (:func:`slot_capacity` of the shared local length)."""
    return all_gather_group(
        per_slot.detach().contiguous(), ctx.group_info, 1, differentiable=False, validate=False
    )


def visible_pools(slots: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
    """bool ``[batch, local_seq, P]``: slot ``j`` holds a pool visible to the local query
    (``doc(end) == doc(t) != 0`` and ``end <= t``)."""
    return visible_slots(slots, ctx.doc_ids, ctx.seq_start, ctx.local_seq_len)


def visible_slots(slots: torch.Tensor, doc_ids: torch.Tensor, start: int,
                  length: int) -> torch.Tensor:
    """bool ``[batch, length, P]``: :func:`visible_pools` for the queries ``start .. start +
    length - 1`` (global positions) and the pool ends ``slots [batch, P]`` (-1 = empty)."""
    doc_end = doc_ids.gather(1, slots.clamp(min=0))  # [b, P]
    t = torch.arange(start, start + length, device=doc_ids.device)
    doc_q = doc_ids[:, start : start + length]
    same = (doc_end[:, None, :] == doc_q[:, :, None]) & (doc_q != PAD_DOC_ID)[:, :, None]
    return same & (slots >= 0)[:, None, :] & (slots[:, None, :] <= t[None, :, None])


def top_pools(
              score: torch.Tensor, visible: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``k`` best visible pools per query, with a fixed tie rule.

    Rule: a higher score first; among equal scores the earlier slot (= the earlier pool) first.
    NaN scores count as ``-inf``; a query with fewer than ``k`` visible pools gets all of them.

    Args:
        score: float ``[..., P]``; visible: bool ``[..., P]``.

    Returns:
        ``(slot, chosen, chosen_score)``, each ``[..., k]``: slot indices in ascending slot
        order (chosen ones first; unchosen entries are arbitrary, ``chosen`` False), and the
        scores of the chosen slots. Cost ``O(P)`` per query (a ``topk`` for the k-th value, two
        cumulative sums), not a sort of the row.
    """
    p = score.shape[-1]
    kk = min(k, p)
    s = torch.where(visible & ~torch.isnan(score), score, float("-inf"))
    if kk == 0:
        slot = torch.zeros(*score.shape[:-1], k, dtype=torch.int64, device=score.device)
        return slot, torch.zeros_like(slot, dtype=torch.bool), torch.zeros_like(slot, dtype=s.dtype)
    kth = torch.topk(s, kk, -1).values[..., -1:]  # the kk-th largest value, whatever tie order
    above = visible & (s > kth)
    at = visible & (s == kth)
    room = kk - above.sum(-1, keepdim=True, dtype=torch.int32)
    chosen = above | (at & (torch.cumsum(at, -1, dtype=torch.int32) <= room))
    count = chosen.sum(-1, keepdim=True, dtype=torch.int32)
    running = torch.cumsum(chosen, -1, dtype=torch.int32).contiguous()
    want = torch.arange(1, kk + 1, dtype=torch.int32, device=score.device)
    want = want.expand(*score.shape[:-1], kk).contiguous()
    slot = torch.searchsorted(running, want).clamp(max=p - 1)  # the j-th chosen slot
    ok = want <= count
    picked = torch.where(ok, s.gather(-1, slot), float("-inf"))
    if kk < k:
        pad = k - kk
        slot = torch.cat([slot, slot.new_zeros(*slot.shape[:-1], pad)], -1)
        ok = torch.cat([ok, ok.new_zeros(*ok.shape[:-1], pad)], -1)
        picked = torch.cat([picked, picked.new_full((*picked.shape[:-1], pad), float("-inf"))], -1)
    return slot, ok, picked


def by_score(
             slot: torch.Tensor, chosen: torch.Tensor, chosen_score: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder :func:`top_pools`' output by descending score, ties (and ``-inf``) by slot, the
    unchosen entries last (a stable sort of ``k`` entries)."""
    order = torch.sort(chosen_score, dim=-1, descending=True, stable=True).indices
    return slot.gather(-1, order), chosen.gather(-1, order)


def pool_tokens(ends: torch.Tensor, chosen: torch.Tensor, kpool: int) -> torch.Tensor:
    """int64 ``[..., k * kpool]``: the tokens of each chosen pool (ending at ``ends``), ascending
    inside a pool, ``-1`` for every token of an unchosen entry."""
    tok = ends[..., None] - (kpool - 1) + torch.arange(kpool, device=ends.device)
    return torch.where(chosen[..., None], tok, -1).flatten(-2)


def tail_tokens(doc_ids: torch.Tensor, start: int, n: int, kpool: int) -> torch.Tensor:
    """int64 ``[batch, n, kpool - 1]``: the tail of each query ``t`` of ``start .. start + n -
    1`` (global positions), the tokens of its incomplete pool ``t - m + 1 .. t`` with ``m = (p +
    1) % kpool`` (``p`` = document position; empty when ``t`` ends a pool), then ``-1``; all
    ``-1`` for pad queries.

    >>> tail_tokens(torch.tensor([[1, 1, 1, 1, 1, 0]]), 3, 3, 2).tolist()
    [[[-1], [4], [-1]]]
    """
    dev = doc_ids.device
    t = torch.arange(start, start + n, device=dev)
    pos = position_ids_from_doc_ids(doc_ids)[:, start : start + n]
    real = doc_ids[:, start : start + n] != PAD_DOC_ID
    m = torch.where(real, (pos + 1) % kpool, 0)  # [b, n]
    r = torch.arange(kpool - 1, device=dev)
    tok = (t - m + 1)[..., None] + r
    return torch.where(r < m[..., None], tok, -1)


def doc_lengths(doc_ids: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """int64 ``[batch, length]``: the length of the document (run) of global tokens
    ``start .. start + length - 1`` (a scatter-add over the replicated map, static shapes).

    >>> doc_lengths(torch.tensor([[1, 1, 1, 2, 0]]), 1, 3).tolist()
    [[3, 3, 1]]
    """
    runs = torch.cumsum(document_starts(doc_ids), 1) - 1  # run number of every token
    counts = torch.zeros_like(doc_ids).scatter_add(1, runs, torch.ones_like(doc_ids))
    return counts.gather(1, runs[:, start : start + length])


def place_tail(rows: torch.Tensor, tail: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``cat(rows, -1 * (k - 1))`` with ``tail [..., k - 1]`` written from column ``first``
    (``[..., 1]``) on; every column it overwrites must hold ``-1`` (unfilled pool slots)."""
    out = torch.cat([rows, torch.full_like(tail, -1)], -1)
    return out.scatter(-1, first + torch.arange(tail.shape[-1], device=rows.device), tail)


def rank_pools_reference(
                         scores: list[float], robust_zero: list[bool], k: int, tol: float = 1e-4
) -> tuple[list[int], bool, bool]:
    """The tie rule for the references (plain Python, one query): ``(chosen, near_tie,
    exact_tie)``.

    ``scores[j]`` is pool ``j``'s score (pools in ascending position order, all visible);
    ``chosen`` lists at most ``k`` pools by descending score, equal scores by ascending ``j``.
    ``near_tie``: two pools whose order matters (adjacent in that order, the first one chosen)
    score within ``tol`` of each other, so another rounding could order them differently;
    ``exact_tie``: such a pair is a tie in every precision (both ``robust_zero``: every term
    of both scores is clamped to exactly 0), decided by the tie rule alone.
    """
    order = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
    near = exact = False
    for a, b in zip(order[:k], order[1 : k + 1]):
        if abs(scores[a] - scores[b]) <= tol * max(1.0, abs(scores[a])):
            if robust_zero[a] and robust_zero[b]:
                exact = True
            else:
                near = True
    return order[:k], near, exact


# ---------------------------------------------------------------------------------------------
# the selection pipeline both indexers run
# ---------------------------------------------------------------------------------------------
def check_selection(name: str, index_q, batch: int, local: int, budget: int, pool: int, *,
                    budget_name: str, pool_name: str) -> tuple[int, int]:  # fmt: skip
    """An indexer's budget (tokens from complete pools, a multiple of the pool size) and its
    queries ``index_q [batch, local, index_heads, Di]`` (floating point); returns
    ``(budget, pool)`` as ints (the :mod:`fcp.checks` rule)."""
    pool = check_positive_int(pool, pool_name, fn=name)
    budget = check_positive_int(budget, budget_name, fn=name)
    if budget % pool:
        raise ValueError(f"{name}: {budget_name}={budget} must be a multiple of {pool_name}={pool}")
    check_tensor(index_q, "index_q", fn=name, kind="float", shape=(batch, local, None, None),
                 layout="[batch, local_seq, index_heads, Di]")  # fmt: skip
    return budget, pool


class PoolPlan(NamedTuple):
    """Replicated pool slots ``[batch, P]`` (:func:`pool_slots`) and this rank's ``[batch, C]``."""

    slots: torch.Tensor
    ends: torch.Tensor


@torch.library.custom_op("fcp::pool_slot_table", mutates_args=())
def pool_slot_table(doc_ids: torch.Tensor, kpool: int, cp_size: int) -> torch.Tensor:
    """:func:`pool_slots` as one opaque node (traced, its reshapes reason about the slot count
    symbolically under a dynamic compile)."""
    return pool_slots(doc_ids, kpool, cp_size)


@pool_slot_table.register_fake
def _(doc_ids, kpool, cp_size):
    cap = slot_capacity(doc_ids.shape[1] // cp_size, kpool)
    return doc_ids.new_empty(doc_ids.shape[0], cp_size * cap, dtype=torch.int64)


def plan_pools(ctx: PackedContext, kpool: int) -> PoolPlan:
    """The slot table of pools of ``kpool`` tokens, from the replicated map (no communication)."""
    slots = pool_slot_table(ctx.doc_ids, kpool, ctx.cp_size)
    return PoolPlan(slots, local_slots(slots, ctx, kpool))


def gather_pool_keys(local_keys: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
    """This rank's pooled keys ``[batch, C, Di]`` -> every rank's, fp32: ``[batch, P, Di]`` in
    slot order (one all-gather, no gradient)."""
    return all_gather_slots(local_keys, ctx).float()


def relu_head_scores(q: torch.Tensor, keys_t: torch.Tensor,
                     head_weights: torch.Tensor | None = None,
                     scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[batch, queries, P]``: ``sum_h w_h * relu(scale * q_h . k_p)``.

    ``q`` fp32 ``[batch, queries, heads, Di]``, ``keys_t`` fp32 ``[batch, Di, P]``;
    ``head_weights`` ``[batch, queries, heads]`` (``None``: 1) and ``scale`` (a float or a 0-d
    tensor, the same product bitwise; ``None``: no multiply, so the arithmetic is exactly the
    unscaled one). One ``[queries, P]`` matmul per
    head bounds the memory.
    """
    score = None
    for h in range(q.shape[2]):
        dots = torch.matmul(q[:, :, h], keys_t)
        term = torch.relu(dots if scale is None else dots * scale)
        if head_weights is not None:
            term = head_weights[:, :, h, None] * term
        score = term if score is None else score + term
    return score


#: Default size, in score elements (queries x slots, all batch rows), of one query chunk.
SCORE_CHUNK_ELEMENTS = 1 << 20


def slot_window(first: int, last: int, band: int, local_len: int, kpool: int,
                n_slots: int) -> tuple[int, int]:
    """``(s0, s1)``: the slots that can hold a pool visible to a query in ``[first, last]``
    (global positions): those of positions ``[first - band + 1, last]``."""
    lo = slot_of(max(0, first - band + 1), local_len, kpool)
    return lo, min(n_slots, slot_of(last, local_len, kpool) + 1)


def score_chunks(n: int, seq_start: int, band: int, kpool: int, n_slots: int, chunk: int,
                 local_len: int | None = None) -> list[tuple[int, int, int, int]]:
    """``(r0, r1, s0, s1)`` per chunk of ``chunk`` of the ``n`` queries from ``seq_start``:
    rows ``r0:r1`` score the slots ``s0:s1`` (:func:`slot_window`; slots of ranks of
    ``local_len`` tokens, default ``n``)."""
    local_len = n if local_len is None else local_len
    out = []
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        out.append((r0, r1, *slot_window(seq_start + r0, seq_start + r1 - 1, band, local_len,
                                          kpool, n_slots)))  # fmt: skip
    return out


def score_chunk_rows(batch: int, local_len: int, band: int, kpool: int) -> int:
    """Default queries per chunk: about :data:`SCORE_CHUNK_ELEMENTS` scores per chunk."""
    rows = max(1, local_len)

    def window(n):  # slots of n queries and the band behind them, rank crossings included
        return (n + band) // kpool + 2 + (n + band) // max(1, local_len)

    while rows > 1 and batch * rows * window(rows) > SCORE_CHUNK_ELEMENTS:
        rows = (rows + 1) // 2
    return rows


def scored_pairs(ctx: PackedContext, kpool: int, chunk: int | None = None) -> int:
    """(query, slot) pairs :func:`select_pools` scores per batch row on this rank (the full
    matrix is ``local_seq * P``)."""
    local = ctx.local_seq_len
    n_slots = ctx.cp_size * slot_capacity(local, kpool)
    chunk = chunk or score_chunk_rows(ctx.batch_size, local, ctx.key_band, kpool)
    return sum((r1 - r0) * (s1 - s0) for r0, r1, s0, s1 in
               score_chunks(local, ctx.seq_start, ctx.key_band, kpool, n_slots, chunk))


@torch.library.custom_op("fcp::pool_top", mutates_args=())
def pool_top(q: torch.Tensor, keys: torch.Tensor, head_weights: Optional[torch.Tensor],
             slots: torch.Tensor, doc_ids: torch.Tensor, seq_start: int, local_len: int,
             kpool: int, band: int, n_pools: int, scale: Optional[torch.Tensor],
             divisor: Optional[float],
             chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`top_pools` of :func:`relu_head_scores` (divided by ``divisor`` if given) for the
    queries ``seq_start ..`` (global positions), ``chunk`` queries at a time, each chunk
    against its :func:`slot_window` only.

    ``q`` fp32 ``[b, n, Hi, Di]``, ``keys`` fp32 ``[b, P, Di]``, ``slots`` the pool ends ``[b,
    P]`` of ranks of ``local_len`` tokens (:func:`pool_slots`), ``scale`` a 0-d fp64 tensor
    (:func:`~fcp.ops.kit.common.scalar_tensor`) or ``None``; returns ``(slot, chosen,
    chosen_score)`` ``[b, n, n_pools]`` with global slot ids; ``chunk=0`` is
    :func:`score_chunk_rows`' default."""
    batch, n = q.shape[:2]
    chunk = chunk or score_chunk_rows(batch, local_len, band, kpool)
    slot = q.new_zeros(batch, n, n_pools, dtype=torch.int64)
    chosen = q.new_zeros(batch, n, n_pools, dtype=torch.bool)
    picked = q.new_zeros(batch, n, n_pools)
    for r0, r1, s0, s1 in score_chunks(n, seq_start, band, kpool, slots.shape[1], chunk,
                                       local_len):  # fmt: skip
        hw = None if head_weights is None else head_weights[:, r0:r1]
        score = relu_head_scores(q[:, r0:r1], keys[:, s0:s1].transpose(1, 2), hw, scale)
        if divisor is not None:
            score = score / divisor
        vis = visible_slots(slots[:, s0:s1], doc_ids, seq_start + r0, r1 - r0)
        sl, ok, sc = top_pools(score, vis, n_pools)
        slot[:, r0:r1], chosen[:, r0:r1], picked[:, r0:r1] = sl + s0, ok, sc
    return slot, chosen, picked


@pool_top.register_fake
def _(q, keys, head_weights, slots, doc_ids, seq_start, local_len, kpool, band, n_pools, scale,
      divisor, chunk):  # fmt: skip
    shape = (*q.shape[:2], n_pools)
    return (q.new_empty(shape, dtype=torch.int64), q.new_empty(shape, dtype=torch.bool),
            q.new_empty(shape))  # fmt: skip


register_fp32_autocast(pool_top)


#: Where the tail goes in a row: after ``min(n_pools, complete pools of the document)`` pool
#: slots (GLM's layout), right after the chosen pools (QSA's: valid ids first), or nowhere.
TAIL_LAYOUTS = ("after_document_pools", "after_chosen", "none")


@torch.library.custom_op("fcp::pool_selection", mutates_args=())
def pool_selection(q: torch.Tensor, keys: torch.Tensor, head_weights: Optional[torch.Tensor],
                   ascending: Optional[torch.Tensor], slots: torch.Tensor, doc_ids: torch.Tensor,
                   start: int, local_len: int, kpool: int, band: int, n_pools: int,
                   scale: Optional[torch.Tensor], divisor: Optional[float], chunk: int,
                   tail: str) -> torch.Tensor:  # fmt: skip
    """:func:`select_pools`' rows for the queries ``start ..`` (global positions; ``q``, its
    ``head_weights`` and ``ascending`` (int ``[b, n, 1]``, nonzero: ascending) hold their
    rows): :func:`pool_top`, the order, each pool's tokens and the tail, in one opaque node
    (traced, the ordering, expansion and tail arithmetic were a large part of a DSA layer's
    dynamic compile). int64 ``[b, n, n_pools * kpool (+ kpool - 1)]``."""
    slot, chosen, chosen_score = pool_top(q, keys, head_weights, slots, doc_ids, start,
                                          local_len, kpool, band, n_pools, scale, divisor,
                                          chunk)  # fmt: skip
    ranked, ranked_ok = by_score(slot, chosen, chosen_score)
    if ascending is None:
        slot, chosen = ranked, ranked_ok
    else:
        up = ascending.bool()
        slot, chosen = torch.where(up, slot, ranked), torch.where(up, chosen, ranked_ok)
    ends = slots.gather(1, slot.flatten(1)).view_as(slot)
    rows = pool_tokens(ends, chosen, kpool)
    if tail == "none" or kpool == 1:
        return rows
    n = q.shape[1]
    if tail == "after_document_pools":
        pools_of_doc = doc_lengths(doc_ids, start, n) // kpool
        first = torch.clamp(pools_of_doc, max=n_pools)[..., None] * kpool
    else:
        first = chosen.sum(-1, keepdim=True) * kpool
    return place_tail(rows, tail_tokens(doc_ids, start, n, kpool), first)


@pool_selection.register_fake
def _(q, keys, head_weights, ascending, slots, doc_ids, start, local_len, kpool, band, n_pools,
      scale, divisor, chunk, tail):  # fmt: skip
    width = n_pools * kpool + (0 if tail == "none" or kpool == 1 else kpool - 1)
    return q.new_empty(*q.shape[:2], width, dtype=torch.int64)


def select_pools(q: torch.Tensor, keys: torch.Tensor, plan: PoolPlan, ctx: PackedContext,
                 kpool: int, n_pools: int, *, tail: str, ascending: torch.Tensor | None = None,
                 head_weights: torch.Tensor | None = None, scale: float | None = None,
                 divisor: float | None = None, chunk: int | None = None) -> torch.Tensor:
    """Global token ids ``[batch, local, n_pools * kpool (+ kpool - 1)]`` of the chosen pools.

    Scores ``relu_head_scores(q, keys, head_weights, scale)`` (then ``/ divisor`` if given) of
    ``q`` fp32 ``[batch, local, heads, Di]`` against ``keys`` fp32 ``[batch, P, Di]``
    (:func:`gather_pool_keys`), ``chunk`` queries at a time (default
    :func:`score_chunk_rows`; results do not depend on it or on ``ctx.band``, bitwise),
    then the ``n_pools`` best visible pools (:func:`top_pools`' tie rule), ordered by
    descending score, or ascending where ``ascending`` (bool ``[batch, local, 1]``) holds;
    each pool's tokens ascending; ``-1`` for unfilled entries; then the tail per ``tail``
    (:data:`TAIL_LAYOUTS`; none when ``kpool == 1``). With long documents under CP the
    queries are balanced across ranks (:mod:`fcp.ops.kit.balance`; the ids do not change).
    """
    band, local = ctx.key_band, ctx.local_seq_len
    # 0: the op picks the default itself, on concrete sizes, so that a dynamic length does not
    # specialise the graph on the chunking (results do not depend on it)
    chunk = 0 if chunk is None else chunk
    scale_t = None if scale is None else scalar_tensor(scale, q.device)

    def run(start: int, n: int, q, ascending, head_weights):
        return pool_selection(q, keys, head_weights, ascending, plan.slots, ctx.doc_ids, start,
                              local, kpool, band, n_pools, scale_t, divisor, chunk,
                              tail)  # fmt: skip

    # bool does not travel through every backend's all-to-all: int8 for the trip
    up = None if ascending is None else ascending.to(torch.int8)
    return run_balanced(ctx, attention_plan(ctx), run, q, up, head_weights)
