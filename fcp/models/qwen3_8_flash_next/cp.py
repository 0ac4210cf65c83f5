"""Contiguous CP for the language-only Qwen3.8-Flash-Next model: drop-in for NeMo AutoModel 0.7.0.

This module is ``nemo_automodel.components.models.qwen3_8_flash_next.cp`` on top of fcp's core::

    from fcp.models.qwen3_8_flash_next import cp   # instead of nemo_automodel...qwen3_8_flash_next

Every name keeps NeMo's signature, return types, dtypes, batch keys, error kinds and in-place
mutation on every valid input; the work is fcp's:

========================================== ====================================================
seed name                                  delegates to
========================================== ====================================================
``Qwen3_8_FlashNextCPContext``             :class:`fcp.context.PackedContext`
                                           (``.packed_context``)
``packed_boundaries_from_seq_lens``        :func:`fcp.layout.packed_boundaries_from_seq_lens`
``qwen3_8_flash_next_cp_all_gather``       :func:`fcp.comm.all_gather_sequence`
``qwen3_8_flash_next_cp_left_halo``        :func:`fcp.comm.left_halo` (one all-to-all)
``shard_batch_for_qwen3_8_flash_next_cp``  :func:`fcp.shard.shard_batch`
``_validate_right_tail_mask``              :func:`fcp.layout.validate_right_tail_mask`
``_pad_right``                             :func:`fcp.shard.pad_sequence_dim`
========================================== ====================================================

NeMo's contract, kept: the sharder **mutates** ``batch`` (local ``input_ids``, ``labels``,
``position_ids``, bool ``padding_mask`` with True = pad, the context under
``"_qwen3_8_flash_next_cp_context"``; packing keys, ``qkv_format`` and ``attention_mask`` removed)
and returns NeMo's ``ShardLayout(original_seq_len, padded_seq_len)`` (NeMo's class when
importable). The global length is padded to a multiple of ``cp * pad_multiple`` even without CP;
position ids default to one global ``arange`` and continue ``last + 1, last + 2, ...`` into the
padding. Packed rows take ``cu_seqlens`` (ending at the row length) or the real ``seq_lens``
(a pack-padding tail becomes its own segment, a document for the model);
``global_cu_seqlens`` keeps those boundaries, ending before the CP padding, which is in no
document. Errors keep NeMo's kinds: ``ValueError``; ``NotImplementedError`` for unsupported
layouts and ``KeyError`` for missing labels, raised as
:class:`~fcp.models.compat.UnsupportedBatchError` /
:class:`~fcp.models.compat.MissingBatchKeyError`, which are ``ValueError`` s as well.

``Qwen3_8_FlashNextCPContext`` is, like NeMo's, a frozen dataclass (``replace`` re-validates); fcp
also registers it as a pytree (tensor fields are leaves, group and sizes static) through
:func:`fcp.pytree.register_frozen_pytree`, so it can enter a compiled model. Its fcp view
``packed_context`` (doc ids: the segments of ``global_cu_seqlens``, else one document per row over
the non-pad tokens; pad 0) is kept outside the dataclass fields, so ``dataclasses.replace`` and
FSDP's input casting see NeMo's fields only. The sharder's context holds the very core
:func:`fcp.shard_batch` built and validated (no second construction, no second host sync); every
layer's collectives and the core's host memo use that one object. A context made by ``__init__``
(NeMo code, ``dataclasses.replace``, FSDP's cast, pytree unflattening, copies) validates its
fields and derives its own core without host synchronisation, as NeMo's re-validates: a frozen
dataclass's constructor cannot know the object it copies, and fcp keeps no global cache. Value
checks (host syncs) run when the tensors have data, i.e. not while tracing.

Stricter than NeMo (NeMo silently accepts these, or fails later or with another exception; fcp
raises ``ValueError`` / ``TypeError`` naming the argument and value, identically on every rank,
before any collective that depends on the batch and before touching the batch; NeMo mutates the
batch before some errors):

* ``[ranks]`` CP ranks holding different batches, or some of them rejecting theirs: the same
  agreement check as the GLM-5.3-Flash module's (:class:`fcp.shard.BatchAgreement`, 48 bytes per
  rank through the group's store), so every rank raises one ``ValueError`` naming the ranks and
  what differs, and a rank that never joins is named in a ``RuntimeError``. NeMo runs on
  with corrupted outputs, fails inside a collective on some ranks only, or hangs.
* ``[non-tensor]`` a list or other non-tensor where a tensor is expected (``cu_seqlens``,
  ``seq_lens``, masks, ``labels``, ``position_ids``, ``loss_mask``, the context's tensors):
  NeMo raises ``AttributeError`` or ignores it.
* ``[seq-lens]`` ``packed_boundaries_from_seq_lens`` / the sharder's ``seq_lens``: float or bool
  values (NeMo truncates floats, counts True as 1), more than one row or a 0-d tensor (NeMo
  flattens rows into one row), a sentinel before a real length (NeMo drops it), a non-negative
  ``sentinel``. Zero and negative lengths are ``ValueError`` in both.
* ``[cu-seqlens]`` float or bool ``cu_seqlens`` (NeMo truncates) or several rows (NeMo flattens
  them).
* ``[context-ints]`` a context ``rank`` / ``size`` / ``local_sequence_start`` /
  ``local_sequence_length`` that is not an int (float, bool).
* ``[context-group]`` ``group=None`` with ``size > 1``, or a group whose size or this process's rank
  differ from ``size`` / ``rank`` (NeMo fails later in a collective, or gathers over the group).
* ``[context-mask]`` a ``global_padding_mask`` whose padding is not a right tail, or, with
  ``global_cu_seqlens``, is not exactly the positions from ``global_cu_seqlens[-1]`` on.
* ``[context-cu]`` a float or bool ``global_cu_seqlens`` (NeMo keeps it uncast).
* ``[shapes]`` ``labels``, ``position_ids`` or ``loss_mask`` whose shape does not match
  ``input_ids`` (``[batch, sequence]``; position ids also ``[1, sequence]`` or
  ``[k, batch, sequence]``); NeMo pads and slices whatever its dim 1 holds.
* ``[ints]`` a non-int ``pad_multiple``, ``padding_token_id`` or ``history``.
* ``[pad-right]`` ``_pad_right`` of a tensor that is not rank two (NeMo raises ``RuntimeError``).
* ``[mesh]`` a ``cp_mesh`` that is not a ``ProcessGroup`` or 1-D ``DeviceMesh`` (NeMo takes any
  object with ``size()`` / ``get_group()`` / ``get_local_rank()``).
* ``[gather-shape]`` an all-gather whose sequence axis is neither the local length nor a whole
  fraction of it.
* ``[stream-dtype]`` float or bool ``labels`` in the batch, float or bool ``position_ids`` (NeMo
  pads and slices them; ``fcp.shard_batch`` and the GLM sharder reject them too). A loss mask
  serving as labels (no ``labels`` key) keeps its dtype, as in NeMo.
* ``[meta]`` a meta tensor (no values) as ``input_ids``, ``labels``, ``position_ids``,
  ``loss_mask``, a mask, ``seq_lens`` or ``cu_seqlens``: ``ValueError`` naming it (NeMo fails
  inside, e.g. ``Tensor.item() cannot be called on meta tensors``).

Relaxed on purpose: ``cp_mesh=None`` (or a one-rank group) means no CP, where NeMo needs a mesh
object even at size one; a 1-D ``loss_mask`` is taken as ``[1, sequence]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, MutableMapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fcp.checks import check_instance, check_int, check_tensor
from fcp.comm import all_gather_sequence, left_halo
from fcp.context import PackedContext
from fcp.groups import mesh_size, resolve_group
from fcp.layout import PAD_DOC_ID, SEQ_LENS_SENTINEL, lengths_from_doc_ids
from fcp.layout import packed_boundaries_from_seq_lens as core_packed_boundaries
from fcp.layout import validate_right_tail_mask
from fcp.models.compat import (
    MissingBatchKeyError,
    UnsupportedBatchError,
    shard_layout,
    shard_layout_class,
)
from fcp.pytree import has_data, register_frozen_pytree
from fcp.shard import BatchAgreement, check_stream, pad_sequence_dim, shard_batch

__all__ = [
    "Qwen3_8_FlashNextCPContext",
    "packed_boundaries_from_seq_lens",
    "qwen3_8_flash_next_cp_all_gather",
    "qwen3_8_flash_next_cp_left_halo",
    "shard_batch_for_qwen3_8_flash_next_cp",
]

#: Batch key of the per-forward context, read by NeMo's Qwen model code.
_CONTEXT_KEY = "_qwen3_8_flash_next_cp_context"
#: Packing keys other than document boundaries: a layout this CP path does not support.
_UNSUPPORTED_PACKED_KEYS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_padded",
                            "packed_seq_ids", "_packed_seq_ids", "indices", "max_seqlen",
                            "max_seqlen_q", "max_seqlen_kv")  # fmt: skip


def __getattr__(name: str):
    if name == "ShardLayout":  # NeMo's module exposes it; resolved lazily (NeMo is optional)
        return shard_layout_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------------
def _is_binary(t: torch.Tensor) -> bool:
    return t.dtype == torch.bool or bool(((t == 0) | (t == 1)).all())


def _boundaries(cu: Any, name: str) -> torch.Tensor:
    """``cu`` as int64 ``[n]`` boundaries: a 1-D (or one-row) integer tensor, else an error."""
    cu = check_tensor(cu, name, kind="int", values=True)
    if cu.dim() == 2 and cu.shape[0] == 1:
        cu = cu[0]
    if cu.dim() != 1:
        raise ValueError(f"{name} must be a rank-1 boundary tensor, got shape {tuple(cu.shape)}")
    return cu.to(torch.int64)


def _bad_boundaries(cu: torch.Tensor) -> bool:
    """Not ``0 = b[0] < b[1] < ...`` (host sync)."""
    return cu.numel() < 2 or int(cu[0]) != 0 or bool((cu.diff() <= 0).any())


def _doc_ids(padding_mask: torch.Tensor, cu: torch.Tensor | None) -> torch.Tensor:
    """fcp's int64 ``[batch, global]`` map of a context, without host synchronisation.

    With boundaries: segment ``j`` is document ``j + 1`` and positions from ``cu[-1]`` on are pad;
    without: one document per row over its non-pad tokens.
    """
    if cu is None:
        return (~padding_mask).to(torch.int64)
    pos = torch.arange(padding_mask.shape[1], device=padding_mask.device)
    cu = cu.to(device=padding_mask.device, dtype=torch.int64)
    ids = torch.bucketize(pos, cu[1:], right=True) + 1
    return torch.where(pos < cu[-1], ids, PAD_DOC_ID).unsqueeze(0)


# ---------------------------------------------------------------------------------------------
# context
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Qwen3_8_FlashNextCPContext:
    """Per-forward metadata for Qwen3.8-Flash-Next's contiguous CP sequence shard.

    Attributes:
        group: process group whose rank-ordered shards form one sequence (1-D mesh accepted),
            ``None`` for the size-one identity path.
        rank: this process's rank within ``group``.
        size: number of contiguous sequence shards.
        global_input_ids: padded raw ids ``[batch, global_sequence]`` (int32 / int64),
            replicated; used for PLE hashing.
        global_padding_mask: replicated bool ``[batch, global_sequence]``, True = padding (a right
            tail).
        local_sequence_start: global position of local position zero (``rank * length``).
        local_sequence_length: physical positions per rank, CP padding included.
        global_cu_seqlens: optional packed-document boundaries ``[num_docs + 1]`` of a one-row
            batch, from 0, strictly increasing, ending at or before the global length; the tail
            after the last boundary is CP padding in no document.

    ``packed_context`` is fcp's :class:`~fcp.context.PackedContext` of the same shard.
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    global_input_ids: torch.Tensor
    global_padding_mask: torch.Tensor
    local_sequence_start: int
    local_sequence_length: int
    global_cu_seqlens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        """Validate the replicated metadata and contiguous rank mapping.

        ``ValueError`` / ``TypeError`` naming the field and value (NeMo's checks, plus those
        listed in the module docstring). Value checks run only on tensors with data.
        """
        size, rank = check_int(self.size, "size"), check_int(self.rank, "rank")
        if size <= 0 or rank < 0 or rank >= size:
            raise ValueError(f"Invalid Qwen3.8-Flash-Next CP rank/size: rank={rank}, size={size}")
        ids = check_tensor(self.global_input_ids, "global_input_ids")
        if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                "global_input_ids must be int32/int64 [batch, global_sequence]; got "
                f"shape={tuple(ids.shape)}, dtype={ids.dtype}"
            )
        mask = check_tensor(self.global_padding_mask, "global_padding_mask")
        if mask.shape != ids.shape:
            raise ValueError(
                f"global_padding_mask has shape {tuple(mask.shape)}, global_input_ids "
                f"{tuple(ids.shape)}: the axes must agree"
            )
        if mask.dtype != torch.bool:
            raise ValueError(f"global_padding_mask must be bool (True = pad), got {mask.dtype}")
        if mask.device != ids.device:
            raise ValueError(
                f"global_padding_mask is on {mask.device}, global_input_ids on {ids.device}"
            )
        length = check_int(self.local_sequence_length, "local_sequence_length", 1)
        if ids.shape[1] != length * size:
            raise ValueError(
                f"global sequence {ids.shape[1]} != local_sequence_length={length} * size={size}"
            )
        start = check_int(self.local_sequence_start, "local_sequence_start")
        if start != rank * length:
            raise ValueError(
                f"local_sequence_start={start} must be rank * local_sequence_length = "
                f"{rank * length} (contiguous rank order)"
            )
        if self.group is None:
            if size > 1:
                raise ValueError(f"group is None but size={size}; CP needs a process group")
            info = resolve_group(None)
        else:
            info = resolve_group(self.group, fn="Qwen3_8_FlashNextCPContext")
            if info.size != size or info.rank != rank:
                raise ValueError(
                    f"group has {info.size} rank(s) and this process is its rank {info.rank}, "
                    f"but size={size}, rank={rank}"
                )
        cu = self.global_cu_seqlens
        if cu is not None:
            cu = check_tensor(cu, "global_cu_seqlens")
            if cu.dim() != 1 or cu.numel() < 2:
                raise ValueError(
                    "global_cu_seqlens must be a rank-1 boundary tensor with at least two "
                    f"entries, got shape {tuple(cu.shape)}"
                )
            check_tensor(cu, "global_cu_seqlens", kind="int")
            if ids.shape[0] != 1:
                raise ValueError(
                    f"global_cu_seqlens describes one packed row, but the batch has {ids.shape[0]}"
                )
        if has_data(mask) and (cu is None or has_data(cu)):
            self._check_values(mask, cu)
        packed = PackedContext(
            doc_ids=_doc_ids(mask, cu),
            group=info.group,
            cp_size=info.size,
            cp_rank=info.rank,
            seq_start=start,
            local_seq_len=length,
        )
        object.__setattr__(self, "_packed", packed)  # not a field: replace() rebuilds it

    @classmethod
    def _of_core(
        cls, core: PackedContext, global_input_ids: torch.Tensor, global_cu_seqlens: Any
    ) -> "Qwen3_8_FlashNextCPContext":
        """The sharder's context of its core ``core``, whose ``packed_context`` is ``core``.

        Every field but the padded ids and the boundaries is the core's own, and those two were
        validated by the sharder, so nothing is checked or derived again (``__init__`` would
        validate the values a second time and build a second core).
        """
        out = object.__new__(cls)
        fields = dict(group=core.group, rank=core.cp_rank, size=core.cp_size,
                      global_input_ids=global_input_ids,
                      global_padding_mask=core.doc_ids == PAD_DOC_ID,
                      local_sequence_start=core.seq_start, local_sequence_length=core.local_seq_len,
                      global_cu_seqlens=global_cu_seqlens, _packed=core)  # fmt: skip
        for name, value in fields.items():
            object.__setattr__(out, name, value)
        return out

    def _check_values(self, mask: torch.Tensor, cu: torch.Tensor | None) -> None:
        total = mask.shape[1]
        if cu is not None:
            b = cu.to(torch.int64)
            if _bad_boundaries(b) or int(b[-1]) > total:
                raise ValueError(
                    f"global_cu_seqlens = {b.tolist()} must start at 0, be strictly increasing "
                    f"and end at or before the padded global length {total}"
                )
            pad = torch.arange(total, device=mask.device) >= int(b[-1])
            if not torch.equal(mask, pad.expand_as(mask).to(mask.device)):
                raise ValueError(
                    f"global_padding_mask must be True exactly from global_cu_seqlens[-1] = "
                    f"{int(b[-1])} on (the CP padding), got {mask.int().tolist()}"
                )
        else:
            validate_right_tail_mask(~mask, name="~global_padding_mask")

    @property
    def packed_context(self) -> PackedContext:
        """fcp's :class:`~fcp.context.PackedContext` of this shard, for fcp's operators."""
        return self._packed

    @property
    def global_sequence_length(self) -> int:
        """Return the padded global physical sequence length."""
        return self.global_input_ids.shape[1]

    @property
    def local_sequence_end(self) -> int:
        """Return the exclusive global end of this rank's sequence shard."""
        return self.local_sequence_start + self.local_sequence_length

    @property
    def global_sequence_lengths(self) -> torch.Tensor:
        """Return logical right-padded lengths as int64 ``[batch]`` (compile-safe)."""
        return lengths_from_doc_ids(self.packed_context.doc_ids)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_packed"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)
        self.__post_init__()


