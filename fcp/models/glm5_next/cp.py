"""Contiguous packed context parallelism for GLM-5.3-Flash: drop-in for NeMo AutoModel 0.7.0.

Kimi Delta Attention carries recurrent and short-convolution state from left to right, so the
generic load-balanced CP permutation is not valid: one contiguous token interval per CP rank and
one replicated global document-id map, consumed by both KDA and KPool-DSA.

This module is ``nemo_automodel.components.models.glm5_next.cp`` on top of fcp's generic core::

    from fcp.models.glm5_next import cp   # instead of nemo_automodel.components.models.glm5_next

Every name keeps NeMo's signature, return types, dtypes, batch keys and in-place mutation on every
valid input; the work is fcp's:

=============================== ===============================================================
seed name                       delegates to
=============================== ===============================================================
``Glm5NextPackedContext``       :class:`fcp.context.PackedContext` (``to_packed_context``)
``all_gather_sequence``         :func:`fcp.comm.all_gather_group` (funcol, compile-safe)
``all_gather_backward_anchor``  :func:`fcp.comm.all_gather_backward_anchor`, shaped ``(B, 1, 1)``
``build_fla_cp_context``        ``fcp.ops.kit.fla.build_fla_cp_context`` (FLA imported lazily)
``doc_ids_from_cu_seqlens``     :func:`fcp.layout.doc_ids_from_cu_seqlens`, NeMo's numbering
``doc_ids_from_seq_lens``       :func:`fcp.layout.doc_ids_from_seq_lens`, NeMo's numbering
``segment_cu_seqlens``          :func:`fcp.layout.segment_cu_seqlens` (int32 like NeMo)
``shard_batch_for_glm5_next_cp`` :func:`fcp.shard.shard_batch` (validation, padding, slicing)
``_pad_sequence_dim``           :func:`fcp.shard.pad_sequence_dim`
=============================== ===============================================================

NeMo's contract, kept: the sharder **mutates** ``batch`` and returns it with NeMo's keys
(``glm5_next_packed_context``, local ``labels`` / ``position_ids`` / ``padding_mask`` with True =
pad, ``input_ids`` full and unpadded unless ``shard_primary``), and returns NeMo's
``ShardLayout(original_seq_len, padded_seq_len)`` third (NeMo's class when importable). Document
ids come from ``_packed_seq_ids``, a 2-D ``attention_mask`` (binary or indexed), then
``seq_lens_padded`` / ``seq_lens``, then ``cu_seqlens``, then ``padding_mask``; the NeMo-visible
map is int32 and numbers documents as NeMo does (a zero-length document still uses an id).
Position ids default to one global ``arange`` padded with 0. Documents are the runs of equal
non-zero ids; fcp's core sees them renumbered 1, 2, ... as int64 (``to_packed_context``).
NeMo's ``labels`` are already next-token targets: the core gets them as its ``shift_labels``
(sharded as given, never shifted again) and the batch gets them back under ``labels``; NeMo's
position ids run on across documents, which the core refuses next to a document map, so the
sharder slices them itself.

``Glm5NextPackedContext`` is, like NeMo's, a **mutable**, unhashable dataclass whose memo
``_cu_seqlens`` is an ``__init__`` field: NeMo's model code builds it per forward and FSDP's
mixed-precision hook rebuilds it with ``dataclasses.replace`` (every field passed back to
``__init__``), so it may hold no ``init=False`` field and no other dataclass. It is therefore not a
pytree: fcp's compiled code takes ``context.to_packed_context(group)``, the frozen pytree
:class:`~fcp.context.PackedContext`. Its constructor checks shapes and types only (no host sync)
and accepts any map NeMo's model builds, left padding included; ``to_packed_context`` validates
the values.

One cache; contexts converted once. Host planning (segment boundaries, FLA contexts) lives in the
core ``PackedContext``'s host memo. The sharder's context holds the very core
:func:`fcp.shard_batch` built and validated: ``to_packed_context(group)`` returns it (no second
construction, no second host sync), and ``row_cu_seqlens`` / ``build_fla_cp_context`` read its
memo. NeMo's contract decides where that core is kept: in ``_cu_seqlens``, under a key of its own,
inside a small host memo object, because that is the one field that can carry a memo through
``dataclasses.replace`` and FSDP's cast to the rebuilt context (the cast copies the dict, not the
object in it). The int rows of ``_cu_seqlens`` mirror ``row_cu_seqlens`` results for NeMo code
and are never read. A context NeMo's model builds itself for a non-CP forward (possibly
left-padded, which no core represents) has no core and keeps its row boundaries in that host memo.
Every entry records the field values it was computed from (the map by identity and in-place
version) and serves no context whose fields changed since, so assigning a field needs no hook.
Copies and pickles start with an empty memo.

Stricter than NeMo (NeMo silently accepts these, or fails later or with another exception; fcp
raises ``ValueError`` / ``TypeError`` naming the argument and value, before any collective that
depends on the batch and before touching the batch):

* ``[ranks]`` CP ranks holding different batches (rows, length or document map), or some of them
  rejecting theirs: every rank raises ``ValueError`` naming the ranks and what differs, after one
  exchange of 48 bytes per rank through the group's store (:class:`fcp.shard.BatchAgreement`);
  a CP rank that never joins it (it passed another group or ``None``) makes the others raise a
  ``RuntimeError`` naming it after ``fcp.shard.JOIN_TIMEOUT_S`` seconds. NeMo runs on with
  corrupted outputs (same length), fails inside a collective on some ranks only, or waits for
  the collective timeout.
* ``[non-tensor]`` a list or other non-tensor where a tensor is expected (``seq_lens``,
  ``seq_lens_padded``, ``cu_seqlens``, ``_packed_seq_ids``, ``attention_mask``,
  ``padding_mask``, ``labels``, ``position_ids``, ``loss_mask``, ``doc_ids_row``): NeMo ignores it
  or raises ``AttributeError``.
* ``[dtype]`` float or bool ``seq_lens`` / ``cu_seqlens`` / ``doc_ids_row`` (NeMo truncates
  floats and counts True as 1), and negative or non-integral values in ``_packed_seq_ids`` or a
  2-D ``attention_mask`` (NeMo truncates them).
* ``[seq-lens]`` ``seq_lens`` whose row sums exceed ``seq_len`` (NeMo truncates the last
  document), negative lengths other than the sentinel (NeMo skips them), a sentinel before a
  real length (NeMo drops it), a non-negative ``padding_value``, more than two dims.
* ``[cu-seqlens]`` ``cu_seqlens`` not starting at 0, decreasing, ending after ``seq_len``
  (NeMo truncates), with a negative entry before a real one (NeMo drops negatives anywhere;
  a trailing run of negative fill values is accepted), with fewer than two real entries (NeMo
  returns one document over the whole row), or with more than one row (NeMo flattens rows).
* ``[segment-row]`` ``segment_cu_seqlens`` of a tensor that is not 1-D (NeMo compares along
  dim 0 and flattens).
* ``[pad-tail]`` a sharded document map with padding (id 0) before a real token, i.e. left or
  interior padding: fcp's map has pad only as a right tail. ``Glm5NextPackedContext`` itself
  accepts such maps (NeMo's non-CP forward builds them); its ``to_packed_context`` raises.
* ``[rows]`` a document source or token stream whose rows or length differ from ``input_ids``:
  ``cu_seqlens`` or 1-D ``seq_lens`` with batch > 1, a short ``_packed_seq_ids``, a
  wrong-length ``padding_mask`` / ``labels`` / ``position_ids`` / ``loss_mask`` (NeMo leaves
  those unpadded and unsliced, or fails inside ``masked_fill``), 3-D position ids.
* ``[mask-dims]`` an ``attention_mask`` that is not 2-D (NeMo ignores a 4-D mask as a document
  source, possibly dropping its packing).
* ``[seq-lens-padded-none]`` ``seq_lens_padded: None`` next to a ``seq_lens`` tensor (NeMo then
  ignores ``seq_lens``).
* ``[empty]`` an empty sequence (``input_ids.shape[1] == 0``) or ``input_ids`` that is not an
  integer tensor of rank 1 or 2.
* ``[mesh]`` a ``cp_mesh`` that is not ``None``, a ``ProcessGroup`` or a 1-D ``DeviceMesh``
  (NeMo takes any object with ``size()`` / ``get_local_rank()``), a non-int
  ``padding_token_id`` or non-bool ``shard_primary``.
* ``[context]`` ``Glm5NextPackedContext`` whose ``doc_ids`` is not a 2-D integer tensor, whose
  length is not a multiple of ``cp_size``, whose ``seq_start`` is not ``rank * local_seq_len``,
  or whose ``original_seq_len`` is outside ``[0, padded length]`` (NeMo floor-divides), or whose
  ``_cu_seqlens`` is not a dict (NeMo fails in ``row_cu_seqlens``).
* ``[row]`` ``row_cu_seqlens`` / ``build_fla_cp_context`` with a non-int row (an out-of-range row
  raises ``IndexError``, as in NeMo).
* ``[group]`` ``build_fla_cp_context`` / ``to_packed_context`` with a group whose size is not
  ``cp_size`` or whose rank does not own ``seq_start`` (NeMo lets FLA plan another layout).
* ``[gather-shapes]`` ``all_gather_sequence`` of shards whose shapes differ between ranks (every
  rank raises instead of a gloo error or hang).
* ``[meta]`` a meta tensor (no values) as ``input_ids``, a token stream, a mask, ``_packed_seq_ids``,
  ``seq_lens`` or ``cu_seqlens``: ``ValueError`` naming it (NeMo fails inside with ``Tensor.item()
  cannot be called on meta tensors`` or a ``nonzero`` error).
* ``[seq-len]`` a float or bool ``seq_len`` of ``doc_ids_from_seq_lens`` /
  ``doc_ids_from_cu_seqlens`` (NeMo's ``arange`` takes a float). A negative one raises
  :class:`~fcp.models.compat.NegativeLengthError`, a ``RuntimeError`` as NeMo's and a
  ``ValueError``.

Kept from NeMo on purpose: ``padding_value`` is keyword-only; ``cp_group=None`` in the gathers means
the default process group (``ValueError`` when none is initialised); an out-of-range row raises
``IndexError``; FLA missing makes ``build_fla_cp_context`` raise ``RuntimeError``. Not provided:
NeMo's private FLA probe ``_FLA_CP_AVAILABLE`` / ``_build_cp_context`` (fcp imports FLA lazily).
"""

