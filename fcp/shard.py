"""Contiguous batch sharding: one token interval per CP rank, one replicated document map.

:func:`shard_batch` runs eagerly, once per batch, on the replicated full batch. It validates and
resolves everything host-side (a bad batch raises the same ``ValueError`` / ``TypeError`` on
every rank that holds it), checks that every CP rank holds the same batch (:class:`BatchAgreement`:
one small exchange), pads, slices, and returns this rank's local batch and ``PackedContext`` for
the compiled model. :func:`gather_sequence` is the inverse.

Padding never trains: every token outside a document (doc id 0: the pad tail of a
``cu_seqlens`` / ``seq_lens`` / mask row and the CP padding added here) gets the label
``IGNORE_INDEX`` and loss mask 0, so :func:`fcp.loss.loss_token_count` counts real tokens only.

Ranks must agree: a data-loader bug that hands one CP rank another batch would otherwise corrupt
every operator's output silently (same length) or fail inside a collective on some ranks only
(different lengths). Before anything depends on it, the ranks exchange one fixed-size summary
(rows, length, padded length, a 128-bit hash of the document map, whether the rank accepted its
batch); if they differ, every rank raises the same ``ValueError`` naming the ranks and what
differs (for maps, after a second exchange, the first differing position). A rank that rejects
its batch still joins the exchange, so the others raise instead of waiting in a collective.

Worked example (2 ranks, ``pad_multiple=1``)::

    batch = {"input_ids": [[5, 6, 7, 8, 9]], "labels": [[6, 7, 8, 9, -100]],
             "cu_seqlens": [0, 2, 5]}
    padded to 6:  input_ids [[5, 6, 7, 8, 9, 0]], labels [[6, 7, 8, 9, -100, -100]]
    doc_ids       [[1, 1, 2, 2, 2, 0]]
    rank 0 local: input_ids [[5, 6, 7]], position_ids [[0, 1, 0]]
    rank 1 local: input_ids [[8, 9, 0]], position_ids [[1, 2, 0]]
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fcp.checks import check_bool, check_instance, check_int, check_tensor
from fcp.comm import all_gather_sequence
from fcp.context import PackedContext
from fcp.groups import GroupInfo, resolve_group
from fcp.layout import (
    PAD_DOC_ID,
    doc_ids_from_cu_seqlens,
    doc_ids_from_seq_lens,
    position_ids_from_doc_ids,
    validate_doc_ids,
    validate_right_tail_mask,
)

__all__ = [
    "BatchAgreement",
    "IGNORE_INDEX",
    "INTEGER_STREAMS",
    "PACKING_KEYS",
    "TOKEN_KEYS",
    "check_stream",
    "shard_batch",
    "gather_sequence",
    "global_doc_ids_from_batch",
    "normalize_batch_axis",
    "pad_sequence_dim",
    "padded_length",
]

IGNORE_INDEX = -100
#: Token-aligned streams sharded along the sequence axis, with their pad values by meaning.
#: ``None``: filled from ``padding_token_id``. Position ids pad with 0: pad tokens are never
#: visible to real ones, and 0 keeps rotary tables in range.
TOKEN_KEYS: dict[str, Any] = {
    "input_ids": None,
    "inputs_embeds": 0.0,
    "labels": IGNORE_INDEX,
    "position_ids": 0,
    "loss_mask": 0,
    "attention_mask": False,
    "padding_mask": False,
    "token_type_ids": 0,
}
#: Packing metadata consumed into the document map (the context carries the layout afterwards).
PACKING_KEYS = ("cu_seqlens", "seq_lens", "seq_lens_padded", "max_seqlen", "doc_ids")
_MASK_KEYS = ("attention_mask", "padding_mask")


#: Token streams holding integers (ids, labels, positions); ``inputs_embeds`` is floating.
INTEGER_STREAMS = ("input_ids", "labels", "position_ids", "token_type_ids")


def check_stream(key: str, t: Any, *, fn: str = "") -> torch.Tensor:
    """A token stream or packing tensor: a real (not meta) tensor of its kind (host-side)."""
    kind = "int" if key in INTEGER_STREAMS else "float" if key == "inputs_embeds" else None
    return check_tensor(t, key, kind=kind, values=True, fn=fn)


def pad_sequence_dim(tensor: torch.Tensor, pad_len: int, value: float | int | bool, dim: int = 1):
    """Right-pad ``tensor`` along ``dim`` by ``pad_len`` entries of ``value`` (new tensor)."""
    if pad_len < 0:
        raise ValueError(f"pad_len must be >= 0, got {pad_len}")
    if pad_len == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = pad_len
    fill = torch.full(shape, value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, fill], dim=dim)


def normalize_batch_axis(batch: Mapping[str, Any]) -> dict[str, Any]:
    """Return a new batch whose token streams have a leading batch axis.

    THD collaters give ``[sequence]`` rows (``[sequence, hidden]`` for ``inputs_embeds``); they
    become ``[1, sequence]`` (``[1, sequence, hidden]``). ``seq_lens`` keeps its own layout.
    """
    primary = "input_ids" if batch.get("input_ids") is not None else "inputs_embeds"
    ref = batch.get(primary)
    flat = isinstance(ref, torch.Tensor) and ref.dim() == (1 if primary == "input_ids" else 2)
    out = dict(batch)
    if not flat:
        return out
    for key in TOKEN_KEYS:
        t = out.get(key)
        if isinstance(t, torch.Tensor):
            expect_flat = 2 if key == "inputs_embeds" else 1
            if t.dim() == expect_flat:
                out[key] = t.unsqueeze(0)
    return out


def global_doc_ids_from_batch(batch: Mapping[str, Any], seq_len: int) -> torch.Tensor:
    """Resolve the int64 ``[batch, seq_len]`` document map before packing metadata is dropped.

    Sources, in order: ``doc_ids`` (validated), ``cu_seqlens`` (one packed row), ``seq_lens``
    (per-row real lengths, ``-1000`` marks unused slots; ``seq_lens_padded`` is virtual-layout
    metadata and never used for physical offsets), a right-tail ``attention_mask`` /
    ``padding_mask`` (one document per row), else one document per row covering it all.
    """
    primary = batch.get("input_ids")
    if primary is None:
        primary = batch["inputs_embeds"]
    n_rows, device = primary.shape[0], primary.device
    mask = _mask_of(batch, primary)
    packed = batch.get("cu_seqlens") is not None or batch.get("seq_lens") is not None
    if batch.get("doc_ids") is not None:
        doc_ids = check_stream("doc_ids", batch["doc_ids"])
        if doc_ids.dim() == 1:
            doc_ids = doc_ids.unsqueeze(0)
        if tuple(doc_ids.shape) != (n_rows, seq_len):
            raise ValueError(
                f"doc_ids has shape {tuple(doc_ids.shape)}, expected {(n_rows, seq_len)}"
            )
        validate_doc_ids(doc_ids)
    elif batch.get("cu_seqlens") is not None:
        if n_rows != 1:
            raise ValueError(
                f"cu_seqlens describes one packed row, but the batch has {n_rows} rows; "
                "use seq_lens [batch, documents] for packed batches with several rows"
            )
        doc_ids = doc_ids_from_cu_seqlens(check_stream("cu_seqlens", batch["cu_seqlens"]), seq_len)
    elif batch.get("seq_lens") is not None:
        seq_lens = check_stream("seq_lens", batch["seq_lens"])
        rows = 1 if seq_lens.dim() == 1 else seq_lens.shape[0]
        if rows != n_rows:
            raise ValueError(
                f"seq_lens has {rows} rows but input has batch {n_rows} "
                f"(seq_lens shape {tuple(seq_lens.shape)})"
            )
        doc_ids = doc_ids_from_seq_lens(seq_lens, seq_len)
    elif mask is not None:
        doc_ids = mask.long()  # one document (id 1) per row, pad tail 0
    else:
        doc_ids = torch.ones(n_rows, seq_len, dtype=torch.long)
    doc_ids = doc_ids.to(device=device, dtype=torch.long)
    if packed and mask is not None:
        # A validity mask next to packing metadata must agree with it: valid == inside a document.
        if not torch.equal(mask.to(device), doc_ids != PAD_DOC_ID):
            raise ValueError(
                "attention_mask/padding_mask disagrees with the packing metadata: the mask must "
                "be True exactly on the tokens covered by documents"
            )
    return doc_ids


def _mask_of(batch: Mapping[str, Any], primary: torch.Tensor) -> torch.Tensor | None:
    masks = [k for k in _MASK_KEYS if batch.get(k) is not None]
    if not masks:
        return None
    like = primary if primary.dim() == 2 else primary[..., 0]
    normalised = []
    for key in masks:
        m = batch[key]
        if m.dim() != 2 or (m.dtype != torch.bool and bool(((m != 0) & (m != 1)).any())):
            raise ValueError(
                f"{key} with shape {tuple(m.shape)} and dtype {m.dtype} is a packed or "
                "block attention mask, which contiguous CP does not support; pass packing "
                "metadata (cu_seqlens / seq_lens) and an optional binary right-tail mask"
            )
        normalised.append(validate_right_tail_mask(m, like=like, name=key))
    if len(normalised) == 2 and not torch.equal(normalised[0], normalised[1]):
        raise ValueError("attention_mask and padding_mask are both given and disagree")
    return normalised[0]



class BatchAgreement:
    """Every CP rank joins exactly one fixed-size exchange per batch; disagreement raises.

    Use as a context manager around a sharder's validation, and call :meth:`check` with the
    validated map before anything depends on it::

        with BatchAgreement(cp_mesh, "my_sharder") as agreement:
            doc_ids = validate(batch)                # may raise on this rank
            agreement.check(doc_ids, seq_len)        # raises on every rank if ranks differ
        ... # collectives may follow: every rank holds the same layout

    A rank whose validation raises joins the exchange on the way out (as "rejected") and its own
    error propagates; the ranks that accepted their batch then raise a ``ValueError`` naming it.
    The exchange is one all-gather of 6 int64 per rank; only when the maps differ, a second
    all-gather of the maps locates the first differing position. It runs on the group's device
    whatever the batch's (CPU for gloo; on NCCL the current GPU, read back on the host: one
    synchronisation per batch). ``enabled=False``, ``None`` or a one-rank group: no exchange
    (the caller guarantees agreement). Eager only.

    Args:
        cp_mesh: the CP group (``None``, ``ProcessGroup``, 1-D ``DeviceMesh`` or ``GroupInfo``).
        fn: the sharder's name, for messages.
        enabled: whether to exchange at all.
    """

    def __init__(self, cp_mesh: Any, fn: str, *, enabled: bool = True) -> None:
        self.info: GroupInfo = resolve_group(cp_mesh)
        self.fn = fn
        enabled = check_bool(enabled, "check_agreement", fn=fn)
        self._pending = enabled and self.info.group is not None

    def __enter__(self) -> "BatchAgreement":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._pending and isinstance(exc, Exception):
            self._pending = False
            self._gather(None)  # "rejected"; the exception propagates
        return False

    def check(self, doc_ids: torch.Tensor, original_seq_len: int) -> None:
        """Raise ``ValueError`` on every rank unless all hold this ``[batch, padded]`` map and
        ``original_seq_len`` (and all accepted their batch)."""
        if not self._pending:
            return
        self._pending = False
        rows = self._gather(_summary(doc_ids, original_seq_len))
        rejected = [r for r, row in enumerate(rows) if row[0]]
        if rejected:
            raise ValueError(
                f"{self.fn}: CP rank(s) {rejected} rejected their batch (their own error says "
                "why) while this rank accepted its own; every CP rank must hold the same full "
                "batch"
            )
        shapes = [tuple(row[1:4]) for row in rows]
        if len(set(shapes)) > 1:
            listed = ", ".join(f"rank {r}: {b} row(s) x {n} tokens (padded to {p})"
                               for r, (b, n, p) in enumerate(shapes))  # fmt: skip
            raise ValueError(
                f"{self.fn}: CP ranks hold batches of different lengths ({listed}); every CP "
                "rank must hold the same full batch"
            )
        if len({tuple(row[4:]) for row in rows}) > 1:
            raise ValueError(f"{self.fn}: {_first_difference(doc_ids, self.info)}")

    def _gather(self, summary: list[int] | None) -> list[list[int]]:
        row = [1, 0, 0, 0, 0, 0] if summary is None else [0, *summary]
        mine = torch.tensor([row], dtype=torch.int64, device=_exchange_device(self.info.group))
        got = all_gather_sequence(mine, self.info, dim=0, differentiable=False, validate=False)
        return got.cpu().tolist()


def _summary(doc_ids: torch.Tensor, original_seq_len: int) -> list[int]:
    """``[rows, original length, padded length, hash_lo, hash_hi]`` of a validated map."""
    host = doc_ids.detach().cpu().contiguous().numpy()
    digest = hashlib.sha1(memoryview(host).cast("B"), usedforsecurity=False).digest()
    halves = [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in (0, 8)]
    return [doc_ids.shape[0], original_seq_len, doc_ids.shape[1], *halves]


def _first_difference(doc_ids: torch.Tensor, info: GroupInfo) -> str:
    """The failure path's second exchange: every rank's map, and where the first one differs."""
    mine = doc_ids.unsqueeze(0).to(_exchange_device(info.group))
    maps = all_gather_sequence(mine, info, dim=0, differentiable=False, validate=False).cpu()
    differs = (maps != maps[:1]).flatten(1)  # [ranks, batch * padded]
    ranks = [r for r in range(info.size) if bool(differs[r].any())]
    first = min(ranks, key=lambda r: int(differs[r].int().argmax()))
    flat = int(differs[first].int().argmax())
    row, pos = divmod(flat, doc_ids.shape[1])
    return (
        f"CP ranks hold different document maps at the same length: rank {first}'s differs "
        f"from rank 0's first at row {row}, token {pos} (doc id {int(maps[first, row, pos])} "
        f"vs {int(maps[0, row, pos])}; ranks {ranks} differ from rank 0); every CP rank must "
        "hold the same full batch"
    )


def _exchange_device(group: Any) -> torch.device:
    """The device of the exchange, whatever device the batch is on: CPU for gloo (and fake)
    groups, the current accelerator otherwise (NCCL and the like)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or backend == "fake" or not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.accelerator.current_accelerator()


