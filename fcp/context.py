"""``PackedContext``: the replicated global document map plus this rank's contiguous interval.

Every fcp operator takes one of these. It is a frozen dataclass registered as a pytree whose only
leaf is the global doc-id map; everything else (group, sizes, offsets) is static metadata, so a
compiled model sees one tensor input whose *values* change from batch to batch while its shape
does not, and nothing recompiles when the packing changes.

Worked example: ``seq_len = 10`` padded to 12 for ``cp_size = 4`` (local length 3), documents of
lengths 4, 1 and 5, then two pad tokens::

    doc_ids        = [[1, 1, 1, 1, 2, 3, 3, 3, 3, 3, 0, 0]]
    rank 0: seq_start 0, local_doc_ids [[1, 1, 1]]
    rank 1: seq_start 3, local_doc_ids [[1, 2, 3]]   # doc 1 started on rank 0
    rank 2: seq_start 6, local_doc_ids [[3, 3, 3]]
    rank 3: seq_start 9, local_doc_ids [[3, 0, 0]]   # the pad tail is doc id 0
    row_cu_seqlens(0) -> segments [0, 4, 5, 10, 12] (the pad tail is its own segment)

A single-process context needs nothing but the map: ``PackedContext(doc_ids)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fcp.groups import GroupInfo, resolve_group
from fcp.layout import PAD_DOC_ID, position_ids_from_doc_ids, segment_cu_seqlens

__all__ = ["PackedContext"]


@dataclass(frozen=True)
class PackedContext:
    """Global packed-document layout for one model step, as seen by one CP rank.

    Attributes:
        doc_ids: int64 ``[batch, global_seq]``, the **global** (CP-padded) doc-id map, identical on
            every rank. Documents are numbered 1, 2, ... per row; pad tokens are 0.
        group: the CP ``ProcessGroup`` (``None`` when CP is off).
        cp_size: number of CP ranks (1 when CP is off).
        cp_rank: this rank's index in ``group``.
        seq_start: global index of this rank's first token (``cp_rank * local_seq_len``).
        local_seq_len: padded local length; ``global_seq == cp_size * local_seq_len``.
        original_seq_len: the row length before CP padding (``None``: unknown, taken as
            ``global_seq``).

    Only ``doc_ids`` is a pytree leaf; the rest is static. ``seq_start`` and ``local_seq_len``
    default to the values implied by ``cp_rank`` and ``cp_size``.
    """

    doc_ids: torch.Tensor
    group: Any = None
    cp_size: int = 1
    cp_rank: int = 0
    seq_start: int | None = None
    local_seq_len: int | None = None
    original_seq_len: int | None = None
    # Host-side memo of per-row segment boundaries (planning runs once per batch, not per layer).
    # Not part of equality, hashing or the pytree.
    _row_cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        d = self.doc_ids
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"doc_ids must be a torch.Tensor, got {type(d).__name__}")
        if d.dim() != 2:
            raise ValueError(f"doc_ids must be [batch, sequence], got shape {tuple(d.shape)}")
        if d.dtype != torch.int64:
            raise ValueError(f"doc_ids must be int64, got {d.dtype}")
        if not isinstance(self.cp_size, int) or self.cp_size < 1:
            raise ValueError(f"cp_size must be a positive int, got {self.cp_size!r}")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"cp_rank={self.cp_rank} is outside [0, cp_size={self.cp_size})")
        if self.cp_size > 1 and self.group is None:
            raise ValueError(f"cp_size={self.cp_size} needs a process group, got group=None")
        total = d.shape[1]
        if self.local_seq_len is None:
            if total % self.cp_size:
                raise ValueError(
                    f"doc_ids sequence length {total} is not divisible by cp_size={self.cp_size}; "
                    "pad the batch with fcp.shard_batch first"
                )
            object.__setattr__(self, "local_seq_len", total // self.cp_size)
        if self.local_seq_len * self.cp_size != total:
            raise ValueError(
                f"local_seq_len={self.local_seq_len} * cp_size={self.cp_size} != "
                f"doc_ids sequence length {total}"
            )
        expected_start = self.cp_rank * self.local_seq_len
        if self.seq_start is None:
            object.__setattr__(self, "seq_start", expected_start)
        if self.seq_start != expected_start:
            raise ValueError(
                f"seq_start={self.seq_start} does not match cp_rank={self.cp_rank} * "
                f"local_seq_len={self.local_seq_len} = {expected_start} (shards are contiguous)"
            )
        if self.original_seq_len is not None and not 0 <= self.original_seq_len <= total:
            raise ValueError(
                f"original_seq_len={self.original_seq_len} is outside [0, {total}] "
                "(the padded global length)"
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls, doc_ids: torch.Tensor, cp_group: Any = None, *, original_seq_len: int | None = None
    ) -> "PackedContext":
        """Build this rank's context from a replicated map and a group / 1-D mesh / ``None``."""
        info = resolve_group(cp_group)
        return cls(
            doc_ids=doc_ids,
            group=info.group,
            cp_size=info.size,
            cp_rank=info.rank,
            original_seq_len=original_seq_len,
        )

    # ------------------------------------------------------------------ static facts
    @property
    def cp_enabled(self) -> bool:
        """Whether the sequence is split across more than one rank."""
        return self.cp_size > 1

    @property
    def group_info(self) -> GroupInfo:
        return GroupInfo(self.group, self.cp_size, self.cp_rank)

    @property
    def batch_size(self) -> int:
        return self.doc_ids.shape[0]

    @property
    def global_seq_len(self) -> int:
        """Padded global length ``cp_size * local_seq_len``."""
        return self.doc_ids.shape[1]

    @property
    def seq_end(self) -> int:
        """Exclusive global end of this rank's interval."""
        return self.seq_start + self.local_seq_len

    @property
    def interval(self) -> tuple[int, int]:
        """``(seq_start, seq_end)`` of this rank, global token indices."""
        return self.seq_start, self.seq_end

    # ------------------------------------------------------------------ tensors (compile-safe)
    @property
    def local_doc_ids(self) -> torch.Tensor:
        """int64 ``[batch, local_seq]``: this rank's slice of the global map (a view)."""
        return self.doc_ids[:, self.seq_start : self.seq_end]

    @property
    def local_valid(self) -> torch.Tensor:
        """bool ``[batch, local_seq]``: True for real tokens, False for padding."""
        return self.local_doc_ids != PAD_DOC_ID

    @property
    def position_ids(self) -> torch.Tensor:
        """int64 ``[batch, global_seq]``: positions restarting at every document start."""
        return position_ids_from_doc_ids(self.doc_ids)

    @property
    def local_position_ids(self) -> torch.Tensor:
        """int64 ``[batch, local_seq]``: this rank's slice of :attr:`position_ids`."""
        return self.position_ids[:, self.seq_start : self.seq_end]

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous slice of a full-length tensor (differentiable).

        ``tensor.shape[dim]`` may be the padded global length or the original length (then it is
        zero-padded on the right first). Used with ``shard_primary=False``: the model builds the
        full embedding sequence, then applies ``context.shard(embeds)``.
        """
        n = tensor.shape[dim]
        if n != self.global_seq_len:
            if n > self.global_seq_len or (
                self.original_seq_len is not None and n != self.original_seq_len
            ):
                raise ValueError(
                    f"tensor.shape[{dim}]={n} is neither the padded global length "
                    f"{self.global_seq_len} nor original_seq_len={self.original_seq_len}"
                )
            pad_shape = list(tensor.shape)
            pad_shape[dim] = self.global_seq_len - n
            tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)
        return tensor.narrow(dim, self.seq_start, self.local_seq_len)

    # ------------------------------------------------------------------ host-side planning
    def row_cu_seqlens(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global segment boundaries of one batch row: ``(on doc_ids' device, on CPU)``.

        int64 ``[segments + 1]`` from 0 to ``global_seq``; the pad tail is its own segment.
        Host-side (synchronises); memoised per row so repeated layers pay once per batch.
        """
        key = ("global", self._check_row(row))
        if key not in self._row_cache:
            cpu = segment_cu_seqlens(self.doc_ids[row].cpu())
            self._row_cache[key] = (cpu.to(self.doc_ids.device), cpu)
        return self._row_cache[key]

    def local_cu_seqlens(self, row: int) -> torch.Tensor:
        """Segment boundaries of this rank's slice of ``row``, local indices, int64 on CPU.

        Example (the module docstring's layout, rank 1): ``[0, 1, 2, 3]``.
        """
        key = ("local", self._check_row(row))
        if key not in self._row_cache:
            self._row_cache[key] = segment_cu_seqlens(self.local_doc_ids[row].cpu())
        return self._row_cache[key]

    def _check_row(self, row: int) -> int:
        if not isinstance(row, int) or not 0 <= row < self.batch_size:
            raise ValueError(f"row={row!r} is outside [0, batch={self.batch_size})")
        return row

    def replace(self, **changes: Any) -> "PackedContext":
        """A new context with ``changes`` applied (fresh host-side memo)."""
        changes.setdefault("_row_cache", {})
        return dataclasses.replace(self, **changes)