from __future__ import annotations

import contextlib
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fcp.checks import check_instance, check_int, check_tensor
from fcp.comm import all_gather_backward_anchor as core_backward_anchor
from fcp.comm import all_gather_group
from fcp.comm import dependent_zeros
from fcp.context import PackedContext, check_context
from fcp.groups import resolve_group
from fcp.layout import (
    PAD_DOC_ID,
    SEQ_LENS_SENTINEL,
    document_starts,
    validate_right_tail_mask,
)
from fcp.layout import doc_ids_from_cu_seqlens as core_doc_ids_from_cu_seqlens
from fcp.layout import doc_ids_from_seq_lens as core_doc_ids_from_seq_lens
from fcp.layout import segment_cu_seqlens as core_segment_cu_seqlens
from fcp.models.compat import (
    MissingBatchKeyError,
    NegativeLengthError,
    shard_layout,
    shard_layout_class,
)
from fcp.shard import BatchAgreement, check_stream, pad_sequence_dim, shard_batch

#: Document id of padding tokens.
_PAD_DOC_ID = PAD_DOC_ID
#: Batch key of the global layout, read by NeMo's GLM model code.
_CONTEXT_KEY = "glm5_next_packed_context"
#: Keys a THD collater gives as ``[sequence]`` rows; ``_normalize_batch_axis`` adds the batch axis.
_THD_KEYS = ("input_ids", "labels", "position_ids", "attention_mask", "padding_mask",
             "_packed_seq_ids")  # fmt: skip