register_frozen_pytree(
    Qwen3_8_FlashNextCPContext,
    leaves=("global_input_ids", "global_padding_mask", "global_cu_seqlens"),
    name="fcp.models.qwen3_8_flash_next.Qwen3_8_FlashNextCPContext",
)


# ---------------------------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------------------------
def qwen3_8_flash_next_cp_all_gather(
    tensor: torch.Tensor,
    context: Qwen3_8_FlashNextCPContext,
    *,
    sequence_dim: int = 1,
    differentiable: bool = True,
) -> torch.Tensor:
    """Gather equal contiguous sequence shards in global rank order.

    :func:`fcp.comm.all_gather_sequence` on ``context.packed_context`` (funcol, compile-safe).

    Args:
        tensor: local tensor whose ``sequence_dim`` axis has length
            ``context.local_sequence_length`` (or a fixed compressed fraction of it shared by
            every rank; anything else raises ``ValueError``). All non-sequence axes are
            replicated in shape across the CP group.
        context: Qwen3.8-Flash-Next contiguous CP metadata.
        sequence_dim: axis on which rank-ordered parts are concatenated (negative allowed).
        differentiable: ``True``: gradients go back to the owning ranks (each gets the sum over
            ranks of its slice's gradient). ``False`` (frozen routing values, integer metadata):
            the result has no gradient.

    Returns:
        Tensor with the same axis order as ``tensor`` and a ``sequence_dim`` length multiplied
        by ``context.size`` (``tensor`` itself when ``size`` is one).
    """
    return all_gather_sequence(
        tensor, context.packed_context, dim=sequence_dim, differentiable=differentiable
    )


