"""Balanced query work for long documents: which rank computes which queries of a softmax-style
operator, planned on the host from static facts only.

Contiguous CP is unbalanced for attention: a query scores the keys of its document before it,
so with one document filling the row, rank ``r``'s work grows as ``2r + 1`` and the last rank
is the straggler (``(2P - 1) / P`` times the mean). The operators that score keys
(``doc_causal_attention``, the indexers) already all-gather what they read, so any rank can
compute any query: balancing moves queries and outputs, never keys.

The plan (:func:`plan_queries`) cuts every rank's interval into ``n`` equal pieces and gives
each rank ``n`` pieces, chosen among

* **identity** (nothing moves) and
* **snakes**: the ``n * P`` pieces in row order, dealt ``0, 1, .., P-1, P-1, .., 0, 0, ..``
  (``n = 2`` is the "zigzag" of ring attention: rank ``r`` computes pieces ``r`` and
  ``2P - 1 - r``),

by the work a rank does under the operator's cost model (``cost(start, length)``: for the
banded kernels, the key blocks each query block scores, which depends only on the position and
``ctx.band``). Identity wins unless a snake lowers the slowest rank's work by more than
:data:`MIN_GAIN`: rows of short documents (a small ``band``: the same cost everywhere) move
nothing. The plan is a pure function of ``(global_seq, cp_size, band)`` and the cost model,
the same on every rank and a constant of a compiled graph (a new band bucket is a new graph,
as it already is).

Traffic per balanced call: each moved query's inputs go out and its outputs come back (one
``all_to_all_single`` each way, :func:`fcp.comm.send_pieces`), about ``(P - 1) / P`` of the
local queries for a snake; the backward reverses both.

Worked example: 2 ranks, 8 tokens of one document, local 4, ``band = 8``: costs grow along the
row, so the plan is the zigzag ``(0, 1, 1, 0)``: rank 0 computes tokens 0-1 and 6-7, rank 1
tokens 2-5::

    >>> work = lambda start, n: sum(start + i + 1 for i in range(n))  # keys before each query
    >>> plan = plan_queries(8, 2, work, min_piece=1)
    >>> plan.owners, plan.runs(0), plan.runs(1)
    ((0, 1, 1, 0), [(0, 2), (6, 2)], [(2, 4)])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fcp.comm import send_pieces
from fcp.context import PackedContext
from fcp.ops.kit.softmax import BLOCK, key_block_windows

__all__ = ["MIN_GAIN", "QueryPlan", "attention_plan", "banded_cost", "banded_plan", "is_static",
           "last_query", "plan_queries", "run_balanced"]

#: A snake is used only if it lowers the slowest rank's planned work by more than this fraction
#: (moving queries costs traffic; below it the contiguous split is balanced enough).
MIN_GAIN = 0.10
#: Pieces per rank tried by :func:`plan_queries` (fewer pieces: fewer kernel calls).
PIECES = (2, 4, 8, 16)


@dataclass(frozen=True)
class QueryPlan:
    """Global piece ``g`` (``local_seq // n`` tokens from ``g * piece``) is computed by rank
    ``owners[g]``; each rank computes ``n = len(owners) // cp_size`` pieces.

    Attributes:
        owners: the assignment, Python ints (static).
        piece: tokens per piece.
        loads: each rank's planned work under the cost model (for reports and tests).
    """

    owners: tuple[int, ...]
    piece: int
    loads: tuple[float, ...]

    @property
    def moves(self) -> bool:
        """Whether any piece is computed away from its home rank."""
        n = len(self.owners) // len(self.loads)
        return any(o != g // n for g, o in enumerate(self.owners))

    @property
    def imbalance(self) -> float:
        """Slowest rank's planned work over the mean (1.0: balanced)."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean else 1.0

    def runs(self, rank: int) -> list[tuple[int, int]]:
        """``(global start, length)`` of the contiguous runs of queries ``rank`` computes,
        ascending (adjacent pieces merged)."""
        out: list[tuple[int, int]] = []
        for g, o in enumerate(self.owners):
            if o != rank:
                continue
            if out and out[-1][0] + out[-1][1] == g * self.piece:
                out[-1] = (out[-1][0], out[-1][1] + self.piece)
            else:
                out.append((g * self.piece, self.piece))
        return out


def _snake(size: int, n: int) -> tuple[int, ...]:
    """Pieces ``0 .. n * size - 1`` dealt to ranks ``0, 1, .., size-1, size-1, .., 0, 0, ..``."""
    return tuple(g % size if (g // size) % 2 == 0 else size - 1 - g % size
                 for g in range(n * size))  # fmt: skip


def _loads(owners, piece: int, size: int, cost) -> tuple[float, ...]:
    loads = [0.0] * size
    for g, o in enumerate(owners):
        loads[o] += cost(g * piece, piece)
    return tuple(loads)


def plan_queries(global_seq: int, cp_size: int, cost: Callable[[int, int], float], *,
                 min_piece: int = BLOCK) -> QueryPlan:
    """The balanced plan for a row of ``global_seq`` tokens on ``cp_size`` ranks (module
    docstring). ``cost(start, length)``: the work of computing queries ``[start, start +
    length)``. Pieces are at least ``min_piece`` tokens; a snake replaces the identity if it
    lowers the slowest rank's work by more than :data:`MIN_GAIN`, a snake of more pieces
    replaces one of fewer if it lowers it by more than a fifth of that."""
    local = global_seq // cp_size
    identity = tuple(range(cp_size))
    best = QueryPlan(identity, local, _loads(identity, local, cp_size, cost))
    gain = MIN_GAIN
    for n in PIECES if cp_size > 1 else ():
        if local % n or local // n < min_piece:
            continue
        owners = _snake(cp_size, n)
        plan = QueryPlan(owners, local // n, _loads(owners, local // n, cp_size, cost))
        if max(plan.loads) < max(best.loads) * (1 - gain):
            best, gain = plan, MIN_GAIN / 5
    return best


# A constant of the graph to Dynamo, which calls it (cached) instead of tracing the cost loops
# (the plan's arguments are the static ints of a static-shape graph).
@torch.compiler.assume_constant_result
@functools.lru_cache(maxsize=256)
def banded_plan(global_seq: int, cp_size: int, band: int, stride: int = 1) -> QueryPlan:
    """:func:`plan_queries` under :func:`banded_cost` (the banded softmax kernel and the
    indexers' scorer), cached: a pure function of static ints."""
    return plan_queries(global_seq, cp_size,
                        lambda start, n: banded_cost(start, n, band, stride, global_seq))


def banded_cost(start: int, n: int, band: int, stride: int, keys: int) -> float:
    """Key blocks scored by the query blocks of ``[start, start + n)`` (blocks of
    :data:`~fcp.ops.kit.softmax.BLOCK` from ``start``) over ``keys`` key positions, plus one
    per query block for its own work."""
    nq = -(-n // BLOCK)
    nkb = -(-max(1, keys // stride) // BLOCK)
    windows = key_block_windows(start, nq, nkb, band, stride)
    return float(sum(max(0, hi - lo + 1) + 1 for lo, hi in windows))


def attention_plan(ctx: PackedContext, stride: int = 1) -> QueryPlan:
    """The plan of a banded operator on ``ctx`` (the identity without CP, with
    ``ctx.balance=False``, under a compile with a dynamic (symbolic) row length, or where
    balancing gains too little)."""
    if not ctx.cp_enabled or not ctx.balance or not is_static(ctx.global_seq_len):
        local = ctx.local_seq_len
        return QueryPlan(tuple(range(ctx.cp_size)), local, (0.0,) * ctx.cp_size)
    return banded_plan(ctx.global_seq_len, ctx.cp_size, ctx.key_band, stride)


def is_static(n: int) -> bool:
    """Whether ``n`` is a concrete int: ``False`` for a symbolic size of a dynamic-shape compile,
    where a plan would guard on the length's divisors (a recompile per length) and the
    contiguous layout is used instead.

    Dynamo reports a symbolic size as an ``int`` to ``isinstance``; ``statically_known_true``
    never guards, and a size symbol is unbounded above, so only a concrete int is known to be
    below any bound.
    """
    return statically_known_true(n < 2**62)


def run_balanced(ctx: PackedContext, plan: QueryPlan, compute: Callable[..., torch.Tensor],
                 *per_query: torch.Tensor | None) -> torch.Tensor:
    """``compute(start, n, *inputs)`` over the queries this rank computes under ``plan``, with
    the results sent home.

    ``per_query``: ``[batch, local_seq, ...]`` tensors of this rank's queries (or ``None``),
    sent to the ranks that compute them (:func:`fcp.comm.send_pieces`); ``compute`` gets the
    rows ``[batch, n, ...]`` of one contiguous run of global queries ``[start, start + n)``
    and returns ``[batch, n, ...]``. Returns ``[batch, local_seq, ...]``: this rank's own
    queries' results, in order (gradients take the reverse path).
    """
    if not plan.moves:
        return compute(ctx.seq_start, ctx.local_seq_len, *per_query)
    moved = [None if x is None else send_pieces(x, ctx, plan.owners) for x in per_query]
    outs, offset = [], 0
    for start, n in plan.runs(ctx.cp_rank):
        outs.append(compute(start, n, *[None if x is None else x[:, offset : offset + n]
                                        for x in moved]))  # fmt: skip
        offset += n
    return send_pieces(torch.cat(outs, 1), ctx, plan.owners, back=True)


def last_query(ctx: PackedContext, plan: QueryPlan) -> int:
    """Exclusive end of the last query this rank computes under ``plan`` (keys after it are
    never visible to it)."""
    start, n = plan.runs(ctx.cp_rank)[-1] if plan.moves else (ctx.seq_start, ctx.local_seq_len)
    return start + n
