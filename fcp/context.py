"""``PackedContext``: the replicated global document map plus this rank's contiguous interval.

Every fcp operator and collective takes one of these, as ``ctx``, right after its tensor inputs
(:func:`check_context` is the one check each makes). It is a frozen dataclass registered as a
pytree whose only leaf is the global doc-id map; everything else (group, sizes, offsets) is static metadata, so a
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

The context also carries ``band``, a static bound on how far back any query can see, planned
once from the map: the longest document rounded up to a power of two, at least
:data:`MIN_BAND` and at most the row (here 12: the row is shorter than ``MIN_BAND``).
Operators that score keys score only ``[t - band + 1, t]`` per query ``t``, so with documents
of bounded length their cost per token does not grow with the row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from fcp.checks import check_instance, check_int, check_tensor
from fcp.groups import GroupInfo
from fcp.layout import (
    PAD_DOC_ID,
    longest_document,
    position_ids_from_doc_ids,
    segment_cu_seqlens,
    validate_doc_ids,
)
from fcp.pytree import has_data, register_frozen_pytree

_T = TypeVar("_T")

__all__ = ["MIN_BAND", "PackedContext", "band_bucket", "check_context"]


@dataclass(frozen=True)
class PackedContext:
    """Global packed-document layout for one model step, as seen by one CP rank.

    Attributes:
        doc_ids: int64 ``[batch, global_seq]``, the **global** (CP-padded) doc-id map, identical on
            every rank. Documents are numbered 1, 2, ... per row; pad tokens are 0 and form a tail
            (the form :func:`fcp.layout.validate_doc_ids` checks).
        group: the CP ``ProcessGroup`` (``None`` when CP is off).
        cp_size: number of CP ranks (1 when CP is off).
        cp_rank: this rank's index in ``group``.
        seq_start: global index of this rank's first token (``cp_rank * local_seq_len``).
        local_seq_len: padded local length; ``global_seq == cp_size * local_seq_len``.
        original_seq_len: the row length before CP padding (``None``: unknown, taken as
            ``global_seq``).
        band: every real token's document started fewer than ``band`` tokens before it (at
            least the longest document of the map). Default: planned from the map at
            construction (:func:`band_bucket`): the longest document rounded up to a power of
            two, at least :data:`MIN_BAND`, at most ``global_seq``, so packings with similar
            document lengths give the same value and a row length has at most
            ``log2(global_seq / MIN_BAND) + 2`` of them. Operators that score
            keys (the dense attention backends, the indexers) score, per block of queries, only
            keys within ``band`` of it. ``None`` where the map has no data (a context built
            from traced ids inside a compiled region): operators then take the whole row.
        balance: whether the operators that score keys (document-causal attention, the
            indexers) may compute some of this rank's queries on another rank to even out the
            work of long documents (:mod:`fcp.ops.kit.balance`: planned from the static facts
            ``global_seq``, ``cp_size`` and ``band``; results do not change). ``False``: every
            rank computes its own interval (the contiguous layout, no query traffic).

    Only ``doc_ids`` is a pytree leaf; the rest is static (``band`` included: compiled code sees
    it as a constant, so a new band bucket compiles a new graph, a new packing in the same
    bucket does not). ``seq_start`` and ``local_seq_len`` default to the values implied by
    ``cp_rank`` and ``cp_size``.

    Validation: construction checks every static field and, eagerly, the map's values with
    :func:`~fcp.layout.validate_doc_ids` (one host synchronisation, so every rank holding the same
    replicated map reaches the same verdict before any collective). Build contexts eagerly, once
    per batch (``fcp.shard_batch`` does), and pass them into the compiled model as arguments:
    when ``torch.compile`` rebuilds a context from its pytree leaves (fake tensors), only the
    static checks run, so a compiled region never synchronises. A context is therefore valid
    for as long as it exists (it is frozen): the operators and collectives that take it check
    only that they were given one (:func:`check_context`, once per call), never its contents.
    """

    doc_ids: torch.Tensor
    group: Any = None
    cp_size: int = 1
    cp_rank: int = 0
    seq_start: int | None = None
    local_seq_len: int | None = None
    original_seq_len: int | None = None
    band: int | None = None
    balance: bool = True

    def __post_init__(self) -> None:
        d = self.doc_ids
        check_tensor(d, "doc_ids", fn="PackedContext")
        if d.dim() != 2:
            raise ValueError(f"doc_ids must be [batch, sequence], got shape {tuple(d.shape)}")
        check_tensor(d, "doc_ids", fn="PackedContext", dtype=torch.int64)
        if d.is_meta and not torch.compiler.is_compiling():
            raise ValueError("doc_ids is a meta tensor; a context needs the real document map")
        cp_size = check_int(self.cp_size, "cp_size", 1)
        cp_rank = check_int(self.cp_rank, "cp_rank", 0)
        if cp_rank >= cp_size:
            raise ValueError(f"cp_rank={cp_rank} is outside [0, cp_size={cp_size})")
        if cp_size > 1 and self.group is None:
            raise ValueError(f"cp_size={cp_size} needs a process group, got group=None")
        total = d.shape[1]
        if self.local_seq_len is None:
            if total % cp_size:
                raise ValueError(
                    f"doc_ids sequence length {total} is not divisible by cp_size={cp_size}; "
                    "pad the batch with fcp.shard_batch first"
                )
            object.__setattr__(self, "local_seq_len", total // cp_size)
        local = check_int(self.local_seq_len, "local_seq_len", 0)
        if local * cp_size != total:
            raise ValueError(
                f"local_seq_len={local} * cp_size={cp_size} != doc_ids sequence length {total}"
            )
        expected_start = cp_rank * local
        if self.seq_start is None:
            object.__setattr__(self, "seq_start", expected_start)
        if check_int(self.seq_start, "seq_start", 0) != expected_start:
            raise ValueError(
                f"seq_start={self.seq_start} does not match cp_rank={cp_rank} * "
                f"local_seq_len={local} = {expected_start} (shards are contiguous)"
            )
        if self.original_seq_len is not None:
            original = check_int(self.original_seq_len, "original_seq_len", 0)
            if original > total:
                raise ValueError(
                    f"original_seq_len={original} is outside [0, {total}] "
                    "(the padded global length)"
                )
        if self.band is not None:
            check_int(self.band, "band", 0, fn="PackedContext")
        if not isinstance(self.balance, bool):
            raise TypeError(f"PackedContext: balance must be a bool, got {self.balance!r}")
        if has_data(d):
            validate_doc_ids(d)
            longest = longest_document(d)
            if self.band is None:
                object.__setattr__(self, "band", band_bucket(longest, total))
            elif self.band < longest:
                raise ValueError(
                    f"PackedContext: band={self.band} is shorter than the longest document "
                    f"({longest} tokens); leave band=None to plan it from the map"
                )
        # Host-side memo of planning results (segment boundaries, FLA contexts): planning runs
        # once per batch, not once per layer. Not a field (FSDP's input cast rebuilds dataclasses
        # with dataclasses.replace over their fields), so not in equality, hashing or the pytree.
        object.__setattr__(self, "_memo", {})

    # ------------------------------------------------------------------ static facts
    @property
    def cp_enabled(self) -> bool:
        """Whether the sequence is split across more than one rank."""
        return self.cp_size > 1

    @property
    def group_info(self) -> GroupInfo:
        """The CP group as :class:`~fcp.groups.GroupInfo` ``(group, size, rank)``."""
        return GroupInfo(self.group, self.cp_size, self.cp_rank)

    @property
    def batch_size(self) -> int:
        """Rows of the batch (``doc_ids.shape[0]``): the same on every rank."""
        return self.doc_ids.shape[0]

    @property
    def seq_end(self) -> int:
        """Exclusive global end of this rank's interval."""
        return self.seq_start + self.local_seq_len

    @property
    def global_seq_len(self) -> int:
        """Padded global length ``cp_size * local_seq_len``."""
        return self.doc_ids.shape[1]

    @property
    def key_band(self) -> int:
        """:attr:`band`, or ``global_seq`` when it is unknown (``None``)."""
        return self.global_seq_len if self.band is None else self.band

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
        full embedding sequence, then applies ``ctx.shard(embeds)``.
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
    def memo(self, key: Hashable, compute: Callable[[], _T]) -> _T:
        """``compute()``, evaluated once per context and ``key`` (host-side planning memo).

        For planning that depends only on the replicated map (segment boundaries, FLA metadata):
        every layer of a step then reuses the first result. Eager only; never inside a compiled
        region. A context made by :meth:`replace` (or by pytree unflattening) starts empty.
        """
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def row_cu_seqlens(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global segment boundaries of one batch row: ``(on doc_ids' device, on CPU)``.

        int64 ``[segments + 1]`` from 0 to ``global_seq``; the pad tail is its own segment.
        Host-side (synchronises); memoised per row so repeated layers pay once per batch.
        """

        def compute():
            cpu = segment_cu_seqlens(self.doc_ids[row].cpu())
            return cpu.to(self.doc_ids.device), cpu

        return self.memo(("global_cu_seqlens", self.check_row(row)), compute)

    def local_cu_seqlens(self, row: int) -> torch.Tensor:
        """Segment boundaries of this rank's slice of ``row``, local indices, int64 on CPU.

        Example (the module docstring's layout, rank 1): ``[0, 1, 2, 3]``.
        """
        return self.memo(
            ("local_cu_seqlens", self.check_row(row)),
            lambda: segment_cu_seqlens(self.local_doc_ids[row].cpu()),
        )

    def check_row(self, row: int) -> int:
        """``row`` if it is a batch row of this context, else ``ValueError``."""
        row = check_int(row, "row", 0)
        if row >= self.batch_size:
            raise ValueError(f"row={row!r} is outside [0, batch={self.batch_size})")
        return row

    def replace(self, **changes: Any) -> "PackedContext":
        """A new context with ``changes`` applied (validated anew, fresh host-side memo; a new
        ``doc_ids`` without a ``band`` gets its band planned anew)."""
        if "doc_ids" in changes and "band" not in changes:
            changes["band"] = None
        return dataclasses.replace(self, **changes)


#: The smallest planned band: below about a thousand tokens a band saves too little work to be
#: worth a compiled graph of its own, so every packing of short documents shares one.
MIN_BAND = 1024


def band_bucket(longest: int, seq: int) -> int:
    """The default :attr:`PackedContext.band`: the smallest power of two ``>= longest``, at
    least :data:`MIN_BAND`, at most ``seq``.

    >>> [band_bucket(n, 1 << 14) for n in (0, 700, 1024, 1025, 5000, 9000)]
    [1024, 1024, 1024, 2048, 8192, 16384]
    >>> band_bucket(5, 12)
    12
    """
    return min(seq, max(MIN_BAND, 1 << max(0, longest - 1).bit_length()))


register_frozen_pytree(PackedContext, leaves=("doc_ids",), name="fcp.PackedContext")


def check_context(value: Any, *, fn: str = "", name: str = "ctx", hint: str = "") -> PackedContext:
    """``value`` if it is a :class:`PackedContext`, else :class:`~fcp.checks.ArgumentTypeError`
    naming ``fn`` and ``name`` (``hint`` is appended to the message).

    The one context check of every operator's dispatcher (and of each collective): a type
    check only, evaluated at trace time under ``torch.compile`` (nothing in the graph). The
    context's *contents* need no second look: a ``PackedContext`` validates itself once, when
    it is built (``fcp.shard_batch`` builds it eagerly, once per batch; see the class
    docstring), and it is frozen.
    """
    return check_instance(value, PackedContext, name, fn=fn, hint=hint)
