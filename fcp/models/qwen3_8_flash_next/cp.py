"""Contiguous context parallelism for the language-only Qwen3.8-Flash-Next model: seed adapter.

This is the API of ``nemo_automodel.components.models.qwen3_8_flash_next.cp`` on top of fcp's
generic core; every name is a thin adapter:

========================================== ====================================================
seed name                                  delegates to
========================================== ====================================================
``Qwen3_8_FlashNextCPContext``             :class:`fcp.context.PackedContext`
                                           (``.packed_context``; doc ids from
                                           :func:`fcp.shard.global_doc_ids_from_batch`)
``packed_boundaries_from_seq_lens``        :func:`fcp.layout.packed_boundaries_from_seq_lens`
``qwen3_8_flash_next_cp_all_gather``       :func:`fcp.comm.all_gather_sequence`
``qwen3_8_flash_next_cp_left_halo``        :func:`fcp.comm.left_halo`
``shard_batch_for_qwen3_8_flash_next_cp``  :func:`fcp.shard.shard_batch`
``_pad_right``                             :func:`fcp.shard.pad_sequence_dim`
``_validate_right_tail_mask``              :func:`fcp.layout.validate_right_tail_mask`
========================================== ====================================================

Differences from the seed, all deliberate:

* fcp never mutates a batch: the sharder returns a **new** local batch. The per-forward
  :class:`Qwen3_8_FlashNextCPContext` is in it under ``"cp_context"`` (so ``model(**local)``
  receives it); the third return value, the seed's ``ShardLayout``, is fcp's
  :class:`~fcp.context.PackedContext` (interval, sizes, document map, ``original_seq_len``).
* The context is a frozen dataclass registered as a pytree (tensor fields are leaves, group and
  sizes static), so it can be passed into a compiled model. Its ``global_padding_mask`` is
  stored normalised to bool.
* Collectives are funcol-based (``torch.distributed._functional_collectives``), trace under
  ``torch.compile(fullgraph=True)`` and never synchronise with the host.

Document map of a context: with ``global_cu_seqlens`` (one packed row, segment boundaries
covering the whole padded row) the documents are the segments ending at or before the row's
logical length ``global_padding_mask.sum()``; the tail after it (pack and CP padding) is pad,
doc id 0. Without it each row is one document over its valid tokens.
"""

from __future__ import annotations

import contextlib

import operator
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh

from fcp.comm import all_gather_sequence, left_halo
from fcp.context import PackedContext
from fcp.groups import mesh_size, resolve_group
from fcp.layout import (
    PAD_DOC_ID,
    lengths_from_doc_ids,
    packed_boundaries_from_seq_lens,
    validate_right_tail_mask,
)
from fcp.shard import (
    global_doc_ids_from_batch,
    normalize_batch_axis,
    pad_sequence_dim,
    shard_batch,
)

__all__ = [
    "Qwen3_8_FlashNextCPContext",
    "packed_boundaries_from_seq_lens",
    "qwen3_8_flash_next_cp_all_gather",
    "qwen3_8_flash_next_cp_left_halo",
    "shard_batch_for_qwen3_8_flash_next_cp",
]

#: Key of the per-forward :class:`Qwen3_8_FlashNextCPContext` in the sharded local batch.
_CP_CONTEXT_KEY = "cp_context"
#: Batch keys that describe several documents per row (packed THD rows: batch size one).
_PACKED_KEYS = ("cu_seqlens", "seq_lens", "doc_ids")


def _int_field(value: Any, name: str, minimum: int) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} = {value!r} must be an int") from None
    if value < minimum:
        raise ValueError(f"{name} = {value} must be >= {minimum}")
    return value


