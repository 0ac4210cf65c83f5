"""Run NeMo AutoModel 0.7.0's cp modules and fcp's seed adapters side by side, and compare.

The oracle is the real ``nemo_automodel`` package (installed ``--no-deps`` by the Makefile); only
its two cp modules are imported here (torch, FLA and a few NeMo modules), never its model code.

* :func:`outcome` runs a call on deep copies of its arguments and keeps the result or the error
  (and the mutated arguments, since NeMo mutates batches in place).
* :func:`describe` turns results into plain nested data: every tensor by dtype, shape, device and
  values, dicts with their key order, both context classes by every field and property
  (``row_cu_seqlens`` of every row included), ``ShardLayout`` by type and fields.
* :func:`check` applies the contract: a valid input gives equal descriptions (or errors of the
  same kind); an invalid one may make fcp raise where NeMo does not only if fcp raises
  ``ValueError`` / ``TypeError`` and the case's key (``"[pad-tail]"``) is listed in the adapter's
  module docstring; fcp leaves the batch untouched when it raises.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

NEMO_GLM_CP = "nemo_automodel.components.models.glm5_next.cp"
NEMO_QWEN_CP = "nemo_automodel.components.models.qwen3_8_flash_next.cp"


def nemo_modules():
    """``(glm_cp, qwen_cp)`` of NeMo AutoModel (ImportError when it is not installed)."""
    import importlib

    return importlib.import_module(NEMO_GLM_CP), importlib.import_module(NEMO_QWEN_CP)


class FakeMesh:
    """Duck-typed one-rank mesh: all NeMo's sharders need without ``torch.distributed``."""

    def __init__(self, size: int = 1, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank

    def get_group(self):
        return None


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def outcome(fn: Callable, *args, share: tuple = (), **kwargs) -> Outcome:
    """``fn(*deepcopy(args), **deepcopy(kwargs))``, its result or error, and the copies after.

    ``share``: objects passed as they are, never copied (meshes, process groups).
    """
    memo = {id(obj): obj for obj in share}
    args, kwargs = copy.deepcopy((args, kwargs), memo)
    try:
        return Outcome(fn(*args, **kwargs), None, args, kwargs)
    except Exception as err:  # noqa: BLE001 - the error is the result
        return Outcome(None, err, args, kwargs)


def describe(x: Any) -> Any:
    """Plain, comparable data for a result (see the module docstring)."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        return ("tensor", str(t.dtype), tuple(t.shape), t.device.type, t.tolist())
    if isinstance(x, dict):
        return ("dict", [(k, describe(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [describe(v) for v in x])
    if hasattr(x, "row_cu_seqlens") and hasattr(x, "seq_start"):
        rows = x.doc_ids.shape[0] if isinstance(x.doc_ids, torch.Tensor) else 0
        return (
            "Glm5NextPackedContext", describe(x.doc_ids), x.seq_start, x.cp_size,
            x.original_seq_len, x.cp_enabled, x.local_seq_len, describe(x.local_doc_ids),
            [describe(x.row_cu_seqlens(r)) for r in range(rows)],
        )  # fmt: skip
    if hasattr(x, "global_input_ids") and hasattr(x, "local_sequence_start"):
        return (
            "Qwen3_8_FlashNextCPContext", ("group", id(x.group)), x.rank, x.size,
            describe(x.global_input_ids), describe(x.global_padding_mask),
            x.local_sequence_start, x.local_sequence_length, describe(x.global_cu_seqlens),
            x.global_sequence_length, describe(x.global_sequence_lengths), x.local_sequence_end,
        )  # fmt: skip
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__qualname__, [(f.name, describe(getattr(x, f.name)))
                                       for f in dataclasses.fields(x)])  # fmt: skip
    if isinstance(x, type) or callable(x):
        return ("object", id(x))
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return ("object", id(x))


def assert_same(nemo: Any, fcp: Any, what: str = "") -> None:
    a, b = describe(nemo), describe(fcp)
    if a != b:
        raise AssertionError(f"{what}: NeMo and fcp differ\n  NeMo: {a}\n  fcp:  {b}")


def check(
    nemo: Outcome,
    fcp: Outcome,
    doc: str,
    case: str | None = None,
    *,
    compare_args: bool = True,
    what: str = "",
) -> str:
    """Apply the drop-in contract to one input; returns ``"same"``, ``"same-error"`` or
    ``"stricter"`` (``case``: the docstring key of an invalid input, ``None`` for a valid one)."""
    if nemo.error is None and fcp.error is None:
        assert_same(nemo.value, fcp.value, f"{what} result")
        if compare_args:  # in-place mutation of keyword arguments (the batch) agrees
            assert_same(nemo.kwargs, fcp.kwargs, f"{what} keyword arguments after the call")
        return "same"
    if fcp.error is None:
        raise AssertionError(f"{what}: NeMo raised {nemo.error!r} but fcp accepted the input")
    if nemo.error is not None and isinstance(fcp.error, type(nemo.error)):
        return "same-error"
    # fcp raises where NeMo accepts the input, or raises another kind of error: only a
    # documented stricter case may do that, and only with ValueError / TypeError.
    if case is None:
        raise AssertionError(
            f"{what}: fcp raised {fcp.error!r} on a valid input (NeMo: "
            f"{'accepted' if nemo.error is None else repr(nemo.error)})"
        )
    if not isinstance(fcp.error, (ValueError, TypeError)):
        raise AssertionError(f"{what} [{case}]: fcp raised {fcp.error!r}, not ValueError/TypeError")
    if f"[{case}]" not in doc:
        raise AssertionError(f"{what}: stricter case [{case}] is not documented in the module")
    return "stricter"


def batch_untouched(before: dict, after: dict) -> None:
    """fcp validates before mutating: a rejected batch is left exactly as it was."""
    assert_same(before, after, "batch after a rejected call")
