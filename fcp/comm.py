"""Compile-native collectives for contiguous CP, all on ``torch.distributed._functional_collectives``.

Every byte an fcp operator moves between ranks goes through these functions. Each takes the
rank's context as ``ctx: PackedContext``, right after its tensor inputs (options after it):

* :func:`all_gather_sequence` - equal contiguous shards concatenated in rank order (backward: a
  reduce-scatter of the gradient).
* :func:`all_gather_backward_anchor` - a zero scalar that keeps a rank in the backward collective
  of a gather whose values its loss ignores.
* :func:`left_halo` - the ``history`` global tokens just before this rank's interval, moved with
  one ``all_to_all_single`` whose split sizes are static Python ints (``O(history)`` bytes);
  :func:`with_left_halo` returns them concatenated with the shard.
* :func:`send_pieces` - equal pieces of the sequence sent to the ranks that compute them, and
  their results sent home (``back=True``): the query balancing of long documents
  (:mod:`fcp.ops.kit.balance`), one ``all_to_all_single`` with static splits each way.
* :func:`state_chain` - the incoming state of a linear recurrence, from every earlier rank's
  transition and zero-start state, with one all-gather and fp32 accumulation.

The one group-only form, named apart, is :func:`all_gather_group` ``(tensor, group, dim)``: for
code that holds a process group but no context (the batch agreement before a context exists,
NeMo-contract wrappers that take a group). Its ``group`` is a :data:`fcp.groups.GroupLike`.

The context arrives validated (:class:`~fcp.context.PackedContext` checks itself when it is
built); a collective only checks that it *is* one (a trace-time ``isinstance``, nothing in the
graph).

All are identities (no collective) when CP is off, contain no host synchronisation, and
trace under ``torch.compile(fullgraph=True)``. Their gradients flow through funcol's own autograd
formulas (all-gather <-> reduce-scatter, all-to-all <-> all-to-all with swapped splits).

Gradients summed over ranks accumulate in the compute dtype. The backward of a gather or a halo
*sums* partial gradients from several ranks; in bf16 that sum (and the rounding of each partial
before it) costs accuracy one process does not lose. With ``dtype=torch.float32``,
:func:`all_gather_sequence` and :func:`with_left_halo` move the forward in the input's dtype
(bf16 on the wire), return at least fp32 (fp64 stays fp64), and run the backward exchange and
every sum of partials in it, rounding to the input's dtype once, as one process does::

    kv = all_gather_sequence(torch.cat([k, v], -1), ctx, dtype=torch.float32)  # bf16 sent
    xx = with_left_halo(x, ctx, history=3, dtype=torch.float32)                # [B, 3 + L, C]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

from fcp.checks import check_instance, check_tensor
from fcp.context import PackedContext, check_context
from fcp.groups import GroupInfo, GroupLike, resolve_group
from fcp.scan import fold_maps

__all__ = [
    "all_gather_group",
    "all_gather_sequence",
    "all_gather_backward_anchor",
    "dependent_zeros",
    "left_halo",
    "halo_plan",
    "state_chain",
    "with_left_halo",
]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _wait(t: torch.Tensor) -> torch.Tensor:
    # Eager funcol returns AsyncCollectiveTensor; waiting right away avoids "unwaited collective"
    # warnings at exit. Under tracing the wait is already in the graph.
    if isinstance(t, funcol.AsyncCollectiveTensor):
        return t.wait()
    return t


# ---------------------------------------------------------------------------------------------
# sequence all-gather
# ---------------------------------------------------------------------------------------------
def all_gather_sequence(
    tensor: torch.Tensor,
    ctx: PackedContext,
    dim: int = 1,
    *,
    differentiable: bool = True,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Concatenate this CP group's equal contiguous shards in global rank order along ``dim``.

    Args:
        tensor: this rank's shard, any shape; ``tensor.shape[dim]`` is ``ctx.local_seq_len``
            (or a whole fraction of it, e.g. ``local_seq // 4`` for a compressed stream, the
            same on every rank), every other axis the same on every rank.
        ctx: the rank's :class:`~fcp.context.PackedContext`; without CP this is the identity
            (``tensor`` itself, or cast to the result dtype).
        dim: axis to concatenate (negative allowed).
        differentiable: ``True``: backward sends each rank the sum over ranks of the gradient of
            its own slice (one reduce-scatter). ``False``: the input is detached (integer metadata,
            frozen routing values); no backward collective.
        dtype: ``torch.float32`` makes the result (and its gradient) at least fp32: the
            result dtype is ``torch.promote_types(tensor.dtype, dtype)`` (fp32 for bf16 shards,
            fp64 stays fp64). The shards travel in their own dtype and are cast after the
            gather; the backward reduce-scatter sums the ranks' gradients in the result dtype
            and casts once to ``tensor``'s dtype. ``None``: ``tensor``'s dtype throughout.

    Returns:
        ``tensor`` with ``shape[dim]`` multiplied by ``ctx.cp_size``.

    Raises:
        ArgumentTypeError: ``ctx`` is not a ``PackedContext`` (a raw group goes to
            :func:`all_gather_group`).
        ValueError: ``tensor.shape[dim]`` is not the local length or a whole fraction of it
            (checked statically, from the context: no collective, also under compile).

    Example (2 ranks, ``dim=1``): rank 0 holds ``[[a, b]]``, rank 1 ``[[c, d]]``; both get
    ``[[a, b, c, d]]``.
    """
    fn = "all_gather_sequence"
    check_context(ctx, fn=fn, hint="; gather on a raw process group with all_gather_group")
    wide = _result_dtype(tensor, dtype, fn)
    if not ctx.cp_enabled:
        return tensor.to(wide)
    dim = dim % tensor.dim()
    n, local = tensor.shape[dim], ctx.local_seq_len
    if n == 0 or local % n:
        raise ValueError(
            f"{fn}: shard length tensor.shape[{dim}]={n} must be the local "
            f"sequence length {local} or a whole fraction of it"
        )
    return _gather(tensor, ctx.group, dim, differentiable, wide)