def shard_batch(
    cp_mesh: Any,
    batch: Mapping[str, Any],
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    pad_multiple: int = 1,
    pad_to: int | str | None = None,
    shard_primary: bool = True,
    extra_token_keys: tuple[str, ...] = (),
    ignore_padding: bool = True,
    check_agreement: bool = True,
) -> tuple[dict[str, Any], PackedContext]:
    """Validate, pad and contiguously shard a (packed) batch for this CP rank.

    Args:
        cp_mesh: 1-D ``DeviceMesh``, ``ProcessGroup`` or ``None`` (no CP).
        batch: full-sequence batch, identical on every CP rank, never mutated. Token streams
            ``[batch, sequence]`` (``[sequence]`` rows from THD collaters are accepted):
            exactly one of ``input_ids`` (integer) / ``inputs_embeds`` (float
            ``[batch, sequence, hidden]``); optional ``labels`` (integer), ``position_ids``,
            ``loss_mask``, ``attention_mask`` / ``padding_mask`` (binary, right-tail, True/1 =
            valid token), ``token_type_ids``; packing metadata (integer tensors) ``doc_ids`` /
            ``cu_seqlens`` / ``seq_lens`` (+ ignored ``seq_lens_padded``). Other entries pass
            through unchanged.
        loss_mask: optional ``[batch, sequence]`` loss mask, sharded into ``local["loss_mask"]``
            (overrides ``batch["loss_mask"]``).
        padding_token_id: input id appended for CP divisibility (an int).
        pad_multiple: every rank's local length is a multiple of this (e.g. 4 for a ratio-4
            compressed attention).
        pad_to: buckets the padded global length, so that a compiled model sees few distinct
            lengths (see "Row lengths" below). ``None`` (default): the smallest multiple of
            ``m = cp_size * pad_multiple``; an int ``n``: the smallest multiple of
            ``lcm(n, m)``; ``"pow2"``: the smallest ``m * 2**j`` (a power of two when ``m``
            is one), at most twice the row.
        shard_primary: ``False`` keeps ``input_ids`` / ``inputs_embeds`` full length (padded)
            so the model can splice features into the full sequence first and then apply the
            differentiable ``context.shard(embeds)``; every other stream is still sharded.
        extra_token_keys: further ``[batch, sequence, ...]`` keys to shard (padded with 0).
        ignore_padding: ``True`` (default): padding never trains: the ``labels`` of every token
            outside a document (doc id 0, the batch's own pad tail included) become
            :data:`IGNORE_INDEX` and its ``loss_mask`` 0. ``False`` keeps the given values on
            the pad tail (only the CP padding added here is ignored).
        check_agreement: ``True`` (default): before anything depends on it, every CP rank checks
            that all hold the same rows, length and document map (:class:`BatchAgreement`: one
            all-gather of 6 int64 per rank). ``False`` for callers that guarantee it.

    Returns:
        ``(local_batch, context)``: a **new** dict with this rank's slices (packing metadata
        removed, its layout lives in ``context``; ``position_ids`` added from the document map
        when absent: positions restart at every document) and this rank's
        :class:`~fcp.context.PackedContext`.

    Raises:
        TypeError / ValueError naming the offending key or argument and its value (the same on
        every rank holding the same batch); ``ValueError`` on every rank when the CP ranks hold
        different batches (naming the ranks and the lengths or the first differing position) or
        some of them rejected theirs. A batch of zero rows is rejected.

    Padding (by meaning): input ids ``padding_token_id``, embeddings 0, labels -100, loss mask 0,
    validity masks False, position ids 0, doc id 0.

    Row lengths: a compiled model specialises on the local length the first time; the second
    length it sees recompiles it once with a dynamic sequence dimension, and every later
    length reuses that graph (fcp's operators do not branch on the length; tested over 4
    lengths). Bucketing with ``pad_to`` keeps the static graphs instead: with ``pad_to=1024``
    every row of up to 1024 tokens shares one graph, with ``"pow2"`` a row length ``n`` gets
    one of ``log2(n)`` graphs, at the price of computing the padding (at most 2x the tokens).

    Example (one process; the pad tail of ``cu_seqlens`` ends in -100 labels)::

        >>> batch = {"input_ids": torch.arange(6)[None], "labels": torch.arange(6)[None],
        ...          "cu_seqlens": torch.tensor([0, 2, 4])}
        >>> shard_batch(None, batch)[0]["labels"].tolist()
        [[0, 1, 2, 3, -100, -100]]
    """
    with BatchAgreement(cp_mesh, "shard_batch", enabled=check_agreement) as agreement:
        check_instance(batch, Mapping, "batch", fn="shard_batch")
        check_bool(ignore_padding, "ignore_padding", fn="shard_batch")
        work, keys, doc_ids = _validated(batch, loss_mask, padding_token_id, pad_multiple,
                                         pad_to, shard_primary, extra_token_keys,
                                         agreement.info.size)  # fmt: skip
        seq_len = work[keys.primary].shape[1]
        agreement.check(doc_ids, seq_len)
    info = agreement.info
    pad = doc_ids.shape[1] - seq_len
    context = PackedContext(
        doc_ids=doc_ids,
        group=info.group,
        cp_size=info.size,
        cp_rank=info.rank,
        original_seq_len=seq_len,
    )

    local: dict[str, Any] = {k: v for k, v in work.items() if k not in PACKING_KEYS}
    if local.get("position_ids") is None:
        local["position_ids"] = position_ids_from_doc_ids(doc_ids)[:, :seq_len]
    outside = doc_ids[:, :seq_len] == PAD_DOC_ID  # tokens in no document: never trained
    for key, fill in keys.fills.items():
        t = local.get(key)
        if not isinstance(t, torch.Tensor):
            continue
        if fill is None:
            fill = keys.padding_token_id
        if ignore_padding and key in ("labels", "loss_mask"):
            t = t.masked_fill(outside.to(t.device), fill)
        t = pad_sequence_dim(t, pad, fill)
        keep_full = key == keys.primary and not shard_primary
        local[key] = t if keep_full else context.shard(t, dim=1)
    return local, context


