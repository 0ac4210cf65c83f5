"""Per-rank jobs of the load-balancing tests (:mod:`tests.test_balance`): each runs an operator
on this rank's slice with ``ctx.balance`` on and off and returns both results."""

from __future__ import annotations

import torch

from fcp.comm import send_pieces
from fcp.ops.kit.balance import attention_plan
from tests import _attention_rank_fns as attn
from tests.support import cp_jobs


def balanced_and_contiguous(env, name, inputs, doc_ids, kw, grad_out):
    """``(balanced, contiguous, moved)``: :func:`attn.run_in` results with ``balance=True`` and
    ``False`` on the same ranks, and whether the balanced plan moved queries."""
    torch.set_num_threads(1)
    ctx = cp_jobs.cp_context(env, doc_ids)
    on = attn.run_in(name, inputs, ctx, kw, grad_out)
    off = attn.run_in(name, inputs, ctx.replace(balance=False), kw, grad_out)
    return on, off, attention_plan(ctx).moves


def round_trip(env, x, owners):
    """``(sent, back)``: this rank's slice of ``x`` sent to its pieces' owners, and sent back;
    plus the gradient of ``sum(sent * weight)`` w.r.t. the slice (weight = global positions)."""
    ctx = cp_jobs.cp_context(env, torch.ones(1, x.shape[1], dtype=torch.int64))
    mine = x[:, slice(*ctx.interval)].clone().requires_grad_()
    sent = send_pieces(mine, ctx, owners)
    back = send_pieces(sent, ctx, owners, back=True)
    (sent * sent.detach()).sum().backward()
    return sent.detach(), back.detach(), mine.grad


def plan_moves(doc_ids: torch.Tensor, world: int) -> bool:
    """Whether rank 0's plan for ``doc_ids`` on ``world`` ranks moves queries (no group
    needed: the plan reads static facts only)."""
    from fcp.context import PackedContext

    return attention_plan(PackedContext(doc_ids, group=object(), cp_size=world)).moves
