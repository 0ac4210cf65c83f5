"""One vocabulary for argument checks, used by every public function of fcp.

The rule (every check here follows it, so every fcp function does):

* a wrong **type** (a float where an int is expected, a list where a tensor is, an integer tensor
  where a floating one is) raises :class:`ArgumentTypeError`, a ``TypeError`` that is also a
  ``ValueError``, so ``except ValueError`` catches every bad argument of a batch whatever its kind;
* a wrong **value** (out of range, wrong shape, unknown name) raises ``ValueError``;
* the message names the function, the argument and the offending value::

    >>> check_positive_int(1.5, "ratio", fn="compressed_attention")
    Traceback (most recent call last):
    ...
    fcp.checks.ArgumentTypeError: compressed_attention: ratio must be an int, got 1.5 (float)
    >>> check_positive_int(0, "ratio", fn="compressed_attention")
    Traceback (most recent call last):
    ...
    ValueError: compressed_attention: ratio=0 must be >= 1

Every check returns the checked value (an int as a plain ``int``), so a caller writes
``ratio = check_positive_int(ratio, "ratio", fn=name)``. Checks read only Python values and tensor
metadata (shape, dtype, device): none synchronises with the device, so they are safe inside a
compiled region, where Dynamo evaluates them at trace time. Value checks that need tensor data
(document maps, lengths) live beside the data they check (:mod:`fcp.layout`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "ArgumentTypeError",
    "check_bool",
    "check_choice",
    "check_float",
    "check_instance",
    "check_int",
    "check_positive_int",
    "check_power_of_two",
    "check_tensor",
    "describe",
]


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (or a tensor of the wrong dtype).

    A ``TypeError`` by the rule, and a ``ValueError`` too, so that code catching ``ValueError``
    for a malformed batch catches every rejection fcp makes.
    """


def _prefix(fn: str) -> str:
    return f"{fn}: " if fn else ""


def describe(value: Any) -> str:
    """A short description of ``value`` for messages: shape and dtype for tensors."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def check_int(value: Any, name: str, minimum: int | None = None, *, fn: str = "") -> int:
    """``value`` as a plain ``int`` (bools, floats, strings and None are type errors: nothing is
    ever truncated), at least ``minimum`` if given.

    >>> check_int(3, "pad_multiple", 1)
    3
    """
    try:
        if isinstance(value, bool):  # operator.index would take True as 1
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{_prefix(fn)}{name} must be an int, got {describe(value)}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{_prefix(fn)}{name}={value} must be >= {minimum}")
    return value


def check_positive_int(value: Any, name: str, *, fn: str = "") -> int:
    """``check_int(value, name, 1)``."""
    return check_int(value, name, 1, fn=fn)


def check_power_of_two(value: Any, name: str, *, fn: str = "") -> int:
    """A positive int that is a power of two (chunk sizes)."""
    value = check_positive_int(value, name, fn=fn)
    if value & (value - 1):
        raise ValueError(f"{_prefix(fn)}{name}={value} must be a power of two")
    return value


def check_bool(value: Any, name: str, *, fn: str = "") -> bool:
    """``value`` if it is a ``bool`` (ints, including 0 and 1, are type errors)."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{_prefix(fn)}{name} must be a bool, got {describe(value)}")
    return value


def check_float(value: Any, name: str, *, fn: str = "", positive: bool = False) -> float:
    """``value`` as a Python ``float`` (ints accepted; bools and tensors are type errors);
    finite, and ``> 0`` if ``positive``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{_prefix(fn)}{name} must be a float, got {describe(value)}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{_prefix(fn)}{name}={value} must be finite")
    if positive and value <= 0:
        raise ValueError(f"{_prefix(fn)}{name}={value} must be > 0")
    return value


def check_choice(value: Any, name: str, choices: Iterable[Any], *, fn: str = "") -> Any:
    """``value`` if it is one of ``choices`` (``ValueError`` listing them otherwise)."""
    choices = tuple(choices)
    try:
        ok = value in choices
    except TypeError:  # unhashable or incomparable: certainly not a choice
        ok = False
    if not ok:
        raise ValueError(f"{_prefix(fn)}{name} must be one of {choices}, got {value!r}")
    return value


def check_instance(value: Any, cls: type | tuple[type, ...], name: str, *, fn: str = "",
                   hint: str = "") -> Any:  # fmt: skip
    """``value`` if it is an instance of ``cls``, else :class:`ArgumentTypeError` (``hint``,
    what to do instead, ends its message)."""
    if not isinstance(value, cls):
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise ArgumentTypeError(
            f"{_prefix(fn)}{name} must be a {names}, got {describe(value)}{hint}"
        )
    return value


_KINDS = {
    "float": (lambda t: t.is_floating_point(), "floating point"),
    "int": (lambda t: not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool),
            "an integer dtype"),
    "bool": (lambda t: t.dtype == torch.bool, "bool"),
}  # fmt: skip


def check_tensor(
    value: Any,
    name: str,
    *,
    fn: str = "",
    kind: str | None = None,
    dtype: torch.dtype | None = None,
    dim: int | tuple[int, ...] | None = None,
    shape: tuple[int | None, ...] | None = None,
    layout: str = "",
    values: bool = False,
) -> torch.Tensor:
    """``value`` if it is a ``torch.Tensor`` of the required kind, dtype, rank and shape.

    Args:
        kind: ``"float"``, ``"int"`` (any integer dtype, not bool) or ``"bool"``.
        dtype: one exact dtype.
        dim: the required rank (or a tuple of allowed ranks).
        shape: the required shape, ``None`` entries free (implies the rank).
        layout: how the message names the axes, e.g. ``"[batch, local_seq, heads, K]"``.
        values: the caller reads the tensor's values on the host (eager validation of a batch):
            a meta tensor, which has none, is a ``ValueError`` naming it.

    Not a tensor, wrong kind or dtype: :class:`ArgumentTypeError`; wrong rank or shape, or a
    meta tensor with ``values``: ``ValueError``. Metadata only (no host synchronisation).

    >>> check_tensor(torch.zeros(2, device="meta"), "cu_seqlens", values=True)
    Traceback (most recent call last):
    ...
    ValueError: cu_seqlens is a meta tensor; its values are needed here
    """
    p = _prefix(fn)
    if not isinstance(value, torch.Tensor):
        raise ArgumentTypeError(f"{p}{name} must be a torch.Tensor, got {describe(value)}")
    if values and value.is_meta:
        raise ValueError(f"{p}{name} is a meta tensor; its values are needed here")
    if kind is not None:
        test, words = _KINDS[kind]
        if not test(value):
            raise ArgumentTypeError(f"{p}{name} must be {words}, got dtype {value.dtype}")
    if dtype is not None and value.dtype != dtype:
        raise ArgumentTypeError(f"{p}{name} must have dtype {dtype}, got {value.dtype}")
    if shape is not None:
        dim = len(shape)
    if dim is not None:
        dims = dim if isinstance(dim, tuple) else (dim,)
        if value.dim() not in dims:
            want = layout or " or ".join(f"{d}-D" for d in dims)
            raise ValueError(f"{p}{name} must be {want}, got shape {tuple(value.shape)}")
    if shape is not None and any(w is not None and w != s for w, s in zip(shape, value.shape)):
        want = [("." if w is None else w) for w in shape]
        named = f" {layout}" if layout else ""
        raise ValueError(
            f"{p}{name} must have shape{named} = [{', '.join(map(str, want))}], "
            f"got {tuple(value.shape)}"
        )
    return value