def qwen3_8_flash_next_cp_left_halo(
    tensor: torch.Tensor, context: Qwen3_8_FlashNextCPContext, *, history: int
) -> torch.Tensor:
    """Collect only the preceding causal boundary needed by a local operator.

    :func:`fcp.comm.left_halo`: one all-to-all with static splits in which a rank sends at most
    ``history`` trailing tokens to each later rank that needs them; gradients of a later rank's
    halo flow back to the owner. Rank zero and globally short prefixes are zero padded on the
    left; ``history`` may exceed the local length.

    Args:
        tensor: local sequence tensor ``[batch, local_sequence, channels]``.
        context: Qwen3.8-Flash-Next contiguous CP metadata.
        history: number of immediately preceding global tokens required (``>= 0``).

    Returns:
        Left context ``[batch, history, channels]``; never a token of this rank (``tensor[:, :0]``
        for ``history == 0``; zeros without CP).
    """
    if tensor.dim() != 3 or tensor.shape[1] != context.local_sequence_length:
        raise ValueError(
            "CP halo input must be [batch, local_sequence, channels]; got "
            f"{tuple(tensor.shape)} for local_sequence={context.local_sequence_length}"
        )
    history = check_int(history, "history", 0)
    if history == 0:
        return tensor[:, :0]
    return left_halo(tensor, context.packed_context, history)


