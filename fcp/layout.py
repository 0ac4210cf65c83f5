"""Packed-document layout: document-id maps, boundaries and positions.

A *row* is a ``[sequence]`` token stream holding documents packed back to back,
optionally followed by a pad tail.  Its layout is described by an int64
*document-id map* of shape ``[batch, sequence]``: documents are numbered
1, 2, ..., n in order within each row and pad tokens carry ``PAD_DOC_ID = 0``::

    doc_ids_from_cu_seqlens(tensor([0, 3, 5]), 7) -> [[1, 1, 1, 2, 2, 0, 0]]

Conventions (every function here follows them):

* **Zero-length documents** occupy no tokens, get no id and no boundary: they
  are dropped, so they never shift any other document and ids stay
  consecutive.  ``seq_lens [2, 0, 3]`` gives the same map as ``[2, 3]``.
* **Pad tail** is its own run: ``segment_cu_seqlens`` gives it its own segment
  and ``position_ids_from_doc_ids`` restarts positions at 0 at the first pad
  token, so pad positions never extend the last document.
* ``seq_lens`` entries equal to the sentinel (default ``-1000``) mark unused
  trailing slots of a fixed-width ``[batch, documents]`` tensor.  The sentinel
  must be negative because 0 is a legitimate (zero-length) document.

Host-side functions (``doc_ids_from_cu_seqlens`` / ``doc_ids_from_seq_lens``,
``segment_cu_seqlens``, ``packed_boundaries_from_seq_lens``, ``longest_document``,
``validate_*``) may synchronise with the device and have data-dependent output shapes.
``document_starts``, ``position_ids_from_doc_ids``, ``lengths_from_doc_ids``,
``doc_ids_from_position_ids`` / ``doc_ids_from_seq_idx`` (transformers' packing formats) and
``shift_labels_from_labels`` are compile-safe: no host sync, no data-dependent shapes.
Nothing loops over documents or tokens in Python.  Every rejection is a ``ValueError`` naming the
argument and the offending value; a wrong type or dtype is :class:`fcp.checks.ArgumentTypeError`
(a ``TypeError`` that is also a ``ValueError``: the rule of :mod:`fcp.checks`) and names the
function too. A value error starts with the argument's name (``cu_seq_lens_q[2] = ...``), the
key a caller such as :func:`fcp.shard_batch` passed as ``name``, so its message reads the same
wherever the check runs. Verdicts depend only on the inputs, so CP ranks holding the same
replicated metadata agree.
"""

from __future__ import annotations

import torch

from fcp.checks import ArgumentTypeError, check_int, check_tensor

__all__ = [
    "PAD_DOC_ID", "OUTSIDE_DOC_ID", "SEQ_LENS_SENTINEL", "doc_ids_window",
    "doc_ids_from_cu_seqlens", "doc_ids_from_seq_lens",
    "doc_ids_from_position_ids", "doc_ids_from_seq_idx", "shift_labels_from_labels",
    "segment_cu_seqlens", "packed_boundaries_from_seq_lens",
    "document_starts", "position_ids_from_doc_ids", "lengths_from_doc_ids",
    "longest_document",
    "validate_doc_ids", "validate_right_tail_mask",
]  # fmt: skip

PAD_DOC_ID = 0
#: Doc id of positions before/after the global map (halo windows): matches no token.
OUTSIDE_DOC_ID = -1
SEQ_LENS_SENTINEL = -1000


# ---- argument checks ---------------------------------------------------------


def _require_tensor(x, name: str, fn: str, integer: bool = False) -> None:
    check_tensor(x, name, fn=fn, kind="int" if integer else None, values=True)  # values are read


def _non_negative_int(value, name: str, fn: str) -> int:
    return check_int(value, name, 0, fn=fn)


def _index_str(name: str, idx: tuple[int, ...]) -> str:
    return f"{name}[{', '.join(str(i) for i in idx)}]"