#: Packing metadata the sharder consumes (the context carries the layout afterwards).
_METADATA_KEYS = ("attention_mask", "_packed_seq_ids", "seq_lens", "seq_lens_padded", "cu_seqlens",
                  "cu_seqlens_padded", "max_seqlen", "qkv_format")  # fmt: skip


def __getattr__(name: str):
    if name == "ShardLayout":  # NeMo's module exposes it; resolved lazily (NeMo is optional)
        return shard_layout_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------------
def _first_bad(bad: torch.Tensor) -> tuple[int, ...] | None:
    hits = bad.nonzero()
    return tuple(hits[0].tolist()) if hits.shape[0] else None


def _id_map(raw: torch.Tensor, name: str) -> torch.Tensor:
    """``raw`` (bool / int / float holding non-negative integers) as NeMo's int32 id map."""
    if raw.is_complex():
        raise ValueError(f"{name} has dtype {raw.dtype}; expected integer document ids")
    if raw.dtype != torch.bool:
        bad = (raw < 0) | (raw > torch.iinfo(torch.int32).max)
        if raw.is_floating_point():
            bad |= raw != raw.trunc()  # NaN too
        hit = _first_bad(bad)
        if hit is not None:
            where = f"{name}[{', '.join(map(str, hit))}]"
            raise ValueError(
                f"{where} = {raw[hit].item()!r} is not a document id (a non-negative integer; "
                "0 = pad)"
            )
    return raw.to(torch.int32)


def _runs(raw: torch.Tensor, name: str) -> torch.Tensor:
    """fcp's int64 map of a NeMo id map: runs of equal non-zero ids numbered 1, 2, ... per row.

    ``raw`` must hold non-negative ids with padding (0) only as a right tail ([pad-tail]).
    """
    if (raw < 0).any():
        raise ValueError(f"{name} holds negative document ids")
    valid = raw != PAD_DOC_ID
    try:
        validate_right_tail_mask(valid, name=f"{name} != 0")
    except ValueError as err:
        raise ValueError(
            f"{err}: fcp's document map has padding (id 0) only as a right tail; left or "
            "interior padding is not supported"
        ) from None
    return torch.cumsum(document_starts(raw) & valid, dim=1) * valid


# ---------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------
#: Key of fcp's host memo in a context's ``_cu_seqlens`` dict (NeMo's keys are ints).
_MEMO_KEY = "fcp.host_memo"


def _state(context: "Glm5NextPackedContext") -> tuple:
    """The field values a memo entry of ``context`` is computed from (the map by identity and
    in-place version, so an assigned or edited map never matches an old entry)."""
    ids = context.doc_ids
    version = None if ids.is_inference() else ids._version  # inference tensors keep none
    return ids, version, context.seq_start, context.cp_size, context.original_seq_len


def _same(a: tuple, b: tuple) -> bool:
    return a[0] is b[0] and a[1:] == b[1:]


class _HostMemo:
    """fcp's host memo of one layout, shared by every copy ``dataclasses.replace`` and FSDP's
    input cast make of its :class:`Glm5NextPackedContext`.

    It holds, per process group, the core :class:`~fcp.context.PackedContext` built for (or by)
    the context, whose own host memo holds every planning result (segment boundaries, FLA
    contexts); and the row boundaries of a layout that has no core. Every entry records the field
    values it was computed from (:func:`_state`) and is served only to a context that still has
    them. Not a container (FSDP's cast rebuilds containers; it passes this object on as it is);
    copies and pickles start empty (a core holds a process group).
    """

    __slots__ = ("cores", "rows")

    def __init__(self) -> None:
        self.cores: dict[Any, tuple[tuple, PackedContext]] = {}  # group -> (state, core)
        self.rows: tuple[tuple, dict[int, tuple[torch.Tensor, torch.Tensor]]] | None = None

    def __reduce__(self):
        return _HostMemo, ()

    def core(self, context: "Glm5NextPackedContext", group: Any) -> PackedContext | None:
        """``context``'s core on ``group``, if one was built for its current field values."""
        entry = self.cores.get(group)
        return entry[1] if entry is not None and _same(entry[0], _state(context)) else None

    def any_core(self, context: "Glm5NextPackedContext") -> PackedContext | None:
        """A current core of ``context`` on any group (its map and boundaries are the same)."""
        state = _state(context)
        return next((core for built, core in self.cores.values() if _same(built, state)), None)

    def keep(self, context: "Glm5NextPackedContext", core: PackedContext) -> PackedContext:
        """Make ``core`` ``context``'s core on ``core.group``; its memo serves the boundaries."""
        self.cores[core.group] = (_state(context), core)
        self.rows = None
        return core

    def coreless_rows(self, context: "Glm5NextPackedContext") -> dict:
        """Row index -> boundaries of ``context``'s current map, for a layout without a core."""
        state = _state(context)
        if self.rows is None or not _same(self.rows[0], state):
            self.rows = (state, {})
        return self.rows[1]