# ---------------------------------------------------------------------------------------------
# batch helpers and the sharder
# ---------------------------------------------------------------------------------------------
def packed_boundaries_from_seq_lens(
    seq_lens: torch.Tensor,
    *,
    total_tokens: int | None = None,
    sentinel: int = SEQ_LENS_SENTINEL,
) -> torch.Tensor:
    """Convert loader ``seq_lens`` metadata to physical document boundaries.

    The THD packer concatenates documents contiguously and pads only the pack tail, so physical
    boundaries follow the real lengths; when ``total_tokens`` exceeds the packed length, the
    trailing pack padding becomes its own segment
    (:func:`fcp.layout.packed_boundaries_from_seq_lens`).

    Args:
        seq_lens: real per-document lengths ``[num_docs]`` or ``[1, num_docs]``, positive;
            trailing ``sentinel`` slots are unused.
        total_tokens: physical row length including trailing pack padding.
        sentinel: filler value marking unused length slots.

    Returns:
        int64 boundaries ``[num_docs (+1 pad segment) + 1]`` starting at zero.
    """
    bounds = core_packed_boundaries(seq_lens, total_tokens, sentinel)
    widths = seq_lens.reshape(-1)
    widths = widths[widths != sentinel]
    if widths.numel() == 0 or bool((widths <= 0).any()):
        raise ValueError(
            f"packed seq_lens must contain positive document widths, got {widths.tolist()}"
        )
    return bounds


