"""One way to name a CP group: :data:`GroupLike`, resolved once on the host to a :class:`GroupInfo`.

Operators and collectives take the CP group inside their context (``ctx: PackedContext``); the
few functions that take a raw group (:func:`fcp.comm.all_gather_group`, the batch agreement of
:func:`fcp.shard_batch`, :func:`fcp.loss.global_token_mean`, the NeMo-contract wrappers of
:mod:`fcp.models`) accept exactly the types of :data:`GroupLike` and resolve them here, so
compiled code only ever sees a plain ``ProcessGroup`` (or ``None``) and Python ints.

    >>> resolve_group(None)
    GroupInfo(group=None, size=1, rank=0)

Errors follow :mod:`fcp.checks`: an object of another type is an
:class:`~fcp.checks.ArgumentTypeError`, a ``DeviceMesh`` of the wrong rank a ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch.distributed as dist

from fcp.checks import ArgumentTypeError, describe

__all__ = ["GroupInfo", "GroupLike", "mesh_size", "resolve_group"]


@dataclass(frozen=True)
class GroupInfo:
    """A resolved CP group: the process group (``None`` when CP is off), its size and our rank."""

    group: Any
    size: int
    rank: int


#: What a raw-group argument accepts: ``None`` (one process), a ``ProcessGroup``, a
#: one-dimensional ``DeviceMesh`` or an already resolved :class:`GroupInfo`.
GroupLike = Union[None, dist.ProcessGroup, getattr(dist, "DeviceMesh", Any), GroupInfo]

_GROUP_TYPES = "None, a torch.distributed.ProcessGroup, a 1-D DeviceMesh or a GroupInfo"


def resolve_group(group: GroupLike, *, name: str = "group", fn: str = "resolve_group") -> GroupInfo:
    """Resolve a :data:`GroupLike` to a ``GroupInfo``.

    A group of size one resolves to ``GroupInfo(None, 1, 0)``: a one-rank CP group is the
    non-CP case and needs no collective. ``name`` and ``fn`` name the argument and the calling
    function in messages: another type raises :class:`~fcp.checks.ArgumentTypeError`, a
    ``DeviceMesh`` of more than one dimension ``ValueError``.
    """
    if group is None:
        return GroupInfo(None, 1, 0)
    if isinstance(group, GroupInfo):
        return group
    mesh_cls = _device_mesh_cls()
    if mesh_cls is not None and isinstance(group, mesh_cls):
        if group.ndim != 1:
            raise ValueError(
                f"{fn}: {name} must be a one-dimensional DeviceMesh, got a "
                f"{group.ndim}-D DeviceMesh with shape {tuple(group.shape)}"
            )
        pg = group.get_group()
        size, rank = group.size(), group.get_local_rank()
    elif isinstance(group, dist.ProcessGroup):
        pg = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
    else:
        raise ArgumentTypeError(f"{fn}: {name} must be {_GROUP_TYPES}, got {describe(group)}")
    if size == 1:
        return GroupInfo(None, 1, 0)
    return GroupInfo(pg, size, rank)


def mesh_size(mesh: Any, *, name: str = "mesh", fn: str = "mesh_size") -> int:
    """Size of an optional mesh or group: a :data:`GroupLike`, or a ``DeviceMesh`` of any rank
    (its total size); ``None`` counts as 1. Another type: :class:`~fcp.checks.ArgumentTypeError`."""
    if mesh is None:
        return 1
    if isinstance(mesh, GroupInfo):
        return mesh.size
    mesh_cls = _device_mesh_cls()
    if mesh_cls is not None and isinstance(mesh, mesh_cls):
        return mesh.size()
    if isinstance(mesh, dist.ProcessGroup):
        return dist.get_world_size(mesh)
    raise ArgumentTypeError(
        f"{fn}: {name} must be None, a ProcessGroup, a DeviceMesh or a GroupInfo, "
        f"got {describe(mesh)}"
    )


def _device_mesh_cls():
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DeviceMesh