@dataclass(frozen=True, eq=False)
class Qwen3_8_FlashNextCPContext:
    """Per-forward metadata for Qwen3.8-Flash-Next's contiguous CP sequence shard.

    Attributes:
        group: CP process group (``None`` without CP; a 1-D ``DeviceMesh`` is accepted too).
        rank: this rank's index in ``group``.
        size: number of CP ranks.
        global_input_ids: replicated raw ids ``[batch, global_sequence]`` (CP-padded).
        global_padding_mask: replicated right-tail validity mask ``[batch, global_sequence]``.
        local_sequence_start: ``rank * local_sequence_length``.
        local_sequence_length: tokens per rank; ``size * local_sequence_length`` is the global
            length.
        global_cu_seqlens: optional int ``[segments + 1]`` physical boundaries of one packed row
            (batch one) from 0 to the global length, e.g. from
            :func:`packed_boundaries_from_seq_lens` with ``total_tokens`` = the global length.

    ``packed_context`` is the generic :class:`~fcp.context.PackedContext` every fcp operator
    takes (same group, rank and interval; document map as in the module docstring).

    Construction validates on the host (it synchronises with the device): build it eagerly,
    once per batch (the sharder does), and pass it into the compiled model.
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    global_input_ids: torch.Tensor
    global_padding_mask: torch.Tensor
    local_sequence_start: int
    local_sequence_length: int
    global_cu_seqlens: torch.Tensor | None = None
    _packed: PackedContext = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Validate the replicated metadata and contiguous rank mapping.

        Raises ``ValueError`` naming the field: ``size`` < 1, ``rank`` outside ``[0, size)``,
        ``group`` of another size / rank (or missing when ``size > 1``), ``global_input_ids``
        not an integer ``[batch, sequence]`` tensor, ``global_padding_mask`` of another shape,
        non-binary or not a right tail, ``size * local_sequence_length`` != the global length,
        ``local_sequence_start`` != ``rank * local_sequence_length``, ``global_cu_seqlens`` not
        valid boundaries, not for one row, not covering the global length, or splitting a
        segment at the mask's logical length.
        """
        size = _int_field(self.size, "size", 1)
        rank = _int_field(self.rank, "rank", 0)
        if rank >= size:
            raise ValueError(f"rank = {rank} is outside [0, size={size})")
        if self.group is None:
            if size > 1:
                raise ValueError(f"group is None but size = {size}; CP needs a process group")
            info = resolve_group(None)
        else:
            info = resolve_group(self.group)
            if info.size != size or info.rank != rank:
                raise ValueError(
                    f"group has size {info.size} and this process is its rank {info.rank}, but "
                    f"size = {size}, rank = {rank}"
                )
        ids = self.global_input_ids
        if (
            not isinstance(ids, torch.Tensor)
            or ids.dim() != 2
            or ids.is_floating_point()
            or ids.is_complex()
        ):
            raise ValueError(
                "global_input_ids must be an integer [batch, global_sequence] tensor, got "
                + (f"shape {tuple(ids.shape)} dtype {ids.dtype}" if isinstance(ids, torch.Tensor)
                   else type(ids).__name__)
            )
        mask = validate_right_tail_mask(
            self.global_padding_mask, like=ids, name="global_padding_mask"
        ).to(ids.device)
        length = _int_field(self.local_sequence_length, "local_sequence_length", 1)
        if size * length != ids.shape[1]:
            raise ValueError(
                f"size = {size} * local_sequence_length = {length} != global sequence length "
                f"{ids.shape[1]} (global_input_ids.shape[1])"
            )
        start = _int_field(self.local_sequence_start, "local_sequence_start", 0)
        if start != rank * length:
            raise ValueError(
                f"local_sequence_start = {start} != rank * local_sequence_length = "
                f"{rank * length} (shards are contiguous, in rank order)"
            )
        doc_batch = {"input_ids": ids, "padding_mask": mask}
        cu = self.global_cu_seqlens
        if cu is not None:
            doc_batch["cu_seqlens"] = self._document_boundaries(cu, mask)
        try:  # cu_seqlens: validates start at 0, monotonicity; mask and boundaries agree
            doc_ids = global_doc_ids_from_batch(doc_batch, ids.shape[1])
        except ValueError as err:
            raise ValueError(f"global_cu_seqlens: {err}") from None
        object.__setattr__(self, "global_padding_mask", mask)
        packed = PackedContext(
            doc_ids=doc_ids,
            group=info.group,
            cp_size=info.size,
            cp_rank=info.rank,
            seq_start=start,
            local_seq_len=length,
        )
        object.__setattr__(self, "_packed", packed)

    def _document_boundaries(self, cu: Any, mask: torch.Tensor) -> torch.Tensor:
        """Validated ``global_cu_seqlens`` cut at the logical length: the documents' boundaries."""
        total = self.global_input_ids.shape[1]
        if not isinstance(cu, torch.Tensor) or cu.is_floating_point() or cu.dtype == torch.bool:
            raise ValueError("global_cu_seqlens must be an integer tensor or None")
        if mask.shape[0] != 1:
            raise ValueError(
                f"global_cu_seqlens describes one packed row, but the batch has {mask.shape[0]} "
                "rows"
            )
        flat = cu.reshape(-1).to(device=mask.device, dtype=torch.int64)
        if flat.numel() == 0 or int(flat[-1]) != total:
            last = int(flat[-1]) if flat.numel() else None
            raise ValueError(
                f"global_cu_seqlens must cover the global sequence: last boundary is {last}, "
                f"expected {total}"
            )
        logical = int(mask.sum())
        if not bool((flat == logical).any()):
            raise ValueError(
                f"global_padding_mask has {logical} valid tokens, which is not a boundary of "
                f"global_cu_seqlens {flat.tolist()}: padding would share a segment with a document"
            )
        docs = flat[flat <= logical]
        return docs

    @property
    def packed_context(self) -> PackedContext:
        """The generic :class:`~fcp.context.PackedContext` of this shard (for fcp operators)."""
        return self._packed

    @property
    def global_sequence_length(self) -> int:
        """Return the padded global physical sequence length."""
        return self.global_input_ids.shape[1]

    @property
    def global_sequence_lengths(self) -> torch.Tensor:
        """Return logical right-padded lengths as int64 [batch] (compile-safe)."""
        return lengths_from_doc_ids(self._packed.doc_ids)

    @property
    def local_sequence_end(self) -> int:
        """Return the exclusive global end of this rank's sequence shard."""
        return self.local_sequence_start + self.local_sequence_length