def all_gather_group(
    tensor: torch.Tensor,
    group: GroupLike,
    dim: int = 1,
    *,
    differentiable: bool = True,
    validate: bool = True,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`all_gather_sequence` on a raw group, for code that holds no context.

    The group-only form (batch agreement before a context exists, NeMo-contract wrappers that
    take a group, shards whose length is not tied to the local sequence length).

    Args:
        tensor: this rank's shard; every axis must have the same size on every rank.
        group: a :data:`~fcp.groups.GroupLike` (``None``: one process, the identity).
        dim, differentiable, dtype: as for :func:`all_gather_sequence`.
        validate: in eager mode, check first that the shapes agree across ranks (one tiny
            all-gather) and raise ``ValueError`` on every rank instead of letting the
            collective fail. Skipped under ``torch.compile``.

    Returns:
        ``tensor`` with ``shape[dim]`` multiplied by the group size.
    """
    fn = "all_gather_group"
    info = resolve_group(group, fn=fn)
    wide = _result_dtype(tensor, dtype, fn)
    if info.group is None:
        return tensor.to(wide)
    dim = dim % tensor.dim()
    if validate and not _compiling():
        _check_equal_shapes(tensor, info, fn)
    return _gather(tensor, info.group, dim, differentiable, wide)


def _gather(tensor: torch.Tensor, group: Any, dim: int, differentiable: bool,
            wide: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The gather of both forms on a resolved, CP-enabled ``group``, result in ``wide``."""
    if not differentiable:
        tensor = tensor.detach()
    # Gather along dim 0 and move the axis back: funcol's own dim != 0 path returns a view whose
    # wait() drops the autograd edge in eager mode (torch 2.13), which would silently cut K/V
    # gradients. Rank-order concatenation is the same either way.
    front = tensor.movedim(dim, 0).contiguous()
    if wide != tensor.dtype and differentiable:
        gathered = _GatherWide.apply(front, group, wide)
    else:
        gathered = _wait(funcol.all_gather_single(front, 0, group)).to(wide)
    return gathered.movedim(0, dim)


def _result_dtype(tensor: torch.Tensor, dtype: torch.dtype | None, fn: str) -> torch.dtype:
    """``promote_types(tensor.dtype, dtype)`` for a floating ``tensor`` (``None``: its dtype)."""
    if dtype is None:
        return tensor.dtype
    check_instance(dtype, torch.dtype, "dtype", fn=fn)
    if not dtype.is_floating_point:
        raise ValueError(f"{fn}: dtype must be a floating dtype, got {dtype}")
    check_tensor(tensor, "tensor", fn=fn, kind="float")  # dtype= is for floating shards
    return torch.promote_types(tensor.dtype, dtype)


class _GatherWide(torch.autograd.Function):
    """All-gather along dim 0 in the input's dtype, result in ``wide``; backward: one
    reduce-scatter in ``wide``, then one cast to the input's dtype."""

    @staticmethod
    def forward(ctx, front: torch.Tensor, group: Any, wide: torch.dtype) -> torch.Tensor:
        ctx.group, ctx.narrow = group, front.dtype
        return _wait(funcol.all_gather_single(front, 0, group)).to(wide)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = _wait(funcol.reduce_scatter_single(grad.contiguous(), "sum", 0, ctx.group))
        return summed.to(ctx.narrow), None, None


def _check_equal_shapes(tensor: torch.Tensor, info: GroupInfo, what: str) -> None:
    shape = torch.tensor([tensor.dim(), *tensor.shape, *([0] * (8 - tensor.dim()))])
    shapes = _wait(funcol.all_gather_single(shape.to(tensor.device), 0, info.group))
    shapes = shapes.view(info.size, -1).cpu()
    if not bool((shapes == shapes[0]).all()):
        rows = [tuple(s[1 : 1 + int(s[0])].tolist()) for s in shapes]
        raise ValueError(f"{what}: shards must have equal shapes on every rank, got {rows}")


# ---------------------------------------------------------------------------------------------
# backward anchor
# ---------------------------------------------------------------------------------------------
def dependent_zeros(grad: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Exact zeros of ``shape`` / ``dtype`` that a compiler cannot prove constant.

    A backward collective's input must *depend on* the incoming gradient: constant zeros would let
    a compiler's partitioner hoist the gather's backward reduce-scatter into the forward graph of a
    rank that uses none of the gathered values, so ranks would issue collectives in different
    orders (``g * 0`` is folded to a constant by inductor's joint-graph passes). ``(g != g) &
    (g == g)`` is False for every value, NaN and inf included (a ``0 * g`` or a NaN-passing
    ``where`` would turn one NaN in one document's gradient into NaN everywhere).
    """
    never = (grad != grad) & (grad == grad)
    return never.any().to(dtype).expand(shape)


class _BackwardAnchor(torch.autograd.Function):
    """Zero forward; zero gradient to ``gathered`` in backward, so its backward collective runs."""

    @staticmethod
    def forward(ctx, gathered: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype = gathered.shape, gathered.dtype
        return gathered.new_zeros(())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        return dependent_zeros(grad_output, ctx.shape, ctx.dtype)


def all_gather_backward_anchor(gathered: torch.Tensor) -> torch.Tensor:
    """A zero-valued scalar with a backward edge to ``gathered``.

    A rank whose loss does not depend on a gathered tensor (for example a rank holding only
    padding) would skip the gather's backward reduce-scatter while the other ranks wait in it: a
    hang. ``loss = loss + all_gather_backward_anchor(kv)`` changes no value and no gradient
    (unlike ``0 * kv.sum()`` it stays zero when ``kv`` holds inf/NaN) but makes every rank
    join the collective. Its backward is NaN-free: a non-finite gradient of one document never
    reaches another document's gathered values through it.

    Returns a 0-d tensor of ``gathered``'s dtype and device.
    """
    if not gathered.requires_grad:
        return gathered.new_zeros(())
    return _BackwardAnchor.apply(gathered)


# ---------------------------------------------------------------------------------------------
# left halo
# ---------------------------------------------------------------------------------------------
def halo_plan(cp_size: int, local_len: int, history: int) -> list[tuple[list[int], list[int]]]:
    """Static all-to-all plan of :func:`left_halo`: per rank, ``(send_sizes, recv_sizes)``.

    Rank ``j`` sends rank ``r > j`` the part of its interval ``[j*L, (j+1)*L)`` that overlaps
    ``r``'s halo window ``[r*L - history, r*L)``: its last ``min(L, ...)`` tokens. With
    ``history <= L`` that is just ``history`` tokens to ``j + 1``.

    >>> halo_plan(3, 4, 2)
    [([0, 2, 0], [0, 0, 0]), ([0, 0, 2], [2, 0, 0]), ([0, 0, 0], [0, 2, 0])]
    """

    def overlap(src: int, dst: int) -> int:
        if src >= dst:
            return 0
        lo = max(src * local_len, dst * local_len - history)
        return max(0, (src + 1) * local_len - lo)

    return [
        ([overlap(r, d) for d in range(cp_size)], [overlap(s, r) for s in range(cp_size)])
        for r in range(cp_size)
    ]


def left_halo(tensor: torch.Tensor, ctx: PackedContext, history: int) -> torch.Tensor:
    """The ``history`` global tokens immediately before this rank's interval.

    Args:
        tensor: ``[batch, local_seq, *channels]``, this rank's shard.
        ctx: the rank's :class:`~fcp.context.PackedContext` (group, rank, local length).
        history: how many preceding tokens are needed; may exceed ``local_seq`` (the halo then
            spans several earlier ranks).

    Returns:
        ``[batch, history, *channels]``, same dtype; zero-padded on the left where the global
        sequence starts (always all zeros on rank 0 and without CP). Documents are not masked here:
        operators mask by the replicated doc-id map.

    Bytes: one ``all_to_all_single`` with static splits from :func:`halo_plan`; each rank sends
    ``min(history, (world-1-r) * L)``-ish tokens, i.e. ``history`` tokens when ``history <= L``,
    never the ``O(world * history)`` of an all-gather. Gradients of halo values flow back to the
    owning ranks through the all-to-all's backward (the same exchange, reversed).
    """
    _check_halo(tensor, ctx, history, "left_halo")
    if not ctx.cp_enabled or history == 0:
        return tensor.new_zeros(tensor.shape[0], history, *tensor.shape[2:])
    return _halo_exchange(tensor, ctx.group, ctx.cp_size, ctx.cp_rank, history)


def _check_halo(tensor: torch.Tensor, ctx: PackedContext, history: int, fn: str) -> None:
    check_context(ctx, fn=fn)
    if history < 0:
        raise ValueError(f"{fn}: history must be >= 0, got {history}")
    if tensor.shape[1] != ctx.local_seq_len:
        raise ValueError(
            f"{fn}: tensor.shape[1]={tensor.shape[1]} != ctx.local_seq_len={ctx.local_seq_len}"
        )


def _halo_exchange(tensor: torch.Tensor, group: Any, size: int, rank: int, history: int):
    """The exchange of :func:`left_halo` on ``group`` (differentiable through funcol)."""
    batch, local_len, rest = tensor.shape[0], tensor.shape[1], tensor.shape[2:]
    send, recv = halo_plan(size, local_len, history)[rank]
    seq_first = tensor.movedim(1, 0)  # all_to_all splits along dim 0
    pieces = [seq_first[local_len - n :] for n in send if n]
    send_buf = torch.cat(pieces, 0) if pieces else seq_first[:0]
    got = _wait(
        funcol.all_to_all_single(send_buf.contiguous(), recv, send, group)
    )  # [sum(recv), batch, *rest], in source-rank order = global order
    got = got.movedim(0, 1)
    missing = history - sum(recv)
    if missing:
        got = torch.cat([got.new_zeros(batch, missing, *rest), got], 1)
    return got


def with_left_halo(
    tensor: torch.Tensor, ctx: PackedContext, history: int, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``cat([left_halo(tensor, ctx, history), tensor], 1)``, at least in ``dtype``.

    Args:
        tensor: ``[batch, local_seq, *channels]``, this rank's shard.
        ctx, history: as for :func:`left_halo`.
        dtype: as for :func:`all_gather_sequence`: the result is in
            ``torch.promote_types(tensor.dtype, dtype)`` (``None``: ``tensor``'s dtype).

    Returns:
        ``[batch, history + local_seq, *channels]``: the halo, then the shard.

    The halo travels in ``tensor``'s dtype (the same one all-to-all as :func:`left_halo`). When the
    result is wider than ``tensor``, the backward sends the halo's gradient back in the result
    dtype and the owner adds it to its shard's own gradient in it, rounding to ``tensor``'s dtype
    once, as one process rounds the single gradient of each token.
    """
    _check_halo(tensor, ctx, history, "with_left_halo")
    wide = _result_dtype(tensor, dtype, "with_left_halo")
    if not ctx.cp_enabled or history == 0:
        halo = tensor.new_zeros(tensor.shape[0], history, *tensor.shape[2:])
        return torch.cat([halo, tensor], 1).to(wide)
    if wide == tensor.dtype:
        halo = _halo_exchange(tensor, ctx.group, ctx.cp_size, ctx.cp_rank, history)
        return torch.cat([halo, tensor], 1)
    return _HaloWide.apply(tensor, ctx.group, ctx.cp_size, ctx.cp_rank, history, wide)


class _HaloWide(torch.autograd.Function):
    """Forward: :func:`_halo_exchange` in the input's dtype, cast to ``wide`` with the shard.
    Backward: the halo's gradient returns to its owners in ``wide`` (the forward's all-to-all
    with swapped splits), each owner sums it into its shard's gradient in ``wide``."""

    @staticmethod
    def forward(ctx, tensor, group, size: int, rank: int, history: int, wide: torch.dtype):
        ctx.plan, ctx.narrow = (group, size, rank, history), tensor.dtype
        halo = _halo_exchange(tensor, group, size, rank, history)
        return torch.cat([halo, tensor], 1).to(wide)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, size, rank, history = ctx.plan
        own, local_len = grad[:, history:], grad.shape[1] - history
        send, recv = halo_plan(size, local_len, history)[rank]
        # the received part of the halo (after the zeros before the sequence start), source order
        back = grad[:, history - sum(recv) : history].movedim(1, 0).contiguous()
        got = _wait(funcol.all_to_all_single(back, send, recv, group)).movedim(0, 1)
        offset = 0
        for n in send:  # destination order, as the forward sent them: my last n tokens each
            if n:
                zeros = own.new_zeros(own.shape[0], local_len - n, *own.shape[2:])
                own = own + torch.cat([zeros, got[:, offset : offset + n]], 1)
                offset += n
        return own.to(ctx.narrow), None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# query balancing: pieces of the sequence computed on another rank
# ---------------------------------------------------------------------------------------------
def check_owners(owners: tuple[int, ...], ctx: PackedContext, fn: str) -> int:
    """The tokens per piece of a piece assignment ``owners`` (see :func:`send_pieces`), or
    ``ValueError`` naming what is wrong with it."""
    size, local = ctx.cp_size, ctx.local_seq_len
    n = len(owners) // size if size else 0
    if not owners or len(owners) % size or local % n:
        raise ValueError(f"{fn}: owners has {len(owners)} pieces; it needs a positive multiple of "
                         f"cp_size={size} pieces per row, a whole fraction of "
                         f"local_seq_len={local} each")  # fmt: skip
    for r in range(size):
        if sum(1 for o in owners if o == r) != n:
            raise ValueError(f"{fn}: owners={owners} gives rank {r} "
                             f"{sum(1 for o in owners if o == r)} pieces, not {n}: every rank "
                             "computes as many pieces as it holds")  # fmt: skip
    return local // n


def send_pieces(tensor: torch.Tensor, ctx: PackedContext, owners: tuple[int, ...], *,
                back: bool = False) -> torch.Tensor:
    """Move equal pieces of the sequence to the ranks that compute them (load balancing).

    Each rank's interval is cut into ``n = len(owners) // cp_size`` pieces of
    ``local_seq // n`` tokens; global piece ``g`` (rank ``g // n``'s piece ``g % n``) is
    computed by rank ``owners[g]``, and every rank computes ``n`` pieces.

    Args:
        tensor: ``[batch, local_seq, *channels]``. ``back=False``: this rank's own interval;
            ``back=True``: the pieces this rank computed, ascending global order. More
            generally ``[batch, n * rows, *channels]``: ``rows`` per piece (e.g. a piece with
            the tokens before it).
        ctx: the rank's :class:`~fcp.context.PackedContext`.
        owners: the static assignment (Python ints, the same on every rank).
        back: ``False``: returns the pieces this rank computes, ascending global order (one
            ``all_to_all_single``). ``True``: the inverse: results go home, in the interval's
            order.

    Returns:
        ``tensor``'s shape and dtype; gradients take the reverse path (funcol's all-to-all
        autograd). The identity where ``owners`` moves nothing or CP is off.

    Example (2 ranks, 2 pieces each, ``owners = (0, 1, 1, 0)``, "zigzag"): rank 0 holds
    ``[a, b]``, rank 1 ``[c, d]``; forward, rank 0 gets ``[a, d]``, rank 1 ``[b, c]``.
    """
    fn = "send_pieces"
    check_context(ctx, fn=fn)
    check_owners(tuple(owners), ctx, fn)
    size, rank = ctx.cp_size, ctx.cp_rank
    n = len(owners) // size
    if tensor.dim() < 2 or tensor.shape[1] % n:
        raise ValueError(f"{fn}: tensor {tuple(tensor.shape)} must be [batch, pieces * rows, "
                         f"...] with {n} pieces per rank")  # fmt: skip
    piece = tensor.shape[1] // n  # rows per piece (its tokens, or more: e.g. with a halo)
    if not ctx.cp_enabled or all(o == g // n for g, o in enumerate(owners)):
        return tensor
    home = [g for g in range(rank * n, (rank + 1) * n)]  # my interval's pieces
    mine = [g for g, o in enumerate(owners) if o == rank]  # the pieces I compute, ascending
    if not back:  # my pieces by destination rank; I receive mine by source = ascending g
        order = sorted(home, key=lambda g: owners[g])
        send = [piece * sum(1 for g in home if owners[g] == d) for d in range(size)]
        recv = [piece * sum(1 for g in mine if g // n == s) for s in range(size)]
        perm = [g - rank * n for g in order]
    else:  # my results by home rank (= ascending g); I receive mine by computing rank
        send = [piece * sum(1 for g in mine if g // n == d) for d in range(size)]
        recv = [piece * sum(1 for g in home if owners[g] == s) for s in range(size)]
        perm = list(range(n))
    got = _wait(funcol.all_to_all_single(_pieces(tensor.movedim(1, 0), piece, perm),
                                         recv, send, ctx.group))  # fmt: skip
    if back:  # received by computing rank, then ascending g: restore the interval's order
        arrival = sorted(home, key=lambda g: owners[g])
        got = _pieces(got, piece, [arrival.index(g) for g in home])
    return got.movedim(0, 1)


def _pieces(x: torch.Tensor, piece: int, order: list[int]) -> torch.Tensor:
    """The ``piece``-long slices of ``x`` (along dim 0) in ``order``, contiguous (static
    slices: no index tensor to copy to the device)."""
    if order == sorted(order):
        return x.contiguous()
    return torch.cat([x[i * piece : (i + 1) * piece] for i in order], 0)


# ---------------------------------------------------------------------------------------------
# state chain
# ---------------------------------------------------------------------------------------------
def state_chain(transition: torch.Tensor, state: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
    """Incoming state of this rank for a linear recurrence split across ranks.

    Each rank ``r`` ran its shard from a zero state and reports

    * ``transition`` ``M_r``: ``[..., K, K]``, the linear map its shard applies to an incoming
      state (a document start inside the shard makes it zero),
    * ``state`` ``S_r``: ``[..., K, V]``, the state its shard reaches from zero,

    so that ``S_out(r) = M_r @ S_in(r) + S_r``. This returns
    ``S_in(r) = M_{r-1} (... (M_1 S_0 + S_1) ...) + S_{r-1}`` (zeros on rank 0 and without CP),
    as fp32 ``[..., K, V]``.

    One all-gather of the fp32 ``[..., K, K + V]`` block (static shape, independent of where
    documents start); the chain over earlier ranks is then evaluated locally in fp32, inside
    ``torch.autocast`` too (:func:`~fcp.scan.fold_maps` turns it off around its matmuls).
    Differentiable with respect to every rank's ``M`` and ``S`` (backward: one reduce-scatter).

    ``ctx`` is the rank's :class:`~fcp.context.PackedContext` (its group, size and rank).
    """
    check_context(ctx, fn="state_chain")
    if transition.shape[-1] != transition.shape[-2] or transition.shape[-1] != state.shape[-2]:
        raise ValueError(
            f"state_chain: transition {tuple(transition.shape)} must be [..., K, K] and state "
            f"{tuple(state.shape)} [..., K, V] with the same K"
        )
    if transition.shape[:-2] != state.shape[:-2]:
        raise ValueError(
            f"state_chain: leading dims differ: transition {tuple(transition.shape[:-2])} vs "
            f"state {tuple(state.shape[:-2])}"
        )
    info = ctx.group_info
    zero = state.new_zeros(state.shape, dtype=torch.float32)
    if info.group is None:
        return zero
    k = transition.shape[-1]
    block = torch.cat([transition.float(), state.float()], -1).unsqueeze(0)
    blocks = _wait(funcol.all_gather_single(block.contiguous(), 0, info.group))
    # Rank 0 uses none of the gathered blocks; the anchor keeps it in the backward collective.
    acc = zero + all_gather_backward_anchor(blocks)
    if info.rank:  # static: the rank is a Python int
        # earlier ranks' maps composed by the same log-depth scan as a recurrence's chunks
        acc = acc + fold_maps(blocks[: info.rank])[..., k:]
    return acc
