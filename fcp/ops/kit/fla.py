"""What fcp's FLA backends share: host-side planning of FLA's CP metadata, and op plumbing.

Used by :mod:`fcp.ops.kda.fla` and :mod:`fcp.ops.conv.fla` (and the GLM-5.3-Flash seed adapter's
``build_fla_cp_context``). Importing this module does not import FLA (which costs seconds).

Planning: an ``FLACPContext`` per batch row.

FLA's context-parallel kernels (``chunk_kda(..., cp_context=...)``, ``causal_conv1d(...,
cp_context=...)``) take one flattened ``[1, local_tokens]`` sequence per call plus a
:class:`fla.ops.cp.FLACPContext` describing it. :func:`build_fla_cp_context` derives that context
for one row of fcp's replicated doc-id map, field for field what ``fla.ops.cp.build_cp_context``
computes from the same global boundaries, without calling it (FLA's builder is the test oracle).

Worked example (the ``PackedContext`` docstring's layout: documents of lengths 4, 1, 5, then two pad
tokens; ``cp_size = 4``, so 3 tokens per rank; global boundaries ``[0, 4, 5, 10, 12]``)::

    rank  local boundaries  pre_num_ranks  post_num_ranks  first  last  pre_num_conv_tokens
    0     [0, 3]            0              1               True   False 0
    1     [0, 1, 2, 3]      1              2               False  False 3
    2     [0, 3]            1              1               False  False 1
    3     [0, 1, 3]         2              0               False  True  4

(rank 1's first segment is document 1, which started 3 tokens earlier on rank 0; its last one is
document 3, which ends on rank 3; the pad tail is its own segment, so rank 3 is its own last.)

Host-side: it synchronises with the device once per row (through
:meth:`PackedContext.row_cu_seqlens`) and is memoised in the context's host memo, so every layer of a
step reuses the same object. It is planning, not model code: call it eagerly, outside
``torch.compile``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from fcp.context import PackedContext

__all__ = [
    "build_fla_cp_context",
    "fla_cp_fields",
    "make_fla_cp_context",
    "process_group_from_name",
    "group_name",
    "device_guard",
    "contiguous_or_none",
    "empty",
    "grad_like",
    "state_dtype",
]


def fla_cp_fields(global_cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> dict[str, Any]:
    """FLA's contiguous-layout CP metadata of one rank, from a row's global boundaries.

    Args:
        global_cu_seqlens: int ``[segments + 1]`` on CPU, from 0 to the padded global length
            (``cp_size * local_len``), strictly increasing.
        cp_size, cp_rank: the CP world and this rank.

    Returns:
        ``dict`` with ``cu_seqlens_cpu`` (int32 local boundaries), ``pre_num_ranks``,
        ``post_num_ranks``, ``is_first_rank``, ``is_last_rank``, ``pre_num_conv_tokens``.

    Vectorised: two ``searchsorted`` calls over the boundaries, no loop over documents.
    """
    cu = global_cu_seqlens.to(torch.int64)
    total = int(cu[-1])
    if total < cp_size or total % cp_size:
        raise ValueError(
            f"global length {total} must be a positive multiple of cp_size={cp_size} "
            "(pad the batch with fcp.shard_batch first)"
        )
    length = total // cp_size
    start, end = cp_rank * length, (cp_rank + 1) * length
    bounds = torch.tensor([start, end], dtype=torch.int64)
    # segment holding token `start` (last boundary <= start) and the one holding `end - 1`
    first_seg = int(torch.searchsorted(cu, bounds[:1], right=True)) - 1
    last_seg = int(torch.searchsorted(cu, bounds[1:], right=False)) - 1
    first_start = int(cu[first_seg])
    last_end = int(cu[last_seg + 1])
    inner = cu[first_seg + 1 : last_seg + 1] - start  # boundaries strictly inside the interval
    local = torch.cat([inner.new_zeros(1), inner, inner.new_full((1,), length)]).to(torch.int32)
    first_owner = first_start // length
    last_owner = (last_end - 1) // length
    return dict(
        cu_seqlens_cpu=local, pre_num_ranks=cp_rank - first_owner,
        post_num_ranks=last_owner - cp_rank, is_first_rank=first_owner == cp_rank,
        is_last_rank=last_owner == cp_rank, pre_num_conv_tokens=start - first_start,
    )


def build_fla_cp_context(ctx: PackedContext, row: int, cp_group: Any = None,
                         conv_kernel_size: int | None = None):
    """FLA's own :class:`fla.ops.cp.FLACPContext` for one batch row of this rank's shard.

    Args:
        ctx: this rank's :class:`~fcp.context.PackedContext` (replicated doc-id map,
            ``cp_size``, ``cp_rank``).
        row: batch row.
        cp_group: the process group FLA should communicate over (stored as the context's
            ``group``); ``None`` gives a context without communication, as FLA's builder does when
            given a world size and rank instead of a group.
        conv_kernel_size: the short-conv width, stored as ``conv1d_kernel_size`` (``None`` for
            KDA-only use).

    Returns:
        ``FLACPContext(layout='contiguous')`` whose ``cu_seqlens`` (int32, on the doc-id map's
        device) / ``cu_seqlens_cpu`` are the row's segments clipped to this rank's interval (the
        pad tail is a segment of its own), with FLA's ``pre_num_ranks``, ``post_num_ranks``,
        ``is_first_rank``, ``is_last_rank`` and ``pre_num_conv_tokens``.

    Memoised per ``(row, conv_kernel_size, cp_group)`` in ``ctx``'s host memo: repeated
    calls return the same object. Imports FLA (lazily, on first use).
    """
    from fla.ops.cp import FLACPContext  # lazy: importing fla costs seconds

    def compute():
        _, cpu = ctx.row_cu_seqlens(row)
        fields = fla_cp_fields(cpu, ctx.cp_size, ctx.cp_rank)
        local_cpu = fields.pop("cu_seqlens_cpu")
        fla_ctx = FLACPContext(
            group=cp_group,
            cu_seqlens=local_cpu.to(device=ctx.doc_ids.device, non_blocking=True),
            cu_seqlens_cpu=local_cpu, conv1d_kernel_size=conv_kernel_size, **fields,
        )
        return cp_group, fla_ctx  # keeps the group alive, so its id() cannot be reused

    key = ("fla_cp_context", ctx.check_row(row), conv_kernel_size, id(cp_group))
    return ctx.memo(key, compute)[1]


def make_fla_cp_context(cu_seqlens, cu_seqlens_cpu, group_name: str, pre, post, first, last,
                        conv=None, pre_conv=None):  # fmt: skip
    """An ``FLACPContext`` from fields passed through a custom op's schema (scalars and the
    process group's name); inside the op's kernel, eagerly."""
    from fla.ops.cp import FLACPContext

    return FLACPContext(
        group=process_group_from_name(group_name), cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, pre_num_ranks=pre, post_num_ranks=post, is_first_rank=first,
        is_last_rank=last, conv1d_kernel_size=conv, pre_num_conv_tokens=pre_conv,
    )


# ---------------------------------------------------------------------------------------------
# op plumbing
# ---------------------------------------------------------------------------------------------
def process_group_from_name(name: str):
    """The ``ProcessGroup`` registered as ``name`` (``""``: ``None``). Custom-op schemas cannot
    carry a group, so ops take its name."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def group_name(ctx: PackedContext) -> str:
    """The name of ``ctx``'s CP group, ``""`` without CP."""
    return ctx.group.group_name if ctx.cp_enabled else ""


def device_guard(t: torch.Tensor):
    """FLA launches on the current CUDA device: make it ``t``'s."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def contiguous_or_none(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.contiguous()


def empty(device, dtype) -> torch.Tensor:
    """A 0-element tensor: an op output that exists only in some configurations."""
    return torch.empty(0, device=device, dtype=dtype)


def grad_like(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``grad`` in ``like``'s dtype, contiguous (zeros where FLA returned ``None``)."""
    if grad is None:
        return torch.zeros_like(like, memory_format=torch.contiguous_format)
    return grad.to(like.dtype).contiguous()


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """FLA's states and cumulative gates are fp32."""
    return torch.promote_types(torch.float32, dtype)