def _first_true(mask: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first True of ``mask`` in row-major order, or None (host sync)."""
    hits = mask.nonzero()  # nonzero lists indices in row-major order
    return tuple(hits[0].tolist()) if hits.shape[0] else None


def _checked_seq_lens(seq_lens, seq_len, sentinel: int, fn: str,
                      name: str = "seq_lens") -> torch.Tensor:  # fmt: skip
    """Validate per-row lengths and return int64 ``[batch, documents]`` real
    lengths with sentinel slots replaced by 0 (``fn``: the caller, for type errors)."""
    _require_tensor(seq_lens, name, fn, integer=True)
    sentinel = check_int(sentinel, "sentinel/padding_value", fn=fn)
    if sentinel >= 0:
        raise ValueError(
            f"sentinel/padding_value = {sentinel} must be negative: "
            "0 is a valid zero-length document"
        )
    if seq_lens.dim() not in (1, 2):
        raise ValueError(
            f"{name} has shape {tuple(seq_lens.shape)}; expected [documents] or [batch, documents]"
        )
    squeeze_index = seq_lens.dim() == 1
    lens = seq_lens.to(torch.int64)
    if squeeze_index:
        lens = lens[None]

    def where(idx):  # report indices in the caller's rank
        return _index_str(name, idx[1:] if squeeze_index else idx)

    is_sentinel = lens == sentinel
    bad = _first_true((lens < 0) & ~is_sentinel)
    if bad is not None:
        raise ValueError(
            f"{where(bad)} = {int(lens[bad])} is negative "
            f"(only the sentinel {sentinel} may be negative)"
        )
    # A real length after a sentinel would make "unused trailing slot" ambiguous.
    after_sentinel = torch.cummax(is_sentinel.to(torch.int8), dim=1).values.bool()
    bad = _first_true(after_sentinel & ~is_sentinel)
    if bad is not None:
        raise ValueError(
            f"{where(bad)} = {int(lens[bad])} follows a sentinel ({sentinel}); "
            "sentinel slots must be trailing"
        )
    lens = torch.where(is_sentinel, 0, lens)
    if seq_len is not None:
        # Clamping first keeps the sum from overflowing on absurd lengths.
        sums = lens.clamp(max=seq_len + 1).sum(dim=1)
        bad = _first_true(sums > seq_len)
        if bad is not None:
            row = bad[0]
            raise ValueError(
                f"{name} row {row} sums to {sum(lens[row].tolist())} tokens, "
                f"more than seq_len = {seq_len}"
            )
    return lens


def _doc_ids_from_starts(starts: torch.Tensor, totals: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Ids from per-row document start offsets ``[batch, docs]`` (each <= seq_len)
    and real-token counts ``[batch]``, as a cumsum of start flags."""
    batch = starts.shape[0]
    flags = torch.zeros(batch, seq_len + 1, dtype=torch.int64, device=starts.device)
    # Scatter (not add): a zero-length document shares its start with the next
    # one, so setting the flag again is a no-op and it gets no id.
    flags.scatter_(1, starts, 1)
    # A large negative flag where the pad tail begins drives every pad id below
    # 0, so one in-place clamp zeroes the tail (it overrides any flag there).
    flags.scatter_(1, totals[:, None], -(seq_len + 1))
    return flags[:, :seq_len].cumsum(dim=1).clamp_(min=PAD_DOC_ID)


# ---- host-side constructors --------------------------------------------------


def doc_ids_from_cu_seqlens(
    cu_seqlens: torch.Tensor, seq_len: int, *, name: str = "cu_seqlens"
) -> torch.Tensor:
    """Document-id map of one row from cumulative boundaries.

    Args:
        cu_seqlens: integer ``[documents + 1]`` (or ``[1, documents + 1]``),
            starting at 0, non-decreasing, last entry ``<= seq_len``.
            Positions at or past ``cu_seqlens[-1]`` are pad.
        seq_len: row length.
        name: how messages name ``cu_seqlens`` (transformers' ``cu_seq_lens_q`` is the same
            format).

    Returns:
        int64 ``[1, seq_len]``.

    Example:
        ``doc_ids_from_cu_seqlens(tensor([0, 3, 5]), 7) -> [[1, 1, 1, 2, 2, 0, 0]]``;
        ``tensor([0, 3, 3, 5])`` gives the same map (zero-length doc dropped).
    """
    fn = "doc_ids_from_cu_seqlens"
    seq_len = _non_negative_int(seq_len, "seq_len", fn)
    _require_tensor(cu_seqlens, name, fn, integer=True)
    if cu_seqlens.dim() == 2 and cu_seqlens.shape[0] == 1:
        cu_seqlens = cu_seqlens[0]
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        raise ValueError(
            f"{name} has shape {tuple(cu_seqlens.shape)}; expected a non-empty "
            "[documents + 1] or [1, documents + 1]"
        )
    cu = cu_seqlens.to(torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"{name}[0] = {int(cu[0])}; must start at 0")
    bad = _first_true(cu[1:] < cu[:-1])
    if bad is not None:
        i = bad[0] + 1
        raise ValueError(
            f"{name}[{i}] = {int(cu[i])} is less than {name}[{i - 1}] = {int(cu[i - 1])}; "
            "must be non-decreasing"
        )
    total = int(cu[-1])
    if total > seq_len:
        raise ValueError(f"{name}[-1] = {total} exceeds seq_len = {seq_len}")
    return _doc_ids_from_starts(cu[None, :-1], cu[None, -1], seq_len)


def doc_ids_from_seq_lens(
    seq_lens: torch.Tensor, seq_len: int, padding_value: int = SEQ_LENS_SENTINEL
) -> torch.Tensor:
    """Document-id map from per-row document lengths.

    Args:
        seq_lens: integer ``[batch, documents]`` (or ``[documents]`` for batch 1).
            Entries equal to ``padding_value`` mark unused trailing slots;
            others must be ``>= 0`` and each row must sum to ``<= seq_len``.
        seq_len: row length; the remainder of each row is pad.
        padding_value: the (negative) sentinel.

    Returns:
        int64 ``[batch, seq_len]``.

    Example:
        ``doc_ids_from_seq_lens(tensor([[2, 1, -1000], [4, -1000, -1000]]), 5)``
        ``-> [[1, 1, 2, 0, 0], [1, 1, 1, 1, 0]]``
    """
    fn = "doc_ids_from_seq_lens"
    seq_len = _non_negative_int(seq_len, "seq_len", fn)
    lens = _checked_seq_lens(seq_lens, seq_len, padding_value, fn)
    # Exclusive cumsum: every start (sentinel slots included) is <= seq_len.
    ends = lens.cumsum(dim=1)
    return _doc_ids_from_starts(ends - lens, lens.sum(dim=1), seq_len)


def _doc_ids_from_changes(row: torch.Tensor, changed: torch.Tensor) -> torch.Tensor:
    """Ids ``1, 2, ...`` of ``row``'s ``[batch, sequence]`` tokens, given bool ``changed``
    ``[batch, sequence - 1]``: token ``t + 1`` starts a document (token 0 always does)."""
    starts = torch.ones_like(row, dtype=torch.bool)
    starts[:, 1:] = changed
    return starts.to(torch.int64).cumsum(dim=1)


def _row_stream(t, name: str, fn: str) -> torch.Tensor:
    _require_tensor(t, name, fn, integer=True)
    if t.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected [batch, sequence]")
    return t


def doc_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document-id map of packed rows whose positions restart at every document.

    A document starts at token 0 and wherever ``position_ids[b, t] != position_ids[b, t - 1] + 1``,
    whatever value positions restart at (transformers' ``DataCollatorWithFlattening`` restarts
    them at its ``position_ids_start``). Positions describe no pad tail: every token is in a
    document (a mask or another source says where padding is). Compile-safe.

    Args:
        position_ids: integer ``[batch, sequence]``.

    Returns:
        int64 ``[batch, sequence]``.

    Example: ``[[0, 1, 2, 0, 1, 7]] -> [[1, 1, 1, 2, 2, 3]]``
    """
    pos = _row_stream(position_ids, "position_ids", "doc_ids_from_position_ids").to(torch.int64)
    return _doc_ids_from_changes(pos, pos[:, 1:] != pos[:, :-1] + 1)


def doc_ids_from_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    """Document-id map from per-token document indices (Mamba2 kernels' and transformers'
    ``seq_idx``): a document starts at token 0 and wherever the index changes. No pad tail, as
    for :func:`doc_ids_from_position_ids`. Compile-safe.

    Example: ``[[0, 0, 1, 1, 1, 4]] -> [[1, 1, 2, 2, 2, 3]]``
    """
    idx = _row_stream(seq_idx, "seq_idx", "doc_ids_from_seq_idx")
    return _doc_ids_from_changes(idx, idx[:, 1:] != idx[:, :-1])


def shift_labels_from_labels(
    labels: torch.Tensor, doc_ids: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Next-token targets of unshifted labels (transformers' convention), document by document.

    ``out[b, t] = labels[b, t + 1]`` when token ``t + 1`` is in the same run of ``doc_ids`` as
    token ``t``, else ``ignore_index``: a document's last token predicts nothing (not the next
    document's first token), nor does a row's last token. The pad tail is a run of its own.
    Built over whole rows, so that sharding the result keeps every target, also the one of a
    shard's last token. Compile-safe.

    Args:
        labels: integer ``[batch, sequence]``, unshifted (the target of token ``t`` is
            ``labels[t + 1]``).
        doc_ids: the rows' ``[batch, sequence]`` document map.

    Example: labels ``[[5, 6, 7, 8, 9]]``, doc ids ``[[1, 1, 1, 2, 2]]``
    ``-> [[6, 7, -100, 9, -100]]``
    """
    same = doc_ids[:, 1:] == doc_ids[:, :-1]
    nxt = torch.where(same, labels[:, 1:], ignore_index)
    return torch.cat([nxt, torch.full_like(labels[:, :1], ignore_index)], dim=1)


def segment_cu_seqlens(doc_ids_row: torch.Tensor) -> torch.Tensor:
    """Boundaries of the consecutive-id runs of one row (host-side).

    Args:
        doc_ids_row: integer ``[sequence]`` (or ``[1, sequence]``).

    Returns:
        int64 ``[runs + 1]`` from 0 to ``sequence``; the pad tail is its own
        segment.  An empty row gives ``[0]``.

    Example:
        ``segment_cu_seqlens(tensor([1, 1, 1, 2, 2, 0, 0])) -> [0, 3, 5, 7]``
    """
    name = "doc_ids_row"
    _require_tensor(doc_ids_row, name, "segment_cu_seqlens", integer=True)
    if doc_ids_row.dim() == 2 and doc_ids_row.shape[0] == 1:
        doc_ids_row = doc_ids_row[0]
    if doc_ids_row.dim() != 1:
        raise ValueError(
            f"{name} has shape {tuple(doc_ids_row.shape)}; expected [sequence] or [1, sequence]"
        )
    n = doc_ids_row.shape[0]
    zero = torch.zeros(1, dtype=torch.int64, device=doc_ids_row.device)
    if n == 0:
        return zero
    inner = torch.nonzero(doc_ids_row[1:] != doc_ids_row[:-1]).reshape(-1) + 1
    return torch.cat([zero, inner.to(torch.int64), zero + n])


def packed_boundaries_from_seq_lens(
    seq_lens: torch.Tensor,
    total_tokens: int | None = None,
    sentinel: int = SEQ_LENS_SENTINEL,
) -> torch.Tensor:
    """Physical document boundaries of one packed row from real lengths.

    Args:
        seq_lens: integer ``[documents]`` or ``[1, documents]``; sentinel slots
            and zero-length documents contribute no boundary.
        total_tokens: physical row length, ``>=`` the packed length.  When it
            exceeds it, the pad tail becomes its own segment, so pad tokens
            never join a real document.  ``None`` means "exactly packed".

    Returns:
        int64 ``[real_docs (+1 pad segment) + 1]``, equal to
        ``segment_cu_seqlens(doc_ids_from_seq_lens(seq_lens, total_tokens)[0])``.

    Example:
        ``packed_boundaries_from_seq_lens(tensor([3, 0, 2, -1000]), 8) -> [0, 3, 5, 8]``
    """
    fn = "packed_boundaries_from_seq_lens"
    lens = _checked_seq_lens(seq_lens, None, sentinel, fn)
    if lens.shape[0] != 1:
        raise ValueError(
            f"seq_lens has batch {lens.shape[0]} (shape {tuple(seq_lens.shape)}); "
            "packed boundaries describe a single row"
        )
    lens = lens[0]
    ends = lens[lens > 0].cumsum(dim=0)
    zero = torch.zeros(1, dtype=torch.int64, device=lens.device)
    bounds = torch.cat([zero, ends])
    packed = int(bounds[-1])
    if total_tokens is None:
        return bounds
    total_tokens = _non_negative_int(total_tokens, "total_tokens", fn)
    if total_tokens < packed:
        raise ValueError(
            f"total_tokens = {total_tokens} is smaller than the packed length {packed} of seq_lens"
        )
    if total_tokens > packed:
        bounds = torch.cat([bounds, zero + total_tokens])
    return bounds


# ---- compile-safe helpers (no host sync, static shapes) ----------------------


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """bool ``[batch, sequence]``: True where a new run (document or pad tail)
    starts; position 0 is always a start.

    Example: ``[[1, 1, 2, 0, 0]] -> [[True, False, True, True, False]]``
    """
    first = torch.ones_like(doc_ids[..., :1], dtype=torch.bool)
    return torch.cat([first, doc_ids[..., 1:] != doc_ids[..., :-1]], dim=-1)


def position_ids_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[batch, sequence]`` positions restarting at 0 at every run start.

    The pad tail counts as its own run (0, 1, ... from the first pad token),
    so pad positions stay bounded by the pad length rather than extending the
    last document.  Compile-safe.

    Example: ``[[1, 1, 1, 2, 2, 0, 0]] -> [[0, 1, 2, 0, 1, 0, 1]]``
    """
    seq = doc_ids.shape[-1]
    idx = torch.arange(seq, device=doc_ids.device, dtype=torch.int64).expand(doc_ids.shape)
    # The latest start at or before each token is a running max of start indices.
    run_start = torch.cummax(torch.where(document_starts(doc_ids), idx, 0), dim=-1).values
    return idx - run_start


def lengths_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[batch]``: number of real (non-pad) tokens per row.  Compile-safe.

    Example: ``[[1, 1, 2, 0], [1, 1, 1, 1]] -> [3, 4]``
    """
    return (doc_ids != PAD_DOC_ID).sum(dim=-1, dtype=torch.int64)


def longest_document(doc_ids: torch.Tensor) -> int:
    """The length of the longest real document of any row (0 without one).  Host-side.

    Example: ``[[1, 1, 1, 2, 0, 0]] -> 3`` (the pad tail is not a document)
    """
    if doc_ids.numel() == 0:
        return 0
    pos = position_ids_from_doc_ids(doc_ids)
    return int(torch.where(doc_ids != PAD_DOC_ID, pos + 1, 0).max())


# ---- validators (host-side) --------------------------------------------------


def validate_doc_ids(doc_ids: torch.Tensor, name: str = "doc_ids") -> None:
    """Check that ``doc_ids`` is int64 ``[batch, sequence]`` with every row of
    the form ``1,..,1,2,..,2,...,n,..,n,0,..,0``: the first real id is 1, each
    step is +0 or +1, and zeros appear only in a tail.  Raises ``ValueError``
    naming the first violating ``[row, position]`` (another dtype, or not a tensor:
    :class:`~fcp.checks.ArgumentTypeError`); returns None.

    Example: ``[[1, 1, 3, 0]]`` -> ``ValueError: doc_ids[0, 2] = 3 follows 1 ...``
    """
    check_tensor(doc_ids, name, fn="validate_doc_ids", dtype=torch.int64, values=True)
    if doc_ids.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(doc_ids.shape)}; expected [batch, sequence]")
    if doc_ids.numel() == 0:
        return None
    # A virtual pad before each row makes "starts at 1" an ordinary +1 step.
    step = torch.diff(doc_ids, dim=1, prepend=torch.zeros_like(doc_ids[:, :1]))
    # Clearing bit 0 leaves 0 exactly for steps of +0 and +1 (two's complement
    # keeps negatives non-zero); checked for non-pad tokens, so negative ids
    # fail too, while real -> pad steps are free.
    real = doc_ids != PAD_DOC_ID
    bad = real & ((step & -2) != 0)
    # The one legal-looking step that is not: 0 -> 1 after the row has begun.
    bad[:, 1:] |= real[:, 1:] & ~real[:, :-1]
    hit = _first_true(bad)
    if hit is None:
        return None
    b, j = hit
    v, p = int(doc_ids[b, j]), (int(doc_ids[b, j - 1]) if j > 0 else PAD_DOC_ID)
    where = _index_str(name, (b, j))
    if v < 0:
        reason = "is negative; ids are >= 0 (0 = pad)"
    elif j == 0:
        reason = "starts the row; a row's first real id must be 1"
    elif p == PAD_DOC_ID:
        reason = f"follows pad ({name}[{b}, {j - 1}] = 0); pad may only form a tail"
    else:
        reason = f"follows {p} ({name}[{b}, {j - 1}]); ids must step by +0 or +1"
    raise ValueError(f"{where} = {v} {reason}")