@dataclass
class Glm5NextPackedContext:
    """Global packed-document layout for one model step.

    Attributes:
        doc_ids: integer document ids ``[batch, global_sequence]`` (int32 from the sharder), 0 =
            padding; the runs of equal positive ids are the documents.
        seq_start: global offset of this rank's contiguous local token interval.
        cp_size: number of context-parallel ranks (divides the global length).
        original_seq_len: sequence length before CP divisibility padding.
        _cu_seqlens: NeMo's memo field (an ``__init__`` field so that ``dataclasses.replace`` and
            FSDP's input cast carry it to the rebuilt context). fcp keeps its one host memo in
            it (under a key of its own) and mirrors each :meth:`row_cu_seqlens` result under the
            row as given, which is all NeMo code sees.

    ``to_packed_context(group)`` is the same layout as fcp's frozen, pytree-registered
    :class:`~fcp.context.PackedContext` (int64 ids 1, 2, ... per row), for fcp's operators.
    """

    doc_ids: torch.Tensor
    seq_start: int = 0
    cp_size: int = 1
    original_seq_len: int | None = None
    _cu_seqlens: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        fn = "Glm5NextPackedContext"
        d = check_tensor(self.doc_ids, "doc_ids", fn=fn, kind="int", dim=2,
                         layout="[batch, sequence]")  # fmt: skip
        cp_size = check_int(self.cp_size, "cp_size", 1, fn=fn)
        if d.shape[1] % cp_size:
            raise ValueError(f"{fn}: cp_size={cp_size} must divide the doc_ids length {d.shape[1]}")
        local = d.shape[1] // cp_size
        start = check_int(self.seq_start, "seq_start", fn=fn)
        if not (0 <= start < max(d.shape[1], 1) and (local == 0 or start % local == 0)):
            raise ValueError(
                f"{fn}: seq_start={start} must be r * local_seq_len ({local}) for a rank r in "
                f"[0, cp_size={cp_size})"
            )
        if self.original_seq_len is not None:
            original = check_int(self.original_seq_len, "original_seq_len", 0, fn=fn)
            if original > d.shape[1]:
                raise ValueError(
                    f"{fn}: original_seq_len={original} is outside [0, {d.shape[1]}] (the padded "
                    "global length)"
                )
        check_instance(self._cu_seqlens, dict, "_cu_seqlens", fn=fn)

    @classmethod
    def _of_core(cls, core: PackedContext, doc_ids: torch.Tensor) -> "Glm5NextPackedContext":
        """The NeMo view, with NeMo's map ``doc_ids``, of the core ``core`` (which it keeps)."""
        out = cls(doc_ids, core.seq_start, core.cp_size, core.original_seq_len)
        out._memo().keep(out, core)
        return out

    @classmethod
    def from_packed_context(cls, context: PackedContext) -> "Glm5NextPackedContext":
        """The NeMo view (int32 ids) of a core context; ``to_packed_context(group)`` returns it."""
        context = check_context(context, fn="Glm5NextPackedContext.from_packed_context",
                                name="context")
        return cls._of_core(context, context.doc_ids.to(torch.int32))

    def _memo(self) -> _HostMemo:
        memo = self._cu_seqlens.get(_MEMO_KEY)
        if not isinstance(memo, _HostMemo):
            memo = self._cu_seqlens[_MEMO_KEY] = _HostMemo()
        return memo

    def to_packed_context(self, cp_group: Any = None) -> PackedContext:
        """This layout as fcp's :class:`~fcp.context.PackedContext` on ``cp_group``.

        ``cp_group``: ``ProcessGroup``, 1-D ``DeviceMesh`` or ``None`` (no CP). Its size must be
        ``cp_size`` and this rank must own ``seq_start``; the map must have padding only as a
        right tail (``ValueError`` otherwise). Built (and validated) once per group and field
        values: the sharder's context returns the sharder's core, also after
        ``dataclasses.replace`` / FSDP's input cast; after a field is assigned, a new one.
        """
        info = resolve_group(cp_group, name="cp_group", fn="to_packed_context")
        memo = self._memo()
        core = memo.core(self, info.group)
        if core is None:
            if info.size != self.cp_size:
                raise ValueError(
                    f"cp_group has {info.size} rank(s) but the layout has cp_size={self.cp_size}"
                )
            core = PackedContext(
                doc_ids=_runs(self.doc_ids, "doc_ids"),
                group=info.group,
                cp_size=info.size,
                cp_rank=info.rank,
                seq_start=self.seq_start,
                original_seq_len=self.original_seq_len,
            )
            memo.keep(self, core)
        return core

    @property
    def cp_enabled(self) -> bool:
        """Return whether the sequence is split across more than one rank."""
        return self.cp_size > 1

    @property
    def local_seq_len(self) -> int:
        """Return the padded local sequence length."""
        return self.doc_ids.shape[1] // self.cp_size

    @property
    def local_doc_ids(self) -> torch.Tensor:
        """Return document ids ``[batch, local_sequence]`` for this rank (a view)."""
        return self.doc_ids[:, self.seq_start : self.seq_start + self.local_seq_len]

    def row_cu_seqlens(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return device/CPU segment boundaries for one packed batch row.

        int64 ``[runs + 1]`` from 0 to the padded length: every run of equal ids (the pad tail
        included) is a segment (:func:`fcp.layout.segment_cu_seqlens`); negative rows count from
        the end. Computed once per row and field values: by the core's memo
        (:meth:`PackedContext.row_cu_seqlens`) when the layout has a core, else in fcp's host
        memo (a layout NeMo's model builds itself, possibly left-padded). Mirrored in
        ``_cu_seqlens`` under ``row`` as given.
        """
        index, rows = check_int(row, "row"), self.doc_ids.shape[0]
        if not -rows <= index < rows:
            raise IndexError(f"index {index} is out of bounds for dimension 0 with size {rows}")
        index %= rows
        memo = self._memo()
        core = memo.any_core(self)
        if core is not None:
            bounds = core.row_cu_seqlens(index)
        else:
            cache = memo.coreless_rows(self)
            if index not in cache:
                device = core_segment_cu_seqlens(self.doc_ids[index])
                cache[index] = (device, device.cpu())
            bounds = cache[index]
        self._cu_seqlens[row] = bounds
        return bounds


# ---------------------------------------------------------------------------------------------
# document maps
# ---------------------------------------------------------------------------------------------
def _sequence_length(seq_len: Any, fn: str) -> int:
    """``seq_len`` as an int >= 0; negative: :class:`NegativeLengthError`, NeMo's RuntimeError."""
    seq_len = check_int(seq_len, "seq_len", fn=fn)
    if seq_len < 0:
        raise NegativeLengthError(f"{fn}: seq_len={seq_len} must be >= 0")
    return seq_len


def doc_ids_from_seq_lens(
    seq_lens: torch.Tensor, seq_len: int, *, padding_value: int = SEQ_LENS_SENTINEL
) -> torch.Tensor:
    """Convert per-document lengths ``[batch, documents]`` to ids ``[batch, sequence]``.

    int32 on ``seq_lens``' device; document ``j`` of a row (counting zero-length ones, not the
    trailing ``padding_value`` slots) gets id ``j + 1``; the rest of the row is pad (0).
    :func:`fcp.layout.doc_ids_from_seq_lens` validates and builds the map.

    Example: ``doc_ids_from_seq_lens(tensor([2, 0, 2]), 5) -> [[1, 1, 3, 3, 0]]``.
    """
    seq_len = _sequence_length(seq_len, "doc_ids_from_seq_lens")
    ids = core_doc_ids_from_seq_lens(seq_lens, seq_len, padding_value)
    lens = seq_lens if seq_lens.dim() == 2 else seq_lens.unsqueeze(0)
    # Core ids count non-empty documents; NeMo's count every slot. k-th non-empty -> its slot.
    slots = torch.arange(lens.shape[1], device=lens.device).expand(lens.shape)
    slots = torch.where(lens > 0, slots, lens.shape[1]).sort(dim=1).values
    if slots.shape[1] == 0:
        return ids.to(torch.int32)
    nemo = slots.gather(1, (ids - 1).clamp(min=0)) + 1
    return torch.where(ids > 0, nemo, 0).to(torch.int32)


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Convert cumulative document boundaries to ids ``[1, sequence]``.

    int32 on ``cu_seqlens``' device; segment ``j`` (counting empty ones) gets id ``j + 1`` and
    positions from ``cu_seqlens[-1]`` on are pad (0). A trailing run of negative fill values is
    ignored. :func:`fcp.layout.doc_ids_from_cu_seqlens` validates and builds the map.

    Example: ``doc_ids_from_cu_seqlens(tensor([0, 2, 2, 5, -1]), 6) -> [[1, 1, 3, 3, 3, 0]]``.
    """
    seq_len = _sequence_length(seq_len, "doc_ids_from_cu_seqlens")
    cu = check_tensor(cu_seqlens, "cu_seqlens", values=True)
    if cu.dim() == 2 and cu.shape[0] == 1:
        cu = cu[0]
    if cu.dim() == 1 and not (cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool):
        real = int((cu >= 0).cumprod(0).sum())  # entries before the first negative one
        if bool((cu[real:] >= 0).any()):
            raise ValueError(
                f"cu_seqlens = {cu.tolist()} has a negative entry before a boundary; only a "
                "trailing run of negative fill values is allowed"
            )
        cu = cu[:real]
        if cu.numel() < 2:
            raise ValueError(
                f"cu_seqlens = {cu_seqlens.tolist()} needs at least two boundaries (0 and the "
                "end of the first document)"
            )
    ids = core_doc_ids_from_cu_seqlens(cu, seq_len)  # validates dtype, shape, order, range
    nonempty = (cu[1:] > cu[:-1]).nonzero().reshape(-1)
    nemo = nonempty[(ids - 1).clamp(min=0)] + 1 if nonempty.numel() else ids
    return torch.where(ids > 0, nemo, 0).to(torch.int32)


def segment_cu_seqlens(doc_ids_row: torch.Tensor) -> torch.Tensor:
    """Return boundaries for consecutive document-id runs covering the full row.

    int32 ``[runs + 1]`` from 0 to ``sequence`` on the row's device (the pad tail is its own run);
    an empty row gives ``[0]``. :func:`fcp.layout.segment_cu_seqlens` of a 1-D integer row.
    """
    row = check_tensor(doc_ids_row, "doc_ids_row", values=True)
    if row.dim() != 1:
        raise ValueError(f"doc_ids_row must be 1-D [sequence], got shape {tuple(row.shape)}")
    return core_segment_cu_seqlens(row).to(torch.int32)


# ---------------------------------------------------------------------------------------------
# FLA
# ---------------------------------------------------------------------------------------------
def build_fla_cp_context(
    packed_context: Glm5NextPackedContext,
    row: int,
    cp_group: Any,
    conv_kernel_size: int,
):
    """Build FLA's KDA context for one batch row.

    Args:
        packed_context: global document layout (or fcp's ``PackedContext``).
        row: batch row being executed (negative counts from the end).
        cp_group: context-parallel process group (or 1-D mesh; ``None``: the default group).
        conv_kernel_size: short-convolution width used for the left halo.

    Returns:
        FLA ``FLACPContext`` carrying segment and process-group metadata, planned by
        ``fcp.ops.kit.fla.build_fla_cp_context`` (field for field what FLA's own builder
        gives; memoised per row, width and group).

    Raises:
        RuntimeError: FLA is not importable (as NeMo).
    """
    try:
        from fcp.ops.kit.fla import build_fla_cp_context as plan  # imports FLA lazily
        import fla.ops.cp  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            "GLM-5.3 context parallelism requires the `fla` optional dependency"
        ) from err
    group = _default_group() if cp_group is None else cp_group
    if isinstance(packed_context, Glm5NextPackedContext):
        packed_context = packed_context.to_packed_context(group)
    index, rows = check_int(row, "row"), packed_context.batch_size
    if not -rows <= index < rows:
        raise IndexError(f"index {index} is out of bounds for dimension 0 with size {rows}")
    info = resolve_group(group, name="cp_group", fn="build_fla_cp_context")
    return plan(packed_context, index % rows, info.group, conv_kernel_size)


# ---------------------------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------------------------
def _default_group():
    """``None`` as a CP group means the default group, as in ``torch.distributed``."""
    if not dist.is_initialized():
        raise ValueError(
            "Default process group has not been initialized, please make sure to call "
            "init_process_group."
        )
    return dist.group.WORLD


class _AllGatherSequence(torch.autograd.Function):
    """Autograd-aware all-gather of equal contiguous sequence shards.

    ``_AllGatherSequence.apply(x, group, dim)`` equals ``all_gather_sequence(x, group, dim=dim)``:
    forward runs fcp's funcol gather on a detached copy, backward differentiates that same gather
    (a reduce-scatter). Eager only; :func:`all_gather_sequence` is compile-safe.
    """

    @staticmethod
    def forward(ctx, local_tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        group = _default_group() if group is None else group
        if not (local_tensor.is_floating_point() or local_tensor.is_complex()):
            return all_gather_group(local_tensor, group, dim, differentiable=False)
        with torch.enable_grad():
            leaf = local_tensor.detach().requires_grad_()
            gathered = all_gather_group(leaf, group, dim)
        ctx.leaf, ctx.gathered = leaf, gathered
        return gathered.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = torch.autograd.grad(ctx.gathered, ctx.leaf, grad_output)
        del ctx.leaf, ctx.gathered
        return grad, None, None


class _AllGatherBackwardAnchor(torch.autograd.Function):
    """Return zero ``(B, 1, 1)`` while retaining a backward edge to a gathered tensor.

    Backward gives zeros shaped like ``gathered`` that depend on the incoming gradient
    (:func:`fcp.comm.dependent_zeros`). Prefer :func:`all_gather_backward_anchor`.
    """

    @staticmethod
    def forward(ctx, gathered: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype = gathered.shape, gathered.dtype
        return gathered.new_zeros(gathered.shape[:1] + (1, 1))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        return dependent_zeros(grad_output, ctx.shape, ctx.dtype)


def all_gather_sequence(tensor: torch.Tensor, cp_group: Any, *, dim: int = 1) -> torch.Tensor:
    """Gather a sequence-sharded tensor while preserving K/V gradient flow.

    :func:`fcp.comm.all_gather_group`: equal contiguous shards concatenated in rank order
    along ``dim``; backward sends each rank the sum over ranks of its slice's gradient (one
    reduce-scatter). ``cp_group``: ``ProcessGroup`` or 1-D ``DeviceMesh``; ``None`` is the
    default group, as in NeMo.
    """
    group = _default_group() if cp_group is None else cp_group
    return all_gather_group(tensor, group, dim)


def all_gather_backward_anchor(gathered: torch.Tensor) -> torch.Tensor:
    """Create a zero-valued dependency that keeps gather backward collective-safe.

    ``output + all_gather_backward_anchor(full)`` changes nothing but keeps a rank whose loss
    ignores ``full`` in the gather's backward collective. Zeros ``(B, 1, 1)`` of ``gathered``'s
    dtype (:func:`fcp.comm.all_gather_backward_anchor`, NaN-safe in backward).
    """
    anchor = core_backward_anchor(gathered)
    return anchor.expand(gathered.shape[:1] + (1, 1)).contiguous()


# ---------------------------------------------------------------------------------------------
# batch helpers and the sharder
# ---------------------------------------------------------------------------------------------
def _pad_sequence_dim(
    tensor: torch.Tensor, pad_len: int, value: float | int | bool
) -> torch.Tensor:
    """Right-pad dim 1 by ``pad_len`` entries of ``value`` (the same tensor if ``pad_len <= 0``)."""
    if pad_len <= 0:
        return tensor
    return pad_sequence_dim(tensor, pad_len, value)


def _thd_rows(batch: MutableMapping[str, Any]) -> dict[str, torch.Tensor]:
    """For a THD batch (``input_ids [S]``): its ``[S]`` token rows with the batch axis added."""
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
        return {}
    return {
        key: batch[key].unsqueeze(0)
        for key in _THD_KEYS
        if isinstance(batch.get(key), torch.Tensor)
        and batch[key].dim() == 1
        and batch[key].shape[0] == ids.shape[0]
    }


def _normalize_batch_axis(batch: dict[str, Any]) -> None:
    """Restore the placeholder batch axis used by THD VLM collaters (in place).

    With ``input_ids`` ``[S]``, every ``[S]`` token row among ``input_ids``, ``labels``,
    ``position_ids``, ``attention_mask``, ``padding_mask`` and ``_packed_seq_ids`` becomes
    ``[1, S]``; media and packing metadata are left alone.
    """
    if "input_ids" not in batch:
        raise MissingBatchKeyError("input_ids")
    batch.update(_thd_rows(batch))


def _global_doc_ids_from_batch(batch: dict[str, Any], seq_len: int) -> torch.Tensor:
    """Resolve the global document map before removing packing metadata.

    int32 ``[batch, seq_len]`` from the first source present: ``_packed_seq_ids``; a 2-D
    ``attention_mask`` (a binary mask is one document per row, an indexed one holds the ids);
    ``seq_lens_padded`` else ``seq_lens`` (:func:`doc_ids_from_seq_lens`); ``cu_seqlens``
    (:func:`doc_ids_from_cu_seqlens`); else one document per row with ``padding_mask``'s True
    positions as pad. Validated (see the module docstring); padding only as a right tail.
    """
    return _resolve_doc_ids(batch, seq_len)[0]


def _resolve_doc_ids(
    batch: MutableMapping[str, Any], seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(NeMo's int32 map, fcp's int64 map)`` of ``batch`` (see ``_global_doc_ids_from_batch``)."""
    ids = batch.get("input_ids")
    rows = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
    if batch.get("_packed_seq_ids") is not None:
        name = "_packed_seq_ids"
        raw = check_tensor(batch[name], name, values=True)
        raw = _id_map(raw.unsqueeze(0) if raw.dim() == 1 else raw, name)
    elif batch.get("attention_mask") is not None:
        name = "attention_mask"
        raw = check_tensor(batch[name], name, values=True)
        if raw.dim() != 2:
            raise ValueError(
                f"attention_mask has shape {tuple(raw.shape)}; GLM CP reads a 2-D [batch, "
                "sequence] mask (binary or indexed document ids), not a block mask"
            )
        raw = _id_map(raw, name)
    elif (
        "seq_lens_padded" in batch and batch["seq_lens_padded"] is None
        and batch.get("seq_lens") is not None
    ):  # fmt: skip
        raise ValueError(
            "seq_lens_padded is None while seq_lens is given: NeMo's order (seq_lens_padded "
            "first) would silently drop the packing; pass one of them"
        )
    elif batch.get("seq_lens_padded", batch.get("seq_lens")) is not None:
        name = "seq_lens_padded" if batch.get("seq_lens_padded") is not None else "seq_lens"
        raw = doc_ids_from_seq_lens(check_tensor(batch[name], name, values=True), seq_len)
    elif batch.get("cu_seqlens") is not None:
        name = "cu_seqlens"
        raw = doc_ids_from_cu_seqlens(batch[name], seq_len)
    else:
        if rows is None:
            raise MissingBatchKeyError("input_ids")
        name, pad = "padding_mask", batch.get("padding_mask")
        raw = torch.ones(rows, seq_len, dtype=torch.int32, device=ids.device)
        if pad is not None:
            _stream_shape(check_tensor(pad, name, values=True), name, rows, seq_len)
            raw = raw.masked_fill(pad.bool(), PAD_DOC_ID)
        else:
            name = "input_ids"
    if raw.dim() != 2 or raw.shape[1] != seq_len or (rows is not None and raw.shape[0] != rows):
        raise ValueError(
            f"the document map from {name} has shape {tuple(raw.shape)}, expected "
            f"[batch={rows}, sequence={seq_len}] like input_ids"
        )
    return raw, _runs(raw, name)  # pad only as a right tail


def _stream_shape(t: torch.Tensor, name: str, rows: int, seq_len: int) -> None:
    if t.dim() != 2 or tuple(t.shape) != (rows, seq_len):
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}, expected [batch={rows}, sequence={seq_len}] "
            "like input_ids"
        )