def _flatten(ctx: PackedContext):
    static = (
        ctx.group,
        ctx.cp_size,
        ctx.cp_rank,
        ctx.seq_start,
        ctx.local_seq_len,
        ctx.original_seq_len,
    )
    return [ctx.doc_ids], static


def _unflatten(children, static) -> PackedContext:
    group, cp_size, cp_rank, seq_start, local_seq_len, original_seq_len = static
    ctx = object.__new__(PackedContext)
    # Bypass __post_init__: pytree unflattening also runs on fake/traced leaves, and the static
    # fields were validated when the original context was built.
    for name, value in (
        ("doc_ids", children[0]),
        ("group", group),
        ("cp_size", cp_size),
        ("cp_rank", cp_rank),
        ("seq_start", seq_start),
        ("local_seq_len", local_seq_len),
        ("original_seq_len", original_seq_len),
        ("_row_cache", {}),
    ):
        object.__setattr__(ctx, name, value)
    return ctx


def _flatten_with_keys(ctx: PackedContext):
    children, static = _flatten(ctx)
    return [(pytree.GetAttrKey("doc_ids"), children[0])], static


pytree.register_pytree_node(
    PackedContext,
    _flatten,
    _unflatten,
    serialized_type_name="fcp.PackedContext",
    flatten_with_keys_fn=_flatten_with_keys,
)
