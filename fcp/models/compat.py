"""What the seed adapters share with NeMo AutoModel's sharder protocol, without importing NeMo.

* :func:`shard_layout` builds the third value a seed sharder returns: NeMo AutoModel's own
  ``ShardLayout`` when ``nemo_automodel`` is importable (so ``isinstance`` checks and equality in
  NeMo's training loop hold), else :class:`ShardLayout`, a frozen dataclass with the same fields,
  defaults and order. NeMo is looked up on each call, never at import: importing it is slow
  and fcp does not depend on it.
* :class:`UnsupportedBatchError`, :class:`MissingBatchKeyError` and :class:`NegativeLengthError`
  are the errors a seed adapter raises where NeMo raises ``NotImplementedError`` / ``KeyError`` /
  ``RuntimeError``: they are also ``ValueError`` s, so code written against NeMo and code written
  against fcp's "every bad batch is a ``ValueError`` or ``TypeError``" rule both catch them.

>>> shard_layout(original_seq_len=5, padded_seq_len=8).padded_seq_len
8
>>> [issubclass(UnsupportedBatchError, e) for e in (NotImplementedError, ValueError)]
[True, True]
>>> [issubclass(NegativeLengthError, e) for e in (RuntimeError, ValueError)]
[True, True]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ShardLayout", "shard_layout", "shard_layout_class", "UnsupportedBatchError",
           "MissingBatchKeyError", "NegativeLengthError"]  # fmt: skip


@dataclass(frozen=True)
class ShardLayout:
    """What a sharder learned about the layout it applied (NeMo AutoModel's fields, in order).

    Attributes:
        local_token_global_indices: the partition for data-dependent layouts; ``None`` for the
            contiguous layout (its index map is closed-form).
        original_seq_len: sequence length before CP padding.
        padded_seq_len: global sequence length after CP padding.
        input_row_shape: ``[B, S]`` rows before a THD flatten (``None`` here).
        input_token_stream_positions: per-row input-to-padded-column map (``None`` here).
    """

    local_token_global_indices: torch.Tensor | None = None
    original_seq_len: int | None = None
    padded_seq_len: int | None = None
    input_row_shape: tuple[int, ...] | None = None
    input_token_stream_positions: torch.Tensor | None = None


def shard_layout_class() -> type:
    """NeMo AutoModel's ``ShardLayout`` if ``nemo_automodel`` is importable, else
    :class:`ShardLayout`."""
    try:
        from nemo_automodel.components.distributed.context_parallel.sharder import (
            ShardLayout as nemo_shard_layout,
        )
    except ImportError:
        return ShardLayout
    return nemo_shard_layout


def shard_layout(original_seq_len: int, padded_seq_len: int):
    """The contiguous layout's ``ShardLayout(original_seq_len=..., padded_seq_len=...)``."""
    return shard_layout_class()(original_seq_len=original_seq_len, padded_seq_len=padded_seq_len)


class UnsupportedBatchError(NotImplementedError, ValueError):
    """A well-formed batch this CP layout does not support (NeMo raises ``NotImplementedError``)."""


class MissingBatchKeyError(KeyError, ValueError):
    """A batch lacks a key the sharder needs (NeMo raises ``KeyError``)."""


class NegativeLengthError(RuntimeError, ValueError):
    """A negative sequence length (NeMo's tensor constructors raise ``RuntimeError``)."""