class _Keys(NamedTuple):
    primary: str  # "input_ids" or "inputs_embeds"
    fills: dict[str, Any]  # token stream -> pad value (None: padding_token_id)
    padding_token_id: int


def _validated(batch, loss_mask, padding_token_id, pad_multiple, pad_to, shard_primary,
               extra_token_keys, cp_size: int) -> tuple[dict[str, Any], _Keys, torch.Tensor]:
    """``(work, keys, doc_ids)``: the batch with a batch axis and ``loss_mask`` in place, its
    token streams, and the validated document map padded for ``cp_size`` ranks."""
    pad_multiple = check_int(pad_multiple, "pad_multiple", 1, fn="shard_batch")
    if pad_to is not None and not (isinstance(pad_to, str) and pad_to == "pow2"):
        if isinstance(pad_to, str):
            raise ValueError(f"shard_batch: pad_to={pad_to!r} is not one of None, a positive "
                             "int or 'pow2'")
        check_int(pad_to, "pad_to", 1, fn="shard_batch")
    padding_token_id = check_int(padding_token_id, "padding_token_id", -(2**63), fn="shard_batch")
    check_bool(shard_primary, "shard_primary", fn="shard_batch")
    has_ids = batch.get("input_ids") is not None
    has_embeds = batch.get("inputs_embeds") is not None
    if has_ids == has_embeds:
        raise ValueError(
            "shard_batch: batch must contain exactly one of input_ids / inputs_embeds, got "
            + ("both" if has_ids else "neither")
        )
    token_keys = dict(TOKEN_KEYS)
    token_keys.update({k: 0 for k in extra_token_keys})
    if loss_mask is not None:
        check_stream("loss_mask", loss_mask, fn="shard_batch")
    for key in token_keys:
        if batch.get(key) is not None:
            check_stream(key, batch[key], fn="shard_batch")
    work = normalize_batch_axis(batch)
    if loss_mask is not None:
        work["loss_mask"] = loss_mask.unsqueeze(0) if loss_mask.dim() == 1 else loss_mask
    primary_key = "input_ids" if has_ids else "inputs_embeds"
    primary = work[primary_key]
    if primary_key == "input_ids" and primary.dim() != 2:
        raise ValueError(
            f"input_ids must be an integer [batch, sequence] tensor, got shape "
            f"{tuple(primary.shape)} dtype {primary.dtype}"
        )
    if primary_key == "inputs_embeds" and primary.dim() != 3:
        raise ValueError(
            f"inputs_embeds must be [batch, sequence, hidden], got {tuple(primary.shape)}"
        )
    n_rows, seq_len = primary.shape[:2]
    if n_rows == 0:
        raise ValueError(f"{primary_key} has batch size 0 (shape {tuple(primary.shape)})")
    for key in token_keys:
        t = work.get(key)
        if isinstance(t, torch.Tensor) and tuple(t.shape[:2]) != (n_rows, seq_len):
            raise ValueError(
                f"{key} has shape {tuple(t.shape)}, expected [batch={n_rows}, "
                f"sequence={seq_len}, ...] like {primary_key}"
            )

    doc_ids = global_doc_ids_from_batch(work, seq_len)
    padded_len = padded_length(seq_len, cp_size * pad_multiple, pad_to)
    doc_ids = pad_sequence_dim(doc_ids, padded_len - seq_len, PAD_DOC_ID)
    return work, _Keys(primary_key, token_keys, padding_token_id), doc_ids