def validate_right_tail_mask(
    mask: torch.Tensor, like: torch.Tensor | None = None, name: str = "attention_mask"
) -> torch.Tensor:
    """Check a full-sequence validity mask and return it as bool ``[batch, sequence]``.

    ``mask`` must be rank 2, binary (bool, or int/float holding only 0 and 1)
    and right-padded: ``valid* pad*`` per row.  If ``like`` (e.g. ``input_ids``
    ``[batch, sequence]`` or ``inputs_embeds [batch, sequence, hidden]``) is
    given, its leading two dims must equal ``mask.shape``.

    Example: ``tensor([[1, 1, 0]])`` -> ``[[True, True, False]]``;
    ``tensor([[1, 0, 1]])`` -> ``ValueError: attention_mask[0, 2] = 1 follows a 0 ...``
    """
    fn = "validate_right_tail_mask"
    _require_tensor(mask, name, fn)
    if mask.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}; expected [batch, sequence]")
    if like is not None:
        _require_tensor(like, "like", fn)
        if like.dim() < 2 or tuple(like.shape[:2]) != tuple(mask.shape):
            raise ValueError(
                f"{name} has shape {tuple(mask.shape)} but the tensor it describes has "
                f"shape {tuple(like.shape)}"
            )
    if mask.dtype != torch.bool:
        if mask.dtype.is_complex:
            raise ArgumentTypeError(
                f"{fn}: {name} must be bool, int or float, got dtype {mask.dtype}"
            )
        # NaN fails both comparisons, so it is reported as non-binary too.
        hit = _first_true(~((mask == 0) | (mask == 1)))
        if hit is not None:
            raise ValueError(
                f"{_index_str(name, hit)} = {mask[hit].item()!r} is not binary (0 or 1)"
            )
        mask = mask != 0
    hit = _first_true(mask[:, 1:] & ~mask[:, :-1])
    if hit is not None:
        b, j = hit[0], hit[1] + 1
        raise ValueError(
            f"{name}[{b}, {j}] = 1 follows a 0; padding must be a right tail (valid* pad*)"
        )
    return mask


def doc_ids_window(doc_ids: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """int64 ``[batch, length]``: doc ids of global positions ``start .. start + length - 1``.

    ``start`` and ``length`` are Python ints (static); positions outside the map get ``OUTSIDE_DOC_ID`` (-1, which no token has).

    >>> doc_ids_window(torch.tensor([[1, 1, 2]]), -2, 6).tolist()
    [[-1, -1, 1, 1, 2, -1]]
    """
    total = doc_ids.shape[1]
    left, right = max(0, -start), max(0, start + length - total)
    lo, hi = max(0, start), min(total, start + length)
    parts = []
    if left:
        parts.append(doc_ids.new_full((doc_ids.shape[0], left), OUTSIDE_DOC_ID))
    parts.append(doc_ids[:, lo:max(lo, hi)])
    if right:
        parts.append(doc_ids.new_full((doc_ids.shape[0], right), OUTSIDE_DOC_ID))
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]