def shard_batch_for_glm5_next_cp(
    cp_mesh,
    tp_mesh,
    batch: dict[str, Any],
    *,
    loss_mask=None,
    padding_token_id: int = 0,
    shard_primary: bool = False,
):
    """Contiguously shard packed GLM-5.3 token streams.

    The top-level VLM uses ``shard_primary=False``: image features must be spliced into the full
    embedding sequence inside forward before that differentiable primary stream is sliced.
    Labels and other no-grad token streams are still sharded here.

    Args:
        cp_mesh: one-dimensional CP mesh (or ``ProcessGroup``), or ``None``.
        tp_mesh: unused tensor-parallel mesh, accepted by the sharder protocol.
        batch: batch containing token tensors with shape ``[batch, sequence]`` (``[sequence]``
            THD rows get a batch axis); **mutated in place**.
        loss_mask: optional loss mask ``[batch, sequence]``, sharded into ``batch["loss_mask"]``.
        padding_token_id: fill value for padded token ids.
        shard_primary: whether to pad and shard ``input_ids`` here (``False``: left untouched).

    Returns:
        ``(contextlib.nullcontext, batch, ShardLayout(original_seq_len, padded_seq_len))``.
        ``batch`` loses its packing metadata and ``attention_mask``, gets this rank's
        ``labels`` / ``position_ids`` / ``padding_mask`` (bool, True = pad; a given mask keeps its
        dtype) and the global :class:`Glm5NextPackedContext` under
        ``"glm5_next_packed_context"``; the global length is padded to a multiple of the CP size.

    Raises:
        ValueError / TypeError (``KeyError`` too for a missing ``input_ids``): a malformed batch,
        identically on every rank, before the batch is touched; ``ValueError`` on every rank when
        the CP ranks hold different batches ([ranks] in the module docstring).
    """
    del tp_mesh
    # every CP rank joins one exchange, so ranks holding different batches all raise
    with BatchAgreement(cp_mesh, "shard_batch_for_glm5_next_cp") as agreement:
        check_instance(batch, MutableMapping, "batch", fn="shard_batch_for_glm5_next_cp")
        if "input_ids" not in batch:
            raise MissingBatchKeyError("input_ids")
        rows = _thd_rows(batch)
        work = {**batch, **rows}
        ids = check_tensor(work["input_ids"], "input_ids", values=True)
        if ids.dim() != 2 or ids.is_floating_point() or ids.is_complex() or ids.shape[1] == 0:
            raise ValueError(
                f"input_ids must be a non-empty integer [batch, sequence] tensor, got shape "
                f"{tuple(ids.shape)} dtype {ids.dtype}"
            )
        n_rows, seq_len = ids.shape
        raw, doc_ids = _resolve_doc_ids(work, seq_len)

        # NeMo's labels are already next-token targets: fcp's shift_labels, kept as given.
        core_batch: dict[str, Any] = {"input_ids": ids, "doc_ids": doc_ids}
        if work.get("labels") is not None:
            core_batch["shift_labels"] = check_stream("labels", work["labels"])
        positions = work.get("position_ids")
        if "position_ids" not in work:
            positions = torch.arange(seq_len, device=ids.device).unsqueeze(0).expand_as(ids)
        if positions is not None:
            # NeMo's positions run on across documents (one arange by default), which fcp's
            # core refuses next to a document map: they are sharded here, as NeMo does.
            positions = check_stream("position_ids", positions)
            if positions.dim() != 2 or positions.shape[0] not in (1, n_rows) or \
                    positions.shape[1] != seq_len:  # fmt: skip
                raise ValueError(
                    f"position_ids has shape {tuple(positions.shape)}, expected [batch={n_rows}, "
                    f"sequence={seq_len}] (or [1, sequence]) like input_ids"
                )
        padding_mask = work.get("padding_mask")
        if padding_mask is not None:
            check_tensor(padding_mask, "padding_mask", values=True)
            _stream_shape(padding_mask, "padding_mask", n_rows, seq_len)
        local, core = shard_batch(
            cp_mesh,
            core_batch,
            loss_mask=loss_mask,
            padding_token_id=padding_token_id,
            pad_multiple=1,
            shard_primary=shard_primary,
            ignore_padding=False,  # NeMo's contract: the batch's own labels stay as given
            check_agreement=False,  # checked here, after the validation above
        )
        agreement.check(core.doc_ids, seq_len)
    pad = core.global_seq_len - seq_len
    context = Glm5NextPackedContext._of_core(core, pad_sequence_dim(raw, pad, PAD_DOC_ID))

    # Everything is validated: mutate the batch, in NeMo's order (so its keys keep NeMo's order).
    batch.update(rows)
    for key in _METADATA_KEYS:
        batch.pop(key, None)
    if "shift_labels" in core_batch:
        batch["labels"] = local["shift_labels"].contiguous()
    if positions is not None:
        batch["position_ids"] = core.shard(pad_sequence_dim(positions, pad, 0)).contiguous()
    if shard_primary:
        batch["input_ids"] = local["input_ids"].contiguous()
    if padding_mask is not None:
        batch["padding_mask"] = core.shard(pad_sequence_dim(padding_mask, pad, True)).contiguous()
    elif "padding_mask" not in batch:
        batch["padding_mask"] = (~core.local_valid).contiguous()
    batch[_CONTEXT_KEY] = context
    if loss_mask is not None:
        batch["loss_mask"] = local["loss_mask"].contiguous()
    return contextlib.nullcontext, batch, shard_layout(seq_len, core.global_seq_len)