def padded_length(seq_len: int, multiple: int, pad_to: int | str | None = None) -> int:
    """The global length :func:`shard_batch` pads a row of ``seq_len`` tokens to, for a
    ``multiple`` of ``cp_size * pad_multiple`` (at least one multiple, also for an empty row).

    >>> [padded_length(n, 4) for n in (0, 5, 8)]
    [4, 8, 8]
    >>> [padded_length(n, 4, 6) for n in (5, 13)], [padded_length(n, 4, "pow2") for n in (5, 33)]
    ([12, 24], [8, 64])
    """
    if pad_to == "pow2":
        padded = multiple
        while padded < seq_len:
            padded *= 2
        return padded
    if pad_to is not None:
        multiple = math.lcm(multiple, pad_to)
    return max(1, -(-seq_len // multiple)) * multiple


def gather_sequence(
    local: torch.Tensor, context: PackedContext, dim: int = 1, *, unpad: bool = True
) -> torch.Tensor:
    """Inverse of sharding: this rank's ``[batch, local_seq, ...]`` slice back to the full row.

    Gradients flow back to the owning ranks (reduce-scatter). ``unpad=True`` drops the CP padding
    (returns ``original_seq_len`` positions along ``dim``).
    """
    full = all_gather_sequence(local, context, dim=dim)
    if unpad and context.original_seq_len is not None:
        full = full.narrow(dim, 0, context.original_seq_len)
    return full