def _pad_right(tensor: torch.Tensor, length: int, value: int | bool) -> torch.Tensor:
    """Right-pad a rank-two token tensor to ``length``.

    Args:
        tensor: tensor of shape ``[batch, sequence]``.
        length: requested output sequence length, no shorter than ``sequence``.
        value: scalar fill value for appended positions.

    Returns:
        Tensor of shape ``[batch, length]`` (:func:`fcp.shard.pad_sequence_dim`); ``tensor``
        itself when no padding is required.
    """
    tensor = check_tensor(tensor, "tensor")
    if tensor.dim() != 2:
        raise ValueError(f"_pad_right pads a [batch, sequence] tensor, got {tuple(tensor.shape)}")
    length = check_int(length, "length")
    if length < tensor.shape[1]:
        raise ValueError(f"Cannot pad sequence length {tensor.shape[1]} down to {length}")
    return pad_sequence_dim(tensor, length - tensor.shape[1], value)


def _validate_right_tail_mask(mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Validate and normalize a full-sequence token-validity mask.

    Args:
        mask: binary validity tensor ``[batch, global_sequence]`` (True / 1 = real token).
        input_ids: raw ids ``[batch, global_sequence]`` whose axes establish the expected mask
            shape and device.

    Returns:
        Boolean validity tensor ``[batch, global_sequence]`` on ``input_ids``' device.

    Raises:
        UnsupportedBatchError (a ``NotImplementedError``): another shape, or padding that is not
            a right tail (:func:`fcp.layout.validate_right_tail_mask`).
        ValueError: values other than 0 / 1.
    """
    return _right_tail_valid(mask, input_ids, "mask")


def _right_tail_valid(mask: Any, input_ids: torch.Tensor, name: str) -> torch.Tensor:
    """:func:`_validate_right_tail_mask`, its errors naming the batch key ``name``."""
    mask = check_tensor(mask, name, values=True)
    if mask.dim() != 2 or mask.shape != input_ids.shape:
        raise UnsupportedBatchError(
            "Qwen3.8-Flash-Next CP requires a non-packed [batch, sequence] attention/padding "
            f"mask; got {name}={tuple(mask.shape)}, input_ids={tuple(input_ids.shape)}"
        )
    mask = mask.to(device=input_ids.device)
    if not _is_binary(mask):
        raise ValueError("Qwen3.8-Flash-Next CP masks must contain only binary 0/1 values")
    try:
        return validate_right_tail_mask(mask, like=input_ids, name=name)
    except ValueError as err:  # binary and shaped: only the right-tail check can fail
        raise UnsupportedBatchError(
            f"Qwen3.8-Flash-Next CP supports only right-tail padding ({err}); left padding, "
            "interior padding and packing are unsupported"
        ) from None


def _valid_tokens(batch: MutableMapping[str, Any], ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[batch, sequence]`` real tokens from ``attention_mask`` / ``padding_mask``."""
    attention, padding = batch.get("attention_mask"), batch.get("padding_mask")

    def padding_valid() -> torch.Tensor:  # padding_mask: 1 = pad
        pad = check_tensor(padding, "padding_mask", values=True)
        if not _is_binary(pad):
            raise ValueError(
                "Qwen3.8-Flash-Next CP padding_mask must contain only binary 0/1 values"
            )
        return _right_tail_valid(pad.logical_not(), ids, "~padding_mask")

    if attention is not None:
        valid = _right_tail_valid(attention, ids, "attention_mask")
        if padding is not None and not torch.equal(valid, padding_valid()):
            raise ValueError("Qwen3.8-Flash-Next CP attention_mask and padding_mask disagree")
        return valid
    if padding is not None:
        return padding_valid()
    return torch.ones_like(ids, dtype=torch.bool)


def _positions(batch: MutableMapping[str, Any], ids: torch.Tensor) -> torch.Tensor:
    """NeMo's position ids ``[batch, sequence]`` / ``[k, batch, sequence]`` (default: arange)."""
    rows, seq_len = ids.shape
    if "position_ids" not in batch:
        return torch.arange(seq_len, device=ids.device).unsqueeze(0).expand(rows, -1).contiguous()
    pos = check_stream("position_ids", batch["position_ids"])
    if pos.dim() == 2 and pos.shape[1] == seq_len and pos.shape[0] in (1, rows):
        return pos.expand(rows, -1).contiguous() if pos.shape[0] != rows else pos
    if pos.dim() == 3 and tuple(pos.shape[1:]) == (rows, seq_len):
        return pos
    raise ValueError(
        f"position_ids has shape {tuple(pos.shape)}, expected [batch={rows}, sequence="
        f"{seq_len}], [1, sequence] or [k, batch, sequence]"
    )


def _continue_positions(pos: torch.Tensor, dim: int, pad: int) -> torch.Tensor:
    """``pos`` extended by ``pad`` positions along ``dim``: last + 1, last + 2, ..."""
    if pad == 0:
        return pos
    shape = [1] * pos.dim()
    shape[dim] = pad
    steps = torch.arange(1, pad + 1, device=pos.device, dtype=pos.dtype).view(shape)
    return torch.cat([pos, pos.narrow(dim, pos.shape[dim] - 1, 1) + steps], dim)


def shard_batch_for_qwen3_8_flash_next_cp(
    cp_mesh: DeviceMesh,
    tp_mesh: DeviceMesh | None,
    batch: dict[str, Any],
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    pad_multiple: int = 4,
) -> tuple[Callable[[], AbstractContextManager[Any]], dict[str, Any], Any]:
    """Validate, pad, and contiguously shard a Qwen3.8-Flash-Next text batch.

    Args:
        cp_mesh: one-dimensional CP device mesh (or ``ProcessGroup``; ``None``: no CP). Rank
            ``r`` owns the global interval ``[r * local_sequence, (r + 1) * local_sequence)``.
        tp_mesh: optional TP device mesh; must be absent or of size one.
        batch: **mutable** full-sequence batch. ``input_ids`` (int32 / int64), ``labels`` and
            optional binary right-tail ``attention_mask`` (1 = token) / ``padding_mask`` (1 =
            pad) ``[batch, global_sequence]``; ``position_ids`` ``[batch | 1, global_sequence]``
            or ``[k, batch, global_sequence]``. A packed THD row has batch one plus
            ``cu_seqlens`` (ending at the row length) or loader ``seq_lens``, and no masks.
        loss_mask: optional ``[batch, global_sequence]`` loss mask; the labels when the batch
            has none.
        padding_token_id: raw token id appended for CP divisibility.
        pad_multiple: required multiple (> 1) of every rank's local sequence length (QSA's
            compression ratio, four for the released model).

    Returns:
        ``(contextlib.nullcontext, batch, ShardLayout(original_seq_len, padded_seq_len))``;
        ``batch`` holds this rank's token tensors and the replicated
        :class:`Qwen3_8_FlashNextCPContext` under ``"_qwen3_8_flash_next_cp_context"``.
    """
    # every CP rank joins one exchange, so ranks holding different batches all raise
    with BatchAgreement(cp_mesh, "shard_batch_for_qwen3_8_flash_next_cp") as agreement:
        check_instance(batch, MutableMapping, "batch", fn="shard_batch_for_qwen3_8_flash_next_cp")
        if mesh_size(tp_mesh, name="tp_mesh", fn="shard_batch_for_qwen3_8_flash_next_cp") > 1:
            raise UnsupportedBatchError(
                "Qwen3.8-Flash-Next context parallelism cannot be composed with tensor parallelism"
            )
        cu = batch.get("cu_seqlens")
        if cu is None and batch.get("seq_lens") is not None:
            if "input_ids" not in batch:
                raise MissingBatchKeyError("input_ids")
            total = check_tensor(batch["input_ids"], "input_ids", values=True).shape[-1]
            seq_lens = check_tensor(batch["seq_lens"], "seq_lens", values=True)
            cu = packed_boundaries_from_seq_lens(seq_lens,
                                                 total_tokens=total)  # fmt: skip
        unsupported = [k for k in _UNSUPPORTED_PACKED_KEYS if batch.get(k) is not None]
        if unsupported or (batch.get("qkv_format") == "thd" and cu is None):
            raise UnsupportedBatchError(
                "Qwen3.8-Flash-Next packed context parallelism supports only cu_seqlens document "
                f"boundaries; got unsupported keys {unsupported}"
            )
        if "input_ids" not in batch or "inputs_embeds" in batch:
            raise UnsupportedBatchError(
                "Qwen3.8-Flash-Next context parallelism requires raw input_ids as the sole primary "
                "stream for PLE hashing"
            )
        ids = check_tensor(batch["input_ids"], "input_ids", values=True)
        if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                "Qwen3.8-Flash-Next CP input_ids must be an int32/int64 [batch, sequence] tensor; "
                f"got shape={tuple(ids.shape)}, dtype={ids.dtype}"
            )
        rows, seq_len = ids.shape
        if seq_len == 0:
            raise ValueError("Qwen3.8-Flash-Next context parallelism requires a non-empty sequence")
        check_int(pad_multiple, "pad_multiple", 2, fn="shard_batch_for_qwen3_8_flash_next_cp")
        if cu is not None:
            if rows != 1:
                raise ValueError(
                    "Qwen3.8-Flash-Next packed CP requires a THD batch of one row, got "
                    f"batch={rows}"
                )
            cu = _boundaries(cu, "cu_seqlens")
            if _bad_boundaries(cu) or int(cu[-1]) != seq_len:
                raise ValueError(
                    f"cu_seqlens = {cu.tolist()} must start at 0, be strictly increasing and end "
                    f"at the packed token count {seq_len}"
                )
            if batch.get("attention_mask") is not None or batch.get("padding_mask") is not None:
                raise ValueError(
                    "Qwen3.8-Flash-Next packed CP takes document boundaries from cu_seqlens; "
                    "masks are unsupported"
                )
            cu = cu.to(ids.device)
        valid = _valid_tokens(batch, ids)
        labels = batch.get("labels")
        if labels is None and loss_mask is None:
            raise MissingBatchKeyError(
                "Context parallelism requires `labels` in the batch, or labels passed as "
                "`loss_mask`."
            )
        if labels is not None:
            labels = check_stream("labels", labels)
        else:  # NeMo's protocol: the loss mask serves as labels (padded with -100)
            labels, loss_mask = check_tensor(loss_mask, "loss_mask", values=True), None
        if tuple(labels.shape) != (rows, seq_len):
            raise ValueError(f"labels has shape {tuple(labels.shape)}, expected {(rows, seq_len)}")
        positions = _positions(batch, ids)

        core_batch = {"input_ids": ids}
        core_batch.update({"cu_seqlens": cu} if cu is not None else {"attention_mask": valid})
        local, core = shard_batch(
            cp_mesh,
            core_batch,
            loss_mask=loss_mask,
            padding_token_id=padding_token_id,
            pad_multiple=pad_multiple,
            ignore_padding=False,  # NeMo's contract: the loss mask stays as given
            check_agreement=False,  # checked here, after the validation above
        )
        agreement.check(core.doc_ids, seq_len)
    pad = core.global_seq_len - seq_len
    pos_dim = positions.dim() - 1
    global_ids = pad_sequence_dim(ids, pad, padding_token_id)
    context = Qwen3_8_FlashNextCPContext._of_core(core, global_ids, cu)

    # Everything is validated: mutate the batch, in NeMo's order (so its keys keep NeMo's order).
    for key in ("cu_seqlens", "seq_lens", "seq_lens_padded", "qkv_format"):
        batch.pop(key, None)
    batch["padding_mask"] = (~core.local_valid).contiguous()
    batch.pop("attention_mask", None)
    batch["position_ids"] = core.shard(_continue_positions(positions, pos_dim, pad), pos_dim)
    batch["position_ids"] = batch["position_ids"].contiguous()
    batch["input_ids"] = local["input_ids"].contiguous()
    batch["labels"] = core.shard(pad_sequence_dim(labels, pad, -100)).contiguous()
    if loss_mask is not None:
        batch["loss_mask"] = local["loss_mask"].contiguous()
    batch[_CONTEXT_KEY] = context
    return contextlib.nullcontext, batch, shard_layout(seq_len, core.global_seq_len)
