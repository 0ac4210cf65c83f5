"""Contiguous packed context parallelism for GLM-5.3-Flash: seed adapter.

This is the API of ``nemo_automodel.components.models.glm5_next.cp`` on top of fcp's generic
core. Kimi Delta Attention carries recurrent and short-convolution state from left to right, so
the generic load-balanced CP permutation is not valid: one contiguous token interval per CP rank
and one replicated global document-id map, consumed by both KDA and KPool-DSA.

Every name is a thin adapter; nothing is implemented twice:

=============================== ===============================================================
seed name                       delegates to
=============================== ===============================================================
``Glm5NextPackedContext``       :class:`fcp.context.PackedContext` (``to_packed_context``)
``_AllGatherSequence``          :func:`fcp.comm.all_gather_sequence` (forward and backward)
``_AllGatherBackwardAnchor``    ``fcp.comm._BackwardAnchor`` (alias)
``all_gather_sequence``         :func:`fcp.comm.all_gather_sequence`
``all_gather_backward_anchor``  :func:`fcp.comm.all_gather_backward_anchor`
``build_fla_cp_context``        ``fcp.ops.fla_support.build_fla_cp_context`` (lazy: FLA)
``doc_ids_from_cu_seqlens``     :func:`fcp.layout.doc_ids_from_cu_seqlens`
``doc_ids_from_seq_lens``       :func:`fcp.layout.doc_ids_from_seq_lens`
``segment_cu_seqlens``          :func:`fcp.layout.segment_cu_seqlens`
``shard_batch_for_glm5_next_cp`` :func:`fcp.shard.shard_batch` (``pad_multiple=1``)
``_global_doc_ids_from_batch``  :func:`fcp.shard.global_doc_ids_from_batch`
``_normalize_batch_axis``       :func:`fcp.shard.normalize_batch_axis` (returns a new batch)
``_pad_sequence_dim``           :func:`fcp.shard.pad_sequence_dim` (``dim=1``)
``_PAD_DOC_ID``                 :data:`fcp.layout.PAD_DOC_ID` (``0``)
=============================== ===============================================================

Differences from the seed, all deliberate:

* fcp never mutates a batch. ``shard_batch_for_glm5_next_cp`` returns a **new** local batch and
  ``_normalize_batch_axis`` returns a new batch (the seed mutated in place and returned ``None``).
* The local batch carries this rank's :class:`~fcp.context.PackedContext` under the key
  ``"cp_context"``, so ``model(**local_batch)`` hands it to the layers (fcp's operators take it
  directly). The third return value is the :class:`Glm5NextPackedContext` layout, as in the seed.
* Collectives are funcol-based (``torch.distributed._functional_collectives``): they trace under
  ``torch.compile(fullgraph=True)`` and never synchronise with the host. The seed's
  ``torch.autograd.Function`` classes are kept for compatibility only; prefer the functions.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass, field
from typing import Any

import torch

from fcp.comm import all_gather_backward_anchor, dependent_zeros
from fcp.comm import all_gather_sequence as _fcp_all_gather_sequence
from fcp.context import PackedContext
from fcp.groups import mesh_size, resolve_group
from fcp.pytree import register_frozen_pytree
from fcp.layout import (
    PAD_DOC_ID,
    doc_ids_from_cu_seqlens,
    doc_ids_from_seq_lens,
    segment_cu_seqlens,
)
from fcp.shard import global_doc_ids_from_batch, normalize_batch_axis, pad_sequence_dim, shard_batch

__all__ = [
    "Glm5NextPackedContext",
    "all_gather_backward_anchor",
    "all_gather_sequence",
    "build_fla_cp_context",
    "doc_ids_from_cu_seqlens",
    "doc_ids_from_seq_lens",
    "segment_cu_seqlens",
    "shard_batch_for_glm5_next_cp",
]

#: Document id of padding tokens (fcp's :data:`~fcp.layout.PAD_DOC_ID`).
_PAD_DOC_ID = PAD_DOC_ID
#: Key of the per-forward :class:`~fcp.context.PackedContext` in the sharded local batch.
_CP_CONTEXT_KEY = "cp_context"


# ---------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Glm5NextPackedContext:
    """Global packed-document layout for one model step.

    The seed's group-free view of fcp's :class:`~fcp.context.PackedContext`: the replicated
    int64 ``[batch, global_seq]`` map ``doc_ids`` (documents 1, 2, ... per row, pad 0; global
    length divisible by ``cp_size``), this rank's first global token ``seq_start`` (a multiple
    of ``local_seq_len``) and the row length before CP padding. ``to_packed_context(cp_group)``
    attaches a group and returns the core context every fcp operator takes.

    Frozen and registered as a pytree whose only leaf is ``doc_ids`` (the rest is static), like
    ``PackedContext``. ``_cu_seqlens`` is the host-side memo of :meth:`row_cu_seqlens`
    (excluded from the pytree; a fresh dict per instance).
    """

    doc_ids: torch.Tensor
    seq_start: int = 0
    cp_size: int = 1
    original_seq_len: int | None = None
    _cu_seqlens: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )
    # Memo of core contexts per resolved process group (see to_packed_context).
    _cores: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        d = self.doc_ids
        if not isinstance(d, torch.Tensor) or d.dim() != 2 or d.dtype != torch.int64:
            raise ValueError(
                "doc_ids must be an int64 [batch, sequence] tensor, got "
                + (f"shape {tuple(d.shape)} dtype {d.dtype}" if isinstance(d, torch.Tensor)
                   else type(d).__name__)
            )
        if isinstance(self.cp_size, bool) or not isinstance(self.cp_size, int) or self.cp_size < 1:
            raise ValueError(f"cp_size must be a positive int, got {self.cp_size!r}")
        if d.shape[1] % self.cp_size:
            raise ValueError(
                f"doc_ids sequence length {d.shape[1]} is not divisible by cp_size={self.cp_size}"
            )
        local = d.shape[1] // self.cp_size
        if (
            not isinstance(self.seq_start, int)
            or not 0 <= self.seq_start < max(d.shape[1], 1)
            or (local and self.seq_start % local)
        ):
            raise ValueError(
                f"seq_start={self.seq_start!r} must be r * local_seq_len ({local}) for a rank r "
                f"in [0, cp_size={self.cp_size})"
            )
        if self.original_seq_len is not None and not 0 <= self.original_seq_len <= d.shape[1]:
            raise ValueError(
                f"original_seq_len={self.original_seq_len} is outside [0, {d.shape[1]}] "
                "(the padded global length)"
            )

    @classmethod
    def from_packed_context(cls, context: PackedContext) -> "Glm5NextPackedContext":
        """The seed layout of a core context; ``to_packed_context(context.group)`` returns it."""
        out = cls(
            doc_ids=context.doc_ids,
            seq_start=context.seq_start,
            cp_size=context.cp_size,
            original_seq_len=context.original_seq_len,
        )
        out._cores[context.group] = context
        return out

    def to_packed_context(self, cp_group: Any = None) -> PackedContext:
        """This layout as the core :class:`~fcp.context.PackedContext` of ``cp_group``.

        ``cp_group``: ``ProcessGroup``, 1-D ``DeviceMesh`` or ``None``. Its size must be
        ``cp_size`` and this rank's index must own ``seq_start`` (``ValueError`` otherwise).
        Memoised per group, so the core's host-side row planning runs once per batch.
        """
        info = resolve_group(cp_group)
        core = self._cores.get(info.group)
        if core is None:
            if info.size != self.cp_size:
                raise ValueError(
                    f"cp_group has {info.size} rank(s) but the layout has cp_size={self.cp_size}"
                )
            core = PackedContext(
                doc_ids=self.doc_ids,
                group=info.group,
                cp_size=info.size,
                cp_rank=info.rank,
                seq_start=self.seq_start,
                original_seq_len=self.original_seq_len,
            )
            self._cores[info.group] = core
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
        """Return document ids [batch, local_sequence] for this rank (a view, compile-safe)."""
        return self.doc_ids.narrow(1, self.seq_start, self.local_seq_len)

    def row_cu_seqlens(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return device/CPU segment boundaries for one packed batch row.

        Global int64 ``[segments + 1]`` from 0 to the padded length, the pad tail its own
        segment; :meth:`fcp.context.PackedContext.row_cu_seqlens` of the same map. Host-side
        and memoised per row in ``_cu_seqlens``.
        """
        if row not in self._cu_seqlens:
            # Global boundaries do not depend on the group: reuse an attached core (sharing its
            # memo with the operators), else plan with the single-rank core of the same map.
            core = next(iter(self._cores.values()), None) or PackedContext(self.doc_ids)
            self._cu_seqlens[row] = core.row_cu_seqlens(row)
        return self._cu_seqlens[row]