_QWEN_LEAVES = ("global_input_ids", "global_padding_mask", "global_cu_seqlens", "_packed")
_QWEN_STATIC = ("group", "rank", "size", "local_sequence_start", "local_sequence_length")


def _qwen_flatten(ctx: Qwen3_8_FlashNextCPContext):
    return [getattr(ctx, n) for n in _QWEN_LEAVES], tuple(getattr(ctx, n) for n in _QWEN_STATIC)


def _qwen_unflatten(children, static) -> Qwen3_8_FlashNextCPContext:
    ctx = object.__new__(Qwen3_8_FlashNextCPContext)
    # Bypass __post_init__ (leaves may be fake/traced); the fields were validated at creation.
    for name, value in (*zip(_QWEN_LEAVES, children), *zip(_QWEN_STATIC, static)):
        object.__setattr__(ctx, name, value)
    return ctx


pytree.register_pytree_node(
    Qwen3_8_FlashNextCPContext,
    _qwen_flatten,
    _qwen_unflatten,
    serialized_type_name="fcp.models.qwen3_8_flash_next.Qwen3_8_FlashNextCPContext",
    flatten_with_keys_fn=lambda c: (
        [(pytree.GetAttrKey(n), getattr(c, n)) for n in _QWEN_LEAVES],
        _qwen_flatten(c)[1],
    ),
)


# ---------------------------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------------------------
def qwen3_8_flash_next_cp_all_gather(
    tensor: torch.Tensor,
    context: Qwen3_8_FlashNextCPContext,
    sequence_dim: int = 1,
    differentiable: bool = True,
) -> torch.Tensor:
    """Gather equal contiguous sequence shards in global rank order.

    :func:`fcp.comm.all_gather_sequence` on ``context.packed_context``.

    Args:
        tensor: local tensor whose ``sequence_dim`` axis has length
            ``context.local_sequence_length`` (or a fixed compressed fraction of it shared by
            every rank; anything else raises ``ValueError``). All other axes are replicated in
            shape across the CP group.
        context: Qwen3.8-Flash-Next contiguous CP metadata.
        sequence_dim: axis on which rank-ordered parts are concatenated (negative allowed).
        differentiable: ``True``: gradients reduce-scatter back to the owning ranks. ``False``
            (frozen routing values, integer metadata): the input is detached.

    Returns:
        Tensor with the same axis order as ``tensor`` and a ``sequence_dim`` axis ``size``
        times longer (``tensor`` itself without CP).
    """
    return all_gather_sequence(
        tensor, context.packed_context, dim=sequence_dim, differentiable=differentiable
    )


def qwen3_8_flash_next_cp_left_halo(
    tensor: torch.Tensor, context: Qwen3_8_FlashNextCPContext, history: int
) -> torch.Tensor:
    """Collect only the preceding causal boundary needed by a local operator.

    :func:`fcp.comm.left_halo` on ``context.packed_context``: one all-to-all with static split
    sizes in which every rank sends at most ``history`` trailing tokens per receiver; gradients
    of a later rank's halo use flow back to the rank owning those tokens. Rank zero and globally
    short prefixes are zero padded on the left. ``history`` may exceed the local length (the
    halo then spans several earlier ranks).

    Args:
        tensor: local sequence tensor ``[batch, local_sequence, channels...]``.
        context: Qwen3.8-Flash-Next contiguous CP metadata.
        history: number of immediately preceding global tokens required (``>= 0``).

    Returns:
        Left context ``[batch, history, channels...]``. The result does not mask document
        boundaries: operators mask with the replicated document map.
    """
    return left_halo(tensor, context.packed_context, history)


