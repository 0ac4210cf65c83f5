"""One way to make fcp's frozen metadata dataclasses pytrees.

A context that flows into a compiled model must be a pytree whose tensor fields are leaves and
whose other fields (process group, sizes, offsets) are static, so Dynamo guards on the static part
and treats the tensors as inputs whose values may change without recompiling.
:func:`register_frozen_pytree` does that for a frozen dataclass. Unflattening calls the class's
constructor, so ``__post_init__`` runs on every rebuild: nothing bypasses validation. Checks that
need tensor *values* (host synchronisation) must therefore skip tensors without data (see
:func:`has_data`).

>>> import dataclasses, torch
>>> @dataclasses.dataclass(frozen=True)
... class Span:
...     ids: torch.Tensor
...     start: int = 0
>>> register_frozen_pytree(Span, leaves=("ids",), name="doctest.Span")
>>> leaves, spec = torch.utils._pytree.tree_flatten(Span(torch.arange(3), start=2))
>>> len(leaves), torch.utils._pytree.tree_unflatten([leaves[0] + 1], spec).start
(1, 2)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["register_frozen_pytree", "has_data"]


def register_frozen_pytree(
    cls: type, *, leaves: tuple[str, ...], name: str, drop: tuple[str, ...] = ()
) -> None:
    """Register the frozen dataclass ``cls`` as a pytree node.

    Args:
        cls: a ``@dataclass(frozen=True)``; every ``init`` field is either a leaf or static.
        leaves: names of the fields that are pytree children (tensors, or ``None``).
        name: the serialised type name (for ``torch.export``), e.g. ``"fcp.PackedContext"``.
        drop: ``init`` fields left out of the tree (host-side memos): a rebuilt object gets
            their defaults, never a memo computed for other leaf values.

    Every other ``init`` field is static context: it must be hashable and comparable (Dynamo
    guards on it). Fields with ``init=False`` (host-side memos) are not part of the tree; the
    constructor makes them anew.
    """
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        raise TypeError(f"{cls.__name__} must be a frozen dataclass")
    init_fields = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = (set(leaves) | set(drop)) - set(init_fields)
    if unknown:
        raise ValueError(f"{cls.__name__}: {sorted(unknown)} are not init fields")
    static = tuple(n for n in init_fields if n not in leaves and n not in drop)
    leaves = tuple(leaves)

    def flatten(obj):
        return [getattr(obj, n) for n in leaves], tuple(getattr(obj, n) for n in static)

    def unflatten(children, context):
        return cls(**dict(zip(leaves, children)), **dict(zip(static, context)))

    def flatten_with_keys(obj):
        children, context = flatten(obj)
        return [(pytree.GetAttrKey(n), c) for n, c in zip(leaves, children)], context

    pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=name,
        flatten_with_keys_fn=flatten_with_keys,
    )


def has_data(tensor: Any) -> bool:
    """Whether ``tensor``'s values can be read on the host now: ``False`` while tracing
    (``torch.compile``, fake or functional tensors) and for meta tensors."""
    if not isinstance(tensor, torch.Tensor) or torch.compiler.is_compiling():
        return False
    if tensor.is_meta:
        return False
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(tensor):
        return False
    return not torch._C._functorch.is_functorch_wrapped_tensor(tensor) and not (
        torch._is_functional_tensor(tensor)
    )