register_frozen_pytree(
    Glm5NextPackedContext,
    leaves=("doc_ids",),
    name="fcp.models.glm5_next.Glm5NextPackedContext",
    drop=("_cu_seqlens",),
)


# ---------------------------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------------------------
class _AllGatherBackwardAnchor(torch.autograd.Function):
    """Return zero while retaining a backward edge to a gathered tensor.

    ``forward(ctx, gathered)`` -> 0-d zero; ``backward(ctx, grad_output)`` -> zeros like
    ``gathered`` that depend on the gradient (:func:`fcp.comm.dependent_zeros`). Prefer
    :func:`all_gather_backward_anchor`.
    """

    @staticmethod
    def forward(ctx, gathered: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype = gathered.shape, gathered.dtype
        return gathered.new_zeros(())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        return dependent_zeros(grad_output, ctx.shape, ctx.dtype)


class _AllGatherSequence(torch.autograd.Function):
    """Autograd-aware all-gather of equal contiguous sequence shards.

    Seed-compatible ``Function`` wrapper: ``_AllGatherSequence.apply(x, group, dim)`` equals
    ``all_gather_sequence(x, group, dim)``. Forward runs fcp's funcol gather on a detached copy;
    backward differentiates that same gather (funcol's reduce-scatter), so there is one
    implementation. Eager only (the nested autograd call breaks ``fullgraph`` compilation): use
    :func:`all_gather_sequence`, which is compile-safe.
    """

    @staticmethod
    def forward(ctx, local_tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        if not (local_tensor.is_floating_point() or local_tensor.is_complex()):
            return _fcp_all_gather_sequence(local_tensor, group, dim, differentiable=False)
        with torch.enable_grad():
            leaf = local_tensor.detach().requires_grad_()
            gathered = _fcp_all_gather_sequence(leaf, group, dim)
        ctx.leaf, ctx.gathered = leaf, gathered
        return gathered.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = torch.autograd.grad(ctx.gathered, ctx.leaf, grad_output)
        del ctx.leaf, ctx.gathered
        return grad, None, None


def all_gather_sequence(tensor: torch.Tensor, cp_group: Any, dim: int = 1) -> torch.Tensor:
    """Gather a sequence-sharded tensor while preserving K/V gradient flow.

    :func:`fcp.comm.all_gather_sequence`: equal contiguous shards concatenated in rank order
    along ``dim``; backward reduce-scatters the gradient to the owning ranks. ``cp_group``:
    ``ProcessGroup``, 1-D ``DeviceMesh``, ``PackedContext`` or ``None`` (identity).
    """
    return _fcp_all_gather_sequence(tensor, cp_group, dim)


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
        packed_context: global document layout (a :class:`Glm5NextPackedContext`, or a core
            ``PackedContext``).
        row: batch row being executed.
        cp_group: context-parallel process group (or 1-D mesh).
        conv_kernel_size: short-convolution width used for the left halo.

    Returns:
        FLA ``FLACPContext`` carrying segment and process-group metadata, from
        ``fcp.ops.fla_support.build_fla_cp_context`` on ``packed_context.to_packed_context(
        cp_group)`` (FLA is imported on first call). Memoised per row, kernel size and group:
        every layer of a step gets the same object.
    """
    from fcp.ops.fla_support import build_fla_cp_context as _build  # lazy: FLA on first call

    if isinstance(packed_context, Glm5NextPackedContext):
        packed_context = packed_context.to_packed_context(cp_group)
    # FLA takes a ProcessGroup: a mesh resolves to its group, a one-rank group to None.
    return _build(packed_context, row, resolve_group(cp_group).group, conv_kernel_size)


# ---------------------------------------------------------------------------------------------
# batch helpers and the sharder
# ---------------------------------------------------------------------------------------------
def _global_doc_ids_from_batch(batch: dict[str, Any], seq_len: int) -> torch.Tensor:
    """Resolve the global document map before removing packing metadata.

    :func:`fcp.shard.global_doc_ids_from_batch`: ``doc_ids``, ``cu_seqlens``, ``seq_lens``, a
    right-tail mask, else one document per row; int64 ``[batch, seq_len]``.
    """
    return global_doc_ids_from_batch(batch, seq_len)


def _normalize_batch_axis(batch: dict[str, Any]) -> dict[str, Any]:
    """Restore the placeholder batch axis used by THD VLM collaters.

    :func:`fcp.shard.normalize_batch_axis`. Unlike the seed (which mutated ``batch`` and
    returned ``None``) this returns a **new** batch and leaves ``batch`` untouched.
    """
    return normalize_batch_axis(batch)


def _pad_sequence_dim(
    tensor: torch.Tensor, pad_len: int, value: float | int | bool
) -> torch.Tensor:
    """Right-pad ``tensor`` along the sequence axis (dim 1) by ``pad_len`` entries of ``value``.

    :func:`fcp.shard.pad_sequence_dim`; returns ``tensor`` itself when ``pad_len == 0``.
    """
    return pad_sequence_dim(tensor, pad_len, value)


def shard_batch_for_glm5_next_cp(
    cp_mesh,
    tp_mesh,
    batch: dict[str, Any],
    loss_mask=None,
    padding_token_id: int = 0,
    shard_primary: bool = False,
):
    """Contiguously shard packed GLM-5.3 token streams.

    The top-level VLM uses ``shard_primary=False``: image features must be spliced into the full
    embedding sequence inside forward before that differentiable primary stream is sliced (with
    ``local_batch["cp_context"].shard(embeds)``). Labels and other no-grad token streams are
    still sharded here.

    :func:`fcp.shard.shard_batch` with ``pad_multiple=1``: the global length is padded to a
    multiple of the CP size only. (An fcp pooled-key attention under CP needs the local length
    to be a multiple of its block; call :func:`fcp.shard.shard_batch` with ``pad_multiple``
    for that.)

    Args:
        cp_mesh: one-dimensional CP mesh (or ``ProcessGroup``), or ``None``.
        tp_mesh: tensor-parallel mesh accepted by the sharder protocol; must be ``None`` or of
            size one.
        batch: batch containing token tensors with shape ``[batch, sequence]`` and optional
            packing metadata (``cu_seqlens`` / ``seq_lens`` / ``doc_ids``). Never mutated.
        loss_mask: optional loss mask ``[batch, sequence]``.
        padding_token_id: fill value for padded token ids.
        shard_primary: whether to shard ``input_ids`` in this function (``False``: kept full
            length, CP-padded).

    Returns:
        ``(context_factory, local_batch, layout)``: a null context-manager factory, a **new**
        local batch (this rank's token slices, packing metadata removed, ``position_ids`` added
        when absent, and this rank's :class:`~fcp.context.PackedContext` under
        ``"cp_context"``), and the global shard layout :class:`Glm5NextPackedContext`
        (``layout.to_packed_context(cp_mesh)`` is ``local_batch["cp_context"]``).
    """
    if mesh_size(tp_mesh) > 1:
        raise ValueError(
            f"tp_mesh has size {mesh_size(tp_mesh)}; contiguous CP supports no tensor "
            "parallelism (tp_mesh must be None or of size one)"
        )
    local, context = shard_batch(
        cp_mesh,
        batch,
        loss_mask=loss_mask,
        padding_token_id=padding_token_id,
        pad_multiple=1,
        shard_primary=shard_primary,
    )
    local[_CP_CONTEXT_KEY] = context
    return contextlib.nullcontext, local, Glm5NextPackedContext.from_packed_context(context)