# ---------------------------------------------------------------------------------------------
# batch helpers and the sharder
# ---------------------------------------------------------------------------------------------
def _pad_right(tensor: torch.Tensor, length: int, value: int | bool) -> torch.Tensor:
    """Right-pad a rank-two token tensor to ``length``.

    Args:
        tensor: tensor of shape ``[batch, sequence]``.
        length: requested output sequence length, no shorter than ``sequence``.
        value: scalar fill value for appended positions.

    Returns:
        Tensor of shape ``[batch, length]`` (:func:`fcp.shard.pad_sequence_dim`). The input is
        returned unchanged (the same object) when ``length == sequence``.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"_pad_right expects a rank-two [batch, sequence] tensor, got {shape}")
    length = _int_field(length, "length", 0)
    if length < tensor.shape[1]:
        raise ValueError(f"length = {length} is shorter than the sequence ({tensor.shape[1]})")
    return pad_sequence_dim(tensor, length - tensor.shape[1], value)


def _validate_right_tail_mask(mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Validate and normalize a full-sequence token-validity mask.

    Args:
        mask: binary validity tensor ``[batch, global_sequence]`` (bool, or int/float holding
            only 0 and 1), right-padded (``valid* pad*`` per row).
        input_ids: raw ids ``[batch, global_sequence]`` whose axes establish the expected mask
            shape and device.

    Returns:
        Boolean validity tensor ``[batch, global_sequence]`` on the device of ``input_ids``
        (:func:`fcp.layout.validate_right_tail_mask`; ``ValueError`` otherwise).
    """
    return validate_right_tail_mask(mask, like=input_ids, name="mask").to(input_ids.device)


def shard_batch_for_qwen3_8_flash_next_cp(
    cp_mesh: DeviceMesh,
    tp_mesh: DeviceMesh | None,
    batch: dict[str, Any],
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    pad_multiple: int = 4,
) -> tuple[Callable[[], AbstractContextManager[Any]], dict[str, Any], PackedContext]:
    """Validate, pad, and contiguously shard a Qwen3.8-Flash-Next text batch.

    :func:`fcp.shard.shard_batch`, plus the Qwen context built from its result.

    Args:
        cp_mesh: one-dimensional CP device mesh (or ``ProcessGroup``, or ``None``). Rank ``r``
            owns the contiguous global interval ``[r * local_sequence, (r + 1) *
            local_sequence)``.
        tp_mesh: optional TP device mesh; must be absent or of size one.
        batch: full-sequence batch, never mutated. ``input_ids`` (required), ``labels`` and
            optional ``attention_mask`` / ``padding_mask`` (binary right-tail) and
            ``position_ids`` have shape ``[batch, global_sequence]`` (``[sequence]`` THD rows
            are accepted). A packed THD row uses batch size one plus ``cu_seqlens`` or loader
            ``seq_lens`` document boundaries (``seq_lens_padded`` is ignored); packed (non
            right-tail / block) attention and padding masks are unsupported.
        loss_mask: optional ``[batch, global_sequence]`` loss mask, sharded into
            ``local["loss_mask"]``.
        padding_token_id: raw token id appended for CP divisibility.
        pad_multiple: required multiple of every rank's local sequence length (QSA's compression
            ratio, four for the released model).

    Returns:
        ``(context_factory, local_batch, layout)``: a null context factory; a **new** batch with
        this rank's token slices (packing metadata removed, ``position_ids`` added when absent)
        and the :class:`Qwen3_8_FlashNextCPContext` under ``"cp_context"``; and the shard layout,
        fcp's :class:`~fcp.context.PackedContext` (equal to
        ``local_batch["cp_context"].packed_context``).

    Raises:
        ValueError: every rank raises the same error for a bad batch (see ``shard_batch``), for
            a batch without ``input_ids`` and for packing metadata with more than one row.
    """
    if isinstance(batch, Mapping) and batch.get("input_ids") is None:
        raise ValueError("Qwen3.8-Flash-Next CP shards text batches: batch needs input_ids")
    if mesh_size(tp_mesh) > 1:
        raise ValueError(
            f"tp_mesh has size {mesh_size(tp_mesh)}; contiguous CP supports no tensor "
            "parallelism (tp_mesh must be None or of size one)"
        )
    local, layout = shard_batch(
        cp_mesh,
        batch,
        loss_mask=loss_mask,
        padding_token_id=padding_token_id,
        pad_multiple=pad_multiple,
    )
    packed = any(batch.get(k) is not None for k in _PACKED_KEYS)
    if packed and layout.batch_size != 1:
        raise ValueError(
            f"a packed THD batch must have batch size one, got {layout.batch_size} rows"
        )
    ids = normalize_batch_axis(batch)["input_ids"]
    local[_CP_CONTEXT_KEY] = Qwen3_8_FlashNextCPContext(
        group=layout.group,
        rank=layout.cp_rank,
        size=layout.cp_size,
        global_input_ids=_pad_right(ids, layout.global_seq_len, padding_token_id),
        global_padding_mask=layout.doc_ids != PAD_DOC_ID,
        local_sequence_start=layout.seq_start,
        local_sequence_length=layout.local_seq_len,
        global_cu_seqlens=layout.row_cu_seqlens(0)[0] if packed else None,
    )
    return contextlib.nullcontext, local, layout
