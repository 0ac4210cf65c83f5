"""One way to name a CP group: ``None``, a ``ProcessGroup``, or a 1-D ``DeviceMesh``.

Everything in fcp that needs the group's size or this rank's index resolves it here, once, on
the host, so compiled code only ever sees a plain ``ProcessGroup`` (or ``None``) and Python ints.

    >>> resolve_group(None)
    GroupInfo(group=None, size=1, rank=0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["GroupInfo", "resolve_group"]


@dataclass(frozen=True)
class GroupInfo:
    """A resolved CP group: the process group (``None`` when CP is off), its size and our rank."""

    group: Any
    size: int
    rank: int


def resolve_group(group: Any) -> GroupInfo:
    """Resolve ``None`` / ``ProcessGroup`` / 1-D ``DeviceMesh`` / ``GroupInfo`` to a ``GroupInfo``.

    A group of size one resolves to ``GroupInfo(None, 1, 0)``: a one-rank CP group is the
    non-CP case and needs no collective.
    """
    if group is None:
        return GroupInfo(None, 1, 0)
    if isinstance(group, GroupInfo):
        return group
    mesh_cls = _device_mesh_cls()
    if mesh_cls is not None and isinstance(group, mesh_cls):
        if group.ndim != 1:
            raise ValueError(
                f"cp_mesh must be one-dimensional, got a {group.ndim}-D DeviceMesh "
                f"with shape {tuple(group.shape)}"
            )
        pg = group.get_group()
        size, rank = group.size(), group.get_local_rank()
    elif isinstance(group, dist.ProcessGroup):
        pg = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
    else:
        raise TypeError(
            "a CP group must be None, a torch.distributed.ProcessGroup or a 1-D DeviceMesh, "
            f"got {type(group).__name__}"
        )
    if size == 1:
        return GroupInfo(None, 1, 0)
    return GroupInfo(pg, size, rank)


def mesh_size(mesh: Any) -> int:
    """Size of an optional mesh or group (``None`` counts as 1)."""
    if mesh is None:
        return 1
    mesh_cls = _device_mesh_cls()
    if mesh_cls is not None and isinstance(mesh, mesh_cls):
        return mesh.size()
    if isinstance(mesh, dist.ProcessGroup):
        return dist.get_world_size(mesh)
    raise TypeError(f"expected None, a ProcessGroup or a DeviceMesh, got {type(mesh).__name__}")


def _device_mesh_cls():
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DeviceMesh
